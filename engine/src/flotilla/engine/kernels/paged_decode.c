/* Paged decode attention on the CPU: one query token per request reads its keys and values straight from
 * the paged cache, block by block, with an online softmax. Caches are float32 or bfloat16 (one function
 * each); queries and outputs are in the caches' dtype, all arithmetic in float32 (a bfloat16 value is the
 * top half of a float32's bits, so widening it is exact). Nothing is gathered into a
 * contiguous copy, so each K/V byte is read once per step; the query heads that share a KV head (GQA) are
 * served by the same pass over it.
 *
 * Layouts (row-major, as flotilla.engine.kernels.attention documents them):
 *   query, out    [B, H, D] in the caches' dtype  (D a multiple of 8, at most MAX_HEAD_DIM)
 *   k/v cache     [num_blocks, block_size, KVH, D] float32 or bfloat16
 *   block_tables  [B, table_stride] int32; seq_lens [B] int32 (tokens to attend, >= 1)
 * Work items are a request's KV heads (or one of them, in small batches), shared among OpenMP threads.
 * The library is loaded after torch, whose libgomp.so.1 it then uses: one thread pool for torch's ops and
 * this kernel.
 *
 * Two builds of the same loops: on a machine with AVX-512 and its bfloat16 dot products (WIDE), head dims
 * that are multiples of 32 run on 16-float vectors, bfloat16 keys meet the (bfloat16) query as stored in
 * vdpbf16ps and sixteen tokens' dot products are added at once
 * (sum16); elsewhere GCC's generic 8-float vectors, four tokens at a time so four FMA chains run at once.
 * exp is a polynomial on vectors (relative error about 2e-7, like expf's) because a scalar expf per score
 * cost more than the dot products. At 48 requests of 190 tokens the wide build reads the caches at about
 * the speed one core reads memory at all (Intel Xeon with AVX512-BF16, 1 thread: bfloat16 4.8 ms for six
 * layers' 56 MB, 11.7 GB/s, where a plain sum reads 11.7 GB/s; the 8-float build took 5.7 ms).
 */
#include "vectors.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define WIDE 1 /* vectors.h included immintrin.h */
#else
#define WIDE 0
#endif

#define MAX_HEAD_DIM 256
#define MAX_GROUP 16
#define MAX_BLOCK 64

/* Asks for `bytes` of keys and values from element `index` of the caches (a token's lines of the KV heads
 * asked for), into L2 (prefetcht2; prefetcht0 and prefetchnta were 2x slower here). */
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

#if WIDE
/* The sums of sixteen vectors, v[j]'s in lane j: pairs of vectors interleaved and added (32-bit, then 64-bit
   lanes), then their 128-bit quarters; 15 adds and 30 shuffles instead of sixteen horizontal sums. */
static inline __attribute__((always_inline)) __m512 sum16(const __m512 v[16]) {
    __m512 x[8], y[4];
    for (int i = 0; i < 8; i++)
        x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
        y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }
    const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
    const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xdd));
}

/* One query head's scores for the `n` tokens from element `base` on, sixteen tokens at a time (a partial
   last tile repeats its first token, unused), times `scale`, into `row`. A token's dot product is one
   vector of partial sums: bfloat16 keys meet the bfloat16 query in `vdpbf16ps` (32 products
   a instruction, each exact in float32, no widening), float32 keys in FMAs; sum16 then adds all sixteen
   tokens' vectors at once. */
