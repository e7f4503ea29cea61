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

/* Lane-wise maximum (of numbers; a NaN lane takes b's). */
static inline v8f vmax(v8f a, v8f b) {
    const v8i greater = a > b;
    return (v8f)(((v8i)a & greater) | ((v8i)b & ~greater));
}

/* exp(x) for x <= 0 (scores less their running maximum; below -87 it gives about 1e-38): x = n ln2 + r
 * with |r| <= ln2 / 2, exp(r) by Cephes' expf polynomial, 2^n by the exponent bits. One body for every
 * width (VF float lanes, VI as many int32 lanes): GCC's vector extensions take scalars as splats. */
#define DEFINE_EXP_NONPOSITIVE(NAME, VF, VI)                                                                   \
    static inline VF NAME(VF x) {                                                                              \
        const VI below = x < -87.0f;                                                                           \
        x = (VF)(((VI)x & ~below) | ((VI)((VF){} - 87.0f) & below));                                           \
        const VI n = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, VI);                             \
        const VF nf = __builtin_convertvector(n, VF);                                                          \
        const VF r = x - nf * 0.693359375f - nf * -2.12194440e-4f;                                             \
        VF p = (VF){} + 1.9875691500e-4f;                                                                      \
        p = p * r + 1.3981999507e-3f;                                                                          \
        p = p * r + 8.3334519073e-3f;                                                                          \
        p = p * r + 4.1665795894e-2f;                                                                          \
        p = p * r + 1.6666665459e-1f;                                                                          \
        p = p * r + 5.0000001201e-1f;                                                                          \
        p = p * r * r + r + 1.0f;                                                                              \
        return p * (VF)((n + 127) << 23);                                                                      \
    }

DEFINE_EXP_NONPOSITIVE(exp_nonpositive, v8f, v8i)

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* One value from element `index` of a float32 (bf16 == 0) or bfloat16 array, as float32. */
static inline __attribute__((always_inline)) float load_any1(const void *p, int64_t index, const int bf16) {
    if (!bf16) return ((const float *)p)[index];
    const uint32_t bits = (uint32_t)((const uint16_t *)p)[index] << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

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

/* The bits of float32 values rounded to bfloat16, to nearest even (NaN stays a quiet NaN), like torch's
 * cast: the bfloat16 in each lane's top half, zeros below. One body for every width. */
#define DEFINE_BF16_BITS(NAME, VF, VI)                                                                         \
    static inline VI NAME(VF v) {                                                                              \
        const VI bits = (VI)v;                                                                                 \
        const VI nan = (bits & 0x7fffffff) > 0x7f800000;                                                       \
        const VI rounded = (bits + 0x7fff + ((bits >> 16) & 1)) & (int32_t)0xffff0000u;                        \
        return (rounded & ~nan) | (((VI){} + 0x7fc00000) & nan);                                               \
    }

DEFINE_BF16_BITS(bf16_bits, v8f, v8i)

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
/* Where the CPU converts to bfloat16 itself (vcvtneps2bf16), one instruction instead of bf16_bits' seven:
 * the same rounding to nearest even, and a NaN stays a NaN (with its sign and payload, where bf16_bits makes
 * every NaN 0x7fc0); float32 subnormals (below 2^-126, never an activation of a working model) become zero
 * where bf16_bits keeps them as bfloat16 subnormals. */
#define NATIVE_BF16 1
#else
#define NATIVE_BF16 0
#endif

/* Eight float32 values rounded to bfloat16 and widened back (in registers: the identity for what a
 * bfloat16 tensor can hold). */
static inline v8f round_bf16(v8f v) {
#if NATIVE_BF16
    const __m128i halves = (__m128i)_mm256_cvtneps_pbh((__m256)v);
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16);
#else
    return (v8f)bf16_bits(v);
#endif
}

/* Eight float32 values as bfloat16 (rounded as bf16_bits). */
static inline void store_bf16x8(uint16_t *p, v8f v) {
#if NATIVE_BF16
    _mm_storeu_si128((__m128i *)p, (__m128i)_mm256_cvtneps_pbh((__m256)v));
#elif defined(__AVX512F__) && defined(__AVX512VL__)
    const v8u top = (v8u)bf16_bits(v) >> 16;
    _mm_storeu_si128((__m128i *)p, _mm256_cvtepi32_epi16((__m256i)top)); /* one vpmovdw */
#elif defined(__AVX2__)
    const v8u top = (v8u)bf16_bits(v) >> 16;
    /* Each lane is at most 0xffff, so packing with unsigned saturation is exact. */
    const __m256i t = (__m256i)top;
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
#else
    const v8u16 halves = __builtin_convertvector((v8u)bf16_bits(v) >> 16, v8u16);
    memcpy(p, &halves, sizeof halves);
#endif
}

#if defined(__AVX512F__)
/* Sixteen lanes: one AVX-512 register. */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

DEFINE_EXP_NONPOSITIVE(exp_nonpositive16, v16f, v16i)

/* Sixteen values from element `index` of a float32 or bfloat16 array, as float32. */
static inline __attribute__((always_inline)) v16f load_any16(const void *p, int64_t index, const int bf16) {
    if (!bf16) return (v16f)_mm512_loadu_ps((const float *)p + index);
    const __m256i raw = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + index));
    return (v16f)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

DEFINE_BF16_BITS(bf16_bits16, v16f, v16i)

static inline v16f round_bf16x16(v16f v) {
#if NATIVE_BF16
    const __m256i halves = (__m256i)_mm512_cvtneps_pbh((__m512)v);
    return (v16f)_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16);
#else
    return (v16f)bf16_bits16(v);
#endif
}

/* Sixteen float32 values as bfloat16 (rounded as bf16_bits), with one vpmovdw (or the CPU's conversion). */
static inline void store_bf16x16(uint16_t *p, v16f v) {
#if NATIVE_BF16
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh((__m512)v));
#else
    const __m512i top = _mm512_srli_epi32((__m512i)bf16_bits16(v), 16);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(top));
#endif
}
#endif

/* An OpenMP loop `for (HEADER) BODY` in which BODY sees the dtype as the constant BF16. GCC outlines a
 * parallel region into one function, which every inlined copy of its enclosing function shares, with that
 * function's arguments as variables: the kernels' bf16 arguments, constants at each entry point, had
 * become a branch in every loop, and the constants of each path no longer stayed in registers
 * (silu_and_mul ran 22% slower). Here each dtype gets a region of its own. */
#define PARALLEL_BY_DTYPE(flag, CLAUSES, HEADER, BODY)                                                       \
    do {                                                                                                     \
        if (flag) {                                                                                          \
            enum { BF16 = 1 };                                                                               \
            _Pragma(OMP_PARALLEL_FOR(CLAUSES)) for (HEADER) BODY;                                            \
        } else {                                                                                             \
            enum { BF16 = 0 };                                                                               \
            _Pragma(OMP_PARALLEL_FOR(CLAUSES)) for (HEADER) BODY;                                            \
        }                                                                                                    \
    } while (0)
#define OMP_PARALLEL_FOR(CLAUSES) OMP_STRING(omp parallel for CLAUSES)
#define OMP_STRING(x) #x

#endif
