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
#include "vectors.h"

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

/* Asks for `bytes` of keys and values from element `index` of the caches (a token's lines of the KV heads
 * asked for), into L2. */
static inline __attribute__((always_inline)) void prefetch_token(const void *k_cache, const void *v_cache,
                                                                 int64_t index, int bytes, int elem) {
    const char *k = (const char *)k_cache + index * elem, *v = (const char *)v_cache + index * elem;
    for (int off = 0; off < bytes; off += 64) {
        __builtin_prefetch(k + off, 0, 1);
        __builtin_prefetch(v + off, 0, 1);
    }
}

/* Every token of one block, at once. */
static inline void prefetch_block(const void *k_cache, const void *v_cache, int64_t block, int block_size,
                                  int64_t token_stride, int bytes, int elem) {
    for (int t = 0; t < block_size; t++)
        prefetch_token(k_cache, v_cache, (block * block_size + t) * token_stride, bytes, elem);
}

/* One request's `kv_count` KV heads from its first: their query heads (group per KV head, rows of q and o)
 * attend to `len` tokens through `table`. `nv` (head_dim / 8), `group` and `bf16` are constants in every
 * inlined copy, so the loops over a head's vectors and a KV head's query heads unroll, and queries and
 * accumulators stay in registers. Each key and value vector is read (and widened, for bfloat16) once and
 * used by all the query heads of its KV head. Per block and KV head: scores (four tokens at once so that
 * independent FMA chains run together), the online softmax, then the weighted values. */
