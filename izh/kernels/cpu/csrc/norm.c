/* RMSNorm (of rows, and in place of each head of q/k), add + RMSNorm, rotary, SiLU * up and GELU(tanh) * up,
 * float32 and bfloat16.
 * See common.h for the conventions, izh/kernels/cpu/ops.py for the contract. */
#include "common.h"

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

/* GELU with the tanh approximation times up on one row [gate | up] (Gemma's GeGLU): 0.5 g (1 + tanh(u)),
 * u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2u)) through exp_f32 (the same value, with
 * no cancellation where tanh(u) nears -1; torch uses Sleef's tanh: an element may differ from it by a few
 * ulps). The gelu rounds to the dtype before the product. */
INLINE void gelu_tanh_mul_row(const void *gu, void *out, int64_t inter, const int bf) {
    const void *up = off(gu, inter, bf);
    for (int64_t j = 0; j < inter; j++) {
        const float g = ld(gu, j, bf);
        const float u = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
        st(out, j, rnd(g / (1.0f + exp_f32(-2.0f * u)), bf) * ld(up, j, bf), bf);
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
    static __attribute__((noinline)) void gelu_tanh_mul_row_##SFX(const void *gu, void *out, int64_t inter) {\
        gelu_tanh_mul_row(gu, out, inter, BF);                                                               \
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
    void izh_gelu_tanh_mul_##SFX(const void *gu, int64_t gu_stride, void *out, int64_t n, int64_t inter,    \
                                 int nt) {                                                                   \
        ROW_LOOP(n * inter * 8, n,                                                                           \
                 gelu_tanh_mul_row_##SFX(off(gu, r * gu_stride, BF), off(out, r * inter, BF), inter));      \
    }                                                                                                        \
    /* each head of x [n, heads, d] (token and head strides) normalized in place, as rms_norm's rows */      \
    void izh_rms_norm_heads_##SFX(void *x, int64_t tok_stride, int64_t head_stride, const void *w, int64_t n, \
                                  int64_t heads, int64_t d, float eps, int nt) {                             \
        ROW_LOOP(n * heads * d, n, {                                                                         \
            for (int64_t hh = 0; hh < heads; hh++) {                                                         \
                void *row = off(x, r * tok_stride + hh * head_stride, BF);                                   \
                rms_norm_row_##SFX(row, w, row, d, eps);                                                     \
            }                                                                                                \
        });                                                                                                  \
    }                                                                                                        \
    void izh_rotary_##SFX(void *x, int64_t tok_stride, int64_t head_stride, const void *cs, int64_t n,      \
                          int64_t heads, int64_t d, int nt) {                                                \
        ROW_LOOP(n * heads * d, n,                                                                           \
                 rotary_row_##SFX(off(x, r * tok_stride, BF), head_stride, off(cs, r * d, BF), heads, d));   \
    }

DEFINE_ROW_KERNELS(f32, 0)
DEFINE_ROW_KERNELS(bf16, 1)
