/* Paged attention for the CPU: short queries (decode, verified drafts) and, at the end of the
 * file, prefill chunks, against each sequence's context, reading every key and value row where it
 * lies in the paged cache.
 *
 * Built at run time by workers/engine/cpu_kernels.py (gcc -O3 -march=native -fopenmp) and
 * called through ctypes: plain C, no torch headers, so it compiles in about a second. It links
 * libgomp by its soname, which resolves to the copy torch has already loaded: one thread pool.
 *
 * Layout (vLLM's): q, out [T, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D], all
 * contiguous fp32. Sequence s owns query rows query_start[s] .. query_start[s + 1] - 1, the last
 * q_len positions of its seq_lens[s]-token context, and query i sees keys 0 .. its own position.
 * A work item is one query row and its kv heads, all of them when there are rows enough for the
 * threads (each block's rows then read whole, in address order), else one: each kv head's G = H /
 * KVH query heads walk the context once, a block at a time, with an online softmax (one pass over
 * K and V, no score buffer). The walk asks for the block PREFETCH blocks ahead itself, a few lines
 * between each pass over the current one: the hardware prefetchers do not follow the jumps between
 * blocks. Over one kv head's rows (1/KVH of each) prefetching took decodes at batch 64 from 10 to
 * 15.6 GB/s on a 2-core Xeon whose plain reads make 19.6; whole rows, asked for in pieces, took a
 * 2-core EPYC's from 6.3 to 11.1 GB/s on one thread and 9.3 to 18.5 on two (plain reads: 21, 35),
 * and a 2-core AVX-512 Xeon's from 16.7 to 21.0 GB/s on two (plain reads: 23). The lines go to L2,
 * not L1: two blocks ahead of an item with every kv head are 49 KB of keys and values, more than
 * an L1, and asked into L1 they evicted the block being read; into L2, a 2-core AVX-512 EPYC's
 * decodes at batch 64 (contexts of 400) went from 18.8 to 24-30 GB/s on two threads and from 10.2
 * to 16 on one (plain reads: 34, 29).
 *
 * The cache holds fp32, or fp16 when this file is compiled with KV_HALF (paged_attention_f16.c
 * does: the same code, symbols suffixed _f16): half the bytes to read, the same fp32 arithmetic
 * once each row is loaded and widened.
 */
#include <math.h>
#include <stdint.h>

#include "tm_math.h"

#ifdef KV_HALF
typedef _Float16 kv_t;
#define KV_NAME(name) name##_f16
#else
typedef float kv_t;
#define KV_NAME(name) name
#endif

#define MAX_GROUP 16  /* query heads per kv head */
#define MAX_HEADS 32  /* query heads per work item (a kv head's group, or several) */
#define MAX_DIM 256   /* head_dim */
#define MAX_BLOCK 64  /* tokens per cache block */
#define PREFETCH 2    /* blocks ahead: one left misses at the start of every block, four no better */
/* Always inlined: gcc finds a function that only prefetches free of side effects and drops its
 * calls (at -O1 and up), prefetches and all. */
#define INLINE static inline __attribute__((always_inline))

#ifndef KV_HALF
int tm_limits(int64_t group, int64_t head_dim, int64_t block_size) {
    return group <= MAX_GROUP && head_dim <= MAX_DIM && block_size <= MAX_BLOCK;
}
#endif

/* The block PREFETCH blocks ahead of the one being computed, asked for a few lines at a time
 * between the current block's passes (`ask`), for the rows of the work item's kv heads: asked
 * for all at once at the start of each block, hundreds of prefetches queued behind the core's
 * few line-fill buffers and stalled it (1.6x slower on a 2-core EPYC). */
typedef struct {
    const char *k, *v; /* the item's first row in the block ahead (none: tokens is 0) */
    int64_t row, seg;  /* bytes from a token's row to the next's; bytes of the item's heads in one */
    int64_t tokens, tok, off; /* tokens in the block ahead; next line to ask: token, byte in it */
    int64_t step;      /* lines per ask */
} Ahead;

/* Aim `a` at the block holding token `start` (elements: `row` between tokens, the item's heads
 * from `first` in each), its lines spread over `sites` asks. */