static inline __attribute__((always_inline)) void scores_wide(const void *k_cache, int64_t base, int n,
                                                              int64_t token_stride, const void *query,
                                                              const int head_dim, float scale, float *row,
                                                              const int bf16) {
    for (int t = 0; t < n; t += 16) {
        __m512 dots[16];
        for (int j = 0; j < 16; j++) {
            const int64_t k = base + (int64_t)(t + j < n ? t + j : t) * token_stride;
            __m512 s = _mm512_setzero_ps();
            if (bf16)
                for (int d = 0; d < head_dim; d += 32)
                    s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512((const uint16_t *)k_cache + k + d),
                                         (__m512bh)_mm512_loadu_si512((const uint16_t *)query + d));
            else
                for (int d = 0; d < head_dim; d += 16)
                    s = _mm512_fmadd_ps(_mm512_loadu_ps((const float *)k_cache + k + d),
                                        _mm512_loadu_ps((const float *)query + d), s);
            dots[j] = s;
        }
        _mm512_storeu_ps(row + t, _mm512_mul_ps(sum16(dots), _mm512_set1_ps(scale)));
    }
}

/* softmax_block on 16-float vectors: the maximum, exp (the same polynomial) and the sum over whole vectors,
   a partial last vector masked, and no exp at all for the correction while the maximum holds (it is then
   exactly 1). On the 8-float body it had been 40% of the wide path's time: per block and query head, two
   short vectors, horizontal reductions and a scalar expf. */
static inline __attribute__((always_inline)) float softmax_wide(float *row, int n, float *running_max,
                                                                float *denom) {
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        top = _mm512_max_ps(top, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, row + t));
    }
    const float block_max = _mm512_reduce_max_ps(top);
    const float new_max = block_max > *running_max ? block_max : *running_max;
    const float correction = new_max == *running_max ? 1.0f : expf(*running_max - new_max);
    *running_max = new_max;
    __m512 sums = _mm512_setzero_ps();
    for (int t = 0; t < n; t += 16) {
        const __mmask16 valid = n - t >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n - t)) - 1);
        const v16f x = (v16f)_mm512_sub_ps(_mm512_loadu_ps(row + t), _mm512_set1_ps(new_max));
        const __m512 p = _mm512_maskz_mov_ps(valid, (__m512)exp_nonpositive16(x)); /* 0 past n */
        _mm512_storeu_ps(row + t, p);
        sums = _mm512_add_ps(sums, p);
    }
    *denom = *denom * correction + _mm512_reduce_add_ps(sums);
    return correction;
}
#endif

/* Online softmax over one block's scores of one query head: rescales what came before to the new maximum
   (returns the factor for its accumulators), turns the scores into weights in place and adds them to the
   denominator. */
static inline __attribute__((always_inline)) float softmax_block(float *row, int n, float *running_max,
                                                                 float *denom) {
    for (int t = n; t < ((n + 7) & ~7); t++) row[t] = -INFINITY; /* past the block: weight 0 */
    /* The maximum in vectors: a scalar max over the row is one chain of dependent instructions. */
    v8f top = load8(row);
    for (int t = 8; t < n; t += 8) top = vmax(top, load8(row + t));
    float block_max = top[0];
    for (int j = 1; j < 8; j++) block_max = top[j] > block_max ? top[j] : block_max;
    const float new_max = block_max > *running_max ? block_max : *running_max;
    const float correction = expf(*running_max - new_max);
    *running_max = new_max;
    v8f sums = splat(0.0f);
    for (int t = 0; t < n; t += 8) {
        const v8f p = exp_nonpositive(load8(row + t) - splat(new_max));
        store8(row + t, p);
        sums += p;
    }
    *denom = *denom * correction + hsum(sums);
    return correction;
}

/* One request's `kv_count` KV heads from its first: their query heads (group per KV head, rows of q and o)
 * attend to `len` tokens through `table`. `head_dim`, `group`, `bf16` and `wide` are constants in every
 * inlined copy, so the loops over a head's vectors and a KV head's query heads unroll, and queries and
 * accumulators stay in registers. Each key and value vector is read (and widened, for bfloat16) once and
 * used by all the query heads of its KV head. Per block and KV head: scores, the online softmax, then the
 * weighted values. `wide` (AVX-512 machines, head_dim a multiple of 32) works on 16-float vectors with
 * vdpbf16ps for bfloat16 keys and adds sixteen tokens' dot products at once; otherwise 8-float vectors,
 * four tokens at a time so that independent FMA chains run together. */
