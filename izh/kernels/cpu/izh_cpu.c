/* Fused CPU kernels for single-token decode steps; see izh/kernels/cpu/__init__.py for the contract.
 *
 * Plain C11 + OpenMP, no torch headers. Built by the Python module with
 *   gcc -O3 -march=native -std=c11 -fPIC -shared -fopenmp -ffp-contract=off -fno-math-errno
 *       -mprefer-vector-width=512 ...
 * -ffp-contract=off matters: the float32 rotary kernel must round every product separately (no FMA) to
 * be bit-identical to torch's elementwise ops.
 *
 * Every kernel exists twice, `_f32` and `_bf16`; bf16 is stored as uint16_t. Both are stamped out of one
 * always_inline body with a compile-time `bf` flag, so each copy is specialised and auto-vectorised.
 * bf16 rounding follows c10::BFloat16 (round to nearest even, NaN -> 0x7FC0); `rnd(v, 1)` rounds a float
 * through bf16 the way a torch bf16 elementwise op rounds its fp32 result.
 */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

#define INLINE static inline __attribute__((always_inline))
/* The library is built with -ffp-contract=off (rotary must round like torch); attention, which has no
 * bit-exact reference, lets the compiler fuse multiply-adds. Correct either way; only speed depends on it. */
#if defined(__GNUC__) && !defined(__clang__)
#define FAST_FP __attribute__((optimize("fp-contract=fast")))
#else
#define FAST_FP
#endif

/* Work (elements) below which the row kernels stay on the calling thread. */
#define PAR_MIN_ELEMS 65536
/* Work (sum of seq_len * num_heads * head_dim) below which attention stays on the calling thread: about
 * 100 us of single-thread work; below that a second thread buys little and costs a wake-up. */
#define PAR_MIN_ATTN (1 << 19)

