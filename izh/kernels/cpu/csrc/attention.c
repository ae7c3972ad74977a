/* Paged attention (decode steps and prefill chunks), float32 and bfloat16 activations, over a KV cache in
 * any of the kv types (common.h: float32, bf16, float16, float8 e4m3 / e5m2, q8_0).
 * See common.h for the conventions, izh/kernels/cpu/ops.py for the contract. */
#include "common.h"
#if defined(__F16C__) && defined(__AVX2__)
#include <immintrin.h>
#endif

/* Work (sum of seq_len * num_heads * head_dim) below which attention stays on the calling thread: about
 * 100 us of single-thread work; below that a second thread buys little and costs a wake-up. */
#define PAR_MIN_ATTN (1 << 19)

/* Paged decode attention: one query token per sequence, work item = (sequence, kv head). Each thread
 * has one scratch buffer (floats): scores [group * seq_len], value accumulators [group * d padded to a
 * multiple of 32], 1/sum [group]. head_dim <= 32 * MAX_NC (the Python side checks). */

/* Softmax over each head's scores in place, unnormalised (exp(s - max)); inv[hh] = 1 / sum.
 * A function of the L scores alone, whatever the buffer's alignment or the caller: the maximum is exact in
 * any order; exp_f32 is elementwise, built without fp contraction (this function is not FAST_FP, so its
 * vectorised and scalar iterations round alike); the sum runs in 16 lanes (position p in lane p % 16, in
 * order of p) and the lanes are then added in one fixed order. A query's attention is thus the same
 * whether it runs as a decode or inside a prefill chunk (izh_paged_attention_*). */
static __attribute__((noinline)) void softmax_rows(float *restrict sc, float *restrict inv, int64_t group,
                                                   int64_t L, float softcap) {
    for (int64_t hh = 0; hh < group; hh++) {
        float *restrict sh = sc + hh * L;
        /* Gemma 2's soft-capping, softcap * tanh(s / softcap), tanh as 1 - 2 / (exp(2x) + 1) through the
         * same elementwise exp_f32 (a function of the score alone) */
        if (softcap > 0.0f)
            for (int64_t p = 0; p < L; p++)
                sh[p] = softcap * (1.0f - 2.0f / (exp_f32(2.0f * sh[p] / softcap) + 1.0f));
        /* the maximum in 16 lanes (a vector max; as one chain of dependent maxss it was ~2/3 of this
         * function's time), then across them: the same value in any order */
        float top[16];
        for (int k = 0; k < 16; k++) top[k] = -INFINITY;
        int64_t p = 0;
#if defined(__AVX512F__) /* max_ps(s, t) is t where s is NaN or s == t: the scalar select's result */
        __m512 t16 = _mm512_loadu_ps(top);
        for (; p + 16 <= L; p += 16) t16 = _mm512_max_ps(_mm512_loadu_ps(sh + p), t16);
        _mm512_storeu_ps(top, t16);
#elif defined(__AVX2__)
        __m256 t8[2] = {_mm256_loadu_ps(top), _mm256_loadu_ps(top + 8)};
        for (; p + 16 <= L; p += 16)
            for (int h = 0; h < 2; h++) t8[h] = _mm256_max_ps(_mm256_loadu_ps(sh + p + 8 * h), t8[h]);
        _mm256_storeu_ps(top, t8[0]);
        _mm256_storeu_ps(top + 8, t8[1]);
#endif
        for (; p + 16 <= L; p += 16)
            for (int k = 0; k < 16; k++) top[k] = sh[p + k] > top[k] ? sh[p + k] : top[k];
        for (int k = 0; p + k < L; k++) top[k] = sh[p + k] > top[k] ? sh[p + k] : top[k];
        float m = -INFINITY;
        for (int k = 0; k < 16; k++) m = top[k] > m ? top[k] : m;
        /* exp and the sum in one pass (the same operations as an exp pass and then a sum pass) */
        float lanes[16] = {0};
        p = 0;
        for (; p + 16 <= L; p += 16)
            for (int k = 0; k < 16; k++) {
                const float e = exp_f32(sh[p + k] - m);
                sh[p + k] = e;
                lanes[k] += e;
            }
        for (int k = 0; p + k < L; k++) {
            const float e = exp_f32(sh[p + k] - m);
            sh[p + k] = e;
            lanes[k] += e;
        }
        for (int w = 8; w >= 1; w /= 2)
            for (int k = 0; k < w; k++) lanes[k] += lanes[k + w];
        inv[hh] = 1.0f / lanes[0];
    }
}

/* One (sequence, KV head) item, in GCC vector extensions: 16 fp32 lanes (one AVX-512 register, two AVX2
 * ones), no intrinsics. D is a compile-time constant for the common head sizes (64, 128).
 *  - Rows load 32 elements at a time as two vectors (a last partial chunk through a zero-padded copy).
 *    bf16 is widened without shuffles: 16 uint32 lanes hold element pairs, `u << 16` is the even
 *    elements and `u & 0xFFFF0000` the odd ones; q and the value accumulators use the same (even, odd)
 *    order, restored when the output is stored.
 *  - Scores are taken 16 positions at a time (across KV blocks): 16 lane-wise products, then one
 *    shuffle tree sums all 16 (31 shuffles instead of 64 for separate horizontal sums).
 *  - Values: per 16 positions, per head, the D accumulators stay in registers. */
typedef float v16f __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#define MAX_NC 16 /* D <= 512 */
#define ATTN_DP_MAX_GROUP 8 /* query heads per KV head on the vdpbf16ps score path */

INLINE void ld32(const void *p, int64_t c, const int bf, v16f *a, v16f *b) {
    if (bf) {
        v16u u, hi = {0};
        memcpy(&u, (const uint16_t *)p + 32 * c, sizeof u);
        hi += 0xFFFF0000u;
        *a = (v16f)(u << 16);
        *b = (v16f)(u & hi);
    } else {
        memcpy(a, (const float *)p + 32 * c, sizeof *a);
        memcpy(b, (const float *)p + 32 * c + 16, sizeof *b);
    }
}

/* ld32 of chunk c of a D-element row; the last chunk may be partial (zero-padded, nothing read past D). */
INLINE void ld32_row(const void *p, int64_t c, int64_t D, const int bf, v16f *a, v16f *b) {
    const int64_t nv = D - 32 * c;
    if (nv >= 32) {
        ld32(p, c, bf, a, b);
    } else {
        float tmp[32] = {0};
        memcpy(tmp, off(p, 32 * c, bf), (size_t)nv * (bf ? 2 : 4));
        ld32(tmp, 0, bf, a, b);
    }
}

/* Stores a * scale, b * scale as chunk c of a D-element row (dtype obf), undoing ld32's element order
 * (bf: the (even, odd) one). */
INLINE void st32_row(void *p, int64_t c, int64_t D, v16f a, v16f b, float scale, const int bf, const int obf) {
    const int64_t nv = D - 32 * c;
    for (int l = 0; l < 16; l++) {
        const int64_t ea = bf ? 2 * l : l, eb = bf ? 2 * l + 1 : 16 + l;
        if (ea < nv) st(p, 32 * c + ea, a[l] * scale, obf);
        if (eb < nv) st(p, 32 * c + eb, b[l] * scale, obf);
    }
}

/* --- the KV cache's element formats (kv_type, common.h; izh/kernels/kv_cache_dtype.py has the references) --- */

INLINE float with_sign(float mag, uint32_t sign) {
    uint32_t u;
    memcpy(&u, &mag, sizeof u);
    u |= sign;
    memcpy(&mag, &u, sizeof mag);
    return mag;
}

/* float16 bits -> float, exact; no arithmetic on subnormal floats (a subnormal half is its mantissa times
 * 2^-24), so flush-to-zero modes change nothing. Branch-free: loops over it vectorise. */
INLINE float h2f(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    uint32_t u = e == 0x1F ? 0x7F800000u | (m << 13) : ((uint32_t)(h & 0x7FFFu) << 13) + (112u << 23);
    float f;
    memcpy(&f, &u, sizeof f);
    f = e == 0 ? (float)m * 0x1p-24f : f;
    return with_sign(f, (uint32_t)(h & 0x8000u) << 16);
}

/* float8 e4m3fn bits -> float, exact (0x7F / 0xFF: NaN; no infinities). */
INLINE float e4m3_to_f(uint8_t b) {
    const uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    uint32_t u = ((uint32_t)(b & 0x7Fu) << 20) + (120u << 23);
    float f;
    memcpy(&f, &u, sizeof f);
    f = e == 0 ? (float)m * 0x1p-9f : f;
    f = (b & 0x7Fu) == 0x7Fu ? NAN : f;
    return with_sign(f, (uint32_t)(b & 0x80u) << 24);
}

/* float8 e5m2 is the high byte of a float16. */
INLINE float e5m2_to_f(uint8_t b) { return h2f((uint16_t)(b << 8)); }

/* x in a binary float format of ebits exponent and mbits mantissa bits (IEEE-like bias), rounded to nearest
 * even, its magnitude clamped to maxv (no infinities); NaN -> nanv. The bits, sign included. */
INLINE uint32_t f2mini(float x, const int ebits, const int mbits, const float maxv, const uint32_t nanv) {
    const int bias = (1 << (ebits - 1)) - 1;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    const uint32_t sign = (u >> 31) << (ebits + mbits);
    float a = fabsf(x);
    if (a != a) return sign | nanv;
    a = a > maxv ? maxv : a;
    uint32_t r;
    if (a < ldexpf(1.0f, 1 - bias)) { /* subnormal: a multiple of 2^(1 - bias - mbits), exactly scaled */
        r = (uint32_t)rintf(a * ldexpf(1.0f, bias - 1 + mbits));
    } else {
        memcpy(&u, &a, sizeof u);
        const int shift = 23 - mbits;
        u += ((u >> shift) & 1u) + (1u << (shift - 1)) - 1u;
        r = (u >> shift) - ((uint32_t)(127 - bias) << mbits);
    }
    return sign | r;
}

INLINE uint16_t f2h(float x) { return (uint16_t)f2mini(x, 5, 10, 65504.0f, 0x7E00u); }

/* Writes one cache row of kv type kt from d values of src (bf16 when sbf, else float32). q8_0 follows
 * llama.cpp's quantize_row_q8_0_ref: per 32 values d = amax / 127, q = roundf(x * (1 / d)). */
static void kv_write_row(void *dst, const void *src, int64_t d, const int sbf, int kt) {
    uint8_t *o = (uint8_t *)dst;
    switch (kt) {
    case KV_F32:
        for (int64_t j = 0; j < d; j++) ((float *)dst)[j] = ld(src, j, sbf);
        break;
    case KV_BF16:
        for (int64_t j = 0; j < d; j++) ((uint16_t *)dst)[j] = f2bf(ld(src, j, sbf));
        break;
    case KV_F16:
        for (int64_t j = 0; j < d; j++) ((uint16_t *)dst)[j] = f2h(ld(src, j, sbf));
        break;
    case KV_E4M3:
        for (int64_t j = 0; j < d; j++) o[j] = (uint8_t)f2mini(ld(src, j, sbf), 4, 3, 448.0f, 0x7Fu);
        break;
    case KV_E5M2:
        for (int64_t j = 0; j < d; j++) o[j] = (uint8_t)f2mini(ld(src, j, sbf), 5, 2, 57344.0f, 0x7Eu);
        break;
    case KV_Q8_0:
        for (int64_t b = 0; b < d / Q8_0_BLOCK; b++, o += Q8_0_BYTES) {
            float x[Q8_0_BLOCK], amax = 0.0f;
            for (int j = 0; j < Q8_0_BLOCK; j++) {
                x[j] = ld(src, b * Q8_0_BLOCK + j, sbf);
                amax = fabsf(x[j]) > amax ? fabsf(x[j]) : amax;
            }
            const float scale = amax / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
            const uint16_t h = f2h(scale);
            memcpy(o, &h, sizeof h);
            for (int j = 0; j < Q8_0_BLOCK; j++) o[2 + j] = (uint8_t)(int8_t)roundf(x[j] * inv);
        }
        break;
    }
}

/* Rows rows[0 .. m-1] of a cache of kv type kt (D values each) as float32 into tile [m, ts]; rows[o] then
 * points at its tile row. One pass over each row, a vectorised loop per format. */