static inline __attribute__((always_inline)) void attend_heads(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
    const int32_t *next_table, int next_len, void *o,
    int kv_count, const int group, const int head_dim, int block_size, int64_t token_stride, float scale,
    const int bf16, const int wide) {
    const int nv = head_dim / 8;
    const int elem = bf16 ? 2 : 4; /* bytes per cache value */
    const int rows = kv_count * group; /* <= MAX_GROUP */
    float acc[MAX_GROUP][MAX_HEAD_DIM] __attribute__((aligned(64)));
    float scores[MAX_GROUP][MAX_BLOCK + 16] __attribute__((aligned(64)));
    float running_max[MAX_GROUP], denom[MAX_GROUP];
    for (int h = 0; h < rows; h++) {
        running_max[h] = -INFINITY;
        denom[h] = 0.0f;
        for (int d = 0; d < head_dim; d++) acc[h][d] = 0.0f;
    }
    for (int start = 0; start < len; start += block_size) {
        const int64_t block = table[start / block_size];
        const int n = len - start < block_size ? len - start : block_size;
        /* Blocks lie anywhere in memory, where the hardware prefetcher cannot guess, so the kernel asks for
           them itself, into L2 (prefetcht2): the first call for the next block, whole; then, while each
           block computes, the block after next, a token's lines of one KV head at a time in the values'
           loop below, so that the requests keep the miss buffers busy without overflowing them. At 48
           requests of 190 tokens (six layers' caches far larger than the CPU's), against asking for the
           whole next block at once into L1: bfloat16 ran 2.0x faster (12.7 to 6.2 ms for six layers), float32
           1.5x (17.4 to 11.8 ms; tiny-llama's shapes, 1 thread, `-march=native` on AMD EPYC). In a request's
           last two blocks "after next" runs on into the first blocks of the work item this thread takes next
           (next_table; a guess under dynamic scheduling, exact on one thread), so that a request's first
           blocks are not cold misses: 48 requests of 24-236 tokens, six layers, bfloat16, AMD EPYC, 3.7-3.9
           to 3.0-3.3 ms on 1 thread, 2.0 to 1.8-1.9 ms on 2. */
        if (start == 0 && block_size < len)
            prefetch_block(k_cache, v_cache, table[1], block_size, token_stride, kv_count * head_dim * elem, elem);
        const int blocks = (len + block_size - 1) / block_size, ahead = start / block_size + 2;
        int64_t after_next = -1; /* element index of the block after next, or -1 */
        if (ahead < blocks)
            after_next = table[ahead] * block_size * token_stride;
        else if (next_table && ahead - blocks < (next_len + block_size - 1) / block_size)
            after_next = next_table[ahead - blocks] * block_size * token_stride;
        for (int c = 0; c < kv_count; c++) {
            const int64_t base = block * block_size * token_stride + (int64_t)c * head_dim; /* element index */
            const int h0 = c * group;
            float correction[MAX_GROUP];
#if WIDE
            if (wide) {
                for (int g = 0; g < group; g++) {
                    /* The query in the keys' type: bfloat16 keys meet it as stored in vdpbf16ps. */
                    const void *query = (const char *)q + (int64_t)(h0 + g) * head_dim * elem;
                    scores_wide(k_cache, base, n, token_stride, query, head_dim, scale, scores[h0 + g], bf16);
                    correction[g] = softmax_wide(scores[h0 + g], n, &running_max[h0 + g], &denom[h0 + g]);
                }
                __m512 a[MAX_GROUP][MAX_HEAD_DIM / 16];
                for (int g = 0; g < group; g++)
                    for (int d = 0; d < head_dim / 16; d++)
                        a[g][d] = _mm512_mul_ps(_mm512_load_ps(acc[h0 + g] + 16 * d), _mm512_set1_ps(correction[g]));
                for (int t = 0; t < n; t++) {
                    const int64_t v = base + (int64_t)t * token_stride;
                    if (after_next >= 0) /* this token's lines of this KV head, two blocks on */
                        prefetch_token(k_cache, v_cache, after_next + (int64_t)t * token_stride + (int64_t)c * head_dim,
                                       head_dim * elem, elem);
                    __m512 p[MAX_GROUP];
                    for (int g = 0; g < group; g++) p[g] = _mm512_set1_ps(scores[h0 + g][t]);
                    for (int d = 0; d < head_dim / 16; d++) {
                        const __m512 value = (__m512)load_any16(v_cache, v + 16 * d, bf16);
                        for (int g = 0; g < group; g++) a[g][d] = _mm512_fmadd_ps(p[g], value, a[g][d]);
                    }
                }
                for (int g = 0; g < group; g++)
                    for (int d = 0; d < head_dim / 16; d++) _mm512_store_ps(acc[h0 + g] + 16 * d, a[g][d]);
                continue;
            }
#endif
            v8f qv[MAX_GROUP][MAX_HEAD_DIM / 8];
            for (int g = 0; g < group; g++)
                for (int d = 0; d < nv; d++) qv[g][d] = load_any8(q, (int64_t)(h0 + g) * head_dim + 8 * d, bf16);
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
            for (int g = 0; g < group; g++)
                correction[g] = softmax_block(scores[h0 + g], n, &running_max[h0 + g], &denom[h0 + g]);
            /* The weighted values: each value vector read once for the group's accumulators. */
            v8f a[MAX_GROUP][MAX_HEAD_DIM / 8];
            for (int g = 0; g < group; g++)
                for (int d = 0; d < nv; d++) a[g][d] = load8(acc[h0 + g] + 8 * d) * splat(correction[g]);
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
                for (int d = 0; d < nv; d++) store8(acc[h0 + g] + 8 * d, a[g][d]);
        }
    }
    for (int h = 0; h < rows; h++) {
        const v8f inv = splat(1.0f / denom[h]);
        for (int d = 0; d < nv; d++) {
            const v8f x = load8(acc[h] + 8 * d) * inv;
            if (bf16)
                store_bf16x8((uint16_t *)o + (int64_t)h * head_dim + 8 * d, x); /* rounded once, as torch's cast */
            else
                store8((float *)o + (int64_t)h * head_dim + 8 * d, x);
        }
    }
}