INLINE void ahead_at(Ahead *a, const kv_t *k_cache, const kv_t *v_cache, const int32_t *table, int64_t start,
                     int64_t ctx, int64_t row, int64_t first, int64_t block_size, int64_t sites) {
    a->tok = a->off = 0;
    a->tokens = start < ctx ? (ctx - start < block_size ? ctx - start : block_size) : 0;
    if (a->tokens == 0) return;
    const int64_t at = (int64_t)table[start / block_size] * block_size * row + first;
    a->k = (const char *)(k_cache + at);
    a->v = (const char *)(v_cache + at);
    const int64_t lines = a->tokens * ((a->seg + 63) / 64);
    a->step = (lines + sites - 1) / sites;
}

INLINE void ask(Ahead *a, int64_t lines) {
    for (; lines > 0 && a->tok < a->tokens; lines--) { /* locality 1: prefetcht2, into L2 */
        __builtin_prefetch(a->k + a->tok * a->row + a->off, 0, 1);
        __builtin_prefetch(a->v + a->tok * a->row + a->off, 0, 1);
        a->off += 64;
        if (a->off >= a->seg) {
            a->off = 0;
            a->tok++;
        }
    }
}

/* Whatever lines of the block ahead the rounding of `step` left unasked. */
INLINE void ask_rest(Ahead *a) { ask(a, INT64_MAX); }

static inline float dot(const float *restrict a, const kv_t *restrict b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t d = 0; d < n; d++) acc += a[d] * (float)b[d];
    return acc;
}

#if defined(__AVX2__) && defined(__FMA__) && (!defined(KV_HALF) || defined(__F16C__))
#include <immintrin.h>
#define TM_DOT8 1
#ifdef KV_HALF
#define LOAD8(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p)))
#else
#define LOAD8(p) _mm256_loadu_ps(p)
#endif
/* q against 8 keys k, k + row, ..., k + 7 row at once (head_dim a multiple of 8): one vector
 * accumulator per key and one transpose-add at the end, instead of a horizontal sum per key,
 * which left the scores latency-bound. Lane j of the result is the score of key j. */
static inline __m256 dot8(const float *restrict q, const kv_t *restrict k, int64_t row, int64_t head_dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t d = 0; d < head_dim; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, LOAD8(k + d), a0);
        a1 = _mm256_fmadd_ps(x, LOAD8(k + row + d), a1);
        a2 = _mm256_fmadd_ps(x, LOAD8(k + 2 * row + d), a2);
        a3 = _mm256_fmadd_ps(x, LOAD8(k + 3 * row + d), a3);
        a4 = _mm256_fmadd_ps(x, LOAD8(k + 4 * row + d), a4);
        a5 = _mm256_fmadd_ps(x, LOAD8(k + 5 * row + d), a5);
        a6 = _mm256_fmadd_ps(x, LOAD8(k + 6 * row + d), a6);
        a7 = _mm256_fmadd_ps(x, LOAD8(k + 7 * row + d), a7);
    }
    const __m256 lo4 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 hi4 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20), _mm256_permute2f128_ps(lo4, hi4, 0x31));
}

/* acc[0..63] += sum over j < n of p[j] * v[j * row + 0..63], the accumulator in registers
 * throughout (in memory, every key paid a load and a store of it). */
static inline void pv64(const float *restrict p, const kv_t *restrict v, int64_t row, int64_t n,
                        float *restrict acc) {
    __m256 c[8];
    for (int i = 0; i < 8; i++) c[i] = _mm256_loadu_ps(acc + 8 * i);
    for (int64_t j = 0; j < n; j++) {
        const __m256 w = _mm256_set1_ps(p[j]);
        const kv_t *r = v + j * row;
        for (int i = 0; i < 8; i++) c[i] = _mm256_fmadd_ps(w, LOAD8(r + 8 * i), c[i]);
    }
    for (int i = 0; i < 8; i++) _mm256_storeu_ps(acc + 8 * i, c[i]);
}
#endif

#if defined(__AVX512F__)
#define TM_AVX512 1
#ifdef KV_HALF
#define LOAD16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p)))
#else
#define LOAD16(p) _mm512_loadu_ps(p)
#endif
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

/* one_item with AVX-512 for head_dim = 16 nv and blocks of at most 16 tokens: a block's scores
 * of one query head in one register, its weighted values accumulated in nv registers. Always
 * inlined, and called with a constant nv, so every loop over nv unrolls and stays in registers. */