static __attribute__((noinline)) void kv_tile(float *restrict tile, int64_t ts, const void **rows, int64_t m,
                                              int64_t D, int kt) {
    for (int64_t o = 0; o < m; o++) {
        float *restrict t = tile + o * ts;
        const uint8_t *restrict r = (const uint8_t *)rows[o];
        switch (kt) {
        case KV_F32:
            memcpy(t, r, sizeof(float) * (size_t)D);
            break;
        case KV_BF16:
            for (int64_t j = 0; j < D; j++) t[j] = bf2f(((const uint16_t *)r)[j]);
            break;
        case KV_F16: {
            int64_t j = 0;
#if defined(__F16C__) && defined(__AVX2__)
            /* vcvtph2ps, exact as h2f (which gcc does not turn into it: 91 against 69 ms of attention a
             * 32-stream step on AVX2, bench_results/README.md) */
            for (; j + 8 <= D; j += 8)
                _mm256_storeu_ps(t + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(r + 2 * j))));
#endif
            for (; j < D; j++) t[j] = h2f(((const uint16_t *)r)[j]);
            break;
        }
        case KV_E4M3:
            for (int64_t j = 0; j < D; j++) t[j] = e4m3_to_f(r[j]);
            break;
        case KV_E5M2:
            for (int64_t j = 0; j < D; j++) t[j] = e5m2_to_f(r[j]);
            break;
        default: /* KV_Q8_0 */
            for (int64_t b = 0; b < D / Q8_0_BLOCK; b++) {
                const uint8_t *blk = r + b * Q8_0_BYTES;
                uint16_t h;
                memcpy(&h, blk, sizeof h);
                const float scale = h2f(h);
                for (int j = 0; j < Q8_0_BLOCK; j++) t[b * Q8_0_BLOCK + j] = scale * (float)(int8_t)blk[2 + j];
            }
            break;
        }
        rows[o] = t;
    }
}

/* out[o] = sum of the lanes of a[o], for 16 vectors. */
INLINE v16f sum16(v16f *a) {
    const v16i lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
    const v16i hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
    const v16i hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const v16i lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
    const v16i hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    /* after the four levels lane L holds the sum of a[bitreverse4(L)] */
    const v16i rev = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
    v16f b[8], c[4], d[2];
    for (int k = 0; k < 8; k++)
        b[k] = __builtin_shuffle(a[2 * k], a[2 * k + 1], lo8) + __builtin_shuffle(a[2 * k], a[2 * k + 1], hi8);
    for (int k = 0; k < 4; k++)
        c[k] = __builtin_shuffle(b[2 * k], b[2 * k + 1], lo4) + __builtin_shuffle(b[2 * k], b[2 * k + 1], hi4);
    for (int k = 0; k < 2; k++)
        d[k] = __builtin_shuffle(c[2 * k], c[2 * k + 1], lo2) + __builtin_shuffle(c[2 * k], c[2 * k + 1], hi2);
    v16f e = __builtin_shuffle(d[0], d[1], lo1) + __builtin_shuffle(d[0], d[1], hi1);
    return __builtin_shuffle(e, rev);
}

/* The cache row of position p (KV head g) through the sequence's block table. */
INLINE const void *kv_row(const void *cache, const int32_t *blocks, int64_t p, int64_t block_size, int64_t kvh,
                          int64_t g, int64_t rb) {
    const int64_t b = p / block_size;
    return (const char *)cache + (((int64_t)blocks[b] * block_size + (p - b * block_size)) * kvh + g) * rb;
}

/* Pointers to the rows of positions p0 .. p0+m-1 (KV head g) through the block table, m = min(16, L - p0);
 * returns m (0 past the end). Each row is prefetched: the rows are used one chunk later. */
INLINE int64_t row_ptrs(const void **rows, const void *cache, const int32_t *blocks, int64_t p0, int64_t L,
                        int64_t block_size, int64_t kvh, int64_t g, int64_t rb) {
    const int64_t m = p0 >= L ? 0 : (L - p0 < 16 ? L - p0 : 16);
    int64_t b = p0 / block_size, o = p0 - b * block_size;
    for (int64_t k = 0; k < m; k++) {
        rows[k] = (const char *)cache + (((int64_t)blocks[b] * block_size + o) * kvh + g) * rb;
        for (int64_t x = 0; x < rb; x += 64) __builtin_prefetch((const char *)rows[k] + x);
        if (++o == block_size) {
            o = 0;
            b++;
        }
    }
    return m;
}

/* Prefetch into L2 the rows of positions p0 .. p0+15 (KV head g), well ahead of row_ptrs's L1 prefetch:
 * one chunk ahead is too close to hide DRAM latency with the few L1 fill buffers a core has. */
#define ATTN_L2_AHEAD 128
INLINE void prefetch_rows_l2(const void *cache, const int32_t *blocks, int64_t p0, int64_t L, int64_t block_size,
                             int64_t kvh, int64_t g, int64_t rb) {
    const int64_t end = p0 + 16 < L ? p0 + 16 : L;
    for (int64_t p = p0; p < end; p++) {
        const char *row = (const char *)kv_row(cache, blocks, p, block_size, kvh, g, rb);
        for (int64_t x = 0; x < rb; x += 64) __builtin_prefetch(row + x, 0, 2);
    }
}

/* The scores of one query head (q: its row, in the rows' format) against the m (<= 16) rows rk, times
 * scale, into sh[0 .. m): 16 lane-wise products, then one shuffle tree (sum16). attn_item_vec's decode and
 * attn_items_f32's prefill queries both come here, so a query's scores are the same either way. */
INLINE FAST_FP void attn_scores16(const void *q, const void **rk, int64_t m, const int64_t D, const int bf,
                                  float scale, float *sh) {
    const int64_t NC = (D + 31) / 32;
    v16f qa[MAX_NC], qb[MAX_NC], a[16];
    for (int64_t c = 0; c < NC; c++) ld32_row(q, c, D, bf, &qa[c], &qb[c]);
    for (int64_t o = 0; o < 16; o++) {
        v16f x = {0}, ka, kb;
        if (o < m)
            for (int64_t c = 0; c < NC; c++) {
                ld32_row(rk[o], c, D, bf, &ka, &kb);
                x += qa[c] * ka + qb[c] * kb;
            }
        a[o] = x;
    }
    v16f sums = sum16(a) * scale;
    if (m == 16)
        memcpy(sh, &sums, sizeof sums);
    else
        for (int64_t o = 0; o < m; o++) sh[o] = sums[o];
}

/* ah[0 .. D) (padded to 32) += the m (<= 16) rows rv weighted by wh[0 .. m), position by position, in two
 * accumulator sets (even / odd positions: half the FMA dependency chains) added at the end. */
INLINE FAST_FP void attn_values16(float *ah, const float *wh, const void **rv, int64_t m, const int64_t D,
                                  const int bf) {
    const int64_t NC = (D + 31) / 32;
    v16f aa[2][MAX_NC], ab[2][MAX_NC];
    for (int64_t c = 0; c < NC; c++) {
        memcpy(&aa[0][c], ah + 32 * c, sizeof aa[0][c]);
        memcpy(&ab[0][c], ah + 32 * c + 16, sizeof ab[0][c]);
        aa[1][c] = (v16f){0};
        ab[1][c] = (v16f){0};
    }
    int64_t o = 0;
    for (; o + 1 < m; o += 2) {
        const float w0 = wh[o], w1 = wh[o + 1];
        for (int64_t c = 0; c < NC; c++) {
            v16f va, vb;
            ld32_row(rv[o], c, D, bf, &va, &vb);
            aa[0][c] += w0 * va;
            ab[0][c] += w0 * vb;
            ld32_row(rv[o + 1], c, D, bf, &va, &vb);
            aa[1][c] += w1 * va;
            ab[1][c] += w1 * vb;
        }
    }
    if (o < m)
        for (int64_t c = 0; c < NC; c++) {
            v16f va, vb;
            ld32_row(rv[o], c, D, bf, &va, &vb);
            aa[0][c] += wh[o] * va;
            ab[0][c] += wh[o] * vb;
        }
    for (int64_t c = 0; c < NC; c++) {
        v16f sa = aa[0][c] + aa[1][c], sb = ab[0][c] + ab[1][c];
        memcpy(ah + 32 * c, &sa, sizeof sa);
        memcpy(ah + 32 * c + 16, &sb, sizeof sb);
    }
}

/* One (sequence, KV head) item. bf: the rows' format as loaded (bf16 rows in the (even, odd) order, else
 * float32); qbf: q's and out's dtype. conv: the cache holds kv type kt (rows of rb bytes), converted to
 * float32 16 rows at a time into `tile` (in the scratch, L1-sized) just before they are used, each row once
 * for every query head of the group; the dot products and sums are then the float32 path's. Without conv
 * the cache holds the activations' dtype (bf == qbf) and is read in place. */
INLINE FAST_FP void attn_item_vec(int64_t i, int64_t g, const void *q, int64_t q_ts, int64_t q_hs,
                                  const void *kc, const void *vc, int64_t block_size, int64_t kvh,
                                  const int32_t *blocks, int64_t S, int64_t L, void *out, int64_t H,
                                  const int64_t D, float scale, float softcap, float *buf, const int bf,
                                  const int qbf, const int conv, int kt, int64_t rb) {
    /* Attends to the L positions S .. S+L-1 (a sliding window starts past 0); scores are indexed from S. */
    const int64_t group = H / kvh, NC = (D + 31) / 32, DP = NC * 32; /* DP: D padded */
    float *restrict sc = buf;
    float *restrict acc = sc + group * L;
    float *restrict inv = acc + group * DP;
    float *restrict tile = inv + group + 16; /* conv: 16 rows of DP floats, then q as float32 [group, DP] */
    float *restrict qf = tile + 16 * DP;
    const void *rows[2][16];

    if (L <= 0) {
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t j = 0; j < D; j++) st(out, (i * H + g * group + hh) * D + j, 0.0f, qbf);
        return;
    }
    if (conv && qbf != bf) /* bf16 q against float32 rows: q widened once, in the rows' element order */
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t j = 0; j < D; j++) qf[hh * DP + j] = ld(q, i * q_ts + (g * group + hh) * q_hs + j, qbf);
    int64_t m = row_ptrs(rows[0], kc, blocks, S, S + L, block_size, kvh, g, rb);
#if HAVE_DPBF16
    /* bf16 rows of whole 32-element chunks: q . k straight from bf16 by vdpbf16ps (exact products, fp32
     * sums), each K row loaded once for all the query heads sharing it. */
    if (!conv && bf && D % 32 == 0 && group <= ATTN_DP_MAX_GROUP) {
        __m512bh qv[ATTN_DP_MAX_GROUP][MAX_NC];
        for (int64_t hh = 0; hh < group; hh++) {
            const uint16_t *qp = (const uint16_t *)q + i * q_ts + (g * group + hh) * q_hs;
            for (int64_t c = 0; c < NC; c++) qv[hh][c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
        }
        v16f a[ATTN_DP_MAX_GROUP][16];
        for (int64_t p0 = 0, cur = 0; p0 < L; p0 += 16, cur ^= 1) {
            const void **rk = rows[cur];
            const int64_t m_next = row_ptrs(rows[cur ^ 1], kc, blocks, S + p0 + 16, S + L, block_size, kvh, g, rb);
            prefetch_rows_l2(kc, blocks, S + p0 + ATTN_L2_AHEAD, S + L, block_size, kvh, g, rb);
            for (int64_t o = 0; o < 16; o++) {
                if (o >= m) {
                    for (int64_t hh = 0; hh < group; hh++) a[hh][o] = (v16f){0};
                    continue;
                }
                __m512bh kv[MAX_NC];
                for (int64_t c = 0; c < NC; c++)
                    kv[c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)rk[o] + 32 * c);
                for (int64_t hh = 0; hh < group; hh++) {
                    __m512 x = _mm512_setzero_ps();
                    for (int64_t c = 0; c < NC; c++) x = _mm512_dpbf16_ps(x, qv[hh][c], kv[c]);
                    a[hh][o] = (v16f)x;
                }
            }
            for (int64_t hh = 0; hh < group; hh++) {
                v16f sums = sum16(a[hh]) * scale;
                float *sh = sc + hh * L + p0;
                if (m == 16)
                    memcpy(sh, &sums, sizeof sums);
                else
                    for (int64_t o = 0; o < m; o++) sh[o] = sums[o];
            }
            m = m_next;
        }
    } else
