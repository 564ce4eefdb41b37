/* The projections of small batches (decode steps) on AVX-512 and AVX2 CPUs: y = x w^T, fp32.
 *
 * oneDNN (and MKL) reach ~300 GFLOP/s on two cores at prefill sizes, but at a decode step's few
 * dozen rows oneDNN makes 120-190: with 64 rows a step's weights are each used 64 times and
 * streamed from memory once, and its blocking is made for large batches. Here the weight is
 * packed once into panels of NR output columns, k-major (a panel's row for one k is two
 * vectors), and a thread takes whole panels: for each, MR rows of x at a time keep 2 * MR
 * accumulators in registers while the panel streams past (from L2, where the passes over the
 * thread's previous panel asked for it a row at a time; the first pass also asks PF k-steps
 * ahead into L1). With AVX-512 (NR 32, MR 12): 1.1-1.6x
 * oneDNN's packed projections at 64 rows over a step's 30 layers of SmolLM2, up to 2.4x at 8
 * rows. With AVX2 (NR 16, MR 6: 12 accumulators, 2 panel vectors and a broadcast of 16
 * registers, BLIS's Haswell shape). At a few hundred rows both are alike and above that
 * oneDNN's own blocking wins, so larger batches go to F.linear (workers/engine/linear.py).
 *
 * Each output is one sum over k in order, fused multiply-adds from zero, whatever the batch,
 * the threads or the vector width: a row's result does not depend on what else is in the step;
 * tm_greedy_pick repeats that sum for the few columns greedy_head.py needs exactly. With
 * neither AVX-512 nor AVX2 and FMA, tm_gemm_nr() is 0 and nothing here is used. */
#include <math.h>
#include <stdint.h>

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#include <immintrin.h>

#define NR 32  /* output columns per panel: two vectors */
#define MR 12  /* rows of x per pass: 24 accumulators, 2 panel vectors, 1 broadcast of 32 registers */
#define PF 16  /* k-steps ahead that the first pass over a panel asks for it (2 KB) */

/* mr rows of x (xs floats apart) against one panel b, into y (ys apart); only the panel's
 * first `cols` columns exist. Every `every` k-steps the pass asks for the row of another panel
 * at `ahead`, and the next row the time after. Always inlined with constant mr and pf: fully
 * unrolled. */
INLINE void pass(const float *restrict x, int64_t xs, const float *restrict b, int64_t k, float *restrict y, int64_t ys,
                 int64_t cols, const int mr, const int pf, const float *ahead, int64_t every) {
    __m512 c0[MR], c1[MR];
    int64_t due = every;
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        if (pf) { /* past the end of the panel: harmless, a prefetch does not fault */
            _mm_prefetch((const char *)(b + (kk + PF) * NR), _MM_HINT_T0);
            _mm_prefetch((const char *)(b + (kk + PF) * NR + 16), _MM_HINT_T0);
        }
        if (--due == 0) { /* a row of the thread's next panel, into L2 (tm_gemm) */
            due = every;
            _mm_prefetch((const char *)ahead, _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + 16), _MM_HINT_T1);
            ahead += NR;
        }
        const __m512 b0 = _mm512_loadu_ps(b + kk * NR), b1 = _mm512_loadu_ps(b + kk * NR + 16);
        for (int r = 0; r < mr; r++) {
            const __m512 a = _mm512_set1_ps(x[r * xs + kk]);
            c0[r] = _mm512_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm512_fmadd_ps(a, b1, c1[r]);
        }
    }
    const __mmask16 lo = (__mmask16)(cols >= 16 ? 0xFFFF : (1u << cols) - 1u);
    const __mmask16 hi = (__mmask16)(cols >= 32 ? 0xFFFF : cols > 16 ? (1u << (cols - 16)) - 1u : 0u);
    for (int r = 0; r < mr; r++) {
        _mm512_mask_storeu_ps(y + r * ys, lo, c0[r]);
        _mm512_mask_storeu_ps(y + r * ys + 16, hi, c1[r]);
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define NR 16  /* output columns per panel: two vectors */
#define MR 6   /* rows of x per pass: 12 accumulators, 2 panel vectors, 1 broadcast of 16 registers */
#define PF 32  /* k-steps ahead that the first pass over a panel asks for it (2 KB, as above) */

/* As the AVX-512 pass above; a panel's row for one k is one cache line here. The unroll pragmas
 * are needed: without them gcc 12 kept the accumulators in a stack array too, storing all 12
 * every k-step (0.5-0.6x oneDNN at 64 rows instead of 1.2x). */
INLINE void pass(const float *restrict x, int64_t xs, const float *restrict b, int64_t k, float *restrict y, int64_t ys,
                 int64_t cols, const int mr, const int pf, const float *ahead, int64_t every) {
    __m256 c0[MR], c1[MR];
    int64_t due = every;
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) c0[r] = c1[r] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < k; kk++) {
        if (pf) _mm_prefetch((const char *)(b + (kk + PF) * NR), _MM_HINT_T0);
        if (--due == 0) { /* a row of the thread's next panel, into L2 (tm_gemm) */
            due = every;
            _mm_prefetch((const char *)ahead, _MM_HINT_T1);
            ahead += NR;
        }
        const __m256 b0 = _mm256_loadu_ps(b + kk * NR), b1 = _mm256_loadu_ps(b + kk * NR + 8);
#pragma GCC unroll 6
        for (int r = 0; r < mr; r++) {
            const __m256 a = _mm256_broadcast_ss(x + r * xs + kk);
            c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
            c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols), lane);
    const __m256i hi = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cols - 8), lane);