INLINE void one_item16(
    const float *restrict q, const kv_t *restrict k_cache, const kv_t *restrict v_cache,
    const int32_t *restrict table, int64_t ctx, int64_t kvh0, int64_t span, int64_t group, int64_t num_kv_heads,
    int64_t block_size, float scale, float *restrict out, const int nv) {
    __m512 acc[MAX_HEADS][8];
    float m[MAX_HEADS], l[MAX_HEADS];
    const int64_t head_dim = 16 * nv, row = num_kv_heads * head_dim, heads = span * group;
    for (int64_t h = 0; h < heads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int c = 0; c < nv; c++) acc[h][c] = _mm512_setzero_ps();
    }
    const __m512 sc = _mm512_set1_ps(scale), minus_inf = _mm512_set1_ps(-INFINITY);
    Ahead a = {.row = row * (int64_t)sizeof(kv_t), .seg = span * head_dim * (int64_t)sizeof(kv_t)};
    for (int64_t b = 0; b < PREFETCH; b++) { /* the first blocks: nothing to interleave them with */
        ahead_at(&a, k_cache, v_cache, table, b * block_size, ctx, row, kvh0 * head_dim, block_size, 1);
        ask(&a, a.step);
    }
    for (int64_t start = 0; start < ctx; start += block_size) {
        ahead_at(&a, k_cache, v_cache, table, start + PREFETCH * block_size, ctx, row, kvh0 * head_dim, block_size,
                 2 * heads);
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const int64_t base = (int64_t)table[start / block_size] * block_size * row + kvh0 * head_dim;
        const __mmask16 live = (__mmask16)((1u << n) - 1u);
        for (int64_t h = 0; h < heads; h++) {
            /* query head h of the item reads kv head kvh0 + h / group */
            const kv_t *kb = k_cache + base + (h / group) * head_dim, *vb = v_cache + base + (h / group) * head_dim;
            __m512 qv[8], t[16];
            ask(&a, a.step);
            for (int c = 0; c < nv; c++) qv[c] = _mm512_loadu_ps(q + h * head_dim + 16 * c);
            for (int64_t j = 0; j < 16; j++) {
                __m512 x = _mm512_setzero_ps();
                if (j < n)
                    for (int c = 0; c < nv; c++) x = _mm512_fmadd_ps(qv[c], LOAD16(kb + j * row + 16 * c), x);
                t[j] = x;
            }
            const __m512 s = _mm512_mask_blend_ps(live, minus_inf, _mm512_mul_ps(hsum16(t), sc));
            const float top = fmaxf(m[h], _mm512_reduce_max_ps(s));
            if (top > m[h]) { /* rescale what was accumulated under the old maximum */
                const float c = tm_expf(m[h] - top);
                l[h] *= c;
                for (int i = 0; i < nv; i++) acc[h][i] = _mm512_mul_ps(acc[h][i], _mm512_set1_ps(c));
                m[h] = top;
            }
            float p[16];
            _mm512_storeu_ps(p, s);
#pragma omp simd
            for (int64_t j = 0; j < 16; j++) p[j] = tm_expf(p[j] - top);
            float sum = 0.0f; /* over the live keys only: tm_expf(-inf) is about 1e-38, not 0 */
            for (int64_t j = 0; j < n; j++) sum += p[j];
            l[h] += sum;
            ask(&a, a.step);
            __m512 r[8];
            for (int c = 0; c < nv; c++) r[c] = acc[h][c];
            for (int64_t j = 0; j < n; j++) {
                const __m512 w = _mm512_set1_ps(p[j]);
                for (int c = 0; c < nv; c++) r[c] = _mm512_fmadd_ps(w, LOAD16(vb + j * row + 16 * c), r[c]);
            }
            for (int c = 0; c < nv; c++) acc[h][c] = r[c];
        }
        ask_rest(&a);
    }
    for (int64_t h = 0; h < heads; h++) {
        const __m512 inv = _mm512_set1_ps(l[h] > 0.0f ? 1.0f / l[h] : 0.0f);
        for (int c = 0; c < nv; c++) _mm512_storeu_ps(out + h * head_dim + 16 * c, _mm512_mul_ps(acc[h][c], inv));
    }
}
#endif

/* One work item: query row q (its `span` kv heads' query heads, [span * group, head_dim]) over
 * ctx keys, a block at a time; per block, each kv head's group walks that head's rows once with an
 * online softmax. With every kv head in one item a block's rows are read whole, in address order,
 * which the hardware prefetchers follow; one head's rows are 1/KVH of each row. */