#endif
    for (int64_t p0 = 0, cur = 0; p0 < L; p0 += 16, cur ^= 1) {
        const void **rk = rows[cur];
        if (conv) kv_tile(tile, DP, rk, m, D, kt);
        const int64_t m_next = row_ptrs(rows[cur ^ 1], kc, blocks, S + p0 + 16, S + L, block_size, kvh, g, rb);
        prefetch_rows_l2(kc, blocks, S + p0 + ATTN_L2_AHEAD, S + L, block_size, kvh, g, rb);
        for (int64_t hh = 0; hh < group; hh++) {
            const void *qp = conv && qbf != bf ? (const void *)(qf + hh * DP)
                                               : (const void *)off(q, i * q_ts + (g * group + hh) * q_hs, bf);
            attn_scores16(qp, rk, m, D, bf, scale, sc + hh * L + p0);
        }
        m = m_next;
    }
    softmax_rows(sc, inv, group, L, softcap);
    for (int64_t j = 0; j < group * DP; j++) acc[j] = 0.0f;
    m = row_ptrs(rows[0], vc, blocks, S, S + L, block_size, kvh, g, rb);
    for (int64_t p0 = 0, cur = 0; p0 < L; p0 += 16, cur ^= 1) {
        const void **rv = rows[cur];
        if (conv) kv_tile(tile, DP, rv, m, D, kt);
        const int64_t m_next = row_ptrs(rows[cur ^ 1], vc, blocks, S + p0 + 16, S + L, block_size, kvh, g, rb);
        prefetch_rows_l2(vc, blocks, S + p0 + ATTN_L2_AHEAD, S + L, block_size, kvh, g, rb);
        for (int64_t hh = 0; hh < group; hh++) attn_values16(acc + hh * DP, sc + hh * L + p0, rv, m, D, bf);
        m = m_next;
    }
    for (int64_t hh = 0; hh < group; hh++) {
        void *oh = off(out, (i * H + g * group + hh) * D, qbf);
        for (int64_t c = 0; c < NC; c++) {
            v16f aa, ab;
            memcpy(&aa, acc + hh * DP + 32 * c, sizeof aa);
            memcpy(&ab, acc + hh * DP + 32 * c + 16, sizeof ab);
            st32_row(oh, c, D, aa, ab, inv[hh], bf, qbf);
        }
    }
}

#if defined(__AVX2__) && !defined(__AVX512F__)
#include <immintrin.h>
#define ATTN_AVX2 1
/* float32 items on AVX2 (8 lanes): the 16-lane vector code above compiles into shuffles there. Scores 8
 * positions at a time (8 dot products, then one horizontal-add tree), values per head in chunks of 64
 * elements held in 8 registers. Same arithmetic as the reference up to summation order. D % 8 == 0. */
INLINE __m256 attn_hsum8(const __m256 *a) {
    const __m256 h01 = _mm256_hadd_ps(a[0], a[1]), h23 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 h45 = _mm256_hadd_ps(a[4], a[5]), h67 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
    /* lo = [a0..a3 of the low halves | a0..a3 of the high halves], hi likewise for a4..a7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

/* The first m (1..8) lanes of s to dst: a whole chunk in one store, not through a copy of variable length
 * (gcc makes that a slow rep movsq). */
INLINE void store_scores8(float *dst, __m256 s, int64_t m) {
    if (m == 8) {
        _mm256_storeu_ps(dst, s);
    } else {
        float t[8];
        _mm256_storeu_ps(t, s);
        for (int64_t o = 0; o < m; o++) dst[o] = t[o];
    }
}

/* oh[c] = inv * sum over positions p of wh[p] * V[p][c0 + c], for nc 8-float chunks (nc <= 8). */
INLINE void f32_values_avx2(float *oh, const float *vc, const int32_t *blocks, int64_t S, int64_t L,
                            int64_t block_size, int64_t kvh, int64_t g, int64_t D, const float *wh, float inv,
                            int64_t c0, int64_t nc) {
    __m256 acc[8];
    for (int64_t c = 0; c < nc; c++) acc[c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < L; p++) {
        const float *row = (const float *)kv_row(vc, blocks, S + p, block_size, kvh, g, D * 4) + 8 * c0;
        const __m256 w = _mm256_set1_ps(wh[p]);
        for (int64_t c = 0; c < nc; c++) acc[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(row + 8 * c), acc[c]);
    }
    const __m256 vi = _mm256_set1_ps(inv);
    for (int64_t c = 0; c < nc; c++) _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(acc[c], vi));
}

/* The scores of one query head qh against 8 rows (past the end: a zero row), times scale, into sh[0 .. m):
 * 8 independent chains of FMAs over the NC 8-float chunks, then one horizontal-add tree. Shared by the
 * decode item and the prefill rows (attn_items_f32_avx2). */
INLINE FAST_FP void attn_scores8(const float *qh, const float *const *rows, int64_t NC, float scale, float *sh,
                                 int64_t m) {
    __m256 acc[8];
    for (int o = 0; o < 8; o++) acc[o] = _mm256_setzero_ps();
    for (int64_t c = 0; c < NC; c++) { /* 8 independent chains */
        const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
        for (int o = 0; o < 8; o++) acc[o] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[o] + 8 * c), acc[o]);
    }
    store_scores8(sh, _mm256_mul_ps(attn_hsum8(acc), _mm256_set1_ps(scale)), m);
}

static FAST_FP __attribute__((noinline)) void attn_item_f32_avx2(int64_t i, int64_t g, const float *q, int64_t q_ts,
                                                                 int64_t q_hs, const float *kc, const float *vc,
                                                                 int64_t block_size, int64_t kvh,
                                                                 const int32_t *blocks, int64_t S, int64_t L, float *out,
                                                                 int64_t H, const int64_t D, float scale,
                                                                 float softcap, float *buf) {
    const int64_t group = H / kvh, NC = D / 8;
    float *restrict sc = buf;
    float *restrict inv = sc + group * L;
    if (L <= 0) {
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t j = 0; j < D; j++) out[(i * H + g * group + hh) * D + j] = 0.0f;
        return;
    }
    const float *rows[8];
    float zero[512] __attribute__((aligned(32))); /* the rows past L of a last partial chunk */
    if (L % 8) memset(zero, 0, sizeof(float) * (size_t)D);
    for (int64_t p0 = 0; p0 < L; p0 += 8) {
        const int64_t m = L - p0 < 8 ? L - p0 : 8;
        for (int64_t o = 0; o < 8; o++)
            rows[o] = o < m ? (const float *)kv_row(kc, blocks, S + p0 + o, block_size, kvh, g, D * 4) : zero;
        for (int64_t p = p0 + 8; p < p0 + 16 && p < L; p++) { /* the next rows into L1 */
            const char *r = (const char *)kv_row(kc, blocks, S + p, block_size, kvh, g, D * 4);
            for (int64_t x = 0; x < D * 4; x += 64) _mm_prefetch(r + x, _MM_HINT_T0);
        }
        for (int64_t hh = 0; hh < group; hh++)
            attn_scores8(q + i * q_ts + (g * group + hh) * q_hs, rows, NC, scale, sc + hh * L + p0, m);
    }
    softmax_rows(sc, inv, group, L, softcap);
    for (int64_t hh = 0; hh < group; hh++) {
        const float *wh = sc + hh * L;
        float *oh = out + (i * H + g * group + hh) * D;
        for (int64_t c0 = 0; c0 < NC; c0 += 8) {
            /* 8 chunks held in registers; a variable count would put them in memory */
            if (NC - c0 >= 8)
                f32_values_avx2(oh + 8 * c0, vc, blocks, S, L, block_size, kvh, g, D, wh, inv[hh], c0, 8);
            else
                f32_values_avx2(oh + 8 * c0, vc, blocks, S, L, block_size, kvh, g, D, wh, inv[hh], c0, NC - c0);
        }
    }
}
/* The rows of positions S + p0 .. S + p0 + m - 1 (KV head g) as float32 rows in rows[0 .. m): the cache's own
 * (float32, kt KV_F32) or their kv_tile conversion into tile [8, D] (the decode's conversion, attn_item_conv_avx2);
 * rows[m .. 8) point at zeros. The next 8 rows are prefetched into L1. */
INLINE void rows8_avx2(const float **rows, float *tile, const float *zero, const void *cache, const int32_t *blocks,
                       int64_t S, int64_t p0, int64_t m, int64_t end, int64_t block_size, int64_t kvh, int64_t g,
                       int64_t D, int kt, int64_t rb) {
    const void *raw[8];
    for (int64_t o = 0; o < m; o++) raw[o] = kv_row(cache, blocks, S + p0 + o, block_size, kvh, g, rb);
    for (int64_t p = p0 + 8; p < p0 + 16 && p < end; p++) {
        const char *r = (const char *)kv_row(cache, blocks, S + p, block_size, kvh, g, rb);
        for (int64_t x = 0; x < rb; x += 64) _mm_prefetch(r + x, _MM_HINT_T0);
    }
    if (kt != KV_F32) kv_tile(tile, D, raw, m, D, kt);
    for (int64_t o = 0; o < 8; o++) rows[o] = o < m ? (const float *)raw[o] : zero;
}

/* Prefill rows that share their keys on AVX2 (attn_items_f32's contract; rows i0 .. i0+R-1 of lengths L0 + r,
 * first position S, a cache of kv type kt in rows of rb bytes): per query the decode item's arithmetic exactly
 * (attn_item_f32_avx2's over a float32 cache, attn_item_conv_avx2's over the others, which is the same over the
 * converted rows: attn_scores8 per 8 positions; each value chunk one FMA chain over the positions in order, here
 * held in memory between groups of 8 positions, which keeps its bits), with each group of 8 K or V rows fetched,
 * and converted, once for the R queries. */
static FAST_FP __attribute__((noinline)) void attn_items_f32_avx2(int64_t i0, int64_t R, int64_t g, const float *q,
                                                                  int64_t q_ts, int64_t q_hs, const void *kc,
                                                                  const void *vc, int64_t block_size, int64_t kvh,
                                                                  const int32_t *blocks, int64_t S, int64_t L0,
                                                                  float *out, int64_t H, const int64_t D,
                                                                  float scale, float softcap, float *buf, int kt,
                                                                  int64_t rb) {
    const int64_t group = H / kvh, NC = D / 8, Lmax = L0 + R - 1;
    float *restrict sc = buf;                    /* query r: [group, L0 + r] at r * group * Lmax */
    float *restrict acc = sc + R * group * Lmax; /* [R, group, D] */
    float *restrict inv = acc + R * group * D;   /* [R, group] */
    float *restrict tile = inv + R * group + 16; /* kt != KV_F32: 8 converted rows [8, D] */
    const float *rows[8];
    float zero[512] __attribute__((aligned(32)));
    memset(zero, 0, sizeof(float) * (size_t)D);
    for (int64_t p0 = 0; p0 < Lmax; p0 += 8) {
        const int64_t m = Lmax - p0 < 8 ? Lmax - p0 : 8;
        rows8_avx2(rows, tile, zero, kc, blocks, S, p0, m, Lmax, block_size, kvh, g, D, kt, rb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t L = L0 + r, mr = L - p0 < m ? L - p0 : m;
            if (mr <= 0) continue;
            const float *rr[8]; /* the query's rows: zero past its own end, as its decode sees them */
            for (int64_t o = 0; o < 8; o++) rr[o] = o < mr ? rows[o] : zero;
            for (int64_t hh = 0; hh < group; hh++)
                attn_scores8(q + (i0 + r) * q_ts + (g * group + hh) * q_hs, rr, NC, scale,
                             sc + r * group * Lmax + hh * L + p0, mr);
        }
    }
    for (int64_t r = 0; r < R; r++) softmax_rows(sc + r * group * Lmax, inv + r * group, group, L0 + r, softcap);
    for (int64_t j = 0; j < R * group * D; j++) acc[j] = 0.0f;
    for (int64_t p0 = 0; p0 < Lmax; p0 += 8) {
        const int64_t m = Lmax - p0 < 8 ? Lmax - p0 : 8;
        rows8_avx2(rows, tile, zero, vc, blocks, S, p0, m, Lmax, block_size, kvh, g, D, kt, rb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t L = L0 + r, mr = L - p0 < m ? L - p0 : m;
            for (int64_t hh = 0; hh < group; hh++) {
                const float *wh = sc + r * group * Lmax + hh * L + p0;
                float *ah = acc + (r * group + hh) * D;
                for (int64_t c0 = 0; c0 < NC; c0 += 8) {
                    const int64_t nc = NC - c0 < 8 ? NC - c0 : 8;
                    __m256 a[8];
                    for (int64_t c = 0; c < nc; c++) a[c] = _mm256_loadu_ps(ah + 8 * (c0 + c));
                    for (int64_t o = 0; o < mr; o++) {
                        const __m256 w = _mm256_set1_ps(wh[o]);
                        for (int64_t c = 0; c < nc; c++)
                            a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(rows[o] + 8 * (c0 + c)), a[c]);
                    }
                    for (int64_t c = 0; c < nc; c++) _mm256_storeu_ps(ah + 8 * (c0 + c), a[c]);
                }
            }
        }
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t hh = 0; hh < group; hh++) {
            const __m256 vi = _mm256_set1_ps(inv[r * group + hh]);
            float *oh = out + ((i0 + r) * H + g * group + hh) * D;
            const float *ah = acc + (r * group + hh) * D;
            for (int64_t c = 0; c < NC; c++) _mm256_storeu_ps(oh + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(ah + 8 * c), vi));
        }
}

