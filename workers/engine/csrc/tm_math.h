/* expf that gcc vectorises: glibc's expf is a call per element (its vector variants are only
 * declared under -ffast-math, whose crtfastmath.o would switch the whole process to flushing
 * denormals). Cody-Waite range reduction and Cephes' polynomial: about 1 ulp over the range
 * softmax and SiLU use; results below e^-87 come out as FLT_MIN-sized, not 0 or denormal. */
#ifndef TM_MATH_H
#define TM_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float tm_expf(float x) {
    x = x < -87.3f ? -87.3f : x; /* two selects: gcc vectorises them (with -fno-trapping-math) */
    x = x > 88.7f ? 88.7f : x;
    const float n = rintf(x * 1.44269504088896341f);
    float r = fmaf(n, -0.693359375f, x); /* x - n ln2, ln2 in two parts */
    r = fmaf(n, 2.12194440e-4f, r);
    float p = 1.9875691500e-4f;
    p = fmaf(p, r, 1.3981999507e-3f);
    p = fmaf(p, r, 8.3334519073e-3f);
    p = fmaf(p, r, 4.1665795894e-2f);
    p = fmaf(p, r, 1.6666665459e-1f);
    p = fmaf(p, r, 5.0000001201e-1f);
    p = fmaf(p, r * r, r) + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23; /* 2^n */
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
