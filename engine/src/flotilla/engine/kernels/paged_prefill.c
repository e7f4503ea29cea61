/* Prefill attention on the CPU, straight from the paged KV cache: each chunk of new tokens attends causally
 * to its request's cached context and to itself (its keys and values are already stored), for float32 and
 * bfloat16 caches, with an online softmax over the cache's blocks (no gathered copy of the context, no
 * mask tensor).
 *
 * The unit of work is a tile: up to TILE_ROWS query rows (a few consecutive tokens of one chunk, times the
 * query heads of one KV head) against the keys up to the tile's last token, in sub-tiles of LANES tokens
 * read once per tile and shared by all its rows. The rows' queries are transposed once per tile, so that a
 * vector of LANES rows scores a key in head_dim broadcast FMAs, a sub-tile's keys being LANES independent
 * chains, and the online softmax runs lane-wise over rows (no horizontal sums); each row's weighted values
 * are then head_dim / LANES FMA chains over the keys it sees. On 8 prompts of 256 tokens with tiny-llama's
 * shapes (1 thread, AMD EPYC Zen 4) it runs at 72 GFLOP/s in bfloat16 and 58 in float32, where torch's
 * scaled_dot_product_attention over the gathered blocks ran at 33-36 and the first version of this kernel
 * (a row's scores at a time, keys transposed, float32 FMAs) at 44 and 38.
 *
 * Queries [T, H, D] and the output are in the caches' dtype; the output rounded once (as torch's cast rounds).
 */
#include "vectors.h"

#if defined(__AVX512F__)
#define LANES 16
typedef v16f vw;
typedef v16i vwi;
#define exp_w exp_nonpositive16
#define load_anyw load_any16
#else
#define LANES 8
typedef v8f vw;
typedef v8i vwi;
#define exp_w exp_nonpositive
#define load_anyw load_any8
#endif

/* bfloat16 scores as pairs of products (vdpbf16ps), where the CPU has AVX512-BF16: half the instructions of
 * widening both sides to float32. Each product is exact in float32, so the scores differ from the FMA
 * path's by the order of the additions only. The weighted values go in pairs of keys the same way, with
 * the softmax's numerators rounded to bfloat16 first (as transformers' eager attention rounds its
 * probabilities to the values' dtype, and FlashAttention its P): half the FMAs of the values' sum, which
 * were two thirds of the tile's. The denominators stay sums of the float32 numerators. */
#if LANES == 16 && defined(__AVX512BF16__)
#define PAIRS 1
#else
#define PAIRS 0
#endif

/* Whether bfloat16 caches of head_dim take the pairs path: a row's pairs fill whole vectors. */
static inline int pairs_for(int head_dim) { return PAIRS && head_dim % (2 * LANES) == 0; }

#define PREFILL_MAX_HEAD_DIM 256
#define TILE_ROWS 64 /* query rows per tile: their accumulators (64 KiB at head_dim 256) stay in L2 */

/* How many of a sub-tile's n keys (from position `start`) rows `lane` and `lane + 1` see between them; 0 when
 * neither sees one, so their maximum, and their correction, held. */
static inline __attribute__((always_inline)) int keys_seen(vwi row_pos, int lane, int start, int n) {
    const int seen0 = row_pos[lane] - start + 1, seen1 = row_pos[lane + 1] - start + 1;
    const int seen = seen0 > seen1 ? seen0 : seen1;
    return seen <= 0 ? 0 : seen < n ? seen : n;
}

/* Two rows' accumulators, each rescaled by its correction (1 while its maximum held: no multiply). */
static inline __attribute__((always_inline)) void load_rows(vw *a0, vw *a1, const float *row0, const float *row1,
                                                            float c0, float c1, int nv) {
    for (int d = 0; d < nv; d++) {
        memcpy(&a0[d], row0 + d * LANES, sizeof a0[d]);
        memcpy(&a1[d], row1 + d * LANES, sizeof a1[d]);
        if (c0 != 1.0f) a0[d] *= c0;
        if (c1 != 1.0f) a1[d] *= c1;
    }
}

