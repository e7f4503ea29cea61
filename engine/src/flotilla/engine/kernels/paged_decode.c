/* Paged decode attention on the CPU: one query token per request reads its keys and values straight from
 * the paged cache, block by block, with an online softmax. Caches are float32 or bfloat16 (one function
 * each); queries, outputs and all arithmetic are float32 (a bfloat16 value is the top half of a float32's
 * bits, so widening it is exact). Nothing is gathered into a
 * contiguous copy, so each K/V byte is read once per step; the query heads that share a KV head (GQA) are
 * served by the same pass over it.
 *
 * Layouts (row-major, as flotilla.engine.kernels.attention documents them):
 *   query, out    [B, H, D] float32  (D a multiple of 8, at most MAX_HEAD_DIM)
 *   k/v cache     [num_blocks, block_size, KVH, D] float32 or bfloat16
 *   block_tables  [B, table_stride] int32; seq_lens [B] int32 (tokens to attend, >= 1)
 * Work items are a request's KV heads (or one of them, in small batches), shared among OpenMP threads.
 * The library is loaded after torch, whose libgomp.so.1 it then uses: one thread pool for torch's ops and
 * this kernel.
 *
 * Vectors are GCC's generic 8-float vectors (one AVX register; the compiler splits them elsewhere). Scores
 * are computed four tokens at a time so four FMA chains run at once; exp is a polynomial on vectors
 * (relative error about 2e-7, like expf's) because a scalar expf per score cost more than the dot products.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint16_t v8u16 __attribute__((vector_size(16)));

static inline float hsum(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

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

/* Eight cache values from element `index` of a float32 (bf16 == 0) or bfloat16 cache, as float32. The
 * callers pass bf16 as a constant, so each inlined copy keeps one branch. */
static inline __attribute__((always_inline)) v8f load_kv8(const void *cache, int64_t index, const int bf16) {
    if (!bf16) return load8((const float *)cache + index);
    v8u16 halves;
    memcpy(&halves, (const uint16_t *)cache + index, sizeof halves);
    const v8i bits = __builtin_convertvector(halves, v8i) << 16;
    v8f v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* One request's `kv_count` KV heads from its first: their query heads (group per KV head, rows of q and o)
 * attend to `len` tokens through `table`. Each block is read whole, heads after heads, while it is hot in
 * the cache: a block of all KV heads is one contiguous run of memory, which the prefetcher streams. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len, float *o,
    int kv_count, int group, int head_dim, int block_size, int64_t token_stride, float scale, const int bf16) {
    const int elem = bf16 ? 2 : 4; /* bytes per cache value */
    const int nv = head_dim / 8;
    const int rows = kv_count * group; /* <= MAX_GROUP */
    v8f acc[MAX_GROUP][MAX_HEAD_DIM / 8];
    float scores[MAX_GROUP][MAX_BLOCK + 8] __attribute__((aligned(32)));
    float running_max[MAX_GROUP], denom[MAX_GROUP];
    for (int h = 0; h < rows; h++) {
        running_max[h] = -INFINITY;
        denom[h] = 0.0f;
        for (int d = 0; d < nv; d++) acc[h][d] = splat(0.0f);
    }
    for (int start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int n = len - start < block_size ? len - start : block_size;
        if (start + block_size < len) { /* ask for the next block's lines while this one computes */
            const int64_t next = table[start / block_size + 1] * block_size * token_stride;
            const int bytes = kv_count * head_dim * elem;
            for (int t = 0; t < block_size; t++) {
                const char *k = (const char *)k_cache + (next + t * token_stride) * elem;
                const char *v = (const char *)v_cache + (next + t * token_stride) * elem;
                for (int off = 0; off < bytes; off += 64) {
                    __builtin_prefetch(k + off);
                    __builtin_prefetch(v + off);
                }
            }
        }
        for (int c = 0; c < kv_count; c++) {
            const int64_t keys = block * block_size * token_stride + (int64_t)c * head_dim; /* element index */
            const int64_t values = keys;
            const int h0 = c * group;
            /* Scores, four tokens at a time (a partial last tile repeats its first token, unused). */
            for (int t = 0; t < n; t += 4) {
                const int64_t k0 = keys + (int64_t)t * token_stride;
                const int tile = n - t < 4 ? n - t : 4;
                const int64_t k1 = tile > 1 ? k0 + token_stride : k0;
                const int64_t k2 = tile > 2 ? k0 + 2 * token_stride : k0;
                const int64_t k3 = tile > 3 ? k0 + 3 * token_stride : k0;
                for (int h = h0; h < h0 + group; h++) {
                    const float *qh = q + (int64_t)h * head_dim;
                    v8f s0 = splat(0.0f), s1 = s0, s2 = s0, s3 = s0;
                    for (int d = 0; d < head_dim; d += 8) {
                        const v8f qv = load8(qh + d);
                        s0 += qv * load_kv8(k_cache, k0 + d, bf16);
                        s1 += qv * load_kv8(k_cache, k1 + d, bf16);
                        s2 += qv * load_kv8(k_cache, k2 + d, bf16);
                        s3 += qv * load_kv8(k_cache, k3 + d, bf16);
                    }
                    scores[h][t] = hsum(s0) * scale;
                    if (tile > 1) scores[h][t + 1] = hsum(s1) * scale;
                    if (tile > 2) scores[h][t + 2] = hsum(s2) * scale;
                    if (tile > 3) scores[h][t + 3] = hsum(s3) * scale;
                }
            }
            /* Online softmax: rescale what came before to the new maximum, then weigh this block. */
            for (int h = h0; h < h0 + group; h++) {
                float block_max = scores[h][0];
                for (int t = 1; t < n; t++) block_max = scores[h][t] > block_max ? scores[h][t] : block_max;
                const float new_max = block_max > running_max[h] ? block_max : running_max[h];
                const float correction = expf(running_max[h] - new_max);
                running_max[h] = new_max;
                float sum = 0.0f;
                for (int t = 0; t < n; t += 8) {
                    v8f p = exp_nonpositive(load8(&scores[h][t]) - splat(new_max));
                    for (int j = 0; j < 8; j++) {
                        if (t + j >= n) p[j] = 0.0f;
                    }
                    store8(&scores[h][t], p);
                    sum += hsum(p);
                }
                denom[h] = denom[h] * correction + sum;
                if (correction != 1.0f) {
                    const v8f cv = splat(correction);
                    for (int d = 0; d < nv; d++) acc[h][d] *= cv;
                }
            }
            for (int t = 0; t < n; t++) {
                const int64_t v = values + (int64_t)t * token_stride;
                for (int h = h0; h < h0 + group; h++) {
                    const v8f p = splat(scores[h][t]);
                    for (int d = 0; d < nv; d++) acc[h][d] += p * load_kv8(v_cache, v + 8 * d, bf16);
                }
            }
        }
    }
    for (int h = 0; h < rows; h++) {
        const v8f inv = splat(1.0f / denom[h]);
        for (int d = 0; d < nv; d++) store8(o + (int64_t)h * head_dim + 8 * d, acc[h][d] * inv);
    }
}