#define ATTN_AVX2_ITEM(D)                                                                                    \
    attn_item_f32_avx2(i, g, (const float *)q, q_ts, q_hs, (const float *)kc, (const float *)vc, block_size, kvh, \
                       blocks, S, L, (float *)out, H, D, scale, softcap, buf);

/* acc[c] += sum over the tile's m rows o of w[o] * tile[o][c], for the nc 8-float chunks c (nc <= 8). */
INLINE void conv_values_avx2(float *ah, const float *tile, const float *wh, int64_t m, int64_t D, int64_t nc) {
    __m256 a[8];
    for (int64_t c = 0; c < nc; c++) a[c] = _mm256_loadu_ps(ah + 8 * c);
    for (int64_t o = 0; o < m; o++) {
        const __m256 w = _mm256_set1_ps(wh[o]);
        for (int64_t c = 0; c < nc; c++) a[c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(tile + o * D + 8 * c), a[c]);
    }
    for (int64_t c = 0; c < nc; c++) _mm256_storeu_ps(ah + 8 * c, a[c]);
}

/* float32 q against a cache of another kv type (rows of rb bytes) on AVX2: each 8 rows converted once
 * into an 8 x D float32 tile (kv_tile) and used by every query head of the group; scores as
 * attn_item_f32_avx2's, values accumulated per head over the tile into acc [group, D] (in the scratch). */
static FAST_FP __attribute__((noinline)) void attn_item_conv_avx2(int64_t i, int64_t g, const float *q, int64_t q_ts,
                                                                  int64_t q_hs, const void *kc, const void *vc,
                                                                  int64_t block_size, int64_t kvh,
                                                                  const int32_t *blocks, int64_t S, int64_t L,
                                                                  float *out, int64_t H, const int64_t D, float scale,
                                                                  float softcap, float *buf, int kt, int64_t rb) {
    const int64_t group = H / kvh, NC = D / 8;
    float *restrict sc = buf;
    float *restrict inv = sc + group * L;
    float *restrict acc = inv + group + 16;
    float *restrict tile = acc + group * D + 16;
    if (L <= 0) {
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t j = 0; j < D; j++) out[(i * H + g * group + hh) * D + j] = 0.0f;
        return;
    }
    const void *rows[8];
    for (int pass = 0; pass < 2; pass++) {
        const void *cache = pass ? vc : kc;
        if (pass) {
            softmax_rows(sc, inv, group, L, softcap);
            memset(acc, 0, sizeof(float) * (size_t)(group * D));
        }
        for (int64_t p0 = 0; p0 < L; p0 += 8) {
            const int64_t m = L - p0 < 8 ? L - p0 : 8;
            for (int64_t o = 0; o < m; o++) rows[o] = kv_row(cache, blocks, S + p0 + o, block_size, kvh, g, rb);
            for (int64_t p = p0 + 8; p < p0 + 16 && p < L; p++) { /* the next rows into L1 */
                const char *r = (const char *)kv_row(cache, blocks, S + p, block_size, kvh, g, rb);
                for (int64_t x = 0; x < rb; x += 64) _mm_prefetch(r + x, _MM_HINT_T0);
            }
            kv_tile(tile, D, rows, m, D, kt);
            if (m < 8) memset(tile + m * D, 0, sizeof(float) * (size_t)((8 - m) * D));
            for (int64_t hh = 0; hh < group; hh++) {
                if (!pass) {
                    const float *qh = q + i * q_ts + (g * group + hh) * q_hs;
                    __m256 a[8];
                    for (int o = 0; o < 8; o++) a[o] = _mm256_setzero_ps();
                    for (int64_t c = 0; c < NC; c++) {
                        const __m256 qc = _mm256_loadu_ps(qh + 8 * c);
                        for (int o = 0; o < 8; o++) a[o] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(tile + o * D + 8 * c), a[o]);
                    }
                    store_scores8(sc + hh * L + p0, _mm256_mul_ps(attn_hsum8(a), _mm256_set1_ps(scale)), m);
                    continue;
                }
                const float *wh = sc + hh * L + p0;
                float *ah = acc + hh * D;
                for (int64_t c0 = 0; c0 < NC; c0 += 8) {
                    /* 8 chunks held in registers; a variable count would put them in memory (and copy them
                     * there with rep movsq) */
                    if (NC - c0 >= 8)
                        conv_values_avx2(ah + 8 * c0, tile + 8 * c0, wh, m, D, 8);
                    else
                        conv_values_avx2(ah + 8 * c0, tile + 8 * c0, wh, m, D, NC - c0);
                }
            }
        }
    }
    for (int64_t hh = 0; hh < group; hh++)
        for (int64_t j = 0; j < D; j++) out[(i * H + g * group + hh) * D + j] = acc[hh * D + j] * inv[hh];
}
#define ATTN_AVX2_CONV_ITEM(D)                                                                               \
    attn_item_conv_avx2(i, g, (const float *)q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, (float *)out, H, \
                        D, scale, softcap, buf, kt, rb);
#else
#define ATTN_AVX2 0
#define ATTN_AVX2_ITEM(D) (void)0;
#define ATTN_AVX2_CONV_ITEM(D) (void)0;
#endif

/* The first position a row of length L sees: L - window under a sliding window shorter than L, else 0. */
INLINE int64_t window_start(int64_t L, int64_t window) { return window > 0 && L > window ? L - window : 0; }

/* Which rows the AMX tiles take (attn_items_amx): D a multiple of 32 (whole K steps), the group within a tile's
 * 16 rows. */
INLINE int attn_amx_fits(int64_t D, int64_t group) { return D % 32 == 0 && D <= 32 * MAX_NC && group <= 16; }

#define ATTN_AMX_ROWS 64 /* rows an attn_items_amx item: 4 tiles of 16 */

/* The K and V rows of the 32 positions S + p0 .. (up to S + Lmax) of KV head g (row_ptrs: past the end the
 * pointers are not set), and the rows ATTN_L2_AHEAD positions on prefetched into L2: a 32-position block of
 * the tiles' and vdpbf16ps's items. */
INLINE void attn_block_rows(const void **kr, const void **vr, const void *kc, const void *vc, const int32_t *blocks,
                            int64_t S, int64_t p0, int64_t Lmax, int64_t block_size, int64_t kvh, int64_t g,
                            int64_t rb) {
    row_ptrs(kr, kc, blocks, S + p0, S + Lmax, block_size, kvh, g, rb);
    row_ptrs(kr + 16, kc, blocks, S + p0 + 16, S + Lmax, block_size, kvh, g, rb);
    row_ptrs(vr, vc, blocks, S + p0, S + Lmax, block_size, kvh, g, rb);
    row_ptrs(vr + 16, vc, blocks, S + p0 + 16, S + Lmax, block_size, kvh, g, rb);
    for (int64_t a = 0; a < 32; a += 16) {
        prefetch_rows_l2(kc, blocks, S + p0 + ATTN_L2_AHEAD + a, S + Lmax, block_size, kvh, g, rb);
        prefetch_rows_l2(vc, blocks, S + p0 + ATTN_L2_AHEAD + a, S + Lmax, block_size, kvh, g, rb);
    }
}

#if HAVE_QGEMM /* AVX-512 F/BW and BF16: the avx512 and amx builds */
/* exp_f32's Cody-Waite reduction and polynomial in 16 lanes: e^xc = the result x 2^n (*n: xc log2(e) rounded). */
INLINE __m512 exp16_reduced(__m512 xc, __m512 *n) {
    *n = _mm512_sub_ps(_mm512_fmadd_ps(xc, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(12582912.0f)),
                       _mm512_set1_ps(12582912.0f));
    __m512 r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(0.693359375f), xc);
    r = _mm512_fnmadd_ps(*n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    return _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
}

/* e^x in 16 lanes, exp_f32's recipe (its clamps, Cody-Waite reduction and polynomial, with fused multiply-adds,
 * the power of two in two halves): the tiles' softmax, a function of x alone. */
INLINE __m512 exp16_ps(__m512 x) {
    const __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.8f));
    __m512 n;
    __m512 y = exp16_reduced(xc, &n);
    const __m512i ni = _mm512_cvtps_epi32(n), n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    const __m512i b127 = _mm512_set1_epi32(127);
    y = _mm512_mul_ps(_mm512_mul_ps(y, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, b127), 23))),
                      _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, b127), 23)));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(88.72283935546875f), _CMP_GT_OQ), y,
                             _mm512_set1_ps(INFINITY));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-103.972084f), _CMP_LT_OQ), y, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__linux__)
#define ATTN_AMX 1
/* AMX-BF16 tiles for a bfloat16 cache under float32 activations (the amx build): both products of attention in
 * TDPBF16PS, q and the softmax weights rounded to bfloat16 (round to nearest even), fp32 accumulation.
 * llama.cpp's CPU attention likewise rounds q to the cache's type; the cache's own values are used as they are,
 * except that the tiles read bfloat16 subnormals (below ~1.2e-38) as zero.
 *
 * One item: up to ATTN_AMX_ROWS rows (R queries of one sequence x the group's query heads sharing KV head g;
 * R = 1 for a decode), 16 to a tile. What keeps a token's attention the same in any batch: every output element
 * comes out of the same sequence of tile products (the same positions per tile, the same K-dimension order)
 * whatever the other rows of its tile are or how many there are, and the online softmax between them is a
 * function of the row's own scores, block by block from its first position (attn_items_amx). Per 32 positions:
 * the staged K rows (two 16 x D halves) are the A tiles and q^T in pairs the B tile, each 16 x 16 score tile
 * transposed into the block's scores (x scale); then the weights (16 rows x 32, bf16) are the A tile and the V
 * rows interleaved in pairs of positions (the B tile's VNNI layout) the B tiles, into the accumulators (16
 * outputs a tile, four tiles at a time). Positions past a row's length weigh 0; past the item's longest row the
 * staged rows are zeros. */

/* Lanes of a 16 x 16 float matrix (rows r[0..15]) transposed in place. */
INLINE void tr16x16_ps(__m512 *r) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int a = 0; a < 4; a++) { /* rows 4a .. 4a + 3: r[4a + e], 128-bit lane L, is element 4L + e of them */
        const __m512d t0 = _mm512_castps_pd(t[4 * a]), t1 = _mm512_castps_pd(t[4 * a + 1]);
        const __m512d t2 = _mm512_castps_pd(t[4 * a + 2]), t3 = _mm512_castps_pd(t[4 * a + 3]);
        r[4 * a] = _mm512_castpd_ps(_mm512_unpacklo_pd(t0, t2));
        r[4 * a + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(t0, t2));
        r[4 * a + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(t1, t3));
        r[4 * a + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(t1, t3));
    }
    for (int e = 0; e < 4; e++) {
        const __m512 u0 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0x88), u1 = _mm512_shuffle_f32x4(r[e], r[4 + e], 0xdd);
        const __m512 u2 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0x88);
        const __m512 u3 = _mm512_shuffle_f32x4(r[8 + e], r[12 + e], 0xdd);
        t[e] = _mm512_shuffle_f32x4(u0, u2, 0x88);      /* element e */
        t[4 + e] = _mm512_shuffle_f32x4(u1, u3, 0x88);  /* 4 + e */
        t[8 + e] = _mm512_shuffle_f32x4(u0, u2, 0xdd);  /* 8 + e */
        t[12 + e] = _mm512_shuffle_f32x4(u1, u3, 0xdd); /* 12 + e */
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* Rows i0 .. i0+R-1 (lengths L0 + r, first position S; R * group <= ATTN_AMX_ROWS) for KV head g over a bfloat16
 * cache. Rows go through the tiles 16 at a time ("row groups"); each K or V row is staged once for all of them.
 * One pass over the positions, 32 at a time, with the softmax online (each row's running maximum m, its sum of
 * weights in 16 lanes l and its accumulators C, rescaled by e^(m_old - m_new) when the maximum grows): the
 * scores of a block stay in L1, where a whole row of scores was written, read three times and converted. Every
 * step is a function of the row's own scores, in the same blocks from its first position, so a decode (one
 * query) and a prompt token (beside others) run the same operations. */