INLINE float bf2f(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t r = (uint16_t)((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}

INLINE float ld(const void *p, int64_t i, const int bf) {
    return bf ? bf2f(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void st(void *p, int64_t i, float v, const int bf) {
    if (bf)
        ((uint16_t *)p)[i] = f2bf(v);
    else
        ((float *)p)[i] = v;
}

INLINE float rnd(float v, const int bf) { return bf ? bf2f(f2bf(v)) : v; }

INLINE char *off(const void *p, int64_t elems, const int bf) {
    return (char *)p + elems * (bf ? 2 : 4);
}

/* exp(x) in fp32, branch-free so loops over it vectorise (libm's expf does not without -ffast-math).
 * Cephes expf: n = round(x / ln2), r = x - n ln2 (two-constant Cody-Waite), degree-7 polynomial for
 * e^r on [-ln2/2, ln2/2], then scale by 2^n as two factors 2^(n/2) so n in [-150, 128] stays in range
 * (a single rounding into the subnormals). About 1 ulp; overflow -> inf, underflow -> 0, NaN -> NaN. */
INLINE float exp_f32(float x) {
    float xc = x < -104.0f ? -104.0f : x;
    xc = xc > 88.8f ? 88.8f : xc;
    float t = xc * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: round to nearest integer */
    float n = t - 12582912.0f;
    float r = xc - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float y = p * (r * r) + r + 1.0f;
    int32_t ni = (int32_t)n;
    int32_t n1 = ni / 2;
    int32_t n2 = ni - n1;
    uint32_t b1 = (uint32_t)(n1 + 127) << 23, b2 = (uint32_t)(n2 + 127) << 23;
    float s1, s2;
    memcpy(&s1, &b1, sizeof s1);
    memcpy(&s2, &b2, sizeof s2);
    y = y * s1 * s2;
    y = x > 88.72283935546875f ? INFINITY : y;
    y = x < -103.972084f ? 0.0f : y;
    return x != x ? x : y;
}

/* ------------------------------------------------------------------------------------------------ */
/* RMSNorm: out = x * (1 / sqrt(sum(x^2) / h + eps)) * w, each op rounded as torch's composite rms_norm
 * rounds it (x^2, the row sum, / h, + eps, sqrt, 1 / ., x * inv, then * w; bf16 rounds x * inv to bf16
 * before the weight). The row sum adds in exactly the order of torch's CPU sum kernel (SumKernel.cpp:
 * vectorized_inner_sum -> row_sum -> multi_row_sum, 8-lane vectors, 4 accumulators, a 4-level cascade,
 * then the scalar tail and the 8 lanes in order; rows shorter than 8 take the scalar version), so the
 * results are bit-identical to the reference. */

#define TORCH_LANES 8

INLINE float sq(const void *x, int64_t j, const int bf) {
    const float v = ld(x, j, bf);
    return v * v;
}

INLINE int64_t ceil_log2(int64_t x) { /* at::native::utils::CeilLog2 */
    if (x <= 2) return 1;
    int64_t r = 0;
    for (uint64_t v = (uint64_t)(x - 1); v; v >>= 1) r++;
    return r;
}

/* One copy per (V, dtype) via constant propagation; not inlined into each caller (compile time). */
static __attribute__((noinline)) float torch_sumsq_lanes(const void *x, int64_t h, const int64_t V,
                                                         const int bf) {
    const int64_t vec_size = h / V, size_ilp = vec_size / 4;
    int64_t level_power = ceil_log2(size_ilp) / 4;
    level_power = level_power < 4 ? 4 : level_power;
    const int64_t level_step = (int64_t)1 << level_power, level_mask = level_step - 1;
    float acc[4][4][TORCH_LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    while (i + level_step <= size_ilp) {
        for (int64_t j = 0; j < level_step; j++, i++)
            for (int k = 0; k < 4; k++)
                for (int64_t l = 0; l < V; l++) acc[0][k][l] += sq(x, (i * 4 + k) * V + l, bf);
        for (int lv = 1; lv < 4; lv++) {
            for (int k = 0; k < 4; k++)
                for (int64_t l = 0; l < V; l++) {
                    acc[lv][k][l] += acc[lv - 1][k][l];
                    acc[lv - 1][k][l] = 0.0f;
                }
            if (i & (level_mask << (lv * level_power))) break;
        }
    }
    for (; i < size_ilp; i++)
        for (int k = 0; k < 4; k++)
            for (int64_t l = 0; l < V; l++) acc[0][k][l] += sq(x, (i * 4 + k) * V + l, bf);
    for (int lv = 1; lv < 4; lv++)
        for (int k = 0; k < 4; k++)
            for (int64_t l = 0; l < V; l++) acc[0][k][l] += acc[lv][k][l];
    for (int64_t t = size_ilp * 4; t < vec_size; t++)
        for (int64_t l = 0; l < V; l++) acc[0][0][l] += sq(x, t * V + l, bf);
    for (int k = 1; k < 4; k++)
        for (int64_t l = 0; l < V; l++) acc[0][0][l] += acc[0][k][l];
    if (V == 1) return acc[0][0][0];
    float total = 0.0f;
    for (int64_t t = vec_size * V; t < h; t++) total += sq(x, t, bf);
    for (int64_t l = 0; l < V; l++) total += acc[0][0][l];
    return total;
}

INLINE float rms_inv(const void *x, int64_t h, float eps, const int bf) {
    const float ss =
        h < TORCH_LANES ? torch_sumsq_lanes(x, h, 1, bf) : torch_sumsq_lanes(x, h, TORCH_LANES, bf);
    return 1.0f / sqrtf(ss / (float)h + eps);
}

INLINE void rms_norm_row(const void *x, const void *w, void *out, int64_t h, float eps, const int bf) {
    const float inv = rms_inv(x, h, eps, bf);
    for (int64_t j = 0; j < h; j++) st(out, j, rnd(ld(x, j, bf) * inv, bf) * ld(w, j, bf), bf);
}

/* residual += x, rounded to the dtype. */
INLINE void add_row(const void *x, void *res, int64_t h, const int bf) {
    for (int64_t j = 0; j < h; j++) st(res, j, ld(x, j, bf) + ld(res, j, bf), bf);
}

/* SiLU(gate) * up on one row [gate | up]; silu rounds to the dtype before the product, as in torch. */
INLINE void silu_mul_row(const void *gu, void *out, int64_t inter, const int bf) {
    const void *up = off(gu, inter, bf);
    for (int64_t j = 0; j < inter; j++) {
        float g = ld(gu, j, bf);
        float s = rnd(g / (1.0f + exp_f32(-g)), bf);
        st(out, j, s * ld(up, j, bf), bf);
    }
}

/* Rotate-half RoPE over one head, in place; every product / sum rounds to the dtype (torch's ops). */
INLINE void rotary_head(void *x, const void *cs, int64_t half, const int bf) {
    void *x2p = off(x, half, bf);
    const void *sp = off(cs, half, bf);
    for (int64_t j = 0; j < half; j++) {
        float x1 = ld(x, j, bf), x2 = ld(x2p, j, bf);
        float c = ld(cs, j, bf), s = ld(sp, j, bf);
        float o1 = rnd(x1 * c, bf) - rnd(x2 * s, bf);
        float o2 = rnd(x2 * c, bf) + rnd(x1 * s, bf);
        st(x, j, o1, bf);
        st(x2p, j, o2, bf);
    }
}

/* Row loops: serial for small work, an OpenMP team of `nt` (the caller's variable) otherwise. */
#define ROW_LOOP(WORK, N, BODY)                                                    \
    do {                                                                           \
        if (nt <= 1 || (WORK) < PAR_MIN_ELEMS) {                                   \
            for (int64_t r = 0; r < (N); r++) BODY;                                \
        } else {                                                                   \
            _Pragma("omp parallel for num_threads(nt) schedule(static)")           \
            for (int64_t r = 0; r < (N); r++) BODY;                                \
        }                                                                          \
    } while (0)

/* Per dtype: one non-inlined copy of each row function (shared by the serial and the parallel loop, which
 * keeps the compile time down), then the exported kernels. */
#define DEFINE_ROW_KERNELS(SFX, BF)                                                                          \
    static __attribute__((noinline)) void rms_norm_row_##SFX(const void *x, const void *w, void *out,       \
                                                             int64_t h, float eps) {                        \
        rms_norm_row(x, w, out, h, eps, BF);                                                                 \
    }                                                                                                        \
    static __attribute__((noinline)) void silu_mul_row_##SFX(const void *gu, void *out, int64_t inter) {    \
        silu_mul_row(gu, out, inter, BF);                                                                    \
    }                                                                                                        \
    static __attribute__((noinline)) void rotary_row_##SFX(void *x, int64_t head_stride, const void *cs,    \
                                                           int64_t heads, int64_t d) {                      \
        for (int64_t hh = 0; hh < heads; hh++) rotary_head(off(x, hh * head_stride, BF), cs, d / 2, BF);     \
    }                                                                                                        \
    void izh_rms_norm_##SFX(const void *x, int64_t x_stride, const void *w, void *out, int64_t n, int64_t h, \
                            float eps, int nt) {                                                             \
        ROW_LOOP(n * h, n, rms_norm_row_##SFX(off(x, r * x_stride, BF), w, off(out, r * h, BF), h, eps));   \
    }                                                                                                        \
    void izh_add_rms_norm_##SFX(const void *x, void *res, const void *w, void *out, int64_t n, int64_t h,   \
                                float eps, int nt) {                                                         \
        ROW_LOOP(n * h, n, {                                                                                 \
            void *rr = off(res, r * h, BF);                                                                  \
            add_row(off(x, r * h, BF), rr, h, BF);                                                           \
            rms_norm_row_##SFX(rr, w, off(out, r * h, BF), h, eps);                                          \
        });                                                                                                  \
    }                                                                                                        \
    void izh_silu_mul_##SFX(const void *gu, int64_t gu_stride, void *out, int64_t n, int64_t inter,         \
                            int nt) {                                                                        \
        ROW_LOOP(n * inter * 4, n,                                                                           \
                 silu_mul_row_##SFX(off(gu, r * gu_stride, BF), off(out, r * inter, BF), inter));           \
    }                                                                                                        \
    void izh_rotary_##SFX(void *x, int64_t tok_stride, int64_t head_stride, const void *cs, int64_t n,      \
                          int64_t heads, int64_t d, int nt) {                                                \
        ROW_LOOP(n * heads * d, n,                                                                           \
                 rotary_row_##SFX(off(x, r * tok_stride, BF), head_stride, off(cs, r * d, BF), heads, d));   \
    }

DEFINE_ROW_KERNELS(f32, 0)
DEFINE_ROW_KERNELS(bf16, 1)

/* ------------------------------------------------------------------------------------------------ */
/* Paged decode attention: one query token per sequence, work item = (sequence, kv head). Each thread
 * has one scratch buffer (floats): scores [group * seq_len], value accumulators [group * d padded to a
 * multiple of 32], 1/sum [group]. head_dim <= 32 * MAX_NC (the Python side checks). */

/* Softmax over each head's scores in place, unnormalised (exp(s - max)); inv[hh] = 1 / sum. */
INLINE FAST_FP void softmax_rows(float *restrict sc, float *restrict inv, int64_t group, int64_t L) {
    for (int64_t hh = 0; hh < group; hh++) {
        float *restrict sh = sc + hh * L;
        float m = -INFINITY;
#pragma omp simd reduction(max : m)
        for (int64_t p = 0; p < L; p++) m = sh[p] > m ? sh[p] : m;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t p = 0; p < L; p++) {
            float e = exp_f32(sh[p] - m);
            sh[p] = e;
            sum += e;
        }
        inv[hh] = 1.0f / sum;
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

/* Stores a * scale, b * scale as chunk c of a D-element row, undoing ld32's element order. */
INLINE void st32_row(void *p, int64_t c, int64_t D, v16f a, v16f b, float scale, const int bf) {
    const int64_t nv = D - 32 * c;
    for (int l = 0; l < 16; l++) {
        const int64_t ea = bf ? 2 * l : l, eb = bf ? 2 * l + 1 : 16 + l;
        if (ea < nv) st(p, 32 * c + ea, a[l] * scale, bf);
        if (eb < nv) st(p, 32 * c + eb, b[l] * scale, bf);
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

/* Pointers to the rows of positions p0 .. p0+m-1 (KV head g) through the block table, m = min(16, L - p0);
 * returns m (0 past the end). Each row is prefetched: the rows are used one chunk later. */
INLINE int64_t row_ptrs(const void **rows, const void *cache, const int32_t *blocks, int64_t p0, int64_t L,
                        int64_t block_size, int64_t kvh, int64_t g, int64_t D, const int bf) {
    const int64_t m = p0 >= L ? 0 : (L - p0 < 16 ? L - p0 : 16);
    const int64_t row_bytes = D * (bf ? 2 : 4);
    int64_t b = p0 / block_size, o = p0 - b * block_size;
    for (int64_t k = 0; k < m; k++) {
        rows[k] = off(cache, (((int64_t)blocks[b] * block_size + o) * kvh + g) * D, bf);
        for (int64_t x = 0; x < row_bytes; x += 64) __builtin_prefetch((const char *)rows[k] + x);
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
                             int64_t kvh, int64_t g, int64_t D, const int bf) {
    const int64_t end = p0 + 16 < L ? p0 + 16 : L;
    const int64_t row_bytes = D * (bf ? 2 : 4);
    for (int64_t p = p0; p < end; p++) {
        const int64_t b = p / block_size, o = p - b * block_size;
        const char *row = (const char *)off(cache, (((int64_t)blocks[b] * block_size + o) * kvh + g) * D, bf);
        for (int64_t x = 0; x < row_bytes; x += 64) __builtin_prefetch(row + x, 0, 2);
    }
}

INLINE FAST_FP void attn_item_vec(int64_t i, int64_t g, const void *q, int64_t q_ts, int64_t q_hs,
                                  const void *kc, const void *vc, int64_t block_size, int64_t kvh,
                                  const int32_t *bt, int64_t max_blocks, int64_t L, void *out, int64_t H,
                                  const int64_t D, float scale, float *buf, const int bf) {
    const int64_t group = H / kvh, NC = (D + 31) / 32, DP = NC * 32; /* DP: D padded */
    float *restrict sc = buf;
    float *restrict acc = sc + group * L;
    float *restrict inv = acc + group * DP;
    const int32_t *blocks = bt + i * max_blocks;
    const void *rows[2][16];

    if (L <= 0) {
        for (int64_t hh = 0; hh < group; hh++)
            for (int64_t j = 0; j < D; j++) st(out, (i * H + g * group + hh) * D + j, 0.0f, bf);
        return;
    }
    int64_t m = row_ptrs(rows[0], kc, blocks, 0, L, block_size, kvh, g, D, bf);
#if HAVE_DPBF16
    /* bf16 rows of whole 32-element chunks: q . k straight from bf16 by vdpbf16ps (exact products, fp32
     * sums), each K row loaded once for all the query heads sharing it. */
    if (bf && D % 32 == 0 && group <= ATTN_DP_MAX_GROUP) {
        __m512bh qv[ATTN_DP_MAX_GROUP][MAX_NC];
        for (int64_t hh = 0; hh < group; hh++) {
            const uint16_t *qp = (const uint16_t *)q + i * q_ts + (g * group + hh) * q_hs;
            for (int64_t c = 0; c < NC; c++) qv[hh][c] = (__m512bh)_mm512_loadu_si512(qp + 32 * c);
        }
        v16f a[ATTN_DP_MAX_GROUP][16];
        for (int64_t p0 = 0, cur = 0; p0 < L; p0 += 16, cur ^= 1) {
            const void **rk = rows[cur];
            const int64_t m_next = row_ptrs(rows[cur ^ 1], kc, blocks, p0 + 16, L, block_size, kvh, g, D, bf);
            prefetch_rows_l2(kc, blocks, p0 + ATTN_L2_AHEAD, L, block_size, kvh, g, D, bf);
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
        const int64_t m_next = row_ptrs(rows[cur ^ 1], kc, blocks, p0 + 16, L, block_size, kvh, g, D, bf);
        prefetch_rows_l2(kc, blocks, p0 + ATTN_L2_AHEAD, L, block_size, kvh, g, D, bf);
        for (int64_t hh = 0; hh < group; hh++) {
            const void *qp = off(q, i * q_ts + (g * group + hh) * q_hs, bf);
            v16f qa[MAX_NC], qb[MAX_NC], a[16];
            for (int64_t c = 0; c < NC; c++) ld32_row(qp, c, D, bf, &qa[c], &qb[c]);
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
            float *sh = sc + hh * L + p0;
            if (m == 16)
                memcpy(sh, &sums, sizeof sums);
            else
                for (int64_t o = 0; o < m; o++) sh[o] = sums[o];
        }
        m = m_next;
    }
    softmax_rows(sc, inv, group, L);
    for (int64_t j = 0; j < group * DP; j++) acc[j] = 0.0f;
    m = row_ptrs(rows[0], vc, blocks, 0, L, block_size, kvh, g, D, bf);
    for (int64_t p0 = 0, cur = 0; p0 < L; p0 += 16, cur ^= 1) {
        const void **rv = rows[cur];
        const int64_t m_next = row_ptrs(rows[cur ^ 1], vc, blocks, p0 + 16, L, block_size, kvh, g, D, bf);
        prefetch_rows_l2(vc, blocks, p0 + ATTN_L2_AHEAD, L, block_size, kvh, g, D, bf);
        for (int64_t hh = 0; hh < group; hh++) {
            /* two accumulator sets (even / odd positions) halve the FMA dependency chains */
            v16f aa[2][MAX_NC], ab[2][MAX_NC];
            float *ah = acc + hh * DP;
            for (int64_t c = 0; c < NC; c++) {
                memcpy(&aa[0][c], ah + 32 * c, sizeof aa[0][c]);
                memcpy(&ab[0][c], ah + 32 * c + 16, sizeof ab[0][c]);
                aa[1][c] = (v16f){0};
                ab[1][c] = (v16f){0};
            }
            const float *wh = sc + hh * L + p0;
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
        m = m_next;
    }
    for (int64_t hh = 0; hh < group; hh++) {
        void *oh = off(out, (i * H + g * group + hh) * D, bf);
        for (int64_t c = 0; c < NC; c++) {
            v16f aa, ab;
            memcpy(&aa, acc + hh * DP + 32 * c, sizeof aa);
            memcpy(&ab, acc + hh * DP + 32 * c + 16, sizeof ab);
            st32_row(oh, c, D, aa, ab, inv[hh], bf);
        }
    }
}

/* Per dtype, one non-inlined item function (keeps the compile time down): head sizes 64 and 128 get
 * compile-time copies, the rest (up to 32 * MAX_NC) the runtime-D one. */
#define DEFINE_ATTN_ITEM(SFX, BF)                                                                             \
    static FAST_FP __attribute__((noinline)) void attn_item_##SFX(                                           \
        int64_t it, const void *q, int64_t q_ts, int64_t q_hs, const void *kc, const void *vc,              \
        int64_t block_size, int64_t kvh, const int32_t *bt, int64_t max_blocks, const int32_t *seq_lens,    \
        void *out, int64_t H, int64_t d, float scale, float *buf) {                                          \
        const int64_t i = it / kvh, g = it % kvh, L = seq_lens[i];                                           \
        if (d == 64)                                                                                         \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, bt, max_blocks, L, out, H, 64, scale, \
                          buf, BF);                                                                          \
        else if (d == 128)                                                                                   \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, bt, max_blocks, L, out, H, 128,      \
                          scale, buf, BF);                                                                   \
        else                                                                                                 \
            attn_item_vec(i, g, q, q_ts, q_hs, kc, vc, block_size, kvh, bt, max_blocks, L, out, H, d, scale,  \
                          buf, BF);                                                                          \
    }

DEFINE_ATTN_ITEM(f32, 0)
DEFINE_ATTN_ITEM(bf16, 1)

/* Validates every index, then writes the new K/V (all writes precede all reads). Returns 0, or a
 * negative code when an index is out of range (nothing is read or written out of bounds then):
 * -1 slot_mapping >= num_blocks * block_size, -2 seq_len > max_blocks * block_size or < 0, -3 a block id
 * outside [0, num_blocks). Slots < 0 are skipped (padding rows). Sets *max_len and *work (sum seq_len). */
INLINE int attn_prepare(const void *k, int64_t k_ts, int64_t k_hs, const void *v, int64_t v_ts, int64_t v_hs,
                        void *kc, void *vc, int64_t num_blocks, int64_t block_size, int64_t kvh,
                        const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,
                        const int32_t *seq_lens, int64_t n, int64_t d, int64_t *max_len, int64_t *work,
                        const int bf) {
    const int64_t num_slots = num_blocks * block_size;
    *max_len = 0;
    *work = 0;
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = slot_mapping[i];
        const int64_t L = seq_lens[i];
        if (slot >= num_slots) return -1;
        if (L < 0 || L > max_blocks * block_size) return -2;
        const int32_t *blocks = block_tables + i * max_blocks;
        for (int64_t b = 0; b * block_size < L; b++)
            if (blocks[b] < 0 || blocks[b] >= num_blocks) return -3;
        *max_len = L > *max_len ? L : *max_len;
        *work += L;
    }
    const size_t bytes = (size_t)d * (bf ? 2 : 4);
    for (int64_t i = 0; i < n; i++) {
        const int64_t slot = slot_mapping[i];
        if (slot < 0) continue;
        for (int64_t hh = 0; hh < kvh; hh++) {
            memcpy(off(kc, (slot * kvh + hh) * d, bf), off(k, i * k_ts + hh * k_hs, bf), bytes);
            memcpy(off(vc, (slot * kvh + hh) * d, bf), off(v, i * v_ts + hh * v_hs, bf), bytes);
        }
    }
    return 0;
}

/* kv_cache: [2, num_blocks, block_size, kvh, d]; returns attn_prepare's code, or -4 when out of memory. */
#define DEFINE_ATTENTION(SFX, BF)                                                                            \
    FAST_FP int izh_paged_decode_attention_##SFX(                                                            \
        const void *q, int64_t q_ts, int64_t q_hs, const void *k, int64_t k_ts, int64_t k_hs, const void *v,   \
        int64_t v_ts, int64_t v_hs, void *kv_cache, int64_t num_blocks, int64_t block_size, int64_t kvh,     \
        const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens, \
        void *out, int64_t n, int64_t H, int64_t d, float scale, int nt) {                                   \
        void *kc = kv_cache;                                                                                 \
        void *vc = off(kv_cache, num_blocks * block_size * kvh * d, BF);                                     \
        int64_t max_len, work;                                                                               \
        int rc = attn_prepare(k, k_ts, k_hs, v, v_ts, v_hs, kc, vc, num_blocks, block_size, kvh, slot_mapping, \
                              block_tables, max_blocks, seq_lens, n, d, &max_len, &work, BF);                \
        if (rc != 0) return rc;                                                                              \
        const int64_t group = H / kvh;                                                                       \
        const size_t scratch = (size_t)(group * (max_len + d + 32) + group) * sizeof(float);                \
        const int64_t items = n * kvh;                                                                       \
        int failed = 0;                                                                                      \
        if (nt <= 1 || work * H * d < PAR_MIN_ATTN || items <= 1) {                                          \
            float *buf = (float *)malloc(scratch);                                                           \
            if (!buf) return -4;                                                                             \
            for (int64_t it = 0; it < items; it++)                                                           \
                attn_item_##SFX(it, q, q_ts, q_hs, kc, vc, block_size, kvh, block_tables, max_blocks,        \
                                seq_lens, out, H, d, scale, buf);                                            \
            free(buf);                                                                                       \
        } else {                                                                                             \
            _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {                                  \
                float *buf = (float *)malloc(scratch);                                                       \
                failed |= buf == NULL;                                                                       \
                _Pragma("omp for schedule(dynamic, kvh)") for (int64_t it = 0; it < items; it++) if (buf)      \
                    attn_item_##SFX(it, q, q_ts, q_hs, kc, vc, block_size, kvh, block_tables, max_blocks,    \
                                    seq_lens, out, H, d, scale, buf);                                        \
                free(buf);                                                                                   \
            }                                                                                                \
        }                                                                                                    \
        return failed ? -4 : 0;                                                                              \
    }