/* attend_heads with constant sizes for the common shapes (head_dim 64 or 128; 1, 2 or 4 query heads per
 * KV head), variables for the others; the wide path where the machine and head_dim allow. */
#define ATTEND(GROUP, DIM, WIDE_PATH)                                                                          \
    attend_heads(q, k_cache, v_cache, table, len, next_table, next_len, o, kv_count, GROUP, DIM, block_size,     \
                 token_stride, scale, bf16, WIDE_PATH)
#define ATTEND_GROUPS(DIM, WIDE_PATH)                                                                          \
    switch (group) {                                                                                           \
    case 1: ATTEND(1, DIM, WIDE_PATH); return;                                                                 \
    case 2: ATTEND(2, DIM, WIDE_PATH); return;                                                                 \
    case 4: ATTEND(4, DIM, WIDE_PATH); return;                                                                 \
    default: ATTEND(group, DIM, WIDE_PATH); return;                                                            \
    }
static inline __attribute__((always_inline)) void attend_heads_sized(
    const void *q, const void *k_cache, const void *v_cache, const int32_t *table, int len,
    const int32_t *next_table, int next_len, void *o,
    int kv_count, int group, int head_dim, int block_size, int64_t token_stride, float scale, const int bf16) {
    switch (head_dim) {
    case 64: ATTEND_GROUPS(64, WIDE)
    case 128: ATTEND_GROUPS(128, WIDE)
    default:
        if (WIDE && head_dim % 32 == 0) ATTEND(group, head_dim, WIDE);
        else ATTEND(group, head_dim, 0);
    }
}