static void one_item(const float *restrict q, const kv_t *restrict k_cache, const kv_t *restrict v_cache,
                     const int32_t *restrict table, int64_t ctx, int64_t kvh0, int64_t span, int64_t group,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float *restrict out) {
    float acc[MAX_HEADS][MAX_DIM];
    float m[MAX_HEADS], l[MAX_HEADS];
    float s[MAX_GROUP][MAX_BLOCK];
    const int64_t heads = span * group, row = num_kv_heads * head_dim; /* row: stride between tokens */
    for (int64_t h = 0; h < heads; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) acc[h][d] = 0.0f;
    }
    Ahead a = {.row = row * (int64_t)sizeof(kv_t), .seg = span * head_dim * (int64_t)sizeof(kv_t)};
    for (int64_t b = 0; b < PREFETCH; b++) { /* the first blocks: nothing to interleave them with */
        ahead_at(&a, k_cache, v_cache, table, b * block_size, ctx, row, kvh0 * head_dim, block_size, 1);
        ask(&a, a.step);
    }
    for (int64_t start = 0; start < ctx; start += block_size) {
        const int64_t n = ctx - start < block_size ? ctx - start : block_size;
        const int64_t sites = heads * ((n + 7) / 8 + 1); /* the asks below, per block */
        ahead_at(&a, k_cache, v_cache, table, start + PREFETCH * block_size, ctx, row, kvh0 * head_dim, block_size,
                 sites);
        const int64_t base = (int64_t)table[start / block_size] * block_size * row + kvh0 * head_dim;
        for (int64_t kh = 0; kh < span; kh++) {
            const kv_t *kb = k_cache + base + kh * head_dim, *vb = v_cache + base + kh * head_dim;
            const float *qh = q + kh * group * head_dim;
            for (int64_t j = 0; j < n; j += 8)
                for (int64_t g = 0; g < group; g++) {
                    ask(&a, a.step);
#ifdef TM_DOT8
                    if (head_dim % 8 == 0 && j + 8 <= n) {
                        const __m256 dots = dot8(qh + g * head_dim, kb + j * row, row, head_dim);
                        _mm256_storeu_ps(s[g] + j, _mm256_mul_ps(dots, _mm256_set1_ps(scale)));
                        continue;
                    }
#endif
                    for (int64_t i = j; i < n && i < j + 8; i++)
                        s[g][i] = dot(qh + g * head_dim, kb + i * row, head_dim) * scale;
                }
            for (int64_t g = 0; g < group; g++) {
                float *acc_h = acc[kh * group + g];
                float *m_h = &m[kh * group + g], *l_h = &l[kh * group + g];
                float top = *m_h;
                for (int64_t j = 0; j < n; j++) top = s[g][j] > top ? s[g][j] : top;
                if (top > *m_h) { /* rescale what was accumulated under the old maximum */
                    const float c = tm_expf(*m_h - top);
                    *l_h *= c;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) acc_h[d] *= c;
                    *m_h = top;
                }
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t j = 0; j < n; j++) { /* the block's probabilities, vectorised over j */
                    s[g][j] = tm_expf(s[g][j] - top);
                    sum += s[g][j];
                }
                *l_h += sum;
                ask(&a, a.step);
#ifdef TM_DOT8
                if (head_dim % 64 == 0) { /* 64 columns at a time, held in registers across the block */
                    for (int64_t d = 0; d < head_dim; d += 64) pv64(s[g], vb + d, row, n, acc_h + d);
                    continue;
                }
#endif
                for (int64_t j = 0; j < n; j++) {
                    const float p = s[g][j];
                    const kv_t *v = vb + j * row;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) acc_h[d] += p * (float)v[d];
                }
            }
        }
        ask_rest(&a);
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) out[h * head_dim + d] = acc[h][d] * inv;
    }
}