static inline __attribute__((always_inline)) void attend_heads(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len, float *o,
    int kv_count, const int group, const int nv, int block_size, int64_t token_stride, float scale,
    const int bf16) {
    const int head_dim = nv * 8;
    const int elem = bf16 ? 2 : 4; /* bytes per cache value */
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
        const int padded = (n + 7) & ~7;
        /* Blocks lie anywhere in memory, where the hardware prefetcher cannot guess, so the kernel asks for
           them itself, into L2 (prefetcht2): the first call for the next block, whole; then, while each
           block computes, the block after next, a token's lines of one KV head at a time in the values'
           loop below, so that the requests keep the miss buffers busy without overflowing them. At 48
           requests of 190 tokens (six layers' caches far larger than the CPU's), against asking for the
           whole next block at once into L1: bfloat16 ran 2.0x faster (12.7 to 6.2 ms for six layers), float32
           1.5x (17.4 to 11.8 ms; tiny-llama's shapes, 1 thread, `-march=native` on AMD EPYC). */
        if (start == 0 && block_size < len)
            prefetch_block(k_cache, v_cache, table[1], block_size, token_stride, kv_count * head_dim * elem, elem);
        const int64_t after_next = /* element index of the block after next, or -1 */
            start + 2 * block_size < len ? table[start / block_size + 2] * block_size * token_stride : -1;
        for (int c = 0; c < kv_count; c++) {
            const int64_t base = block * block_size * token_stride + (int64_t)c * head_dim; /* element index */
            const int h0 = c * group;
            v8f qv[MAX_GROUP][MAX_HEAD_DIM / 8];
            for (int g = 0; g < group; g++)
                for (int d = 0; d < nv; d++) qv[g][d] = load8(q + (int64_t)(h0 + g) * head_dim + 8 * d);
            /* Scores, four tokens at a time (a partial last tile repeats its first token, unused). */
            for (int t = 0; t < n; t += 4) {
                const int64_t k0 = base + (int64_t)t * token_stride;
                const int tile = n - t < 4 ? n - t : 4;
                const int64_t k1 = tile > 1 ? k0 + token_stride : k0;
                const int64_t k2 = tile > 2 ? k0 + 2 * token_stride : k0;
                const int64_t k3 = tile > 3 ? k0 + 3 * token_stride : k0;
                v8f s[MAX_GROUP][4];
                for (int g = 0; g < group; g++) s[g][0] = s[g][1] = s[g][2] = s[g][3] = splat(0.0f);
                for (int d = 0; d < nv; d++) {
                    const v8f a = load_any8(k_cache, k0 + 8 * d, bf16), b = load_any8(k_cache, k1 + 8 * d, bf16);
                    const v8f e = load_any8(k_cache, k2 + 8 * d, bf16), f = load_any8(k_cache, k3 + 8 * d, bf16);
                    for (int g = 0; g < group; g++) {
                        s[g][0] += qv[g][d] * a;
                        s[g][1] += qv[g][d] * b;
                        s[g][2] += qv[g][d] * e;
                        s[g][3] += qv[g][d] * f;
                    }
                }
                for (int g = 0; g < group; g++)
                    for (int j = 0; j < 4; j++) scores[h0 + g][t + j] = hsum(s[g][j]) * scale;
            }
            /* Online softmax: rescale what came before to the new maximum, then weigh this block. */
            float correction[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                float *row = scores[h0 + g];
                float block_max = row[0];
                for (int t = 1; t < n; t++) block_max = row[t] > block_max ? row[t] : block_max;
                const float new_max = block_max > running_max[h0 + g] ? block_max : running_max[h0 + g];
                correction[g] = expf(running_max[h0 + g] - new_max);
                running_max[h0 + g] = new_max;
                for (int t = n; t < padded; t++) row[t] = -INFINITY; /* past the block: weight 0 */
                v8f sums = splat(0.0f);
                for (int t = 0; t < n; t += 8) {
                    const v8f p = exp_nonpositive(load8(row + t) - splat(new_max));
                    store8(row + t, p);
                    sums += p;
                }
                denom[h0 + g] = denom[h0 + g] * correction[g] + hsum(sums);
            }
            /* The weighted values: each value vector read once for the group's accumulators. */
            v8f a[MAX_GROUP][MAX_HEAD_DIM / 8];
            for (int g = 0; g < group; g++)
                for (int d = 0; d < nv; d++) a[g][d] = acc[h0 + g][d] * splat(correction[g]);
            for (int t = 0; t < n; t++) {
                const int64_t v = base + (int64_t)t * token_stride;
                if (after_next >= 0) /* this token's lines of this KV head, two blocks on */
                    prefetch_token(k_cache, v_cache, after_next + (int64_t)t * token_stride + (int64_t)c * head_dim,
                                   head_dim * elem, elem);
                v8f p[MAX_GROUP];
                for (int g = 0; g < group; g++) p[g] = splat(scores[h0 + g][t]);
                for (int d = 0; d < nv; d++) {
                    const v8f value = load_any8(v_cache, v + 8 * d, bf16);
                    for (int g = 0; g < group; g++) a[g][d] += p[g] * value;
                }
            }
            for (int g = 0; g < group; g++)
                for (int d = 0; d < nv; d++) acc[h0 + g][d] = a[g][d];
        }
    }
    for (int h = 0; h < rows; h++) {
        const v8f inv = splat(1.0f / denom[h]);
        for (int d = 0; d < nv; d++) store8(o + (int64_t)h * head_dim + 8 * d, acc[h][d] * inv);
    }
}

/* attend_heads with constant sizes for the common shapes (head_dim 64 or 128; 1, 2 or 4 query heads per
 * KV head), variables for the others. */
#define ATTEND(GROUP, NV)                                                                                      \
    attend_heads(q, k_cache, v_cache, table, len, o, kv_count, GROUP, NV, block_size, token_stride, scale, bf16)
#define ATTEND_GROUPS(NV)                                                                                      \
    switch (group) {                                                                                           \
    case 1: ATTEND(1, NV); return;                                                                             \
    case 2: ATTEND(2, NV); return;                                                                             \
    case 4: ATTEND(4, NV); return;                                                                             \
    default: ATTEND(group, NV); return;                                                                        \
    }
static inline __attribute__((always_inline)) void attend_heads_sized(
    const float *q, const void *k_cache, const void *v_cache, const int32_t *table, int len, float *o,
    int kv_count, int group, int head_dim, int block_size, int64_t token_stride, float scale, const int bf16) {
    switch (head_dim) {
    case 64: ATTEND_GROUPS(8)
    case 128: ATTEND_GROUPS(16)
    default: ATTEND(group, head_dim / 8);
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
            attend_heads_sized(query + first_head * head_dim, (const char *)k_cache + head_offset,
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