DEFINE_ATTENTION(f32, 0)
DEFINE_ATTENTION(bf16, 1)


/* ------------------------------------------------------------------------------------------------ */
/* Weight-only quantized matmuls for small batches: out[M, N] = x[M, K] (bf16) @ W^T, 1 <= M <= 8 through
 * AVX-512 here (AMX, further down, takes 5..64 rows where it runs; izh_q4_gemm / izh_q8_gemm choose).
 * Decode on a CPU is bound by streaming the weights, so the weights are laid out in the order they are
 * read: one contiguous run per 16 output rows ("tile"), group after group (32 inputs), each group a
 * fixed-size record. Each AVX-512 lane accumulates one output row; threads split the tiles, so every
 * thread reads one contiguous stretch of memory. Needs AVX512-BW + AVX512-BF16 (else izh_qgemm_available
 * returns 0 and the callers keep torch's kernels).
 *
 * int4 record (Q4_RECORD bytes): 8 blocks of 32 bytes, block b covering inputs 4b..4b+3 of the group:
 * byte 2i+e holds row i's code for input 4b+e (low nibble) and 4b+2+e (high nibble); then 16 bf16
 * scales and 16 bf16 minimums (one per row): w = code * scale + minimum, code in [0, 15].
 * A code c is turned into the bf16 number 128 + c by OR-ing it into 0x4300, and vdpbf16ps multiplies
 * pairs of those by pairs of x; the 128 * sum(x) this adds is taken off per group in fp32.
 *
 * int8 record (Q8_RECORD bytes): 32 inputs x 16 rows of int8 codes (input-major), then 16 bf16 scales:
 * w = code * scale (GGUF Q8_0's format). Converted to fp32 and multiplied in fp32. */