void KV_NAME(tm_paged_attention)(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *query_start, const int32_t *seq_lens,
                        const int32_t *rows, const int32_t *row_seq, int64_t num_items, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                        int64_t num_threads, float *out) {
    /* Item i is query row rows[i] (or row i when rows is NULL) of sequence row_seq[i]. A work item
     * is one row's `span` kv heads: all of them (whole rows of each block, in address order) when
     * there are rows enough to keep every thread busy, else one (the kv heads of a row are
     * neighbours in the work order). */
    const int64_t group = num_heads / num_kv_heads;
#ifdef TM_AVX512
    const int wide = block_size <= 16 && (head_dim == 32 || head_dim == 64 || head_dim == 128);
#endif
    int64_t span = 1;
    if (num_items >= 4 * num_threads)
        for (span = num_kv_heads; span > 1; span--)
            if (num_kv_heads % span == 0 && span * group <= MAX_HEADS) break;
    const int64_t parts = num_kv_heads / span, total = num_items * parts;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t w = 0; w < total; w++) {
        const int64_t i = w / parts, kvh = (w % parts) * span;
        const int64_t t = rows ? rows[i] : i;
        const int64_t seq = row_seq[i];
        const int64_t q_len = query_start[seq + 1] - query_start[seq];
        const int64_t ctx = seq_lens[seq] - q_len + (t - query_start[seq]) + 1; /* causal */
        const int64_t at = (t * num_heads + kvh * group) * head_dim;
        const int32_t *table = block_tables + seq * table_stride;
#ifdef TM_AVX512
        if (wide) {
            /* a call per head_dim, so each inlined copy has its nv as a constant */
            const float *qi = q + at;
            float *o = out + at;
            if (head_dim == 32)
                one_item16(qi, k_cache, v_cache, table, ctx, kvh, span, group, num_kv_heads, block_size, scale, o, 2);
            else if (head_dim == 64)
                one_item16(qi, k_cache, v_cache, table, ctx, kvh, span, group, num_kv_heads, block_size, scale, o, 4);
            else
                one_item16(qi, k_cache, v_cache, table, ctx, kvh, span, group, num_kv_heads, block_size, scale, o, 8);
            continue;
        }
#endif
        one_item(q + at, k_cache, v_cache, table, ctx, kvh, span, group, num_kv_heads, head_dim, block_size, scale,
                 out + at);
    }
}

/* Prefill chunks (long queries). A work item is up to PREFILL_ROWS query rows of one kv head: the
 * next rows / group positions of one sequence, each with the group's query heads. They walk the
 * context together, a block at a time, so each key and value row, read once from memory, serves
 * every row of the item from L1 (a query at a time, one_item reads the context once per row),
 * and each row's scores stop at its own position: past the diagonal nothing is computed (beyond
 * the diagonal block's masked corner). prefill_item8 below is the AVX2 path, prefill_item the
 * portable one (a row at a time, one_item's arithmetic). */
#define PREFILL_ROWS 32

#ifdef TM_DOT8
/* exp of 8 lanes: tm_expf's range reduction and polynomial, as vector instructions. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

/* prefill_item with AVX2 for head_dim a multiple of 8 and blocks of at most 16 tokens, its rows
 * (at most 32) across vector lanes: the queries transposed once per item (qt[d][r], scaled), a
 * block's scores are st[j][r] = sum over d of k[j][d] * qt[d][r], four keys and 16 rows at a
 * time (each broadcast key element feeding two FMAs, each query load four); the online softmax
 * then runs down the keys for 8 rows per vector, with no horizontal sums and no per-row
 * branches; and the weighted values, transposed too, are acc[d][r] += v[j][d] * p[j][r], four
 * columns and 16 rows at a time, rescaled for new maxima as they are loaded. Against a row at a
 * time (dot8, a scalar softmax, pv64): 1.2-1.3x; against per-sequence SDPA: 1.5-1.8x. Positions
 * are compared as floats: exact below 2^24 tokens. */