static __attribute__((noinline)) void attn_items_amx(int64_t i0, int64_t R, int64_t g, const float *q, int64_t q_ts,
                                                     int64_t q_hs, const void *kc, const void *vc, int64_t block_size,
                                                     int64_t kvh, const int32_t *blocks, int64_t S, int64_t L0,
                                                     float *out, int64_t H, const int64_t D, float scale,
                                                     float softcap, float *buf) {
    const int64_t group = H / kvh, N = R * group, nrg = (N + 15) / 16, Lmax = L0 + R - 1;
    const int64_t ks = D / 32, dt = D / 16, rb = D * 2;
    float *restrict ct = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63); /* 4 tiles of 16 x 16 */
    float *restrict sb = ct + 1024;                         /* a block's scores [nrg * 16][32] */
    float *restrict mx = sb + ATTN_AMX_ROWS * 32;           /* running maxima [N] */
    float *restrict ls = mx + ATTN_AMX_ROWS;                /* running sums [N][16 lanes] */
    float *restrict cacc = ls + ATTN_AMX_ROWS * 16;         /* accumulators [nrg][dt][16 x 16] */
    uint16_t *restrict qt = (uint16_t *)(cacc + nrg * dt * 256); /* [nrg][ks][16 pairs][16 rows][2] */
    uint16_t *restrict kst = qt + nrg * ks * 512;           /* 32 staged K rows [32][D] */
    uint16_t *restrict vst = kst + 32 * D;                  /* 16 V pairs [16][D][2] */
    uint16_t *restrict pb = vst + 32 * D;                   /* a block's weights [nrg * 16][32] */
    if (Lmax <= 0) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < D; j++) out[((i0 + n / group) * H + g * group + n % group) * D + j] = 0.0f;
        return;
    }
    amx_tilecfg cfg = amx_cfg_16x64(8);
    _tile_loadconfig(&cfg);
    /* q^T in pairs: row n = 16 rg + i of row group rg at qt[rg][s][j][i] = (q_n[32 s + 2 j], q_n[32 s + 2 j + 1]);
     * rows past N are zero, as are their weights */
    memset(qt, 0, sizeof(uint16_t) * (size_t)(nrg * ks * 512));
    memset(pb, 0, sizeof(uint16_t) * (size_t)(nrg * 16 * 32));
    memset(cacc, 0, sizeof(float) * (size_t)(nrg * dt * 256));
    memset(ls, 0, sizeof(float) * (size_t)(N * 16));
    for (int64_t n = 0; n < N; n++) {
        const float *qn = q + (i0 + n / group) * q_ts + (g * group + n % group) * q_hs;
        uint16_t *qg = qt + (n / 16) * ks * 512 + (n % 16) * 2;
        for (int64_t e = 0; e < D; e++) qg[(e / 32) * 512 + ((e % 32) / 2) * 32 + e % 2] = f2bf(qn[e]);
        mx[n] = -INFINITY;
    }
    const __m512 vs = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    for (int64_t p0 = 0; p0 < Lmax; p0 += 32) {
        const int64_t m = Lmax - p0 < 32 ? Lmax - p0 : 32;
        const void *kr[32], *vr[32];
        attn_block_rows(kr, vr, kc, vc, blocks, S, p0, Lmax, block_size, kvh, g, rb);
        /* K rows staged (zero past Lmax); V rows interleaved in pairs of positions: vst[k][2 d + e] */
        for (int64_t o = 0; o < 32; o++)
            for (int64_t c = 0; c < ks; c++)
                _mm512_store_si512(kst + o * D + 32 * c,
                                   o < m ? _mm512_loadu_si512((const uint16_t *)kr[o] + 32 * c) : _mm512_setzero_si512());
        for (int64_t k = 0; k < 16; k++)
            for (int64_t c = 0; c < ks; c++) {
                const __m512i a = 2 * k < m ? _mm512_loadu_si512((const uint16_t *)vr[2 * k] + 32 * c)
                                            : _mm512_setzero_si512();
                const __m512i b = 2 * k + 1 < m ? _mm512_loadu_si512((const uint16_t *)vr[2 * k + 1] + 32 * c)
                                                : _mm512_setzero_si512();
                _mm512_store_si512(vst + k * 2 * D + 64 * c, _mm512_permutex2var_epi16(a, ilo, b));
                _mm512_store_si512(vst + k * 2 * D + 64 * c + 32, _mm512_permutex2var_epi16(a, ihi, b));
            }
        /* scores: sb[n][h * 16 + o] = row n's score at position p0 + 16 h + o; two row groups at a time, so
         * that four independent tiles accumulate (C: tmm0-3, K halves: tmm4-5, q^T: tmm6-7) */
        for (int64_t rg = 0; rg < nrg; rg += 2) {
            const int two = rg + 1 < nrg;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t s = 0; s < ks; s++) {
                _tile_loadd(4, kst + 32 * s, rb);
                _tile_loadd(5, kst + 16 * D + 32 * s, rb);
                _tile_loadd(6, qt + (rg * ks + s) * 512, 64);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 5, 6);
                if (two) {
                    _tile_loadd(7, qt + ((rg + 1) * ks + s) * 512, 64);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_dpbf16ps(3, 5, 7);
                }
            }
            _tile_stored(0, ct, 64);
            _tile_stored(1, ct + 256, 64);
            if (two) {
                _tile_stored(2, ct + 512, 64);
                _tile_stored(3, ct + 768, 64);
            }
            for (int64_t u = 0; u < (two ? 4 : 2); u++) { /* tile u: row group rg + u / 2, half u % 2 */
                __m512 r16[16];
                for (int o = 0; o < 16; o++) r16[o] = _mm512_load_ps(ct + 256 * u + 16 * o);
                tr16x16_ps(r16);
                float *dst = sb + (16 * (rg + u / 2)) * 32 + 16 * (u % 2);
                for (int i = 0; i < 16; i++) _mm512_store_ps(dst + 32 * i, _mm512_mul_ps(r16[i], vs));
            }
        }
        /* the online softmax, and the weights in bfloat16 */
        for (int64_t n = 0; n < N; n++) {
            const int64_t L = L0 + n / group, valid = L - p0 < 0 ? 0 : L - p0 > 32 ? 32 : L - p0;
            uint16_t *pn = pb + n * 32;
            if (valid == 0) {
                _mm512_storeu_si512(pn, _mm512_setzero_si512());
                continue;
            }
            __m512 s0 = _mm512_load_ps(sb + n * 32), s1 = _mm512_load_ps(sb + n * 32 + 16);
            if (softcap > 0.0f) { /* softcap * tanh(s / softcap), tanh as 1 - 2 / (e^2x + 1) */
                const __m512 c = _mm512_set1_ps(softcap), c2 = _mm512_set1_ps(2.0f / softcap), one = _mm512_set1_ps(1.0f);
                s0 = _mm512_mul_ps(c, _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                                       _mm512_add_ps(exp16_ps(_mm512_mul_ps(s0, c2)), one))));
                s1 = _mm512_mul_ps(c, _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f),
                                                                       _mm512_add_ps(exp16_ps(_mm512_mul_ps(s1, c2)), one))));
            }
            const __mmask16 k0 = (__mmask16)(valid >= 16 ? 0xFFFFu : (1u << valid) - 1u);
            const __mmask16 k1 = (__mmask16)(valid >= 32 ? 0xFFFFu : valid <= 16 ? 0u : (1u << (valid - 16)) - 1u);
            s0 = _mm512_mask_blend_ps(k0, ninf, s0);
            s1 = _mm512_mask_blend_ps(k1, ninf, s1);
            const float bm = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1)), mo = mx[n];
            const float mn = bm > mo ? bm : mo;
            if (mn != mo) { /* rescale what the row holds (nothing before its first block) */
                const float alpha = exp_f32(mo - mn);
                const __m512 va = _mm512_set1_ps(alpha);
                _mm512_storeu_ps(ls + n * 16, _mm512_mul_ps(_mm512_loadu_ps(ls + n * 16), va));
                float *cn = cacc + (n / 16) * dt * 256 + (n % 16) * 16;
                for (int64_t t = 0; t < dt; t++) _mm512_store_ps(cn + t * 256, _mm512_mul_ps(_mm512_load_ps(cn + t * 256), va));
                mx[n] = mn;
            }
            const __m512 vm = _mm512_set1_ps(mn);
            const __m512 e0 = exp16_ps(_mm512_sub_ps(s0, vm)), e1 = exp16_ps(_mm512_sub_ps(s1, vm));
            _mm512_storeu_ps(ls + n * 16, _mm512_add_ps(_mm512_loadu_ps(ls + n * 16), _mm512_add_ps(e0, e1)));
            _mm512_storeu_si512(pn, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
        }
        /* values: each row group's accumulators += its weights (A: tmm4) x the V pairs (B: tmm5-7), four
         * accumulator tiles (tmm0-3) at a time */
        for (int64_t rg = 0; rg < nrg; rg++) {
            _tile_loadd(4, pb + rg * 16 * 32, 64);
            for (int64_t t = 0; t < dt; t += 4) {
                float *c = cacc + (rg * dt + t) * 256;
                const int64_t w = dt - t < 4 ? dt - t : 4; /* 2 or 4 (D % 32 == 0) */
                _tile_loadd(0, c, 64);
                _tile_loadd(1, c + 256, 64);
                _tile_loadd(5, vst + 32 * t, D * 4);
                _tile_loadd(6, vst + 32 * t + 32, D * 4);
                _tile_dpbf16ps(0, 4, 5);
                _tile_dpbf16ps(1, 4, 6);
                if (w == 4) {
                    _tile_loadd(2, c + 512, 64);
                    _tile_loadd(3, c + 768, 64);
                    _tile_loadd(7, vst + 32 * t + 64, D * 4);
                    _tile_dpbf16ps(2, 4, 7);
                    _tile_loadd(5, vst + 32 * t + 96, D * 4);
                    _tile_dpbf16ps(3, 4, 5);
                }
                _tile_stored(0, c, 64);
                _tile_stored(1, c + 256, 64);
                if (w == 4) {
                    _tile_stored(2, c + 512, 64);
                    _tile_stored(3, c + 768, 64);
                }
            }
        }
    }
    _tile_release();
    for (int64_t n = 0; n < N; n++) {
        float lanes[16];
        memcpy(lanes, ls + n * 16, sizeof lanes);
        for (int w = 8; w >= 1; w /= 2)
            for (int k = 0; k < w; k++) lanes[k] += lanes[k + w];
        const __m512 vi = _mm512_set1_ps(1.0f / lanes[0]);
        float *on = out + ((i0 + n / group) * H + g * group + n % group) * D;
        const float *cn = cacc + (n / 16) * dt * 256 + (n % 16) * 16;
        for (int64_t t = 0; t < dt; t++) _mm512_storeu_ps(on + 16 * t, _mm512_mul_ps(_mm512_load_ps(cn + t * 256), vi));
    }
}
/* scratch floats attn_items_amx needs (its scores stay in a block's buffer): alignment, the score tile, a block's
 * scores, the maxima and sums, the accumulators, q^T, the staged K and V rows and a block's weights */
#define ATTN_AMX_SCRATCH(D)                                                                                 \
    (16 + 1024 + ATTN_AMX_ROWS * (32 + 1 + 16) + 4 * ((D) / 16) * 256 + 4 * ((D) / 32) * 256 + 32 * (D) +   \
     ATTN_AMX_ROWS * 16 + 64)
#else
#define ATTN_AMX 0
#define ATTN_AMX_SCRATCH(D) 0
#endif

#if HAVE_QGEMM
#define ATTN_DP 1
/* The same recipe as the tiles' (attn_items_amx) with AVX512-BF16's vdpbf16ps in place of TDPBF16PS, for CPUs
 * with AVX512-BF16 and no AMX (AMD Zen 4/5, Intel Cooper Lake; the avx512 build) and the amx build where Linux
 * does not grant the tiles: a bfloat16 cache under float32 activations, q and the softmax weights rounded to
 * bfloat16, exact products summed in float32. vdpbf16ps adds two products to each of 16 float32 lanes, so each
 * product of attention keeps one of its outputs in a lane:
 *  - scores: a lane per query row (16 rows, a "row group"), its two bfloat16 of q at one pair of head elements
 *    (q^T in pairs: the tiles' B layout); a K row's same pair broadcast to every lane; 16 pairs x ks steps per
 *    position. The scores of 32 positions land as 32 vectors of the row group's 16 rows.
 *  - the online softmax lane-wise on those vectors (a row's running maximum, sum and rescale in its lane),
 *    each pair of positions' weights packed into one 32-bit word a row (bf16 of the even, then the odd);
 *  - values: a lane per head element, a row's pair of weights broadcast against 16 elements of two V rows
 *    interleaved in pairs of positions (the tiles' VNNI layout); the accumulators of a few rows in registers.
 * Every output element is computed in its own lane from its row's own q, scores and weights, in the same
 * positions' blocks from the row's first position, whatever the other rows of its item are: a decode and a
 * prompt token (beside up to ATTN_AMX_ROWS rows) run the same operations, so a token's attention is the same
 * alone, batched, chunked or decoded. Positions past a row's length weigh 0 (past the item's longest row, a
 * row of zeros is read). vdpbf16ps reads bfloat16 subnormals as zero and rounds like TDPBF16PS; the order of
 * its two products within a lane is the instruction's, fixed on a given CPU. */
static const uint16_t attn_zero_row[32 * MAX_NC] __attribute__((aligned(64)));