#define Q4_RECORD 320
#define Q8_RECORD 544
#define QGEMM_MAX_M 8
/* Software prefetch distance, in records: the hardware prefetcher alone leaves ~25% of the bandwidth. */
#define QGEMM_PREFETCH 8

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#include <immintrin.h>

INLINE void prefetch_record(const uint8_t *rec, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch((const char *)rec + i, _MM_HINT_T0);
}

INLINE __m512 bf16x16_to_ps(const void *p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

INLINE void store_row16(void *out, int64_t idx, __m512 v, const int out_f32) {
    if (out_f32)
        _mm512_storeu_ps((float *)out + idx, v);
    else
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + idx), (__m256i)_mm512_cvtneps_pbh(v));
}

/* dpbf16ps and FMAs have a latency of several cycles: with few rows, a group's products go to this many
 * independent accumulator chains, summed by sum_chains at the end of the group. */
INLINE int qgemm_chains(const int M) { return M == 1 ? 4 : M == 2 ? 2 : 1; }

INLINE __m512 sum_chains(const __m512 *t, const int NC) {
    __m512 dot = t[0];
    for (int c = 1; c < NC; c++) dot = _mm512_add_ps(dot, t[c]);
    return dot;
}

/* One tile of the int4 matmul. xsum[m * groups + g] = sum of x[m] over group g (fp32). */
INLINE void q4_tile(const int M, const uint16_t *x, int64_t xs, const float *xsum, const uint8_t *rec,
                    int64_t groups, void *out, int64_t os, int out_f32, int64_t tile) {
    const int NC = qgemm_chains(M);
    const __m512i lowmask = _mm512_set1_epi16(0x0F), magic = _mm512_set1_epi16(0x4300);
    __m512 acc[QGEMM_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += Q4_RECORD) {
        prefetch_record(rec + QGEMM_PREFETCH * Q4_RECORD, Q4_RECORD);
        __m512 t[QGEMM_MAX_M][4];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < NC; c++) t[m][c] = _mm512_setzero_ps();
        for (int b = 0; b < 8; b++) {
            const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(rec + 32 * b)));
            const __m512bh lo = (__m512bh)_mm512_or_si512(_mm512_and_si512(w, lowmask), magic);
            const __m512bh hi = (__m512bh)_mm512_or_si512(_mm512_srli_epi16(w, 4), magic);
            const int c0 = (2 * b) % NC, c1 = (2 * b + 1) % NC;
            for (int m = 0; m < M; m++) {
                const uint16_t *xm = x + m * xs + g * 32 + 4 * b;
                int32_t a, c;
                memcpy(&a, xm, 4);
                memcpy(&c, xm + 2, 4);
                t[m][c0] = _mm512_dpbf16_ps(t[m][c0], lo, (__m512bh)_mm512_set1_epi32(a));
                t[m][c1] = _mm512_dpbf16_ps(t[m][c1], hi, (__m512bh)_mm512_set1_epi32(c));
            }
        }
        const __m512 scale = bf16x16_to_ps(rec + 256), minimum = bf16x16_to_ps(rec + 288);
        for (int m = 0; m < M; m++) {
            const float X = xsum[m * groups + g];
            const __m512 dot = _mm512_sub_ps(sum_chains(t[m], NC), _mm512_set1_ps(128.0f * X));
            acc[m] = _mm512_fmadd_ps(dot, scale, acc[m]);
            acc[m] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(X), acc[m]);
        }
    }
    for (int m = 0; m < M; m++) store_row16(out, m * os + tile * 16, acc[m], out_f32);
}

