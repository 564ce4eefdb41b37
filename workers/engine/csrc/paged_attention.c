/* Paged attention for the CPU: short queries (decode, verified drafts) against each sequence's
 * context, reading every key and value row where it lies in the paged cache.
 *
 * Built at run time by workers/engine/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes: plain C, no torch headers, so it compiles in about a second. It links
 * libgomp by its soname, which resolves to the copy torch has already loaded: one thread pool.
 *
 * Layout (vLLM's): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D], all
 * contiguous fp32. Sequence s owns query rows query_start[s] .. query_start[s + 1] - 1, the last
 * q_len positions of its seq_lens[s]-token context, and query i sees keys 0 .. its own position.
 * Each work item is one (sequence, kv head, query) triple: the G = H / KVH query heads that share
 * the kv head walk the context once, a block at a time, with an online softmax (one pass over K
 * and V, no score buffer). The cache rows of one kv head are 1/KVH of each block, too sparse for
 * the hardware prefetchers: each walk asks for the block PREFETCH blocks ahead itself, which
 * took decodes at batch 64 from 10 to 15.6 GB/s (AVX2 code: 9 to 12) on a 2-core Xeon whose plain
 * reads make 19.6.
 */
#include <math.h>
#include <stdint.h>

#include "tm_math.h"

#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_DIM 256   /* head_dim */
#define MAX_BLOCK 64  /* tokens per cache block */
#define PREFETCH 2    /* blocks ahead: one left misses at the start of every block, four no better */
/* Always inlined: gcc finds a function that only prefetches free of side effects and drops its
 * calls (at -O1 and up), prefetches and all. */
#define INLINE static inline __attribute__((always_inline))

int tm_limits(int64_t group, int64_t head_dim, int64_t block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_DIM && block_size <= MAX_BLOCK;
}

/* Ask for the rows of kv head kvh in cache block `block` (K and V), a cache line at a time. */
INLINE void prefetch_block(const float *k_cache, const float *v_cache, int64_t block, int64_t kvh,
                           int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t row = num_kv_heads * head_dim;
    const int64_t base = (block * block_size * num_kv_heads + kvh) * head_dim;
    for (int64_t j = 0; j < block_size; j++)
        for (int64_t d = 0; d < head_dim; d += 16) {
            __builtin_prefetch(k_cache + base + j * row + d);
            __builtin_prefetch(v_cache + base + j * row + d);
        }
}

INLINE void prefetch_first(const float *k_cache, const float *v_cache, const int32_t *table, int64_t ctx,
                           int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    for (int64_t b = 0; b < PREFETCH && b * block_size < ctx; b++)
        prefetch_block(k_cache, v_cache, table[b], kvh, num_kv_heads, head_dim, block_size);
}

INLINE void prefetch_ahead(const float *k_cache, const float *v_cache, const int32_t *table, int64_t start,
                           int64_t ctx, int64_t kvh, int64_t num_kv_heads, int64_t head_dim, int64_t block_size) {
    const int64_t ahead = start + PREFETCH * block_size;
    if (ahead < ctx)
        prefetch_block(k_cache, v_cache, table[ahead / block_size], kvh, num_kv_heads, head_dim, block_size);
}

static inline float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; d++) acc += a[d] * b[d];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_DOT8 1
/* q against 8 keys k, k + row, ..., k + 7 row at once (head_dim a multiple of 8): one vector
 * accumulator per key and one transpose-add at the end, instead of a horizontal sum per key,
 * which left the scores latency-bound. Lane j of the result is the score of key j. */
static inline __m256 dot8(const float *restrict q, const float *restrict k, int64_t row, int64_t head_dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + row + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * row + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * row + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * row + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * row + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * row + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * row + d), a7);
    }
    const __m256 lo4 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 hi4 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

/* acc[0..63] += sum over j < n of p[j] * v[j * row + 0..63], the accumulator in registers
 * throughout (in memory, every key paid a load and a store of it). */
