/* The CPU's fused elementwise ops, float32 or bfloat16 tensors, arithmetic in float32 with the same
 * roundings as the torch code they replace (model/llama.py's RMSNorm and MLP), in one pass over memory
 * instead of five or six, each of which in bfloat16 also widened and rounded its operands; and greedy
 * sampling's argmax.
 *
 *   rms_norm:      out = w * dtype(x * rsqrt(mean(x^2) + eps))       (x [rows, d]; w [d])
 *   add_rms_norm:  residual = dtype(x + residual), then rms_norm of it into out
 *   silu_and_mul:  out = dtype(dtype(silu(gate)) * up)               (gate_up [rows, 2i], out [rows, i])
 *   rope_store:    rotary embeddings on a qkv projection's queries and keys, keys and values into the KV cache
 *   argmax_rows:   each row's first maximum, for greedy sampling (float32)
 * Rows are shared among OpenMP threads (torch's pool, as for the decode kernel).
 */
#include "vectors.h"

static inline __attribute__((always_inline)) void store_x8(void *p, int64_t i, v8f v, const int bf16) {
    if (bf16)
        store_bf16x8((uint16_t *)p + i, v);
    else
        store8((float *)p + i, v);
}

#if defined(__AVX512F__)
static inline __attribute__((always_inline)) void store_x16(void *p, int64_t i, v16f v, const int bf16) {
    if (bf16)
        store_bf16x16((uint16_t *)p + i, v);
    else
        _mm512_storeu_ps((float *)p + i, (__m512)v);
}

static inline __attribute__((always_inline)) v16f round16(v16f v, const int bf16) {
    return bf16 ? round_bf16x16(v) : v;
}
#endif

/* One value rounded to the tensor's dtype and back (identity for float32). */
static inline __attribute__((always_inline)) v8f round8(v8f v, const int bf16) {
    return bf16 ? round_bf16(v) : v;
}

static inline __attribute__((always_inline)) float round1(float v, const int bf16) {
    return bf16 ? round8(splat(v), 1)[0] : v;
}

static inline __attribute__((always_inline)) void store_x1(void *p, int64_t i, float v, const int bf16) {
    if (!bf16) {
        ((float *)p)[i] = v;
        return;
    }
    uint16_t tmp[8];
    store_bf16x8(tmp, splat(v));
    ((uint16_t *)p)[i] = tmp[0];
}

/* One row of rms_norm_rows: 16-float vectors where the machine has AVX-512 (the 8-float body had taken
 * 0.9 ms of a 2048-token bfloat16 prefill's 512-wide norms on one core), then 8, then one value. */
static inline __attribute__((always_inline)) void rms_norm_row(void *out, const void *x, void *residual,
                                                               const void *w, int64_t r, int64_t d, float eps,
                                                               const int bf16) {
    const int64_t row = r * d;
    int64_t i = 0;
    float sum = 0.0f;
    /* With a residual: residual = dtype(x + residual) first, and the norm is of that sum. */
#if defined(__AVX512F__)
    v16f squares16 = (v16f){};
    for (; i + 16 <= d; i += 16) {
        v16f v = load_any16(x, row + i, bf16);
        if (residual) {
            v = round16(v + load_any16(residual, row + i, bf16), bf16);
            store_x16(residual, row + i, v, bf16);
        }
        squares16 += v * v;
    }
    sum += _mm512_reduce_add_ps((__m512)squares16);
#endif
    v8f squares = splat(0.0f);
    for (; i + 8 <= d; i += 8) {
        v8f v = load_any8(x, row + i, bf16);
        if (residual) {
            v = round8(v + load_any8(residual, row + i, bf16), bf16);
            store_x8(residual, row + i, v, bf16);
        }
        squares += v * v;
    }
    sum += hsum(squares);
    for (; i < d; i++) {
        float v = load_any1(x, row + i, bf16);
        if (residual) {
            v = round1(v + load_any1(residual, row + i, bf16), bf16);
            store_x1(residual, row + i, v, bf16);
        }
        sum += v * v;
    }
    const void *src = residual ? residual : x;
    const float scale = 1.0f / sqrtf(sum / (float)d + eps);
    i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= d; i += 16) {
        const v16f normed = round16(load_any16(src, row + i, bf16) * scale, bf16);
        store_x16(out, row + i, load_any16(w, i, bf16) * normed, bf16);
    }