/* One tile of the int8 matmul; xf is x in fp32 [M, K] (contiguous). */
INLINE void q8_tile(const int M, const float *xf, int64_t K, const uint8_t *rec, int64_t groups, void *out,
                    int64_t os, int out_f32, int64_t tile) {
    const int NC = qgemm_chains(M);
    __m512 acc[QGEMM_MAX_M];
    for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += Q8_RECORD) {
        prefetch_record(rec + QGEMM_PREFETCH * Q8_RECORD, Q8_RECORD);
        __m512 t[QGEMM_MAX_M][4];
        for (int m = 0; m < M; m++)
            for (int c = 0; c < NC; c++) t[m][c] = _mm512_setzero_ps();
        for (int k = 0; k < 32; k++) {
            const __m128i codes = _mm_loadu_si128((const __m128i *)(rec + 16 * k));
            const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(codes));
            const int c = k % NC;
            for (int m = 0; m < M; m++)
                t[m][c] = _mm512_fmadd_ps(w, _mm512_set1_ps(xf[m * K + g * 32 + k]), t[m][c]);
        }
        const __m512 scale = bf16x16_to_ps(rec + 512);
        for (int m = 0; m < M; m++) acc[m] = _mm512_fmadd_ps(sum_chains(t[m], NC), scale, acc[m]);
    }
    for (int m = 0; m < M; m++) store_row16(out, m * os + tile * 16, acc[m], out_f32);
}

/* Tiles split statically over the team (one contiguous stretch of weights each); one copy per M. */
#define DEFINE_QGEMM_M(MM)                                                                                    \
    static __attribute__((noinline)) void q4_gemm_m##MM(const uint16_t *x, int64_t xs, const float *xsum,     \
                                                        const uint8_t *w, int64_t tiles, int64_t groups,      \
                                                        void *out, int64_t os, int out_f32, int nt) {         \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                 \
        for (int64_t t = 0; t < tiles; t++)                                                                    \
            q4_tile(MM, x, xs, xsum, w + t * groups * Q4_RECORD, groups, out, os, out_f32, t);                \
    }                                                                                                          \
    static __attribute__((noinline)) void q8_gemm_m##MM(const float *xf, int64_t K, const uint8_t *w,         \
                                                        int64_t tiles, int64_t groups, void *out, int64_t os, \
                                                        int out_f32, int nt) {                                \
        _Pragma("omp parallel for num_threads(nt) schedule(static)")                 \
        for (int64_t t = 0; t < tiles; t++)                                                                    \
            q8_tile(MM, xf, K, w + t * groups * Q8_RECORD, groups, out, os, out_f32, t);                      \
    }
DEFINE_QGEMM_M(1)
DEFINE_QGEMM_M(2)
DEFINE_QGEMM_M(3)
DEFINE_QGEMM_M(4)
DEFINE_QGEMM_M(5)
DEFINE_QGEMM_M(6)
DEFINE_QGEMM_M(7)
DEFINE_QGEMM_M(8)

#define QGEMM_SWITCH(FN, ...)                                                                                  \
    switch (M) {                                                                                               \
    case 1: FN##1(__VA_ARGS__); break;                                                                         \
    case 2: FN##2(__VA_ARGS__); break;                                                                         \
    case 3: FN##3(__VA_ARGS__); break;                                                                         \
    case 4: FN##4(__VA_ARGS__); break;                                                                         \
    case 5: FN##5(__VA_ARGS__); break;                                                                         \
    case 6: FN##6(__VA_ARGS__); break;                                                                         \
    case 7: FN##7(__VA_ARGS__); break;                                                                         \
    default: FN##8(__VA_ARGS__); break;                                                                        \
    }

int izh_qgemm_available(void) { return 1; }

/* The AVX-512 kernels for 1..8 rows (izh_q4_gemm / izh_q8_gemm below choose). Return 0 or -4 (memory). */
static int q4_gemm_avx(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                       int64_t os, int out_f32, int nt) {
    const int64_t groups = K / 32;
    float stack[QGEMM_MAX_M * 256];
    float *xsum = M * groups <= QGEMM_MAX_M * 256 ? stack : (float *)malloc(sizeof(float) * M * groups);
    if (!xsum) return -4;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.0f;
            for (int k = 0; k < 32; k++) s += bf2f(x[m * xs + g * 32 + k]);
            xsum[m * groups + g] = s;
        }
    QGEMM_SWITCH(q4_gemm_m, x, xs, xsum, w, N / 16, groups, out, os, out_f32, nt)
    if (xsum != stack) free(xsum);
    return 0;
}