/* e^x for x <= 0 (a score less its row's maximum) or NaN: exp16_ps's reduction and polynomial, the power of
 * two in one step (x >= -87: 2^n a normal float), 0 below -87 (e^-87 ~ 1.6e-38, a bfloat16 weight of 0 anyway,
 * and -inf), NaN kept. */
INLINE __m512 exp16_le0_ps(__m512 x) {
    const __m512 xc = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n;
    __m512 y = exp16_reduced(xc, &n);
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    y = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), y, _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), y, x);
}

/* A score vector (16 rows' q . K at position o of the block) finished: x scale, soft-capped (softcap *
 * tanh(s / softcap), tanh as 1 - 2 / (e^2x + 1)), and -inf in the lanes whose row is shorter than o + 1 (vlen:
 * each lane's length from the block's first position) when `masked`. */
INLINE __m512 attn_dp_score(__m512 a, __m512 vs, float softcap, const int masked, __m512i vlen, int64_t o) {
    __m512 s = _mm512_mul_ps(a, vs);
    if (softcap > 0.0f) {
        const __m512 one = _mm512_set1_ps(1.0f);
        const __m512 e = exp16_ps(_mm512_mul_ps(s, _mm512_set1_ps(2.0f / softcap)));
        s = _mm512_mul_ps(_mm512_set1_ps(softcap), _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one))));
    }
    if (masked)
        s = _mm512_mask_blend_ps(_mm512_cmpgt_epi32_mask(vlen, _mm512_set1_epi32((int)o)), _mm512_set1_ps(-INFINITY), s);
    return s;
}

/* The scores of `two` (1 or 2) row groups (q^T in pairs at qt, the second's after the first's ks * 512) at 32
 * staged K rows, finished (attn_dp_score; vlen[0..1] the groups' lengths from the block's first position):
 * sb[o][lane] (the second group's 512 floats on), and each group's running maximum mx[0..1] raised to them.
 * Each K pair is broadcast once for both groups; per row the same operations in the same order either way. */
INLINE void attn_dp_scores(const uint16_t *kst, const uint16_t *qt, float *sb, const int64_t D, __m512 vs,
                           float softcap, const int masked, const __m512i *vlen, __m512 *mx, const int two) {
    const int64_t ks = D / 32;
    const __m512bh *q0 = (const __m512bh *)qt, *q1 = (const __m512bh *)(qt + ks * 512);
    for (int64_t o0 = 0; o0 < 32; o0 += 8) {
        __m512 a[8], b[8];
        for (int u = 0; u < 8; u++) a[u] = b[u] = _mm512_setzero_ps();
        for (int64_t c = 0; c < ks * 16; c++) {
            const __m512bh qa = q0[c];
            const __m512bh qb = two == 2 ? q1[c] : qa;
            for (int u = 0; u < 8; u++) {
                const __m512bh kb = (__m512bh)_mm512_set1_epi32(((const int32_t *)(kst + (o0 + u) * D))[c]);
                a[u] = _mm512_dpbf16_ps(a[u], kb, qa);
                if (two == 2) b[u] = _mm512_dpbf16_ps(b[u], kb, qb);
            }
        }
        for (int u = 0; u < 8; u++) {
            const __m512 sa = attn_dp_score(a[u], vs, softcap, masked, vlen[0], o0 + u);
            _mm512_store_ps(sb + 16 * (o0 + u), sa);
            mx[0] = _mm512_max_ps(mx[0], sa);
            if (two == 2) {
                const __m512 sbv = attn_dp_score(b[u], vs, softcap, masked, vlen[1], o0 + u);
                _mm512_store_ps(sb + 512 + 16 * (o0 + u), sbv);
                mx[1] = _mm512_max_ps(mx[1], sbv);
            }
        }
    }
}

INLINE void attn_items_dp_body(int64_t i0, int64_t R, int64_t g, const float *q, int64_t q_ts, int64_t q_hs,
                               const void *kc, const void *vc, int64_t block_size, int64_t kvh, const int32_t *blocks,
                               int64_t S, int64_t L0, float *out, int64_t H, const int64_t D, float scale,
                               float softcap, float *buf) {
    const int64_t group = H / kvh, N = R * group, nrg = (N + 15) / 16, Lmax = L0 + R - 1;
    const int64_t ks = D / 32, dt = D / 16, rb = D * 2;
    /* accumulators a pass: up to 16 vectors (TB of a row's dt, RB rows) */
    const int64_t TB = dt < 16 ? dt : 16, RB = 16 / TB;
    float *restrict sb = (float *)(((uintptr_t)buf + 63) & ~(uintptr_t)63); /* scores [nrg][32][16] */
    uint32_t *restrict pbt = (uint32_t *)(sb + ATTN_AMX_ROWS * 32);       /* a row group's weights in pairs [16][16] */
    float *restrict mx = (float *)(pbt + 256);                           /* running maxima [nrg * 16] */
    float *restrict ls = mx + ATTN_AMX_ROWS;                             /* running sums [nrg * 16] */
    float *restrict cacc = ls + ATTN_AMX_ROWS;                           /* accumulators [nrg * 16][D] */
    uint16_t *restrict qt = (uint16_t *)(cacc + nrg * 16 * D);           /* [nrg][ks][16 pairs][16 rows][2] */
    uint16_t *restrict vst = qt + nrg * ks * 512;                        /* 16 V pairs [16][D][2] */
    uint16_t *restrict kst = vst + 32 * D;                               /* 32 staged K rows [32][D] */
    if (Lmax <= 0) {
        for (int64_t n = 0; n < N; n++)
            for (int64_t j = 0; j < D; j++) out[((i0 + n / group) * H + g * group + n % group) * D + j] = 0.0f;
        return;
    }
    memset(qt, 0, sizeof(uint16_t) * (size_t)(nrg * ks * 512));
    memset(cacc, 0, sizeof(float) * (size_t)(nrg * 16 * D));
    int32_t rlen[ATTN_AMX_ROWS]; /* each row's length (0 past N) */
    for (int64_t n = 0; n < nrg * 16; n++) {
        ls[n] = 0.0f;
        mx[n] = n < N ? -INFINITY : 0.0f; /* a lane past N: no position, weights exp(-inf - 0) = 0, no NaN */
        rlen[n] = n < N ? (int32_t)(L0 + n / group) : 0;
    }
    for (int64_t n = 0; n < N; n++) {
        const float *qn = q + (i0 + n / group) * q_ts + (g * group + n % group) * q_hs;
        uint16_t *qg = qt + (n / 16) * ks * 512 + (n % 16) * 2;
        for (int64_t e = 0; e < D; e++) qg[(e / 32) * 512 + ((e % 32) / 2) * 32 + e % 2] = f2bf(qn[e]);
    }
    const __m512 vs = _mm512_set1_ps(scale);
    const __m512i ilo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                         37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i ihi = _mm512_add_epi16(ilo, _mm512_set1_epi16(16));
    /* (e0[n], e1[n]) pairs from cvtne2ps_pbh(e1, e0)'s halves */
    const __m512i ipair = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int64_t p0 = 0; p0 < Lmax; p0 += 32) {
        const int64_t m = Lmax - p0 < 32 ? Lmax - p0 : 32;
        const void *kr[32], *vr[32];
        attn_block_rows(kr, vr, kc, vc, blocks, S, p0, Lmax, block_size, kvh, g, rb);
        for (int64_t o = m; o < 32; o++) kr[o] = vr[o] = attn_zero_row;
        /* K rows staged (one base address for the broadcasts); V rows interleaved in pairs of positions:
         * vst[k][2 d + e] = V[p0 + 2 k + e][d] */
        for (int64_t o = 0; o < 32; o++)
            for (int64_t c = 0; c < ks; c++)
                _mm512_store_si512(kst + o * D + 32 * c, _mm512_loadu_si512((const uint16_t *)kr[o] + 32 * c));
        for (int64_t k = 0; k < 16; k++)
            for (int64_t c = 0; c < ks; c++) {
                const __m512i a = _mm512_loadu_si512((const uint16_t *)vr[2 * k] + 32 * c);
                const __m512i b = _mm512_loadu_si512((const uint16_t *)vr[2 * k + 1] + 32 * c);
                _mm512_store_si512(vst + k * 2 * D + 64 * c, _mm512_permutex2var_epi16(a, ilo, b));
                _mm512_store_si512(vst + k * 2 * D + 64 * c + 32, _mm512_permutex2var_epi16(a, ihi, b));
            }
        /* scores: sb[rg][o][lane] = row 16 rg + lane's score at position p0 + o, finished, and each row's
         * maximum so far (mnew); two row groups at a time share each broadcast of a K pair. Positions past
         * a row's length are masked only in the blocks that reach past the shortest row (row 0's L0): a row
         * keeps every position of the others either way. */
        const int masked = p0 + 32 > L0;
        __m512i vlen[ATTN_AMX_ROWS / 16];
        __m512 mnew[ATTN_AMX_ROWS / 16];
        for (int64_t rg = 0; rg < nrg; rg++) {
            vlen[rg] = _mm512_sub_epi32(_mm512_loadu_si512(rlen + 16 * rg), _mm512_set1_epi32((int)p0));
            mnew[rg] = _mm512_loadu_ps(mx + 16 * rg);
        }
        for (int64_t rg = 0; rg < nrg; rg += 2) {
            const int two = rg + 1 < nrg;
            if (masked && two)
                attn_dp_scores(kst, qt + rg * ks * 512, sb + rg * 512, D, vs, softcap, 1, vlen + rg, mnew + rg, 2);
            else if (masked)
                attn_dp_scores(kst, qt + rg * ks * 512, sb + rg * 512, D, vs, softcap, 1, vlen + rg, mnew + rg, 1);
            else if (two)
                attn_dp_scores(kst, qt + rg * ks * 512, sb + rg * 512, D, vs, softcap, 0, vlen + rg, mnew + rg, 2);
            else
                attn_dp_scores(kst, qt + rg * ks * 512, sb + rg * 512, D, vs, softcap, 0, vlen + rg, mnew + rg, 1);
        }
        for (int64_t rg = 0; rg < nrg; rg++) {
            float *restrict sg = sb + rg * 512;
            /* the online softmax, lane by lane */
            const __m512 mo = _mm512_loadu_ps(mx + 16 * rg), mn = mnew[rg];
            __mmask16 grew = _mm512_cmp_ps_mask(mn, mo, _CMP_NEQ_UQ);
            __m512 l = _mm512_loadu_ps(ls + 16 * rg);
            if (grew) { /* rescale what those rows hold (nothing before their first block) */
                float alpha[16];
                const __m512 va = exp16_le0_ps(_mm512_sub_ps(mo, mn));
                _mm512_storeu_ps(alpha, va);
                l = _mm512_mask_mul_ps(l, grew, l, va);
                for (; grew; grew &= grew - 1) {
                    float *cn = cacc + (16 * rg + __builtin_ctz(grew)) * D;
                    const __m512 a = _mm512_set1_ps(alpha[__builtin_ctz(grew)]);
                    for (int64_t t = 0; t < dt; t++) _mm512_storeu_ps(cn + 16 * t, _mm512_mul_ps(_mm512_loadu_ps(cn + 16 * t), a));
                }
            }
            _mm512_storeu_ps(mx + 16 * rg, mn);
            for (int64_t k = 0; k < 16; k++) {
                const __m512 e0 = exp16_le0_ps(_mm512_sub_ps(_mm512_load_ps(sg + 32 * k), mn));
                const __m512 e1 = exp16_le0_ps(_mm512_sub_ps(_mm512_load_ps(sg + 32 * k + 16), mn));
                l = _mm512_add_ps(_mm512_add_ps(l, e0), e1);
                _mm512_store_si512(pbt + 16 * k, _mm512_permutexvar_epi16(ipair, (__m512i)_mm512_cvtne2ps_pbh(e1, e0)));
            }
            _mm512_storeu_ps(ls + 16 * rg, l);
            /* values: RB rows' accumulators (TB vectors each) += their weights' pairs x the V pairs */
            const int64_t nend = N < 16 * rg + 16 ? N : 16 * rg + 16;
            for (int64_t n0 = 16 * rg; n0 < nend; n0 += RB)
                for (int64_t t0 = 0; t0 < dt; t0 += TB) {
                    __m512 acc[16];
                    for (int64_t r = 0; r < RB; r++)
                        for (int64_t t = 0; t < TB; t++) acc[r * TB + t] = _mm512_loadu_ps(cacc + (n0 + r) * D + 16 * (t0 + t));
                    for (int64_t k = 0; k < 16; k++) {
                        __m512bh v[16];
                        for (int64_t t = 0; t < TB; t++) v[t] = (__m512bh)_mm512_load_si512(vst + k * 2 * D + 32 * (t0 + t));
                        for (int64_t r = 0; r < RB; r++) {
                            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)pbt[16 * k + n0 + r - 16 * rg]);
                            for (int64_t t = 0; t < TB; t++) acc[r * TB + t] = _mm512_dpbf16_ps(acc[r * TB + t], w, v[t]);
                        }
                    }
                    for (int64_t r = 0; r < RB; r++)
                        for (int64_t t = 0; t < TB; t++) _mm512_storeu_ps(cacc + (n0 + r) * D + 16 * (t0 + t), acc[r * TB + t]);
                }
        }
    }
    for (int64_t n = 0; n < N; n++) {
        const __m512 vi = _mm512_set1_ps(1.0f / ls[n]);
        float *on = out + ((i0 + n / group) * H + g * group + n % group) * D;
        const float *cn = cacc + n * D;
        for (int64_t t = 0; t < dt; t++) _mm512_storeu_ps(on + 16 * t, _mm512_mul_ps(_mm512_loadu_ps(cn + 16 * t), vi));
    }
}