#endif
    for (; i + 8 <= d; i += 8) {
        const v8f normed = round8(load_any8(src, row + i, bf16) * splat(scale), bf16);
        store_x8(out, row + i, load_any8(w, i, bf16) * normed, bf16);
    }
    for (; i < d; i++) {
        const float normed = round1(load_any1(src, row + i, bf16) * scale, bf16);
        store_x1(out, row + i, load_any1(w, i, bf16) * normed, bf16);
    }
}

/* The rows among OpenMP threads, the dtype a constant in each parallel loop (PARALLEL_BY_DTYPE). */
static inline __attribute__((always_inline)) void rms_norm_rows(void *out, const void *x, void *residual,
                                                                const void *w, int64_t rows, int64_t d,
                                                                float eps, int32_t threads, const int bf16) {
    PARALLEL_BY_DTYPE(bf16, schedule(static) num_threads(threads), int64_t r = 0; r < rows; r++,
                      rms_norm_row(out, x, residual, w, r, d, eps, BF16));
}

void flotilla_rms_norm_f32(float *out, const float *x, float *residual, const float *w, int64_t rows, int64_t d,
                           float eps, int32_t threads) {
    rms_norm_rows(out, x, residual, w, rows, d, eps, threads, 0);
}

void flotilla_rms_norm_bf16(uint16_t *out, const uint16_t *x, uint16_t *residual, const uint16_t *w, int64_t rows,
                            int64_t d, float eps, int32_t threads) {
    rms_norm_rows(out, x, residual, w, rows, d, eps, threads, 1);
}

/* silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) so that exp's argument is never positive: 1 / (1 + e)
 * for g >= 0, e / (1 + e) below (one division for both). One body for 8 and 16 lanes. */
#define DEFINE_SILU(NAME, VF, VI, EXP)                                                                         \
    static inline VF NAME(VF g) {                                                                              \
        const VI negative = g < 0.0f;                                                                          \
        const VF e = EXP((VF)((VI)g | (int32_t)0x80000000u)); /* -|g| */                                       \
        const VF numerator = (VF)(((VI)e & negative) | ((VI)((VF){} + 1.0f) & ~negative));                     \
        return g * (numerator / (1.0f + e));                                                                   \
    }

DEFINE_SILU(silu8, v8f, v8i, exp_nonpositive)
#if defined(__AVX512F__)
DEFINE_SILU(silu16, v16f, v16i, exp_nonpositive16)
#endif

static inline __attribute__((always_inline)) void silu_and_mul_row(void *out, const void *gate_up, int64_t r,
                                                                   int64_t inner, const int bf16) {
    const int64_t in = r * 2 * inner, o = r * inner;
    int64_t i = 0;
#if defined(__AVX512F__)
    /* Two vectors an iteration: the division's latency, not the arithmetic, had bound one at a time. */
    for (; i + 32 <= inner; i += 32) {
        const v16f gate0 = silu16(load_any16(gate_up, in + i, bf16));
        const v16f gate1 = silu16(load_any16(gate_up, in + i + 16, bf16));
        store_x16(out, o + i, round16(gate0, bf16) * load_any16(gate_up, in + inner + i, bf16), bf16);
        store_x16(out, o + i + 16, round16(gate1, bf16) * load_any16(gate_up, in + inner + i + 16, bf16), bf16);
    }
    for (; i + 16 <= inner; i += 16) {
        const v16f gate = silu16(load_any16(gate_up, in + i, bf16));
        store_x16(out, o + i, round16(gate, bf16) * load_any16(gate_up, in + inner + i, bf16), bf16);
    }
#endif
    for (; i + 8 <= inner; i += 8) {
        const v8f activated = round8(silu8(load_any8(gate_up, in + i, bf16)), bf16);
        store_x8(out, o + i, activated * load_any8(gate_up, in + inner + i, bf16), bf16);
    }
    for (; i < inner; i++) {
        const float activated = round1(silu8(splat(load_any1(gate_up, in + i, bf16)))[0], bf16);
        store_x1(out, o + i, activated * load_any1(gate_up, in + inner + i, bf16), bf16);
    }
}