static int q8_gemm_avx(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                       int64_t os, int out_f32, int nt) {
    float *xf = (float *)malloc(sizeof(float) * M * K);
    if (!xf) return -4;
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = bf2f(x[m * xs + k]);
    QGEMM_SWITCH(q8_gemm_m, xf, K, w, N / 16, K / 32, out, os, out_f32, nt)
    free(xf);
    return 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Records for medium batches (up to AMX_MAX_M rows) with AMX: each record is dequantized once into a bf16
 * B tile (the weights rounded to bf16: what the dense bf16 model holds) and multiplied with up to 4 A tiles
 * of 16 rows by tdpbf16ps, accumulating over the whole input dim in C tiles. Streaming a quarter (int4) or
 * half (int8) of the dense weights' bytes makes these steps 2-3x faster than the dense bf16 matmul; the
 * dequantizing costs about as much as one row through the AVX-512 kernel, so few rows stay there.
 * Linux needs the AMX state requested once per process (arch_prctl). */
#define AMX_MAX_M 64
#define Q4_AMX_MIN_M 5 /* measured: 1-4 rows are faster through q4_gemm_avx */
#define Q8_AMX_MIN_M 9 /* the int8 AVX-512 kernel (fp32 FMAs) scales better with rows */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

static int amx_permitted = -1; /* -1 unknown, 0 no, 1 yes */

static int amx_available(void) {
    if (amx_permitted < 0) {
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18); repeating it is harmless. */
        amx_permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return amx_permitted;
}

/* B tile row 2r+e layout (VNNI pairs): lane 2i+e of row r holds column i's input 2r+e. */

/* int4: block b's first 16 bytes hold columns 0..7 (byte 2i+e), the next 16 columns 8..15; low nibbles
 * are inputs 4b+e (B row 2b), high nibbles 4b+2+e (row 2b+1). code * scale is exact in fp32 (4-bit
 * code, bf16 scale), so the fused multiply-add rounds once, like torch's codes * scales + mins. */
INLINE void q4_record_to_b_tile(const uint8_t *rec, uint16_t *btile) {
    const __m512i lowmask = _mm512_set1_epi32(0x0F);
    const __m512 scale = bf16x16_to_ps(rec + 256), minimum = bf16x16_to_ps(rec + 288);
    const __m512i lo_idx = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    const __m512i hi_idx = _mm512_add_epi32(lo_idx, _mm512_set1_epi32(8));
    const __m512 s0 = _mm512_permutexvar_ps(lo_idx, scale), s1 = _mm512_permutexvar_ps(hi_idx, scale);
    const __m512 m0 = _mm512_permutexvar_ps(lo_idx, minimum), m1 = _mm512_permutexvar_ps(hi_idx, minimum);
    for (int b = 0; b < 8; b++) {
        const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + 32 * b)));
        const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(rec + 32 * b + 16)));
        const __m512 a0 = _mm512_cvtepi32_ps(_mm512_and_si512(first, lowmask));
        const __m512 c0 = _mm512_cvtepi32_ps(_mm512_and_si512(second, lowmask));
        const __m512 a1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(first, 4));
        const __m512 c1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(second, 4));
        _mm512_store_si512((__m512i *)(btile + 64 * b),
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(c0, s1, m1), _mm512_fmadd_ps(a0, s0, m0)));
        _mm512_store_si512((__m512i *)(btile + 64 * b + 32),
                           (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(c1, s1, m1), _mm512_fmadd_ps(a1, s0, m0)));
    }
}

/* int8: input k's 16 codes are bytes 16k..16k+15 (one per column); code * scale is exact in fp32. The two
 * inputs of a pair are scaled separately, then interleaved into the VNNI lanes. */
INLINE void q8_record_to_b_tile(const uint8_t *rec, uint16_t *btile) {
    const __m512 scale = bf16x16_to_ps(rec + 512);
    const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                           21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    for (int r = 0; r < 16; r++) {
        const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rec + 32 * r))));
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(rec + 32 * r + 16))));
        const __m512i ac = (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(c, scale), _mm512_mul_ps(a, scale));
        _mm512_store_si512((__m512i *)(btile + 32 * r), _mm512_permutexvar_epi16(pairs, ac));
    }
}

#define AMX_CHUNK(C, TILE)                                                                               \
    if (chunks > C) {                                                                                     \
        _tile_loadd(1, xpad + (int64_t)(C) * 16 * K + g * 32, K * 2);                                     \
        _tile_dpbf16ps(TILE, 1, 0);                                                                       \
    }

/* xpad: bf16 [chunks * 16, K], zero rows past M. One thread's share [t0, t1) of the column tiles. */
INLINE void amx_tiles(const int q8, const uint16_t *xpad, int64_t M, int64_t K, const uint8_t *w, int64_t t0,
                      int64_t t1, void *out, int64_t os, int out_f32) {
    const int64_t record = q8 ? Q8_RECORD : Q4_RECORD;
    const int chunks = (int)((M + 15) / 16);
    const int64_t groups = K / 32;
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 6; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    uint16_t btile[16 * 32] __attribute__((aligned(64)));
    float cbuf[16 * 16] __attribute__((aligned(64)));
    for (int64_t t = t0; t < t1; t++) {
        const uint8_t *rec = w + t * groups * record;
        _tile_zero(2);
        _tile_zero(3);
        _tile_zero(4);
        _tile_zero(5);
        for (int64_t g = 0; g < groups; g++, rec += record) {
            prefetch_record(rec + QGEMM_PREFETCH * record, record);
            if (q8)
                q8_record_to_b_tile(rec, btile);
            else
                q4_record_to_b_tile(rec, btile);
            _tile_loadd(0, btile, 64);
            AMX_CHUNK(0, 2)
            AMX_CHUNK(1, 3)
            AMX_CHUNK(2, 4)
            AMX_CHUNK(3, 5)
        }
        for (int c = 0; c < chunks; c++) {
            switch (c) {
            case 0: _tile_stored(2, cbuf, 64); break;
            case 1: _tile_stored(3, cbuf, 64); break;
            case 2: _tile_stored(4, cbuf, 64); break;
            default: _tile_stored(5, cbuf, 64); break;
            }
            for (int r = 0; r < 16 && c * 16 + r < M; r++)
                store_row16(out, (c * 16 + r) * os + t * 16, _mm512_load_ps(cbuf + 16 * r), out_f32);
        }
    }
    _tile_release();
}

static __attribute__((noinline)) void q4_amx_tiles(const uint16_t *xpad, int64_t M, int64_t K, const uint8_t *w,
                                                   int64_t t0, int64_t t1, void *out, int64_t os, int out_f32) {
    amx_tiles(0, xpad, M, K, w, t0, t1, out, os, out_f32);
}

static __attribute__((noinline)) void q8_amx_tiles(const uint16_t *xpad, int64_t M, int64_t K, const uint8_t *w,
                                                   int64_t t0, int64_t t1, void *out, int64_t os, int out_f32) {
    amx_tiles(1, xpad, M, K, w, t0, t1, out, os, out_f32);
}

static int gemm_amx(const int q8, const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                    void *out, int64_t os, int out_f32, int nt) {
    const int64_t rows = (M + 15) / 16 * 16, tiles = N / 16;
    uint16_t *xpad = (uint16_t *)calloc((size_t)(rows * K), sizeof(uint16_t));
    if (!xpad) return -4;
    for (int64_t m = 0; m < M; m++) memcpy(xpad + m * K, x + m * xs, (size_t)K * sizeof(uint16_t));
    if (nt <= 1 || tiles < 2) {
        (q8 ? q8_amx_tiles : q4_amx_tiles)(xpad, M, K, w, 0, tiles, out, os, out_f32);
    } else {
        _Pragma("omp parallel num_threads(nt)") {
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            (q8 ? q8_amx_tiles : q4_amx_tiles)(xpad, M, K, w, tiles * me / team, tiles * (me + 1) / team, out, os,
                                               out_f32);
        }
    }
    free(xpad);
    return 0;
}
#else
static int amx_available(void) { return 0; }
static int gemm_amx(const int q8, const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                    void *out, int64_t os, int out_f32, int nt) {
    (void)q8, (void)x, (void)xs, (void)w, (void)M, (void)N, (void)K, (void)out, (void)os, (void)out_f32, (void)nt;
    return -2;
}
#endif

/* The most rows the record matmuls take: AMX_MAX_M with AMX, else QGEMM_MAX_M. */
int izh_qgemm_max_rows(void) { return amx_available() ? AMX_MAX_M : QGEMM_MAX_M; }