static inline __attribute__((always_inline)) void store_rows(float *row0, float *row1, const vw *a0, const vw *a1,
                                                             int nv) {
    for (int d = 0; d < nv; d++) {
        memcpy(row0 + d * LANES, &a0[d], sizeof a0[d]);
        memcpy(row1 + d * LANES, &a1[d], sizeof a1[d]);
    }
}

/* One tile: `tokens` consecutive tokens of a chunk from absolute position `first_pos`, the `group` query
 * heads of KV head `kv` (rows token-major: row = token * group + g).
 *
 * Rows go in vectors of LANES (row vector `rv` holds rows rv * LANES + lane), with their queries transposed
 * once per tile: a row vector's scores against a key are head_dim FMAs, each with one of the key's elements
 * broadcast, and the LANES keys of a sub-tile are LANES independent FMA chains. The softmax's running maximum
 * and sum are vectors over the rows too, so masking, the maximum and exp are lane-wise with no horizontal
 * reduction; only the weighted values go row by row. */
static inline __attribute__((always_inline)) void prefill_tile(
    const void *query, const void *k_cache, const void *v_cache, const int32_t *table, void *out,
    int64_t first_row, int tokens, int first_pos, int kv, int group, int num_heads, int num_kv_heads,
    const int head_dim, int block_size, float scale, const int bf16) {
    const int rows = tokens * group;
    const int row_vectors = (rows + LANES - 1) / LANES;
    const int nv = head_dim / LANES;
    const int64_t token_stride = (int64_t)num_kv_heads * head_dim;
    const int pairs = bf16 && pairs_for(head_dim);
    float acc[TILE_ROWS][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    vw queries_t[TILE_ROWS / LANES][PREFILL_MAX_HEAD_DIM]; /* [rv][d]: dim d of the rows' queries */
    vw row_max[TILE_ROWS / LANES], denom[TILE_ROWS / LANES];
    vwi row_pos[TILE_ROWS / LANES]; /* each row's position; -1 for the padding lanes of the last vector */
    float keys[LANES][PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    /* The pairs path's (read only where PAIRS): [rv][i], dims 2i and 2i+1 of the rows' queries; the keys
       as stored. */
    vwi query_pairs[TILE_ROWS / LANES][PREFILL_MAX_HEAD_DIM / 2] __attribute__((unused));
    uint32_t key_pairs[LANES][PREFILL_MAX_HEAD_DIM / 2] __attribute__((aligned(64)));
    vw values[LANES][PREFILL_MAX_HEAD_DIM / LANES];
    /* The pairs path's values: [key pair][d]: dims d * LANES.. of keys 2jp and 2jp+1, interleaved; and the
       numerators of a row vector's rows, [key pair][lane], as bfloat16 pairs. */
    vwi value_pairs[LANES / 2][PREFILL_MAX_HEAD_DIM / LANES] __attribute__((unused));
    uint32_t weight_pairs[LANES / 2][LANES] __attribute__((aligned(64), unused));
    int64_t key_at[LANES]; /* where each key of the sub-tile starts in the caches */
    float weights[LANES][LANES] __attribute__((aligned(64))); /* [key][lane]: the sub-tile's softmax numerators */
    int64_t query_row[TILE_ROWS]; /* where each row starts in the query (and the output) */
    for (int r = 0; r < rows; r++)
        query_row[r] = ((first_row + r / group) * num_heads + (int64_t)kv * group + r % group) * head_dim;
    for (int rv = 0; rv < row_vectors; rv++) {
        for (int lane = 0; lane < LANES; lane++) {
            const int r = rv * LANES + lane;
            row_pos[rv][lane] = r < rows ? first_pos + r / group : -1;
            /* A vector of the row's query, then lane by lane: written as one loop over d, GCC made it
               gathers, slower than the scores themselves. */
            if (pairs) {
                for (int d = 0; d < nv; d += 2) {
                    vwi packed = (vwi){}; /* 2 * LANES values of the row, as LANES pairs */
                    if (r < rows) memcpy(&packed, (const uint16_t *)query + query_row[r] + d * LANES, sizeof packed);
                    for (int i = 0; i < LANES; i++) query_pairs[rv][d / 2 * LANES + i][lane] = packed[i];
                }
                continue;
            }
            for (int d = 0; d < nv; d++) {
                vw x = (vw){};
                if (r < rows) x = load_anyw(query, query_row[r] + d * LANES, bf16);
                for (int i = 0; i < LANES; i++) queries_t[rv][d * LANES + i][lane] = x[i];
            }
        }
        row_max[rv] = (vw){} - INFINITY;
        denom[rv] = (vw){};
    }
    for (int r = 0; r < row_vectors * LANES; r++) memset(acc[r], 0, sizeof(float) * head_dim);
    const int last_pos = first_pos + tokens - 1;
    for (int start = 0; start <= last_pos; start += LANES) {
        const int n = last_pos - start + 1 < LANES ? last_pos - start + 1 : LANES;
        /* This sub-tile's keys and values, widened; past n, zeros. The keys are copied even from a float32
           cache: one base address for all of them keeps the score loop's operands out of spilled registers. */
        for (int j = 0; j < LANES; j++) {
            if (j < n) {
                const int pos = start + j;
                const int64_t slot = (int64_t)table[pos / block_size] * block_size + pos % block_size;
                const int64_t at = key_at[j] = slot * token_stride + (int64_t)kv * head_dim;
                if (pairs) {
                    memcpy(key_pairs[j], (const uint16_t *)k_cache + at, sizeof(uint16_t) * head_dim);
                    continue;
                }
                for (int d = 0; d < nv; d++) {
                    const vw x = load_anyw(k_cache, at + (int64_t)d * LANES, bf16);
                    memcpy(keys[j] + d * LANES, &x, sizeof x);
                }
                for (int d = 0; d < nv; d++) values[j][d] = (vw)load_anyw(v_cache, at + (int64_t)d * LANES, bf16);
            } else if (pairs) {
                memset(key_pairs[j], 0, sizeof(uint16_t) * head_dim);
            } else {
                memset(keys[j], 0, sizeof(float) * head_dim);
                for (int d = 0; d < nv; d++) values[j][d] = (vw){};
            }
        }
#if PAIRS
        if (pairs) /* each key pair's values, dim by dim: (key 2jp, key 2jp+1) in a 32-bit lane; past n, zeros */
            for (int jp = 0; jp < LANES / 2; jp++)
                for (int d = 0; d < nv; d++) {
                    __m256i first = _mm256_setzero_si256(), second = _mm256_setzero_si256();
                    if (2 * jp < n) memcpy(&first, (const uint16_t *)v_cache + key_at[2 * jp] + d * LANES, sizeof first);
                    if (2 * jp + 1 < n)
                        memcpy(&second, (const uint16_t *)v_cache + key_at[2 * jp + 1] + d * LANES, sizeof second);
                    value_pairs[jp][d] = (vwi)_mm512_or_si512(
                        _mm512_cvtepu16_epi32(first), _mm512_slli_epi32(_mm512_cvtepu16_epi32(second), 16));
                }
#endif
        /* A token before this sub-tile's first key sees none of it: rows are token-major, so those are the
           tile's first rows, and whole row vectors of them are skipped. */
        const int first_row_seeing = start > first_pos ? (start - first_pos) * group : 0;
        for (int rv = first_row_seeing / LANES; rv < row_vectors; rv++) {
            vw s[LANES];
            for (int j = 0; j < LANES; j++) s[j] = (vw){};
#if PAIRS
            if (pairs) {
                for (int i = 0; i < head_dim / 2; i++) {
                    const __m512bh q = (__m512bh)query_pairs[rv][i];
                    for (int j = 0; j < LANES; j++)
                        s[j] = (vw)_mm512_dpbf16_ps((__m512)s[j], q, (__m512bh)_mm512_set1_epi32((int)key_pairs[j][i]));
                }
            } else
#endif
            for (int d = 0; d < head_dim; d++) {
                const vw q = queries_t[rv][d];
                for (int j = 0; j < LANES; j++) s[j] += keys[j][d] * q;
            }
            vw new_max = row_max[rv];
            vwi keep[LANES];
            for (int j = 0; j < LANES; j++) {
                s[j] *= scale; /* after the sum, as torch scales, not folded into the queries */
                keep[j] = start + j <= row_pos[rv]; /* causal; keys past n are past every row's position */
                s[j] = (vw)(((vwi)s[j] & keep[j]) | ((vwi)((vw){} - INFINITY) & ~keep[j]));
                new_max = (vw)(((vwi)s[j] & (s[j] > new_max)) | ((vwi)new_max & ~(s[j] > new_max)));
            }
            /* Padding lanes see no key: their maximum stays -inf; 0 keeps their arithmetic finite. */
            const vwi none = new_max == (vw){} - INFINITY;
            const vw shift = (vw)((vwi)new_max & ~none);
            /* 0 on a row's first keys; 1 while its maximum holds (most sub-tiles) */
            const vw correction = exp_w(row_max[rv] - shift);
            vw sum = (vw){};
            for (int j = 0; j < LANES; j++) {
                const vw p = (vw)((vwi)exp_w(s[j] - shift) & keep[j]);
                sum += p;
                memcpy(weights[j], &p, sizeof p);
            }
            denom[rv] = denom[rv] * correction + sum;
            row_max[rv] = new_max;
#if PAIRS
            if (pairs) {
                for (int jp = 0; jp < LANES / 2; jp++) {
                    vw first, second;
                    memcpy(&first, weights[2 * jp], sizeof first);
                    memcpy(&second, weights[2 * jp + 1], sizeof second);
                    const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)first));
                    const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh((__m512)second));
                    _mm512_store_si512(weight_pairs[jp], _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
                }
                for (int lane = 0; lane < LANES; lane += 2) {
                    const int r = rv * LANES + lane;
                    const int visible = keys_seen(row_pos[rv], lane, start, n);
                    if (!visible) continue;
                    const int visible_pairs = (visible + 1) / 2; /* a pair's second key may weigh 0 */
                    vw a0[PREFILL_MAX_HEAD_DIM / LANES], a1[PREFILL_MAX_HEAD_DIM / LANES];
                    load_rows(a0, a1, acc[r], acc[r + 1], correction[lane], correction[lane + 1], nv);
                    for (int jp = 0; jp < visible_pairs; jp++) {
                        const __m512bh w0 = (__m512bh)_mm512_set1_epi32((int)weight_pairs[jp][lane]);
                        const __m512bh w1 = (__m512bh)_mm512_set1_epi32((int)weight_pairs[jp][lane + 1]);
                        for (int d = 0; d < nv; d++) {
                            const __m512bh v = (__m512bh)value_pairs[jp][d];
                            a0[d] = (vw)_mm512_dpbf16_ps((__m512)a0[d], v, w0);
                            a1[d] = (vw)_mm512_dpbf16_ps((__m512)a1[d], v, w1);
                        }
                    }
                    store_rows(acc[r], acc[r + 1], a0, a1, nv);
                }
                continue;
            }
#endif
            /* Two rows at a time: 2 * head_dim / LANES FMA chains, each value vector loaded once. A row
               that sees fewer of the keys than the other has weight 0 for the rest. Padding rows (past
               `rows`, weights 0) are written but never read. */
            for (int lane = 0; lane < LANES; lane += 2) {
                const int r = rv * LANES + lane;
                const int visible = keys_seen(row_pos[rv], lane, start, n);
                if (!visible) continue;
                vw a0[PREFILL_MAX_HEAD_DIM / LANES], a1[PREFILL_MAX_HEAD_DIM / LANES];
                load_rows(a0, a1, acc[r], acc[r + 1], correction[lane], correction[lane + 1], nv);
                for (int j = 0; j < visible; j++) {
                    const float p0 = weights[j][lane], p1 = weights[j][lane + 1];
                    for (int d = 0; d < nv; d++) {
                        a0[d] += p0 * values[j][d];
                        a1[d] += p1 * values[j][d];
                    }
                }
                store_rows(acc[r], acc[r + 1], a0, a1, nv);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = 1.0f / denom[r / LANES][r % LANES];
        const int64_t o = query_row[r];
        for (int d = 0; d < head_dim; d += 8) {
            const v8f x = load8(acc[r] + d) * inv;
            if (bf16)
                store_bf16x8((uint16_t *)out + o + d, x);
            else
                store8((float *)out + o + d, x);
        }
    }
}

/* Work item `item` of paged_prefill: (chunk, token tile, KV head), numbered through a prefix sum of each
 * chunk's tiles. */
static inline __attribute__((always_inline)) void prefill_item(
    const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables, int64_t table_stride,
    const int32_t *chunk_rows, const int32_t *chunk_lens, const int32_t *context_lens, void *out, int64_t item,
    int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, const int bf16) {
    const int group = num_heads / num_kv_heads;
    const int tile_tokens = TILE_ROWS / group;
    /* The item's chunk and tile: a walk over the chunks' tile counts (a step has a few chunks). */
    int64_t index = item / num_kv_heads;
    const int kv = (int)(item % num_kv_heads);
    int c = 0;
    for (;; c++) {
        const int64_t tiles = (chunk_lens[c] + tile_tokens - 1) / tile_tokens;
        if (index < tiles) break;
        index -= tiles;
    }
    const int first = (int)index * tile_tokens;
    const int tokens = chunk_lens[c] - first < tile_tokens ? chunk_lens[c] - first : tile_tokens;
    const int32_t *table = block_tables + (int64_t)c * table_stride;
    const int64_t row = (int64_t)chunk_rows[c] + first;
    const int pos = context_lens[c] + first;
#define TILE(DIM)                                                                                              \
    prefill_tile(query, k_cache, v_cache, table, out, row, tokens, pos, kv, group, num_heads, num_kv_heads, DIM, \
                 block_size, scale, bf16)
    if (head_dim == 64)
        TILE(64);
    else if (head_dim == 128)
        TILE(128);
    else
        TILE(head_dim);
#undef TILE
}

/* Returns 0, or -1 when a size is past what the kernel handles (the caller checks first). */
static inline __attribute__((always_inline)) int paged_prefill(
    const void *query, const void *k_cache, const void *v_cache, const int32_t *block_tables,
    int64_t table_stride, const int32_t *chunk_rows, const int32_t *chunk_lens, const int32_t *context_lens,
    void *out, int32_t num_chunks, int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
    float scale, int32_t num_threads, const int bf16) {
    if (head_dim % LANES || head_dim > PREFILL_MAX_HEAD_DIM || num_heads % num_kv_heads)
        return -1;
    const int group = num_heads / num_kv_heads;
    if (group > TILE_ROWS) return -1;
    const int tile_tokens = TILE_ROWS / group;
    int64_t items = 0; /* prefill_item numbers them */
    for (int c = 0; c < num_chunks; c++) items += (int64_t)(chunk_lens[c] + tile_tokens - 1) / tile_tokens;
    items *= num_kv_heads;
    PARALLEL_BY_DTYPE(bf16, schedule(dynamic, 1) num_threads(num_threads), int64_t item = 0; item < items; item++,
                      prefill_item(query, k_cache, v_cache, block_tables, table_stride, chunk_rows, chunk_lens,
                                   context_lens, out, item, num_heads, num_kv_heads, head_dim, block_size, scale,
                                   BF16));
    return 0;
}

/* The entry points, one per cache dtype (the output is in the caches' dtype). */
#define PREFILL_ENTRY(NAME, CACHE_T, BF16)                                                                     \
    int NAME(const CACHE_T *query, const CACHE_T *k_cache, const CACHE_T *v_cache, const int32_t *block_tables,  \
             int64_t table_stride, const int32_t *chunk_rows, const int32_t *chunk_lens,                       \
             const int32_t *context_lens, CACHE_T *out, int32_t num_chunks, int32_t num_heads,                 \
             int32_t num_kv_heads, int32_t head_dim, int32_t block_size, float scale, int32_t num_threads) {   \
        return paged_prefill(query, k_cache, v_cache, block_tables, table_stride, chunk_rows, chunk_lens,      \
                             context_lens, out, num_chunks, num_heads, num_kv_heads, head_dim, block_size,     \
                             scale, num_threads, BF16);                                                        \
    }
PREFILL_ENTRY(flotilla_paged_prefill_f32, float, 0)
PREFILL_ENTRY(flotilla_paged_prefill_bf16, uint16_t, 1)

/* The floats per vector of this build's prefill kernel: head_dim must be a multiple of it. */
int flotilla_paged_prefill_lanes(void) { return LANES; }

/* 1 when this build rounds the softmax's numerators to bfloat16 for bfloat16 caches of head_dim (the pairs
 * path), else 0 (float32 numerators). */
int flotilla_paged_prefill_rounds_weights(int32_t head_dim) { return pairs_for(head_dim); }