void flotilla_silu_and_mul_f32(float *out, const float *gate_up, int64_t rows, int64_t inner, int32_t threads) {
    PARALLEL_BY_DTYPE(0, schedule(static) num_threads(threads), int64_t r = 0; r < rows; r++,
                      silu_and_mul_row(out, gate_up, r, inner, BF16));
}

void flotilla_silu_and_mul_bf16(uint16_t *out, const uint16_t *gate_up, int64_t rows, int64_t inner,
                                int32_t threads) {
    PARALLEL_BY_DTYPE(1, schedule(static) num_threads(threads), int64_t r = 0; r < rows; r++,
                      silu_and_mul_row(out, gate_up, r, inner, BF16));
}

/* x * c + rotate_half(x) * s for one head's two halves (x1 = x[:half], x2 = x[half:]), rounded as torch's
 * three ops round: each product, then the sum. In float32 the products are kept apart (an FMA would round
 * once where torch rounds twice). */
static inline __attribute__((always_inline)) v8f rope_half(v8f x, v8f c, v8f other, v8f s, const int bf16) {
    v8f a = round8(x * c, bf16), b = round8(other * s, bf16);
    __asm__("" : "+x"(a), "+x"(b)); /* no contraction into an FMA across this point */
    return round8(a + b, bf16);
}

/* Rotary embeddings (rotate-half layout) on the queries and keys of a fused qkv projection, and the KV store:
 *   qkv [tokens, (heads + 2 kv_heads) * head_dim] (queries, keys, values), rows `qkv_stride` apart
 *   cos, sin [tokens, head_dim], already in the tensor's dtype (each token's position looked up)
 *   q_out [tokens, heads, head_dim]: the rotated queries
 *   k_cache, v_cache [slots, kv_heads, head_dim]: the rotated keys and the values at slots[t]
 * One pass instead of torch's five ops for the rotation, a split and two index copies. head_dim a multiple of
 * 16 (the caller checks). Tokens are shared among OpenMP threads. */
/* One token of rope_store_rows. */
static inline __attribute__((always_inline)) void rope_store_row(
    void *q_out, void *k_cache, void *v_cache, const void *qkv, int64_t qkv_stride, const void *cos,
    const void *sin, const int64_t *slots, int64_t t, int32_t heads, int32_t kv_heads, int32_t head_dim,
    const int bf16) {
    const int half = head_dim / 2;
    const int elem = bf16 ? 2 : 4;
    const int64_t kv_row = (int64_t)kv_heads * head_dim;
    const int64_t row = t * qkv_stride, angles = t * head_dim;
    for (int h = 0; h < heads + kv_heads; h++) {
        const int64_t src = row + (int64_t)h * head_dim;
        void *dst = h < heads ? q_out : k_cache;
        const int64_t at = h < heads ? (t * heads + h) * head_dim : slots[t] * kv_row + (int64_t)(h - heads) * head_dim;
        for (int i = 0; i < half; i += 8) {
            const v8f x1 = load_any8(qkv, src + i, bf16), x2 = load_any8(qkv, src + half + i, bf16);
            store_x8(dst, at + i,
                     rope_half(x1, load_any8(cos, angles + i, bf16), -x2, load_any8(sin, angles + i, bf16), bf16),
                     bf16);
            store_x8(dst, at + half + i,
                     rope_half(x2, load_any8(cos, angles + half + i, bf16), x1,
                               load_any8(sin, angles + half + i, bf16), bf16),
                     bf16);
        }
    }
    memcpy((char *)v_cache + slots[t] * kv_row * elem,
           (const char *)qkv + (row + (int64_t)(heads + kv_heads) * head_dim) * elem, (size_t)(kv_row * elem));
}