static void prefill_item8(const float *restrict q, int64_t q_stride, const kv_t *restrict k_cache,
                          const kv_t *restrict v_cache, const int32_t *restrict table, int64_t pos0, int64_t nq,
                          int64_t kvh, int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                          float scale, float *restrict out) {
    /* acc[d][r]: the weighted values, transposed like qt; st[j][r] the block's scores, then weights */
    float qt[MAX_DIM][PREFILL_ROWS], st[16][PREFILL_ROWS], acc[MAX_DIM][PREFILL_ROWS], ml[2][PREFILL_ROWS];
    const int64_t rows = nq * group, row = num_kv_heads * head_dim, vecs = (rows + 7) / 8;
    __m256 pos[PREFILL_ROWS / 8], m[PREFILL_ROWS / 8], l[PREFILL_ROWS / 8];
    for (int64_t r = 0; r < vecs * 8; r++) {
        const float *qr = q + (r / group) * q_stride + (r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) qt[d][r] = r < rows ? qr[d] * scale : 0.0f;
        /* a lane past the last row: never masked, scores 0, never written out */
        ml[0][r] = r < rows ? (float)(pos0 + r / group) : INFINITY;
    }
    for (int64_t c = 0; c < vecs; c++) {
        pos[c] = _mm256_loadu_ps(ml[0] + 8 * c);
        m[c] = _mm256_set1_ps(-INFINITY);
        l[c] = _mm256_setzero_ps();
    }
    for (int64_t d = 0; d < head_dim; d++)
        for (int64_t r = 0; r < PREFILL_ROWS; r++) acc[d][r] = 0.0f;
    for (int64_t j = 0; j < 16; j++) /* lanes past the rows are read (a pair of vectors), never used */
        for (int64_t r = 0; r < PREFILL_ROWS; r++) st[j][r] = 0.0f;
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    for (int64_t start = 0; start < pos0 + nq; start += block_size) {
        const int64_t base = (int64_t)table[start / block_size] * block_size * row + kvh * head_dim;
        const kv_t *kb = k_cache + base, *vb = v_cache + base;
        const int64_t keys = pos0 + nq - start < block_size ? pos0 + nq - start : block_size;
        for (int64_t c = 0; c < vecs; c += 2) { /* scores: 16 rows (two vectors) by 4 keys */
            const int two = c + 1 < vecs;
            for (int64_t j = 0; j < keys; j += 4) {
                const kv_t *k0 = kb + j * row, *k1 = k0 + (j + 1 < keys ? row : 0);
                const kv_t *k2 = k0 + (j + 2 < keys ? 2 * row : 0), *k3 = k0 + (j + 3 < keys ? 3 * row : 0);
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, c0 = a0, c1 = a0, e0 = a0, e1 = a0;
                for (int64_t d = 0; d < head_dim; d++) {
                    const __m256 x0 = _mm256_loadu_ps(qt[d] + 8 * c);
                    const __m256 x1 = two ? _mm256_loadu_ps(qt[d] + 8 * c + 8) : x0;
                    __m256 w = _mm256_set1_ps((float)k0[d]);
                    a0 = _mm256_fmadd_ps(w, x0, a0);
                    a1 = _mm256_fmadd_ps(w, x1, a1);
                    w = _mm256_set1_ps((float)k1[d]);
                    b0 = _mm256_fmadd_ps(w, x0, b0);
                    b1 = _mm256_fmadd_ps(w, x1, b1);
                    w = _mm256_set1_ps((float)k2[d]);
                    c0 = _mm256_fmadd_ps(w, x0, c0);
                    c1 = _mm256_fmadd_ps(w, x1, c1);
                    w = _mm256_set1_ps((float)k3[d]);
                    e0 = _mm256_fmadd_ps(w, x0, e0);
                    e1 = _mm256_fmadd_ps(w, x1, e1);
                }
                const __m256 got[4][2] = {{a0, a1}, {b0, b1}, {c0, c1}, {e0, e1}};
                for (int i = 0; i < 4 && j + i < keys; i++) {
                    _mm256_storeu_ps(st[j + i] + 8 * c, got[i][0]);
                    if (two) _mm256_storeu_ps(st[j + i] + 8 * c + 8, got[i][1]);
                }
            }
        }
        for (int64_t c = 0; c < vecs; c++) { /* the online softmax, 8 rows at a time */
            __m256 top = m[c];
            for (int64_t j = 0; j < keys; j++) {
                /* causal: key start + j is seen by the rows at or after its position */
                const __m256 live = _mm256_cmp_ps(_mm256_set1_ps((float)(start + j)), pos[c], _CMP_LE_OQ);
                const __m256 x = _mm256_blendv_ps(ninf, _mm256_loadu_ps(st[j] + 8 * c), live);
                _mm256_storeu_ps(st[j] + 8 * c, x);
                top = _mm256_max_ps(top, x);
            }
            /* every row sees key 0, so after the first block every lane's maximum is finite */
            const __m256 alpha = exp8(_mm256_sub_ps(m[c], top));
            __m256 sum = _mm256_setzero_ps();
            for (int64_t j = 0; j < keys; j++) {
                const __m256 x = _mm256_loadu_ps(st[j] + 8 * c);
                const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(x, top)), _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ));
                _mm256_storeu_ps(st[j] + 8 * c, e);
                sum = _mm256_add_ps(sum, e);
            }
            l[c] = _mm256_fmadd_ps(l[c], alpha, sum);
            m[c] = top;
            _mm256_storeu_ps(ml[0] + 8 * c, alpha);
        }
        for (int64_t c = 0; c < vecs; c += 2) { /* weighted values: 16 rows (two vectors) by 4 columns */
            const int two = c + 1 < vecs;
            const __m256 al0 = _mm256_loadu_ps(ml[0] + 8 * c), al1 = two ? _mm256_loadu_ps(ml[0] + 8 * c + 8) : al0;
            for (int64_t d = 0; d < head_dim; d += 4) {
                /* rescaled for the new maxima as they are loaded */
                __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(acc[d] + 8 * c), al0);
                __m256 b0 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 1] + 8 * c), al0);
                __m256 c0 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 2] + 8 * c), al0);
                __m256 e0 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 3] + 8 * c), al0);
                __m256 a1 = _mm256_mul_ps(_mm256_loadu_ps(acc[d] + 8 * c + 8), al1);
                __m256 b1 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 1] + 8 * c + 8), al1);
                __m256 c1 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 2] + 8 * c + 8), al1);
                __m256 e1 = _mm256_mul_ps(_mm256_loadu_ps(acc[d + 3] + 8 * c + 8), al1);
                for (int64_t j = 0; j < keys; j++) {
                    const kv_t *v = vb + j * row + d;
                    const __m256 p0 = _mm256_loadu_ps(st[j] + 8 * c), p1 = _mm256_loadu_ps(st[j] + 8 * c + 8);
                    __m256 w = _mm256_set1_ps((float)v[0]);
                    a0 = _mm256_fmadd_ps(w, p0, a0);
                    a1 = _mm256_fmadd_ps(w, p1, a1);
                    w = _mm256_set1_ps((float)v[1]);
                    b0 = _mm256_fmadd_ps(w, p0, b0);
                    b1 = _mm256_fmadd_ps(w, p1, b1);
                    w = _mm256_set1_ps((float)v[2]);
                    c0 = _mm256_fmadd_ps(w, p0, c0);
                    c1 = _mm256_fmadd_ps(w, p1, c1);
                    w = _mm256_set1_ps((float)v[3]);
                    e0 = _mm256_fmadd_ps(w, p0, e0);
                    e1 = _mm256_fmadd_ps(w, p1, e1);
                }
                _mm256_storeu_ps(acc[d] + 8 * c, a0);
                _mm256_storeu_ps(acc[d + 1] + 8 * c, b0);
                _mm256_storeu_ps(acc[d + 2] + 8 * c, c0);
                _mm256_storeu_ps(acc[d + 3] + 8 * c, e0);
                _mm256_storeu_ps(acc[d] + 8 * c + 8, a1); /* lanes of the st/acc padding when !two */
                _mm256_storeu_ps(acc[d + 1] + 8 * c + 8, b1);
                _mm256_storeu_ps(acc[d + 2] + 8 * c + 8, c1);
                _mm256_storeu_ps(acc[d + 3] + 8 * c + 8, e1);
            }
        }
    }
    for (int64_t c = 0; c < vecs; c++) _mm256_storeu_ps(ml[1] + 8 * c, l[c]);
    for (int64_t r = 0; r < rows; r++) {
        const float inv = ml[1][r] > 0.0f ? 1.0f / ml[1][r] : 0.0f;
        float *o = out + (r / group) * q_stride + (r % group) * head_dim;
        for (int64_t d = 0; d < head_dim; d++) o[d] = acc[d][r] * inv;
    }
}
#endif