/* Both entry points: returns 0, or -1 when a size is past what this build handles (the caller checks
 * first). `bf16` is a constant in each, so each gets its own copy of the loops. */
static inline __attribute__((always_inline)) int paged_decode(
    const float *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, float *out, int32_t num_requests, int32_t num_heads,
    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads, const int bf16) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads)
        return -1;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    /* Work items: a request's KV heads in chunks of up to MAX_GROUP query heads, or one KV head each when
       there are too few requests to keep every thread busy. */
    int chunk = 1;
    if (num_requests >= 4 * num_threads) chunk = MAX_GROUP / group < num_kv_heads ? MAX_GROUP / group : num_kv_heads;
    const int chunks = (num_kv_heads + chunk - 1) / chunk;
    const int elem = bf16 ? 2 : 4;

#pragma omp parallel for collapse(2) schedule(dynamic, 1) num_threads(num_threads)
    for (int r = 0; r < num_requests; r++) {
        for (int c = 0; c < chunks; c++) {
            const int first = c * chunk;
            const int count = num_kv_heads - first < chunk ? num_kv_heads - first : chunk;
            const int64_t first_head = (int64_t)r * num_heads + (int64_t)first * group;
            const int64_t head_offset = (int64_t)first * head_dim * elem; /* bytes */
            attend_heads(query + first_head * head_dim, (const char *)k_cache + head_offset,
                         (const char *)v_cache + head_offset, block_tables + (int64_t)r * table_stride, seq_lens[r],
                         out + first_head * head_dim, count, group, head_dim, block_size, token_stride, scale, bf16);
        }
    }
    return 0;
}

int flotilla_paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                              float *out, int32_t num_requests, int32_t num_heads, int32_t num_kv_heads,
                              int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_requests,
                        num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, 0);
}

int flotilla_paged_decode_bf16(const float *query, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                               float *out, int32_t num_requests, int32_t num_heads, int32_t num_kv_heads,
                               int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_requests,
                        num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, 1);
}