/* Work item (r, c) of paged_decode: request r's c-th chunk of KV heads. */
static inline __attribute__((always_inline)) void attend_item(
    const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t table_stride,
    const int32_t *seq_lens, void *out, int r, int c, int chunk, int chunks, int32_t num_requests,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads,
    const int bf16) {
    const int group = num_heads / num_kv_heads;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int elem = bf16 ? 2 : 4;
    const int first = c * chunk;
    const int count = num_kv_heads - first < chunk ? num_kv_heads - first : chunk;
    const int64_t first_head = (int64_t)r * num_heads + (int64_t)first * group;
    const int64_t head_offset = (int64_t)first * head_dim * elem; /* bytes */
    const int64_t row_offset = first_head * head_dim * elem; /* bytes, in the query and the output */
    /* The request this thread likely takes next, whose first blocks this one prefetches (whole
       requests only: then both read the caches from the same first KV head). */
    const int next = r + num_threads;
    const int32_t *next_table =
        chunks == 1 && next < num_requests ? block_tables + (int64_t)next * table_stride : 0;
    attend_heads_sized((const char *)query + row_offset, (const char *)k_cache + head_offset,
                       (const char *)v_cache + head_offset, block_tables + (int64_t)r * table_stride,
                       seq_lens[r], next_table, next_table ? seq_lens[next] : 0, (char *)out + row_offset,
                       count, group, head_dim, block_size, token_stride, scale, bf16);
}

/* Both entry points: returns 0, or -1 when a size is past what this build handles (the caller checks
 * first). `bf16` is a constant in each, so each gets its own copy of the loops. */
static inline __attribute__((always_inline)) int paged_decode(
    const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *seq_lens, void *out, int32_t num_requests, int32_t num_heads,
    int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads, const int bf16) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || group > MAX_GROUP || block_size > MAX_BLOCK ||
        num_heads % num_kv_heads)
        return -1;
    /* Work items: a request's KV heads in chunks of up to MAX_GROUP query heads, or one KV head each when
       there are too few requests to keep every thread busy. */
    int chunk = 1;
    if (num_requests >= 4 * num_threads) chunk = MAX_GROUP / group < num_kv_heads ? MAX_GROUP / group : num_kv_heads;
    const int chunks = (num_kv_heads + chunk - 1) / chunk;
    PARALLEL_BY_DTYPE(bf16, collapse(2) schedule(dynamic, 1) num_threads(num_threads),
                      int r = 0; r < num_requests; r++,
                      for (int c = 0; c < chunks; c++)
                          attend_item(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, r, c, chunk,
                                      chunks, num_requests, num_heads, num_kv_heads, head_dim, block_size, scale,
                                      num_threads, BF16));
    return 0;
}

/* The floats in the vectors this build's kernel works on: 16 where AVX-512 with bfloat16 dot products is
 * there (head_dim a multiple of 32 takes that path), else 8. */
int flotilla_paged_decode_lanes(void) { return WIDE ? 16 : 8; }

int flotilla_paged_decode_f32(const float *query, const float *k_cache, const float *v_cache,
                              const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                              float *out, int32_t num_requests, int32_t num_heads, int32_t num_kv_heads,
                              int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_requests,
                        num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, 0);
}

int flotilla_paged_decode_bf16(const uint16_t *query, const uint16_t *k_cache, const uint16_t *v_cache,
                               const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens,
                               uint16_t *out, int32_t num_requests, int32_t num_heads, int32_t num_kv_heads,
                               int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {
    return paged_decode(query, k_cache, v_cache, block_tables, table_stride, seq_lens, out, num_requests,
                        num_heads, num_kv_heads, head_dim, block_size, scale, num_threads, 1);
}