/* 1 when a q4 (q8 = 0) or q8 matmul of M rows runs through AMX, whose weights are rounded to bf16. */
int izh_qgemm_uses_amx(int q8, int64_t M) {
    return M <= AMX_MAX_M && M >= (q8 ? Q8_AMX_MIN_M : Q4_AMX_MIN_M) && amx_available();
}

/* x: bf16 [M, K], row stride xs (elements); w: the records; out: [M, N] bf16 (or fp32 when out_f32), row
 * stride os. Picks the AVX-512 or the AMX kernel by M. Returns 0, -1 for a bad shape (M outside
 * 1..izh_qgemm_max_rows(), N % 16, K % 32), -4 out of memory. */
int izh_q4_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt) {
    if (M < 1 || M > izh_qgemm_max_rows() || N % 16 || K % 32 || N <= 0 || K <= 0) return -1;
    if (izh_qgemm_uses_amx(0, M)) return gemm_amx(0, x, xs, w, M, N, K, out, os, out_f32, nt);
    return q4_gemm_avx(x, xs, w, M, N, K, out, os, out_f32, nt);
}

int izh_q8_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt) {
    if (M < 1 || M > izh_qgemm_max_rows() || N % 16 || K % 32 || N <= 0 || K <= 0) return -1;
    if (izh_qgemm_uses_amx(1, M)) return gemm_amx(1, x, xs, w, M, N, K, out, os, out_f32, nt);
    return q8_gemm_avx(x, xs, w, M, N, K, out, os, out_f32, nt);
}

/* ------------------------------------------------------------------------------------------------ */
/* A whole decode step through the decoder stack in one call, for up to 8 single-token decodes with
 * every linear in izh's records (bf16 activations, Llama-style layers: no per-head q/k norm). It makes
 * exactly the calls the Python modules make (izh.model.llama with the kernels above), in the same order
 * and with the same roundings, so its output is bit-identical to theirs; it only skips the Python between
 * them (about 80 us a layer on a 2-core CPU, as much as the layer's matmuls).
 *
 * layers: num_layers rows of STACK_FIELDS int64: input-norm weight, post-attention-norm weight, KV cache
 * ([2, num_blocks, block_size, kvh, d]), then (records, kind 4 or 8, bias or 0) for qkv, o, gate_up, down.
 * x: [M, hidden] embeddings, used as the residual stream (overwritten); out: [M, hidden] final-normed.
 * Returns 0; attention's -1..-3 for an index outside the cache (found in layer 0, before any K/V is
 * written); -4 out of memory; -5 M outside 1..izh_qgemm_max_rows(); -6 a matmul refused its shape. */
enum { STACK_IN_NORM, STACK_POST_NORM, STACK_KV, STACK_QKV, STACK_O = STACK_QKV + 3, STACK_GATE_UP = STACK_O + 3,
       STACK_DOWN = STACK_GATE_UP + 3, STACK_FIELDS = STACK_DOWN + 3 };

static int stack_linear(const int64_t *lin, const uint16_t *x, int64_t M, int64_t N, int64_t K, uint16_t *out,
                        int nt) {
    const uint8_t *rec = (const uint8_t *)(intptr_t)lin[0];
    int rc = lin[1] == 4 ? izh_q4_gemm(x, K, rec, M, N, K, out, N, 0, nt) : izh_q8_gemm(x, K, rec, M, N, K, out, N, 0, nt);
    if (rc == -1) return -6; /* a shape the matmul refused: not attention's -1 (a slot past the cache) */
    const uint16_t *bias = (const uint16_t *)(intptr_t)lin[2];
    if (rc == 0 && bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) out[m * N + j] = f2bf(bf2f(out[m * N + j]) + bf2f(bias[j]));
    return rc;
}

int izh_decode_stack_bf16(const int64_t *layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t H,
                          int64_t kvh, int64_t d, int64_t inter, float eps, float scale, uint16_t *x,
                          const uint16_t *final_norm, uint16_t *out, const uint16_t *cos_sin,
                          const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,
                          const int32_t *seq_lens, int64_t num_blocks, int64_t block_size, int nt) {
    if (M < 1 || M > izh_qgemm_max_rows()) return -5;
    const int64_t qkv_w = (H + 2 * kvh) * d;
    const size_t elems = (size_t)M * (2 * hidden + qkv_w + H * d + 3 * inter);
    uint16_t *buf = (uint16_t *)malloc(elems * sizeof(uint16_t));
    if (!buf) return -4;
    uint16_t *normed = buf, *h = normed + M * hidden, *qkv = h + M * hidden, *attn = qkv + M * qkv_w;
    uint16_t *gate_up = attn + M * H * d, *act = gate_up + M * 2 * inter;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const int64_t *lp = layers + l * STACK_FIELDS;
        const uint16_t *in_norm = (const uint16_t *)(intptr_t)lp[STACK_IN_NORM];
        const uint16_t *post_norm = (const uint16_t *)(intptr_t)lp[STACK_POST_NORM];
        if (l == 0)
            izh_rms_norm_bf16(x, hidden, in_norm, normed, M, hidden, eps, nt);
        else
            izh_add_rms_norm_bf16(h, x, in_norm, normed, M, hidden, eps, nt);
        if ((rc = stack_linear(lp + STACK_QKV, normed, M, qkv_w, hidden, qkv, nt))) break;
        izh_rotary_bf16(qkv, qkv_w, d, cos_sin, M, H + kvh, d, nt);
        rc = izh_paged_decode_attention_bf16(qkv, qkv_w, d, qkv + H * d, qkv_w, d, qkv + (H + kvh) * d, qkv_w, d,
                                             (void *)(intptr_t)lp[STACK_KV], num_blocks, block_size, kvh,
                                             slot_mapping, block_tables, max_blocks, seq_lens, attn, M, H, d,
                                             scale, nt);
        if (rc) break;
        if ((rc = stack_linear(lp + STACK_O, attn, M, hidden, H * d, h, nt))) break;
        izh_add_rms_norm_bf16(h, x, post_norm, normed, M, hidden, eps, nt);
        if ((rc = stack_linear(lp + STACK_GATE_UP, normed, M, 2 * inter, hidden, gate_up, nt))) break;
        izh_silu_mul_bf16(gate_up, 2 * inter, act, M, inter, nt);
        rc = stack_linear(lp + STACK_DOWN, act, M, hidden, inter, h, nt);
    }
    if (rc == 0) izh_add_rms_norm_bf16(h, x, final_norm, out, M, hidden, eps, nt);
    free(buf);
    return rc;
}
#else
int izh_qgemm_available(void) { return 0; }
int izh_qgemm_max_rows(void) { return 0; }
int izh_qgemm_uses_amx(int q8, int64_t M) {
    (void)q8, (void)M;
    return 0;
}
int izh_q4_gemm(void) { return -2; }
int izh_q8_gemm(void) { return -2; }
int izh_decode_stack_bf16(void) { return -2; }
#endif

/* ------------------------------------------------------------------------------------------------ */
/* Greedy decoding: per fp32 row, the index of the first maximum, a NaN counting as the maximum (the first
 * NaN wins), as torch.max(dim=-1).indices on a CPU. Rows in parallel when there are several. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t j = 0, best = 0;
    float m = -INFINITY;
#if HAVE_DPBF16
    if (n >= 16) {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 v = _mm512_loadu_ps(x + j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
            cur = _mm512_add_epi32(cur, step);
        }
        if (nan) {
            j = 0; /* the scalar loop below finds the first NaN */
        } else {
            m = _mm512_reduce_max_ps(vmax);
            const __mmask16 eq = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(eq, vidx);
        }
    }
