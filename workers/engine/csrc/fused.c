/* The Llama block's elementwise work, fused, for the CPU (built with paged_attention.c).
 *
 * Unfused, a decoder layer runs some 30 elementwise ATen ops (RMSNorm alone is six), each an
 * OpenMP parallel region over a small tensor. On a machine whose cores are shared with the
 * server around the engine, every region waits at its barrier for a thread the OS scheduled
 * away; here a layer has four regions besides its matmuls, and small tensors (a decode step's)
 * stay on one thread. Numerics follow HF's modules: fp32 throughout, the same operation order.
 */
#include <math.h>
#include <stdint.h>

#include "tm_math.h"

/* Below this many elements a loop runs on the calling thread: a parallel region costs more. */
#define PARALLEL_MIN (1 << 18)

/* out[t] = weight * (h[t] / sqrt(mean(h[t]^2) + eps)) with h = x, or, given a residual,
 * residual[t] += x[t] first (in place) and h = residual: vLLM's fused add + RMSNorm. */
void tm_rms_norm(const float *x, float *residual, const float *weight, float eps, int64_t n, int64_t d,
                 float *out, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        const float *xt = x + t * d;
        const float *h = xt;
        float ss = 0.0f;
        if (residual) {
            float *r = residual + t * d;
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < d; i++) {
                r[i] += xt[i];
                ss += r[i] * r[i];
            }
            h = r;
        } else {
#pragma omp simd reduction(+ : ss)
            for (int64_t i = 0; i < d; i++) ss += xt[i] * xt[i];
        }
        const float inv = 1.0f / sqrtf(ss / (float)d + eps);
        float *o = out + t * d;
#pragma omp simd
        for (int64_t i = 0; i < d; i++) o[i] = weight[i] * (h[i] * inv);
    }
}

/* Rotate-half RoPE, in place, on q [n, num_q, d] and k [n, num_k, d] (rows `q_stride` and
 * `k_stride` elements apart: views into the fused qkv output), with cos, sin [n, d]. */
void tm_rope(float *q, int64_t q_stride, int64_t num_q, float *k, int64_t k_stride, int64_t num_k,
             const float *cos, const float *sin, int64_t n, int64_t d, int64_t num_threads) {
    const int64_t half = d / 2;
#pragma omp parallel for num_threads(num_threads) if (n * (num_q + num_k) * d >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        const float *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < num_q + num_k; h++) {
            float *x = h < num_q ? q + t * q_stride + h * d : k + t * k_stride + (h - num_q) * d;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                const float x1 = x[i], x2 = x[i + half];
                x[i] = x1 * c[i] + (-x2) * s[i];
                x[i + half] = x2 * c[i + half] + x1 * s[i + half];
            }
        }
    }
}

/* k_cache/v_cache row slots[t] = k[t], v[t] (rows `k_stride`/`v_stride` apart, `row` values
 * each: kv heads x head_dim); slot -1 (padding) is not stored. The caches hold fp32, or fp16
 * when `half` (each value rounded to the nearest half). */
void tm_store_kv(const float *k, int64_t k_stride, const float *v, int64_t v_stride, const int64_t *slots,
                 void *k_cache, void *v_cache, int64_t n, int64_t row, int64_t half, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * row >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        const float *kt = k + t * k_stride, *vt = v + t * v_stride;
        if (half) {
            _Float16 *kc = (_Float16 *)k_cache + slot * row, *vc = (_Float16 *)v_cache + slot * row;
#pragma omp simd
            for (int64_t i = 0; i < row; i++) {
                kc[i] = (_Float16)kt[i];
                vc[i] = (_Float16)vt[i];
            }
        } else {
            float *kc = (float *)k_cache + slot * row, *vc = (float *)v_cache + slot * row;
#pragma omp simd
            for (int64_t i = 0; i < row; i++) {
                kc[i] = kt[i];
                vc[i] = vt[i];
            }
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i]: the MLP's activation. */
void tm_silu_mul(const float *gate_up, int64_t n, int64_t inter, float *out, int64_t num_threads) {
#pragma omp parallel for num_threads(num_threads) if (n * inter >= PARALLEL_MIN)
    for (int64_t t = 0; t < n; t++) {
        const float *g = gate_up + t * 2 * inter, *u = g + inter;
        float *o = out + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; i++) o[i] = g[i] / (1.0f + tm_expf(-g[i])) * u[i];
    }
}