static inline void pv64(const float *restrict p, const float *restrict v, int64_t row, int64_t n,
                        float *restrict acc) {
    __m256 c[8];
    for (int i = 0; i < 8; i++) c[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t j = 0; j < n; j++) {
        const __m256 w = _mm256_set1_ps(p[j]);
        const float *r = v + j * row;
        for (int i = 0; i < 8; i++) c[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(r + 8 * i), c[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, c[i]);
}
#endif

#if defined(__AVX512F__)
#define TM_AVX512 1
/* Lane j of the result is the sum of t[j]'s 16 lanes: a transpose-add tree, 45 shuffles and
 * adds for 16 keys where a horizontal sum per key would take 64 and leave 16 scalars. */
static inline __m512 hsum16(const __m512 *t) {
    __m512 u[8], w[4], x[2];
    for (int i = 0; i < 8; i++)
        u[i] = _mm512_add_ps(_mm512_unpacklo_ps(t[2 * i], t[2 * i + 1]), _mm512_unpackhi_ps(t[2 * i], t[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    for (int i = 0; i < 2; i++)
        x[i] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], 0x88), _mm512_shuffle_f32x4(x[0], x[1], 0xDD));
}

/* one_query with AVX-512 for head_dim = 16 nv and blocks of at most 16 tokens: a block's scores
 * of one query head in one register, its weighted values accumulated in nv registers. Always
 * inlined, and called with a constant nv, so every loop over nv unrolls and stays in registers. */
INLINE void one_query16(
    const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
    const int32_t *restrict table, int64_t ctx, int64_t kvh, int64_t group, int64_t num_kv_heads,
    int64_t block_size, float scale, float *restrict out, const int nv) {
    __m512 acc[MAX_GROUP][8];
    float m[MAX_GROUP], l[MAX_GROUP];
    const int64_t head_dim = 16 * nv, row = num_kv_heads * head_dim;
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int c = 0; c < nv; c++) acc[g][c] = _mm512_setzero_ps();
    }
    const __m512 sc = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    prefetch_first(k_cache, v_cache, table, ctx, kvh, num_kv_heads, head_dim, block_size);
    for (int64_t start = 0; start < ctx; start += block_size) {
        prefetch_ahead(k_cache, v_cache, table, start, ctx, kvh, num_kv_heads, head_dim, block_size);
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const int64_t base = ((int64_t)table[start / block_size] * block_size * num_kv_heads + kvh) * head_dim;
        const float *kb = k_cache + base, *vb = v_cache + base;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        for (int64_t g = 0; g < group; g++) {
            __m512 qv[8], t[16];
            for (int c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q + g * head_dim + 16 * c);
            for (int64_t j = 0; j < 16; j++) {
                __m512 a = _mm512_setzero_ps();
                if (j < n)
                    for (int c = 0; c < nv; c++)
                        a = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kb + j * row + 16 * c), a);
                t[j] = a;
            }
            const __m512 s = _mm512_mask_blend_ps(live, minus_inf, _mm512_mul_ps(hsum16(t), sc));
            const float top = fmaxf(m[g], _mm512_reduce_max_ps(s));
            if (top > m[g]) { /* rescale what was accumulated under the old maximum */
                const float c = tm_expf(m[g] - top);
                l[g] *= c;
                for (int i = 0; i < nv; i++) acc[g][i] = _mm512_mul_ps(acc[g][i], _mm512_set1_ps(c));
                m[g] = top;
            }
            float p[16];
            _mm512_storeu_ps(p, s);
#pragma omp simd
            for (int64_t j = 0; j < 16; j++) p[j] = tm_expf(p[j] - top);
            float sum = 0.0f; /* over the live keys only: tm_expf(-inf) is about 1e-38, not 0 */
            for (int64_t j = 0; j < n; j++) sum += p[j];
            l[g] += sum;
            __m512 a[8];
            for (int c = 0; c < nv; c++) a[c] = acc[g][c];
            for (int64_t j = 0; j < n; j++) {
                const __m512 w = _mm512_set1_ps(p[j]);
                for (int c = 0; c < nv; c++) a[c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vb + j * row + 16 * c), a[c]);
            }
            for (int c = 0; c < nv; c++) acc[g][c] = a[c];
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const __m512 inv = _mm512_set1_ps(l[g] > 0.0f ? 1.0f / l[g] : 0.0f);
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(out + g * head_dim + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
}
#endif