static __attribute__((noinline)) void attn_items_dp(int64_t i0, int64_t R, int64_t g, const float *q, int64_t q_ts,
                                                    int64_t q_hs, const void *kc, const void *vc, int64_t block_size,
                                                    int64_t kvh, const int32_t *blocks, int64_t S, int64_t L0,
                                                    float *out, int64_t H, int64_t d, float scale, float softcap,
                                                    float *buf) {
    if (d == 64)
        attn_items_dp_body(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, 64, scale, softcap,
                           buf);
    else if (d == 128)
        attn_items_dp_body(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, 128, scale,
                           softcap, buf);
    else if (d == 256)
        attn_items_dp_body(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, 256, scale,
                           softcap, buf);
    else
        attn_items_dp_body(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, d, scale, softcap,
                           buf);
}
/* scratch floats attn_items_dp needs: alignment, the row groups' scores, a row group's weights, the maxima and sums, the
 * accumulators, q^T in pairs, the V pairs and the staged K rows */
#define ATTN_DP_SCRATCH(D)                                                                                   \
    (16 + ATTN_AMX_ROWS * 32 + 256 + 2 * ATTN_AMX_ROWS + ATTN_AMX_ROWS * (D) + 4 * ((D) / 32) * 256 + 32 * (D))

/* Rows i0 .. i0+R-1 of KV head g over a bfloat16 cache on the kernel attn_bf16_path chose: 2 the AMX tiles
 * (attn_items_amx), 1 vdpbf16ps (attn_items_dp). A decode's item (R = 1) and a prefill run's both come here. */
static void attn_items_bf16(int path, int64_t i0, int64_t R, int64_t g, const float *q, int64_t q_ts, int64_t q_hs,
                            const void *kc, const void *vc, int64_t block_size, int64_t kvh, const int32_t *blocks,
                            int64_t S, int64_t L0, float *out, int64_t H, int64_t d, float scale, float softcap,
                            float *buf) {
#if ATTN_AMX
    if (path == 2) {
        attn_items_amx(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, d, scale, softcap, buf);
        return;
    }
#endif
    (void)path;
    attn_items_dp(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, d, scale, softcap, buf);
}
#define ATTN_BF16_ITEM(P)                                                                                    \
    attn_items_bf16(P, i, 1, g, (const float *)q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, (float *)out, H, \
                    d, scale, softcap, buf);
#else
#define ATTN_DP 0
#define ATTN_DP_SCRATCH(D) 0
#define ATTN_BF16_ITEM(P) (void)(P);
#endif

/* 1 when a bfloat16 cache under float32 activations runs on the AMX tiles (attn_items_amx) for head size D and
 * `group` query heads per KV head: the amx build, on a CPU whose tiles Linux lets this process use. */
INLINE int attn_bf16_tiles(int64_t D, int64_t group) { return ATTN_AMX && attn_amx_fits(D, group) && izh_amx_permitted(); }

/* Which kernel a bfloat16 cache under float32 activations takes for head size D and `group` query heads per KV
 * head: 2 the AMX tiles (attn_items_amx), 1 vdpbf16ps (attn_items_dp: builds with AVX512-BF16, where the tiles
 * are not), 0 the float32 items over rows converted to float32 (the AVX2 and generic builds). 1 and 2 round q
 * and the softmax weights to bfloat16. */
INLINE int attn_bf16_path(int64_t D, int64_t group) {
    if (!attn_amx_fits(D, group)) return 0;
    if (attn_bf16_tiles(D, group)) return 2;
    return ATTN_DP;
}

int izh_attention_bf16_path(int64_t d, int64_t group) { return attn_bf16_path(d, group); }

/* Per dtype, one non-inlined item function (keeps the compile time down): head sizes 64 and 128 get
 * compile-time copies, the rest (up to 32 * MAX_NC) the runtime-D one. A cache of another kv type than the
 * activations' (kt) goes through the converting copies (attn_item_conv_*). */
#define DEFINE_ATTN_ITEM(SFX, BF)                                                                             \
    static FAST_FP __attribute__((noinline)) void attn_item_conv_##SFX(                                      \
        int64_t i, int64_t g, const void *q, int64_t q_ts, int64_t q_hs, const void *kc, const void *vc,     \
        int64_t block_size, int64_t kvh, const int32_t *blocks, int64_t S, int64_t L, void *out, int64_t H,  \
        int64_t d, float scale, float softcap, float *buf, int kt, int64_t rb) {                             \
        if (ATTN_AVX2 && !(BF) && d % 8 == 0)                                                                \
            ATTN_AVX2_CONV_ITEM(d == 64 ? 64 : d == 128 ? 128 : d)                                           \
        else if (d == 64)                                                                                    \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, 64, scale, softcap, buf, \
                          0, BF, 1, kt, rb);                                                                 \
        else if (d == 128)                                                                                   \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, 128, scale, softcap, \
                          buf, 0, BF, 1, kt, rb);                                                            \
        else                                                                                                 \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, d, scale, softcap, buf, \
                          0, BF, 1, kt, rb);                                                                 \
    }                                                                                                        \
    static FAST_FP __attribute__((noinline)) void attn_item_##SFX(                                           \
        int64_t it, const void *q, int64_t q_ts, int64_t q_hs, const void *kc, const void *vc,              \
        int64_t block_size, int64_t kvh, const int32_t *bt, int64_t max_blocks, const int32_t *row_seq,     \
        const int32_t *seq_lens, int64_t window, float softcap, void *out, int64_t H, int64_t d, float scale, \
        float *buf, int kt) {                                                                                \
        const int64_t i = it / kvh, g = it % kvh, S = window_start(seq_lens[i], window), L = seq_lens[i] - S; \
        const int32_t *blocks = bt + (row_seq ? row_seq[i] : i) * max_blocks;                               \
        const int64_t rb = (BF) ? d * 2 : d * 4;                                                             \
        const int bf16_path = !(BF) && kt == KV_BF16 ? attn_bf16_path(d, H / kvh) : 0;                     \
        if (bf16_path)                                                                                       \
            ATTN_BF16_ITEM(bf16_path)                                                                        \
        else if (kt != ((BF) ? KV_BF16 : KV_F32))                                                            \
            attn_item_conv_##SFX(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, d, scale,  \
                                 softcap, buf, kt, kv_row_bytes(kt, d));                                     \
        else if (ATTN_AVX2 && !(BF) && d % 8 == 0)                                                           \
            ATTN_AVX2_ITEM(d == 64 ? 64 : d == 128 ? 128 : d)                                                \
        else if (d == 64)                                                                                    \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, 64, scale, softcap, buf, \
                          BF, BF, 0, kt, rb);                                                                \
        else if (d == 128)                                                                                   \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, 128, scale, softcap, \
                          buf, BF, BF, 0, kt, rb);                                                           \
        else                                                                                                 \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L, out, H, d, scale, softcap, buf, \
                          BF, BF, 0, kt, rb);                                                                \
    }

DEFINE_ATTN_ITEM(f32, 0)
DEFINE_ATTN_ITEM(bf16, 1)


/* Prefill rows that share their keys: up to ATTN_MQ consecutive rows i0 .. i0+R-1 of one sequence whose
 * lengths are L0, L0 + 1, .., L0 + R - 1 (the tokens of a prefill chunk) with the same first position S (no
 * sliding window cuts them), for KV head g, float32 activations over a cache of kv type kt (rows of rb bytes).
 * Each query gets attn_item_vec's float32 arithmetic exactly (attn_scores16, softmax_rows, attn_values16, the
 * same chunks of 16 positions, the same stores; another kt: the same kv_tile conversion of each 16 rows first,
 * as its conv path), so a token's attention is the same as its decode's; only the loop order changes: each
 * chunk of K and V rows is fetched, and converted, once for the R queries, not R times (a long prompt's keys
 * stream from memory once per R tokens). The scratch holds R items' worth of buffers and one tile. */
#define ATTN_MQ 8

INLINE FAST_FP void attn_items_f32(int64_t i0, int64_t R, int64_t g, const float *q, int64_t q_ts, int64_t q_hs,
                                   const void *kc, const void *vc, int64_t block_size, int64_t kvh,
                                   const int32_t *blocks, int64_t S, int64_t L0, float *out, int64_t H,
                                   const int64_t D, float scale, float softcap, float *buf, int kt, int64_t rb) {
    const int64_t group = H / kvh, NC = (D + 31) / 32, DP = NC * 32, Lmax = L0 + R - 1;
    float *restrict sc = buf;                   /* query r: [group, L0 + r] at r * group * Lmax */
    float *restrict acc = sc + R * group * Lmax; /* [R, group, DP] */
    float *restrict inv = acc + R * group * DP;  /* [R, group] */
    float *restrict tile = inv + R * group + 16; /* kt != KV_F32: 16 converted rows [16, DP] */
    const void *rows[2][16];
    int64_t m = row_ptrs(rows[0], kc, blocks, S, S + Lmax, block_size, kvh, g, rb);
    for (int64_t p0 = 0, cur = 0; p0 < Lmax; p0 += 16, cur ^= 1) {
        const void **rk = rows[cur];
        if (kt != KV_F32) kv_tile(tile, DP, rk, m, D, kt);
        const int64_t m_next = row_ptrs(rows[cur ^ 1], kc, blocks, S + p0 + 16, S + Lmax, block_size, kvh, g, rb);
        prefetch_rows_l2(kc, blocks, S + p0 + ATTN_L2_AHEAD, S + Lmax, block_size, kvh, g, rb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t L = L0 + r, mr = L - p0 < m ? L - p0 : m;
            if (mr <= 0) continue;
            for (int64_t hh = 0; hh < group; hh++)
                attn_scores16(q + (i0 + r) * q_ts + (g * group + hh) * q_hs, rk, mr, D, 0, scale,
                              sc + r * group * Lmax + hh * L + p0);
        }
        m = m_next;
    }
    for (int64_t r = 0; r < R; r++) softmax_rows(sc + r * group * Lmax, inv + r * group, group, L0 + r, softcap);
    for (int64_t j = 0; j < R * group * DP; j++) acc[j] = 0.0f;
    m = row_ptrs(rows[0], vc, blocks, S, S + Lmax, block_size, kvh, g, rb);
    for (int64_t p0 = 0, cur = 0; p0 < Lmax; p0 += 16, cur ^= 1) {
        const void **rv = rows[cur];
        if (kt != KV_F32) kv_tile(tile, DP, rv, m, D, kt);
        const int64_t m_next = row_ptrs(rows[cur ^ 1], vc, blocks, S + p0 + 16, S + Lmax, block_size, kvh, g, rb);
        prefetch_rows_l2(vc, blocks, S + p0 + ATTN_L2_AHEAD, S + Lmax, block_size, kvh, g, rb);
        for (int64_t r = 0; r < R; r++) {
            const int64_t L = L0 + r, mr = L - p0 < m ? L - p0 : m;
            if (mr <= 0) continue;
            for (int64_t hh = 0; hh < group; hh++)
                attn_values16(acc + (r * group + hh) * DP, sc + r * group * Lmax + hh * L + p0, rv, mr, D, 0);
        }
        m = m_next;
    }
    for (int64_t r = 0; r < R; r++)
        for (int64_t hh = 0; hh < group; hh++) {
            float *oh = out + ((i0 + r) * H + g * group + hh) * D;
            for (int64_t c = 0; c < NC; c++) {
                v16f aa, ab;
                memcpy(&aa, acc + (r * group + hh) * DP + 32 * c, sizeof aa);
                memcpy(&ab, acc + (r * group + hh) * DP + 32 * c + 16, sizeof ab);
                st32_row(oh, c, D, aa, ab, inv[r * group + hh], 0, 0);
            }
        }
}