static inline __attribute__((always_inline)) void rope_store_rows(
    void *q_out, void *k_cache, void *v_cache, const void *qkv, int64_t qkv_stride, const void *cos,
    const void *sin, const int64_t *slots, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t head_dim,
    int32_t threads, const int bf16) {
    PARALLEL_BY_DTYPE(bf16, schedule(static) num_threads(threads), int64_t t = 0; t < tokens; t++,
                      rope_store_row(q_out, k_cache, v_cache, qkv, qkv_stride, cos, sin, slots, t, heads, kv_heads,
                                     head_dim, BF16));
}

void flotilla_rope_store_f32(float *q_out, float *k_cache, float *v_cache, const float *qkv, int64_t qkv_stride,
                             const float *cos, const float *sin, const int64_t *slots, int64_t tokens, int32_t heads,
                             int32_t kv_heads, int32_t head_dim, int32_t threads) {
    rope_store_rows(q_out, k_cache, v_cache, qkv, qkv_stride, cos, sin, slots, tokens, heads, kv_heads, head_dim,
                    threads, 0);
}

void flotilla_rope_store_bf16(uint16_t *q_out, uint16_t *k_cache, uint16_t *v_cache, const uint16_t *qkv,
                              int64_t qkv_stride, const uint16_t *cos, const uint16_t *sin, const int64_t *slots,
                              int64_t tokens, int32_t heads, int32_t kv_heads, int32_t head_dim, int32_t threads) {
    rope_store_rows(q_out, k_cache, v_cache, qkv, qkv_stride, cos, sin, slots, tokens, heads, kv_heads, head_dim,
                    threads, 1);
}

/* Whether any lane of a comparison's mask is set. */
static inline int any8(v8i mask) {
    uint64_t words[4];
    memcpy(words, &mask, sizeof words);
    return (words[0] | words[1] | words[2] | words[3]) != 0;
}

/* The index of each row's first maximum, as torch's max(dim=-1).indices gives it (a NaN counts as the
 * maximum: the first NaN's index), for greedy sampling. torch's reduction with indices took 0.35 ms over
 * [48, 8192] float32 logits on one core; here one pass keeps each lane's maximum and where it first was. */
void flotilla_argmax_rows_f32(int64_t *out, const float *x, int64_t rows, int64_t cols, int32_t threads) {
    const int64_t body = cols & ~(int64_t)7;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * cols;
        v8f top = splat(-INFINITY);
        v8i where = {0, 1, 2, 3, 4, 5, 6, 7}, index = where, nan = {0};
        for (int64_t i = 0; i < body; i += 8, index += 8) {
            const v8f v = load8(row + i);
            const v8i greater = v > top; /* strictly: a lane keeps its first maximum */
            nan |= v != v;
            top = (v8f)(((v8i)v & greater) | ((v8i)top & ~greater));
            where = (index & greater) | (where & ~greater);
        }
        /* Lanes hold indices of their own residue mod 8, so the earliest of the lanes that hold the
           maximum is the first maximum of the vectors; then the tail. An all -inf row keeps index 0. */
        float best = -INFINITY;
        int64_t first = 0;
        for (int j = 0; j < 8 && body; j++)
            if (top[j] > best || (top[j] == best && where[j] < first)) {
                best = top[j];
                first = where[j];
            }
        for (int64_t i = body; i < cols; i++)
            if (row[i] > best) {
                best = row[i];
                first = i;
            }
        if (any8(nan)) { /* rare: the first NaN, found again */
            for (int64_t i = 0; i < body; i++)
                if (row[i] != row[i]) {
                    first = i;
                    break;
                }
        } else {
            for (int64_t i = body; i < cols; i++)
                if (row[i] != row[i]) {
                    first = i;
                    break;
                }
        }
        out[r] = first;
    }
}