#pragma GCC unroll 6
    for (int r = 0; r < mr; r++) {
        _mm256_maskstore_ps(y + r * ys, lo, c0[r]);
        _mm256_maskstore_ps(y + r * ys + 8, hi, c1[r]);
    }
}

#endif

#ifdef NR

int64_t tm_gemm_nr(void) { return NR; }

/* w [n][k] into ceil(n / NR) panels [k][NR], the last one padded with zeros. */
void tm_pack_panels(const float *w, int64_t n, int64_t k, float *out) {
    const int64_t panels = (n + NR - 1) / NR;
#pragma omp parallel for
    for (int64_t p = 0; p < panels; p++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t j = 0; j < NR; j++) {
                const int64_t col = p * NR + j;
                out[(p * k + kk) * NR + j] = col < n ? w[col * k + kk] : 0.0f;
            }
}

static void rows(const float *x, int64_t xs, const float *b, int64_t k, float *y, int64_t ys, int64_t cols, int mr,
                 int pf, const float *ahead, int64_t every) {
#define PASS(n)                                                      \
    case n:                                                          \
        if (pf)                                                      \
            pass(x, xs, b, k, y, ys, cols, n, 1, ahead, every);      \
        else                                                         \
            pass(x, xs, b, k, y, ys, cols, n, 0, ahead, every);      \
        break;
    switch (mr) {
        PASS(1) PASS(2) PASS(3) PASS(4) PASS(5) PASS(6)
#if MR > 6
        PASS(7) PASS(8) PASS(9) PASS(10) PASS(11) PASS(12)
#endif
    }
#undef PASS
}

/* y [m][n] (rows ys apart) = x [m][k] (rows xs apart, each contiguous) times the packed w^T.
 * Panels are handed out one at a time as threads come free, not in equal shares up front: on
 * cores shared with the server and the VM's neighbours, a share finished early waited at the
 * region's end for the other (one step's 30 layers at 64 rows: 1.09-1.13x, at 32 rows 1.05-1.09x,
 * a 2-core Xeon, alternating in one process). A thread claims its next panel as it starts one and
 * asks for it, into L2, a row every few k-steps over the passes of this one: otherwise each
 * panel's first pass waits on memory while the arithmetic units idle, and every pass after it
 * computes while memory idles. Which thread computes a panel changes nothing in it. */
void tm_gemm(const float *x, int64_t m, int64_t k, int64_t xs, const float *panels, int64_t n, float *y, int64_t ys,
             int64_t num_threads) {
    const int64_t count = (n + NR - 1) / NR, passes = (m + MR - 1) / MR;
    int64_t claimed = 0;
#pragma omp parallel num_threads(num_threads) if (m * n * k >= (1 << 16))
    {
        int64_t p = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
        while (p < count) {
            const int64_t next = __atomic_fetch_add(&claimed, 1, __ATOMIC_RELAXED);
            const int64_t cols = n - p * NR < NR ? n - p * NR : NR;
            const float *b = panels + p * k * NR, *ahead = next < count ? panels + next * k * NR : b;
            for (int64_t m0 = 0, i = 0; m0 < m; m0 += MR, i++) {
                const int mr = m - m0 < MR ? (int)(m - m0) : MR;
                /* pass i asks for the next panel's rows i k / passes onwards, one every `passes` k-steps */
                rows(x + m0 * xs, xs, b, k, y + m0 * ys + p * NR, ys, cols, mr, m0 == 0, ahead + i * k / passes * NR,
                     next < count ? passes : INT64_MAX);
            }
            p = next;
        }
    }
}

#else