#endif
    for (; j < n; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > m) {
            m = x[j];
            best = j;
        }
    }
    return best;
}

/* x: fp32 [rows, n] with row stride xs; out: int64 [rows]. */
void izh_argmax_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t n, int64_t *out, int nt) {
    if (nt <= 1 || rows * n < PAR_MIN_ELEMS || rows < 2) {
        for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * xs, n);
    } else {
        _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t r = 0; r < rows; r++) out[r] =
            argmax_row(x + r * xs, n);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* Sampling: per fp32 row of (temperature-scaled, masked) logits x and a uniform u in [0, 1), the first
 * token j whose cumulative exp(x - max) exceeds u times the row's total, i.e. inverse-CDF sampling from
 * softmax(x). Sums are in fp64 by chunks of SAMPLE_CHUNK tokens (vectorised); the scan skips whole chunks
 * by their sums and walks the one where the target falls, adding sequentially (should rounding leave the
 * target past that walk, the next chunk's first token of nonzero weight is taken). A row whose total
 * rounds to u * total picks its last token of nonzero probability; an all -inf (or NaN) row token 0. */
#define SAMPLE_CHUNK 256

static FAST_FP int64_t sample_row(const float *x, int64_t V, double u, double *csum) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
    if (!(m > -INFINITY) || m != m) return 0;
    const int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    float e[SAMPLE_CHUNK];
    double total = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
        const float *xc = x + c * SAMPLE_CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) e[i] = exp_f32(xc[i] - m);
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += e[i];
        csum[c] = sum;
        total += sum;
    }
    const double target = u * total;
    double cum = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        if (cum + csum[c] > target) {
            const int64_t n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
            const float *xc = x + c * SAMPLE_CHUNK;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) e[i] = exp_f32(xc[i] - m);
            double local = 0.0;
            for (int64_t i = 0; i < n; i++) {
                local += e[i];
                if (e[i] > 0.0f && cum + local > target) return c * SAMPLE_CHUNK + i;
            }
        }
        cum += csum[c];
    }
    for (int64_t j = V - 1; j > 0; j--)
        if (exp_f32(x[j] - m) > 0.0f) return j;
    return 0;
}

/* x: fp32 [rows, V] with row stride xs; u: fp64 [rows]; out: int64 [rows]. Returns -4 out of memory. */
int izh_sample_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t V, const double *u, int64_t *out,
                        int nt) {
    const int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    int failed = 0;
    if (nt <= 1 || rows * V < PAR_MIN_ELEMS || rows < 2) {
        double *csum = (double *)malloc(sizeof(double) * (size_t)chunks);
        if (!csum) return -4;
        for (int64_t r = 0; r < rows; r++) out[r] = sample_row(x + r * xs, V, u[r], csum);
        free(csum);
    } else {
        _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {
            double *csum = (double *)malloc(sizeof(double) * (size_t)chunks);
            failed |= csum == NULL;
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) if (csum) out[r] =
                sample_row(x + r * xs, V, u[r], csum);
            free(csum);
        }
    }
    return failed ? -4 : 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Top-p in place: per fp32 row of (temperature-scaled, top-k masked) logits and its top_p < 1, every
 * token outside the nucleus becomes -inf. The nucleus: tokens in descending probability, ties by token
 * id, kept while the probability mass before them is < top_p (the top token always). Probabilities are
 * exp(x - max) / sum in fp64. Only the tokens that can be in the nucleus are sorted: a histogram of the
 * row (buckets of TOP_P_WIDTH below its maximum, weighted by probability) finds the top buckets holding
 * at least top_p + TOP_P_MARGIN of the mass; their tokens are the candidates (all of them when the
 * margin cannot be had). Rows with top_p >= 1 are left alone. */
#define TOP_P_BUCKETS 1024
#define TOP_P_WIDTH 0.05f
#define TOP_P_MARGIN 1e-3

typedef struct {
    float x;
    int32_t id;
} top_p_cand;

static int top_p_order(const void *a, const void *b) {
    const top_p_cand *p = (const top_p_cand *)a, *q = (const top_p_cand *)b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

/* scratch: e [V] floats, cand [V]. */
static FAST_FP void top_p_row(float *x, int64_t V, float top_p, float *e, top_p_cand *cand) {
    if (!(top_p < 1.0f)) return;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
    if (!(m > -INFINITY) || m != m) return;
    double mass[TOP_P_BUCKETS] = {0};
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < V; j++) {
        e[j] = exp_f32(x[j] - m);
        total += e[j];
    }
    /* The last bucket (everything further down, masked tokens included) is never summed: it is reached
     * only when the others do not hold the needed mass. */
    for (int64_t j = 0; j < V; j++) {
        const float d = (m - x[j]) * (1.0f / TOP_P_WIDTH); /* +inf for a masked token */
        if (d < (float)(TOP_P_BUCKETS - 1)) mass[(int)d] += e[j];
    }
    double needed = ((double)top_p + TOP_P_MARGIN) * total, cum = 0.0;
    int crossing = TOP_P_BUCKETS - 1;
    for (int b = 0; b < TOP_P_BUCKETS - 1; b++) {
        cum += mass[b];
        if (cum >= needed) {
            crossing = b;
            break;
        }
    }
    int64_t k = 0;
    if (crossing == TOP_P_BUCKETS - 1) {
        for (int64_t j = 0; j < V; j++) cand[k++] = (top_p_cand){x[j], (int32_t)j};
    } else {
        /* Bucket <= crossing, computed as in the histogram. */
        for (int64_t j = 0; j < V; j++)
            if ((m - x[j]) * (1.0f / TOP_P_WIDTH) < (float)(crossing + 1)) cand[k++] = (top_p_cand){x[j], (int32_t)j};
    }
    qsort(cand, (size_t)k, sizeof *cand, top_p_order);
    const double limit = (double)top_p * total;
    double before = 0.0;
    int64_t last = 0; /* the last kept candidate */
    for (int64_t c = 0; c < k; c++) {
        if (before >= limit) break;
        last = c;
        before += (double)e[cand[c].id];
    }
    const float lx = cand[last].x;
    const int32_t lid = cand[last].id;
    /* Kept: ahead of the last kept candidate in (x descending, id ascending) order, or it. */
    for (int64_t j = 0; j < V; j++)
        if (!(x[j] > lx || (x[j] == lx && j <= lid))) x[j] = -INFINITY;
}

/* x: fp32 [rows, V], row stride xs, modified in place; top_p: fp32 [rows]. Returns -4 out of memory. */
int izh_top_p_rows_f32(float *x, int64_t xs, int64_t rows, int64_t V, const float *top_p, int nt) {
    const size_t scratch = (size_t)V * (sizeof(float) + sizeof(top_p_cand));
    int failed = 0;
    if (nt <= 1 || rows < 2) {
        char *buf = (char *)malloc(scratch);
        if (!buf) return -4;
        for (int64_t r = 0; r < rows; r++)
            top_p_row(x + r * xs, V, top_p[r], (float *)buf, (top_p_cand *)(buf + V * sizeof(float)));
        free(buf);
    } else {
        _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {
            char *buf = (char *)malloc(scratch);
            failed |= buf == NULL;
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t r = 0; r < rows; r++) if (buf)
                top_p_row(x + r * xs, V, top_p[r], (float *)buf, (top_p_cand *)(buf + V * sizeof(float)));
            free(buf);
        }
    }
    return failed ? -4 : 0;
}

/* Lets the loader check it got the library it built. */
int izh_cpu_abi_version(void) { return 5; }