static void prefill_item(const float *restrict q, int64_t q_stride, const kv_t *restrict k_cache,
                         const kv_t *restrict v_cache, const int32_t *restrict table, int64_t pos0, int64_t nq,
                         int64_t kvh, int64_t group, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                         float scale, float *restrict out) {
    /* q, out: the item's first position, at its kv head's first query head; q_stride floats
     * between positions. Row r is position r / group, head r % group; positions pos0 .. pos0+nq-1. */
#ifdef TM_DOT8
    if (head_dim % 8 == 0 && block_size <= 16) {
        prefill_item8(q, q_stride, k_cache, v_cache, table, pos0, nq, kvh, group, num_kv_heads, head_dim, block_size,
                      scale, out);
        return;
    }
#endif
    float acc[PREFILL_ROWS * MAX_DIM]; /* row r at r * head_dim: rows MAX_DIM apart alias in L1 */
    float m[PREFILL_ROWS], l[PREFILL_ROWS], ss[PREFILL_ROWS][MAX_BLOCK];
    const int64_t rows = nq * group, row = num_kv_heads * head_dim;
    for (int64_t r = 0; r < rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int64_t d = 0; d < head_dim; d++) acc[r * head_dim + d] = 0.0f;
    }
    for (int64_t start = 0; start < pos0 + nq; start += block_size) {
        const int64_t base = (int64_t)table[start / block_size] * block_size * row + kvh * head_dim;
        const kv_t *kb = k_cache + base, *vb = v_cache + base;
        for (int64_t r = 0; r < rows; r++) {
            int64_t n = pos0 + r / group + 1 - start; /* the row's keys in this block: causal */
            if (n <= 0) continue;
            n = n < block_size ? n : block_size;
            float *s = ss[r], top = m[r], sum = 0.0f;
            const float *qr = q + (r / group) * q_stride + (r % group) * head_dim;
            for (int64_t j = 0; j < n; j++) {
                s[j] = dot(qr, kb + j * row, head_dim) * scale;
                top = s[j] > top ? s[j] : top;
            }
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < n; j++) {
                s[j] = tm_expf(s[j] - top);
                sum += s[j];
            }
            if (top > m[r]) { /* rescale what was accumulated under the old maximum */
                const float c = tm_expf(m[r] - top);
                l[r] = l[r] * c + sum;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[r * head_dim + d] *= c;
                m[r] = top;
            } else {
                l[r] += sum;
            }
#ifdef TM_DOT8
            if (head_dim % 64 == 0) { /* 64 columns at a time, held in registers across the block */
                for (int64_t d = 0; d < head_dim; d += 64) pv64(s, vb + d, row, n, acc + r * head_dim + d);
                continue;
            }
#endif
            for (int64_t j = 0; j < n; j++) {
                const float p = s[j];
                const kv_t *v = vb + j * row;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) acc[r * head_dim + d] += p * (float)v[d];
            }
        }
    }
    for (int64_t r = 0; r < rows; r++) {
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        float *o = out + (r / group) * q_stride + (r % group) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) o[d] = acc[r * head_dim + d] * inv;
    }
}