int64_t tm_gemm_nr(void) { return 0; }
void tm_pack_panels(const float *w, int64_t n, int64_t k, float *out) { (void)w, (void)n, (void)k, (void)out; }
void tm_gemm(const float *x, int64_t m, int64_t k, int64_t xs, const float *panels, int64_t n, float *y, int64_t ys,
             int64_t num_threads) {
    (void)x, (void)m, (void)k, (void)xs, (void)panels, (void)n, (void)y, (void)ys, (void)num_threads;
}

#endif

#if defined(__AVX512F__)

/* Greedy tokens from a bf16 screen of the logits (workers/engine/greedy_head.py): for each of n
 * rows of h [n][k] (rows hs apart), the argmax over v columns of w [v][k] of the fp32 logits the
 * panels above compute (each one sum over k in order, fused multiply-adds from zero), without
 * computing them all. s [n][v] holds bf16 bits of a cheap approximation whose error is at most
 * c * hn[r] * wn[j] (hn, wn: norms of h's rows and w's, rounded up); a column can hold the argmax
 * only if s_j + e_j >= max_i (s_i - e_i). Those candidates get their exact logit; the first
 * largest wins, as argmax has it. out[r] = that token, or -1 when the row had more than `cap`
 * candidates or anything not finite: the caller computes that row in full. */
static inline float bf16_float(uint16_t b) {
    const uint32_t u = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

/* The exact logit of column j: the panels' sum, in order. */
static inline float exact(const float *x, const float *col, int64_t k) {
    float acc = 0.0f;
    for (int64_t kk = 0; kk < k; kk++) acc = fmaf(x[kk], col[kk], acc);
    return acc;
}

static inline __m512 load_bf16(const uint16_t *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

void tm_greedy_pick(const float *h, int64_t n, int64_t k, int64_t hs, const float *w, const uint16_t *s, int64_t v,
                    const float *wn, const float *hn, float c, int64_t cap, int64_t *out, int64_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (n > 1)
    for (int64_t r = 0; r < n; r++) {
        const uint16_t *row = s + r * v;
        const float *x = h + r * hs;
        const float scale = c * hn[r];
        out[r] = -1;
        if (!isfinite(scale)) continue;
        /* lo = max_j (s_j - e_j); any NaN or infinity in the screen sends the row back. */
        const __m512 sc = _mm512_set1_ps(scale);
        __m512 lov = _mm512_set1_ps(-INFINITY);
        __mmask16 bad = 0;
        int64_t j = 0;
        for (; j + 16 <= v; j += 16) {
            const __m512 sj = load_bf16(row + j);
            bad |= _mm512_fpclass_ps_mask(sj, 0x99); /* NaN, +inf, -inf */
            lov = _mm512_max_ps(lov, _mm512_fnmadd_ps(sc, _mm512_loadu_ps(wn + j), sj));
        }
        float lo = _mm512_reduce_max_ps(lov);
        for (; j < v; j++) {
            const float sj = bf16_float(row[j]);
            bad |= !isfinite(sj);
            lo = fmaxf(lo, sj - scale * wn[j]);
        }
        if (bad) continue;
        /* The candidates, in column order: the first largest exact logit wins. */
        const __m512 lo16 = _mm512_set1_ps(lo);
        int64_t count = 0, best = -1;
        float top = -INFINITY;
        for (j = 0; j < v && count <= cap; j += 16) {
            uint32_t hit;
            if (j + 16 <= v) {
                const __m512 up = _mm512_fmadd_ps(sc, _mm512_loadu_ps(wn + j), load_bf16(row + j));
                hit = _mm512_cmp_ps_mask(up, lo16, _CMP_GE_OQ);
            } else {
                hit = 0;
                for (int64_t q = j; q < v; q++) hit |= (uint32_t)(bf16_float(row[q]) + scale * wn[q] >= lo) << (q - j);
            }
            for (; hit && count <= cap; hit &= hit - 1) {
                const int64_t col = j + __builtin_ctz(hit);
                const float logit = exact(x, w + col * k, k);
                count++;
                if (!isfinite(logit)) count = cap + 1;
                else if (logit > top) top = logit, best = col;
            }
        }
        if (count <= cap) out[r] = best;
    }
}

#else

/* The screen needs AVX-512 (greedy_head.py builds it only with AVX-512 BF16 or AMX): every row
 * goes back to the caller. */
void tm_greedy_pick(const float *h, int64_t n, int64_t k, int64_t hs, const float *w, const uint16_t *s, int64_t v,
                    const float *wn, const float *hn, float c, int64_t cap, int64_t *out, int64_t num_threads) {
    (void)h, (void)k, (void)hs, (void)w, (void)s, (void)v, (void)wn, (void)hn, (void)c, (void)cap, (void)num_threads;
    for (int64_t r = 0; r < n; r++) out[r] = -1;
}

#endif
