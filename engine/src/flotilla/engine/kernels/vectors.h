/* Vector helpers the CPU's C kernels share (paged_decode.c, cpu_ops.c): GCC's generic 8-float vectors
 * (one AVX register; the compiler splits them elsewhere), loads and stores through memcpy (no alignment
 * needed), float32 <-> bfloat16, and exp on vectors (of non-positive numbers). */
#ifndef FLOTILLA_VECTORS_H
#define FLOTILLA_VECTORS_H
#include <math.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

typedef uint32_t v8u __attribute__((vector_size(32)));
static inline v8u splat_i(uint32_t x) { return (v8u){x, x, x, x, x, x, x, x}; }

/* Lane-wise maximum (of numbers; a NaN lane takes b's). */
static inline v8f vmax(v8f a, v8f b) {
    const v8i greater = a > b;
    return (v8f)(((v8i)a & greater) | ((v8i)b & ~greater));
}

/* exp(x) for x <= 0 (scores less their running maximum; below -87 it gives about 1e-38): x = n ln2 + r
 * with |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, 2^n by the exponent bits. */
static inline v8f exp_nonpositive(v8f x) {
    const v8i below = x < splat(-87.0f);
    v8i xi, floor_bits;
    const v8f floor_value = splat(-87.0f);
    memcpy(&xi, &x, sizeof xi);
    memcpy(&floor_bits, &floor_value, sizeof floor_bits);
    xi = (xi & ~below) | (floor_bits & below);
    memcpy(&x, &xi, sizeof x);
    const v8i n = __builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), v8i);
    const v8f nf = __builtin_convertvector(n, v8f);
    const v8f r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
    v8f p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    p = p * r * r + r + splat(1.0f);
    v8i bits = (n + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* Eight values from element `index` of a float32 (bf16 == 0) or bfloat16 array, as float32 (widening a
 * bfloat16 is exact: it is the top half of a float32's bits). Callers pass bf16 as a constant, so each
 * inlined copy keeps one branch. */
static inline __attribute__((always_inline)) v8f load_any8(const void *p, int64_t index, const int bf16) {
    if (!bf16) return load8((const float *)p + index);
#if defined(__AVX2__)
    /* One widening load and a shift: GCC compiles the generic form below as two 4-lane halves and an insert,
       which made the conversion, not the FMAs, the decode kernel's hottest instructions. */
    const __m128i raw = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + index));
    return (v8f)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
#endif
    v8u16 halves;
    memcpy(&halves, (const uint16_t *)p + index, sizeof halves);
    const v8i bits = __builtin_convertvector(halves, v8i) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* The bits of eight float32 values rounded to bfloat16, to nearest even (NaN stays a quiet NaN), like
 * torch's cast: the bfloat16 in each lane's top half, zeros below. */
static inline v8i bf16_bits(v8f v) {
    v8i bits;
    memcpy(&bits, &v, sizeof bits);
    const v8i nan = (bits & 0x7fffffff) > 0x7f800000;
    const v8i rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & (v8i)splat_i(0xffff0000u);
    return (rounded & ~nan) | ((v8i)splat_i(0x7fc00000u) & nan);
}

/* Eight float32 values rounded to bfloat16 and widened back (in registers: the identity for what a
 * bfloat16 tensor can hold). */
static inline v8f round_bf16(v8f v) {
    const v8i bits = bf16_bits(v);
    v8f out;
    memcpy(&out, &bits, sizeof out);
    return out;
}

/* Eight float32 values as bfloat16 (rounded as bf16_bits). */
static inline void store_bf16x8(uint16_t *p, v8f v) {
    const v8u top = (v8u)bf16_bits(v) >> 16;
#if defined(__AVX512F__) && defined(__AVX512VL__)
    _mm_storeu_si128((__m128i *)p, _mm256_cvtepi32_epi16((__m256i)top)); /* one vpmovdw */
#elif defined(__AVX2__)
    /* Each lane is at most 0xffff, so packing with unsigned saturation is exact. */
    const __m256i t = (__m256i)top;
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
#else
    const v8u16 halves = __builtin_convertvector(top, v8u16);
    memcpy(p, &halves, sizeof halves);
#endif
}

#endif