void KV_NAME(tm_prefill_attention)(const float *q, const kv_t *k_cache, const kv_t *v_cache,
                                   const int32_t *block_tables, int64_t table_stride, const int32_t *query_start,
                                   const int32_t *seq_lens, const int32_t *seqs, int64_t num_seqs, int64_t num_heads,
                                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                                   int64_t num_threads, float *out) {
    /* Every query row of the sequences seqs[0 .. num_seqs - 1], whose new tokens are the last q_len
     * of their context (the whole prompt, or a chunk after cached tokens, already stored). Work
     * items: each sequence's positions in runs of `per` (PREFILL_ROWS rows of a group), times its
     * kv heads; the last runs first, as they have the longest contexts to walk. */
    const int64_t group = num_heads / num_kv_heads;
    const int64_t per = PREFILL_ROWS / group > 0 ? PREFILL_ROWS / group : 1;
    int64_t first[num_seqs + 1]; /* work items before sequence i */
    first[0] = 0;
    for (int64_t i = 0; i < num_seqs; i++) {
        const int64_t q_len = query_start[seqs[i] + 1] - query_start[seqs[i]];
        first[i + 1] = first[i] + (q_len + per - 1) / per * num_kv_heads;
    }
    const int64_t total = first[num_seqs];
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int64_t w = 0; w < total; w++) {
        int64_t i = 0;
        while (first[i + 1] <= w) i++;
        const int64_t seq = seqs[i], runs = (first[i + 1] - first[i]) / num_kv_heads;
        const int64_t run = runs - 1 - (w - first[i]) / num_kv_heads, kvh = (w - first[i]) % num_kv_heads;
        const int64_t q_len = query_start[seq + 1] - query_start[seq];
        const int64_t nq = q_len - run * per < per ? q_len - run * per : per;
        const int64_t t = query_start[seq] + run * per; /* the item's first query row */
        const int64_t at = (t * num_heads + kvh * group) * head_dim;
        prefill_item(q + at, num_heads * head_dim, k_cache, v_cache, block_tables + seq * table_stride,
                     seq_lens[seq] - q_len + run * per, nq, kvh, group, num_kv_heads, head_dim, block_size, scale,
                     out + at);
    }
}