static void one_query(const float *restrict q, const float *restrict k_cache, const float *restrict v_cache,
                      const int32_t *restrict table, int64_t ctx, int64_t kvh, int64_t group, int64_t num_kv_heads,
                      int64_t head_dim, int64_t block_size, float scale, float *restrict out) {
    float acc[MAX_GROUP][MAX_DIM];
    float m[MAX_GROUP], l[MAX_GROUP];
    float s[MAX_GROUP][MAX_BLOCK];
    const int64_t row = num_kv_heads * head_dim; /* stride between tokens of a block */
    for (int64_t g = 0; g < group; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) acc[g][d] = 0.0f;
    }
    prefetch_first(k_cache, v_cache, table, ctx, kvh, num_kv_heads, head_dim, block_size);
    for (int64_t start = 0; start < ctx; start += block_size) {
        prefetch_ahead(k_cache, v_cache, table, start, ctx, kvh, num_kv_heads, head_dim, block_size);
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const int64_t base = ((int64_t)table[start / block_size] * block_size * num_kv_heads + kvh) * head_dim;
        const float *kb = k_cache + base, *vb = v_cache + base;
        int64_t j = 0;
#ifdef TM_DOT8
        if (head_dim % 8 == 0) {
            const __m256 sc = _mm256_set1_ps(scale);
            for (; j + 8 <= n; j += 8)
                for (int64_t g = 0; g < group; g++)
                    _mm256_storeu_ps(s[g] + j, _mm256_mul_ps(dot8(q + g * head_dim, kb + j * row, row, head_dim), sc));
        }
#endif
        for (; j < n; j++)
            for (int64_t g = 0; g < group; g++) s[g][j] = dot(q + g * head_dim, kb + j * row, head_dim) * scale;
        for (int64_t g = 0; g < group; g++) {
            float top = m[g];
            for (int64_t j = 0; j < n; j++) top = s[g][j] > top ? s[g][j] : top;
            if (top > m[g]) { /* rescale what was accumulated under the old maximum */
                const float c = tm_expf(m[g] - top);
                l[g] *= c;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] *= c;
                m[g] = top;
            }
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) { /* the block's probabilities, vectorised over j */
                s[g][j] = tm_expf(s[g][j] - top);
                sum += s[g][j];
            }
            l[g] += sum;
#ifdef TM_DOT8
            if (head_dim % 64 == 0) { /* 64 columns at a time, held in registers across the block */
                for (int64_t d = 0; d < head_dim; d += 64) pv64(s[g], vb + d, row, n, acc[g] + d);
                continue;
            }
#endif
            for (int64_t j = 0; j < n; j++) {
                const float p = s[g][j];
                const float *v = vb + j * row;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[g][d] += p * v[d];
            }
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = l[g] > 0.0f ? 1.0f / l[g] : 0.0f;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[g * head_dim + d] = acc[g][d] * inv;
    }
}

void tm_paged_attention(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *query_start, const int32_t *seq_lens,
                        const int32_t *rows, const int32_t *row_seq, int64_t num_items, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t num_threads, float *out) {
    /* Item i is query row rows[i] (or row i when rows is NULL) of sequence row_seq[i]; the work
     * is num_items x KVH, in that order, so the kv heads of one query are neighbours. */
    const int64_t group = num_heads / num_kv_heads;
    const int64_t total = num_items * num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t w = 0; w < total; w++) {
        const int64_t i = w / num_kv_heads, kvh = w % num_kv_heads;
        const int64_t t = rows ? rows[i] : i;
        const int64_t seq = row_seq[i];
        const int64_t q_len = query_start[seq + 1] - query_start[seq];
        const int64_t ctx = seq_lens[seq] - q_len + (t - query_start[seq]) + 1; /* causal */
        const int64_t at = (t * num_heads + kvh * group) * head_dim;
        const int32_t *table = block_tables + seq * table_stride;
#ifdef TM_AVX512
        if (block_size <= 16 && (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
            /* a call per head_dim, so each inlined copy has its nv as a constant */
            const float *qi = q + at;
            float *o = out + at;
            if (head_dim == 32)
                one_query16(qi, k_cache, v_cache, table, ctx, kvh, group, num_kv_heads, block_size, scale, o, 2);
            else if (head_dim == 64)
                one_query16(qi, k_cache, v_cache, table, ctx, kvh, group, num_kv_heads, block_size, scale, o, 4);
            else
                one_query16(qi, k_cache, v_cache, table, ctx, kvh, group, num_kv_heads, block_size, scale, o, 8);
            continue;
        }
#endif
        one_query(q + at, k_cache, v_cache, table, ctx, kvh, group, num_kv_heads,
                  head_dim, block_size, scale, out + at);
    }
}