static FAST_FP __attribute__((noinline)) void attn_items_f32_any(int64_t i0, int64_t R, int64_t g, const float *q,
                                                                 int64_t q_ts, int64_t q_hs, const void *kc,
                                                                 const void *vc, int64_t block_size, int64_t kvh,
                                                                 const int32_t *blocks, int64_t S, int64_t L0,
                                                                 float *out, int64_t H, int64_t d, float scale,
                                                                 float softcap, float *buf, int kt, int64_t rb) {
    if (d == 64)
        attn_items_f32(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, 64, scale, softcap, buf,
                       kt, rb);
    else if (d == 128)
        attn_items_f32(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, 128, scale, softcap,
                       buf, kt, rb);
    else
        attn_items_f32(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, L0, out, H, d, scale, softcap, buf,
                       kt, rb);
}

/* izh_paged_attention_f32's prefill rows (float32 activations, a cache of any kv type kt): runs of rows that
 * share their keys through attn_items_f32 (attn_items_f32_avx2 where the build's decode items are the AVX2 ones),
 * a row alone through the decode item itself. Returns 0, or -4 when out of memory. */
static int attn_prefill_f32(const float *q, int64_t q_ts, int64_t q_hs, const void *kc, const void *vc, int kt,
                            int64_t block_size, int64_t kvh, const int32_t *block_tables, int64_t max_blocks,
                            const int32_t *row_seq, const int32_t *seq_lens, int64_t window, float softcap,
                            float *out, int64_t n, int64_t H, int64_t d, float scale, int64_t max_len, int nt,
                            int64_t work) {
    int64_t *runs = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)n);
    if (!runs) return -4;
    const int64_t group = H / kvh, DP = (d + 31) / 32 * 32, rb = kv_row_bytes(kt, d);
    const int bf16_path = kt == KV_BF16 ? attn_bf16_path(d, group) : 0;
    /* the tiles' and vdpbf16ps's items take up to ATTN_AMX_ROWS rows (9 tokens of a 7-head group), their scores
     * in a block's buffer: not bounded by ATTN_MQ */
    const int64_t mq = bf16_path ? ATTN_AMX_ROWS / group : ATTN_MQ;
    int64_t nruns = 0;
    for (int64_t i = 0; i < n;) {
        const int64_t S = window_start(seq_lens[i], window);
        int64_t j = i + 1;
        while (seq_lens[i] - S > 0 && j < n && j - i < mq && row_seq[j] == row_seq[i] &&
               seq_lens[j] == seq_lens[j - 1] + 1 && window_start(seq_lens[j], window) == S)
            j++;
        runs[2 * nruns] = i;
        runs[2 * nruns + 1] = j - i;
        nruns++;
        i = j;
    }
    /* attn_items_f32's buffers for ATTN_MQ queries and a tile of 16 converted rows, or attn_item_f32's for one,
     * and attn_items_amx's */
    const size_t scratch = (size_t)(ATTN_MQ * group * (max_len + ATTN_MQ + DP + 1) + 16 * DP + group * (max_len + 2 * d + 64) +
                                    group + 32 + 16 * (d + 32) + 64 + ATTN_AMX_SCRATCH(d) + ATTN_DP_SCRATCH(d)) *
                           sizeof(float);
    const int64_t items = nruns * kvh;
    int failed = 0;
    if (nt <= 1 || work * H * d < PAR_MIN_ATTN || items <= 1) nt = 1;
#pragma omp parallel num_threads(nt) reduction(| : failed)
    {
        float *buf = (float *)malloc(scratch);
        failed |= buf == NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++)
            if (buf) {
                const int64_t j = it / kvh, g = it % kvh, i0 = runs[2 * j], R = runs[2 * j + 1];
                const int64_t S = window_start(seq_lens[i0], window);
                if (R == 1) { /* a row alone: the decode's item itself */
                    attn_item_f32(i0 * kvh + g, q, q_ts, q_hs, kc, vc, block_size, kvh, block_tables, max_blocks,
                                  row_seq, seq_lens, window, softcap, out, H, d, scale, buf, kt);
                    continue;
                }
                const int32_t *blocks = block_tables + row_seq[i0] * max_blocks;
#if ATTN_DP
                if (bf16_path) {
                    attn_items_bf16(bf16_path, i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S,
                                    seq_lens[i0] - S, out, H, d, scale, softcap, buf);
                    continue;
                }
#endif
#if ATTN_AVX2
                if (d % 8 == 0) { /* the AVX2 build's float32 items are attn_item_f32_avx2 / _conv_avx2 for these */
                    attn_items_f32_avx2(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, seq_lens[i0] - S,
                                        out, H, d, scale, softcap, buf, kt, rb);
                    continue;
                }
#endif
                attn_items_f32_any(i0, R, g, q, q_ts, q_hs, kc, vc, block_size, kvh, blocks, S, seq_lens[i0] - S,
                                   out, H, d, scale, softcap, buf, kt, rb);
            }
        free(buf);
    }
    free(runs);
    return failed ? -4 : 0;
}

/* Validates every index, then writes the new K/V (all writes precede all reads). Returns 0, or a
 * negative code when an index is out of range (nothing is read or written out of bounds then):
 * -1 slot_mapping >= num_blocks * block_size, -2 seq_len > max_blocks * block_size or < 0, -3 a block id
 * outside [0, num_blocks) among the blocks a row reads (under a window, those of its window only: the
 * entries before it may be -1, blocks already freed). Slots < 0 are skipped (padding rows). Sets *max_len
 * and *work (sum of the lengths read). */
INLINE int attn_prepare(const void *k, int64_t k_ts, int64_t k_hs, const void *v, int64_t v_ts, int64_t v_hs,
                        void *kc, void *vc, int kt, int64_t num_blocks, int64_t block_size, int64_t kvh,
                        const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,
                        const int32_t *row_seq, int64_t num_seqs, const int32_t *seq_lens, int64_t window, int64_t n,
                        int64_t d, int64_t *max_len, int64_t *work, const int bf) {
    const int64_t num_slots = num_blocks * block_size;
    if (kt < 0 || kt > KV_Q8_0 || (kt == KV_Q8_0 && d % Q8_0_BLOCK)) return -6;
    *max_len = 0;
    *work = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = slot_mapping[i];
        const int64_t L = seq_lens[i];
        if (slot >= num_slots) return -1;
        if (L < 0 || L > max_blocks * block_size) return -2;
        const int64_t seq = row_seq ? row_seq[i] : i;
        if (seq < 0 || seq >= num_seqs) return -5;
        const int32_t *blocks = block_tables + seq * max_blocks;
        const int64_t S = window_start(L, window);
        for (int64_t b = S / block_size; b * block_size < L; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return -3;
        *max_len = L - S > *max_len ? L - S : *max_len;
        *work += L - S;
    }
    const size_t bytes = (size_t)d * (bf ? 2 : 4);
    const int64_t rb = kv_row_bytes(kt, d);
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        for (int64_t hh = 0; hh < kvh; hh++) {
            if (kt == (bf ? KV_BF16 : KV_F32)) {
                memcpy(off(kc, (slot * kvh + hh) * d, bf), off(k, i * k_ts + hh * k_hs, bf), bytes);
                memcpy(off(vc, (slot * kvh + hh) * d, bf), off(v, i * v_ts + hh * v_hs, bf), bytes);
            } else {
                kv_write_row((char *)kc + (slot * kvh + hh) * rb, off(k, i * k_ts + hh * k_hs, bf), d, bf, kt);
                kv_write_row((char *)vc + (slot * kvh + hh) * rb, off(v, i * v_ts + hh * v_hs, bf), d, bf, kt);
            }
        }
    }
    return 0;
}

/* Every row i attends to positions 0 .. seq_lens[i] - 1 (with window > 0, the last `window` of them; with
 * softcap > 0, its scores soft-capped) of sequence row_seq[i] (NULL: sequence i), whose
 * block table is block_tables[row_seq[i]]: a decode step has one row per sequence, a prefill chunk one row
 * per token (its position + 1 as the length). Each row is one work item per KV head, computed the same way
 * whatever the other rows are, so a token's attention does not depend on the batch, on how its prompt was
 * chunked, or on whether it ran as a decode or in a prefill (the row kernels share one code path).
 * kv_cache: [2, num_blocks, block_size, kvh, row] of kv_type (row: kv_row_bytes(kv_type, d) bytes; the new
 * K/V are converted as they are written, each cached row as it is read); returns attn_prepare's code (-5: a
 * row_seq entry outside [0, num_seqs), -6: an unknown kv_type, or q8_0 with d not a multiple of 32), or -4
 * when out of memory. */
#define DEFINE_ATTENTION(SFX, BF)                                                                            \
    FAST_FP int izh_paged_attention_##SFX(                                                                   \
        const void *q, int64_t q_ts, int64_t q_hs, const void *k, int64_t k_ts, int64_t k_hs, const void *v,   \
        int64_t v_ts, int64_t v_hs, void *kv_cache, int kv_type, int64_t num_blocks, int64_t block_size,     \
        int64_t kvh, const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,           \
        const int32_t *row_seq, int64_t num_seqs, const int32_t *seq_lens, int64_t window, float softcap,      \
        void *out, int64_t n, int64_t H, int64_t d, float scale, int nt) {                                   \
        void *kc = kv_cache;                                                                                 \
        void *vc = (char *)kv_cache + num_blocks * block_size * kvh * kv_row_bytes(kv_type, d);              \
        int64_t max_len, work;                                                                               \
        int rc = attn_prepare(k, k_ts, k_hs, v, v_ts, v_hs, kc, vc, kv_type, num_blocks, block_size, kvh,     \
                              slot_mapping,                                                                  \
                              block_tables, max_blocks, row_seq, num_seqs, seq_lens, window, n, d, &max_len, &work, \
                              BF);                                                                           \
        if (rc != 0) return rc;                                                                              \
        if (!(BF) && row_seq && n > 1)                                                                       \
            return attn_prefill_f32((const float *)q, q_ts, q_hs, kc, vc, kv_type, block_size, kvh, block_tables, \
                                    max_blocks, row_seq, seq_lens, window, softcap, (float *)out, n, H, d, scale, \
                                    max_len, nt, work);                                                      \
        const int64_t group = H / kvh;                                                                       \
        const size_t scratch =                                                                               \
            (size_t)(group * (max_len + 2 * d + 64) + group + 32 + 16 * (d + 32) + ATTN_AMX_SCRATCH(d) + ATTN_DP_SCRATCH(d)) * \
            sizeof(float);                                                                                   \
        const int64_t items = n * kvh;                                                                       \
        int failed = 0;                                                                                      \
        if (nt <= 1 || work * H * d < PAR_MIN_ATTN || items <= 1) {                                          \
            float *buf = (float *)malloc(scratch);                                                           \
            if (!buf) return -4;                                                                             \
            for (int64_t it = 0; it < items; it++)                                                           \
                attn_item_##SFX(it, q, q_ts, q_hs, kc, vc, block_size, kvh, block_tables, max_blocks, row_seq, \
                                seq_lens, window, softcap, out, H, d, scale, buf, kv_type);                  \
            free(buf);                                                                                       \
        } else {                                                                                             \
            _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {                                  \
                float *buf = (float *)malloc(scratch);                                                       \
                failed |= buf == NULL;                                                                       \
                _Pragma("omp for schedule(dynamic, kvh)") for (int64_t it = 0; it < items; it++) if (buf)      \
                    attn_item_##SFX(it, q, q_ts, q_hs, kc, vc, block_size, kvh, block_tables, max_blocks,    \
                                    row_seq, seq_lens, window, softcap, out, H, d, scale, buf, kv_type);     \
                free(buf);                                                                                   \
            }                                                                                                \
        }                                                                                                    \
        return failed ? -4 : 0;                                                                              \
    }                                                                                                        \
    /* One row per sequence (a decode step): izh_paged_attention with row_seq NULL. */                      \
    int izh_paged_decode_attention_##SFX(                                                                    \
        const void *q, int64_t q_ts, int64_t q_hs, const void *k, int64_t k_ts, int64_t k_hs, const void *v,   \
        int64_t v_ts, int64_t v_hs, void *kv_cache, int kv_type, int64_t num_blocks, int64_t block_size,     \
        int64_t kvh, const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,           \
        const int32_t *seq_lens, int64_t window, float softcap, void *out, int64_t n, int64_t H, int64_t d,    \
        float scale, int nt) {                                                                               \
        return izh_paged_attention_##SFX(q, q_ts, q_hs, k, k_ts, k_hs, v, v_ts, v_hs, kv_cache, kv_type, num_blocks, \
                                         block_size, kvh, slot_mapping, block_tables, max_blocks, NULL, n,     \
                                         seq_lens, window, softcap, out, n, H, d, scale, nt);                 \
    }

DEFINE_ATTENTION(f32, 0)
DEFINE_ATTENTION(bf16, 1)
