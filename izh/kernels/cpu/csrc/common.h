/* Shared by every file of izh's CPU kernels (every .c file of this folder, compiled together into one
 * shared library per instruction-set variant; see izh/kernels/cpu/compiler.py): bf16 helpers, exp_f32, the INLINE
 * and FAST_FP macros, shared constants, and the prototypes of functions one file calls in another.
 *
 * Plain C11 + OpenMP, no torch headers. Each variant has fixed flags (compiler.py, variants.py), e.g. for avx2
 *   gcc -O3 -march=x86-64-v3 -mtune=generic -std=c11 -fPIC -shared -fopenmp -ffp-contract=off
 *       -fno-math-errno -fno-trapping-math ...
 * -ffp-contract=off matters: the float32 rotary kernel must round every product separately (no FMA) to
 * be bit-identical to torch's elementwise ops. Code for an instruction set sits behind its compiler
 * macros (__AVX512F__, __AVX512BF16__, __AMX_TILE__, ...), so every file compiles for every variant, and
 * for aarch64.
 *
 * Every row kernel exists twice, `_f32` and `_bf16`; bf16 is stored as uint16_t. Both are stamped out of
 * one always_inline body with a compile-time `bf` flag, so each copy is specialised and auto-vectorised.
 * bf16 rounding follows c10::BFloat16 (round to nearest even, NaN -> 0x7FC0); `rnd(v, 1)` rounds a float
 * through bf16 the way a torch bf16 elementwise op rounds its fp32 result.
 */
#ifndef IZH_CPU_COMMON_H
#define IZH_CPU_COMMON_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* syscall() */
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>
#include <string.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif

/* The record matmuls (qgemm_avx512.c) and the fused decode stack (stack.c) need these. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define HAVE_QGEMM 1
#else
#define HAVE_QGEMM 0
#endif

#define INLINE static inline __attribute__((always_inline))

#if defined(__AMX_TILE__)
/* An AMX tile configuration (palette 1): each tile's rows and bytes a row. */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

/* Palette 1 with tiles 0 .. n-1 of 16 rows of 64 bytes (the kernels change what they need), the rest unused. */
INLINE amx_tilecfg amx_cfg_16x64(int n) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < n; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    return cfg;
}
#endif
/* The library is built with -ffp-contract=off (rotary must round like torch); attention, which has no
 * bit-exact reference, lets the compiler fuse multiply-adds. Correct either way; only speed depends on it. */
#if defined(__GNUC__) && !defined(__clang__)
#define FAST_FP __attribute__((optimize("fp-contract=fast")))
#else
#define FAST_FP
#endif

/* Work (elements) below which the row kernels stay on the calling thread. */
#define PAR_MIN_ELEMS 65536

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

/* One group of G inputs (a multiple of 32) of an activation row quantized to int8 the way the record and
 * GGUF block matmuls take it (records_f32.c, gguf_blocks.c): d = max |x| / 127 over the group, q =
 * round-half-even(x * (1 / d)) clamped to [-127, 127] (all 0 when d = 0), s16[j] = the sum of q over
 * inputs 16 j .. 16 j + 15. Returns d. Every form below gives the scalar form's bits for finite x: the
 * maximum and the integer sums do not depend on their order, and each product and rounding is the same
 * single operation in a lane. */
INLINE float q8_group_scalar(const float *xg, int G, int8_t *qg, int32_t *s16) {
    float amax = 0.0f;
    for (int k = 0; k < G; k++) {
        const float a = fabsf(xg[k]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < G / 16; j++) {
        int32_t s = 0;
        for (int k = 16 * j; k < 16 * j + 16; k++) {
            float r = rintf(xg[k] * id);
            r = r > 127.0f ? 127.0f : (r < -127.0f ? -127.0f : r);
            qg[k] = (int8_t)r;
            s += (int32_t)r;
        }
        s16[j] = s;
    }
    return d;
}

#if defined(__AVX2__)
/* The sum of v's 8 int32 lanes. */
INLINE int32_t hsum8_epi32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
    return _mm_cvtsi128_si32(s);
}
#endif

#if defined(__AVX512F__)
INLINE float q8_group(const float *xg, int G, int8_t *qg, int32_t *s16) {
    __m512 m = _mm512_setzero_ps();
    for (int k = 0; k < G; k += 16) m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xg + k)), m);
    const float d = _mm512_reduce_max_ps(m) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m512 vid = _mm512_set1_ps(id), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    for (int j = 0; j < G / 16; j++) {
        __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xg + 16 * j), vid),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
        _mm_storeu_si128((__m128i *)(qg + 16 * j), _mm512_cvtepi32_epi8(q));
        s16[j] = _mm512_reduce_add_epi32(q);
    }
    return d;
}
#elif defined(__AVX2__)
INLINE float q8_group(const float *xg, int G, int8_t *qg, int32_t *s16) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps();
    for (int k = 0; k < G; k += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xg + k), abs_mask), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const __m256 vid = _mm256_set1_ps(id), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < G; k += 32) {
        __m256i q[4];
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + k + 8 * i), vid),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        for (int i = 0; i < 2; i++) s16[k / 16 + i] = hsum8_epi32(_mm256_add_epi32(q[2 * i], q[2 * i + 1]));
        const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(qg + k), _mm256_permutevar8x32_epi32(b, order));
    }
    return d;
}
#elif defined(__ARM_NEON) && defined(__aarch64__)
INLINE float q8_group(const float *xg, int G, int8_t *qg, int32_t *s16) {
    float32x4_t m = vdupq_n_f32(0.0f);
    for (int k = 0; k < G; k += 4) m = vmaxq_f32(vabsq_f32(vld1q_f32(xg + k)), m);
    const float d = vmaxvq_f32(m) / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    const float32x4_t vid = vdupq_n_f32(id), lo = vdupq_n_f32(-127.0f), hi = vdupq_n_f32(127.0f);
    for (int j = 0; j < G / 16; j++) {
        int32x4_t q[4];
        for (int i = 0; i < 4; i++) {
            const float32x4_t r = vrndnq_f32(vmulq_f32(vld1q_f32(xg + 16 * j + 4 * i), vid));
            q[i] = vcvtq_s32_f32(vminq_f32(vmaxq_f32(r, lo), hi));
        }
        s16[j] = vaddvq_s32(vaddq_s32(vaddq_s32(q[0], q[1]), vaddq_s32(q[2], q[3])));
        const int16x8_t a = vcombine_s16(vmovn_s32(q[0]), vmovn_s32(q[1]));
        const int16x8_t b = vcombine_s16(vmovn_s32(q[2]), vmovn_s32(q[3]));
        vst1q_s8(qg + 16 * j, vcombine_s8(vmovn_s16(a), vmovn_s16(b)));
    }
    return d;
}
#else
#define q8_group q8_group_scalar
#endif

/* The KV cache's element formats (the attention kernels' kv_type; izh/kernels/kv_cache_dtype.py): a cache
 * row (one token, one KV head) holds d values as float32, bf16, float16, float8 e4m3fn or e5m2, or q8_0
 * (llama.cpp's block_q8_0: per 32 values a float16 scale and 32 int8 codes, 34 bytes). */
enum { KV_F32, KV_BF16, KV_F16, KV_E4M3, KV_E5M2, KV_Q8_0 };
#define Q8_0_BLOCK 32
#define Q8_0_BYTES 34

INLINE int64_t kv_row_bytes(int kt, int64_t d) {
    switch (kt) {
    case KV_F32: return d * 4;
    case KV_BF16:
    case KV_F16: return d * 2;
    case KV_E4M3:
    case KV_E5M2: return d;
    default: return d / Q8_0_BLOCK * Q8_0_BYTES;
    }
}

/* Record sizes (bytes) of the quantized weights; the layout is described in qgemm_avx512.c. */
#define Q4_RECORD 320
#define Q8_RECORD 544

/* --- functions called from another file ----------------------------------------------------------- */

/* norm.c and attention.c: each kernel in float32 (`_f32`) and bfloat16 (`_bf16`, stored as uint16_t). */
#define IZH_DECLARE_ROW_KERNELS(SFX)                                                                          \
    void izh_rms_norm_##SFX(const void *x, int64_t x_stride, const void *w, void *out, int64_t n, int64_t h,   \
                            float eps, int nt);                                                                \
    void izh_add_rms_norm_##SFX(const void *x, void *res, const void *w, void *out, int64_t n, int64_t h,     \
                                float eps, int nt);                                                            \
    void izh_silu_mul_##SFX(const void *gu, int64_t gu_stride, void *out, int64_t n, int64_t inter, int nt);  \
    void izh_gelu_tanh_mul_##SFX(const void *gu, int64_t gu_stride, void *out, int64_t n, int64_t inter,      \
                                 int nt);                                                                      \
    void izh_rms_norm_heads_##SFX(void *x, int64_t tok_stride, int64_t head_stride, const void *w, int64_t n, \
                                  int64_t heads, int64_t d, float eps, int nt);                                \
    void izh_rotary_##SFX(void *x, int64_t tok_stride, int64_t head_stride, const void *cs, int64_t n,        \
                          int64_t heads, int64_t d, int nt);                                                   \
    int izh_paged_decode_attention_##SFX(                                                                      \
        const void *q, int64_t q_ts, int64_t q_hs, const void *k, int64_t k_ts, int64_t k_hs, const void *v,     \
        int64_t v_ts, int64_t v_hs, void *kv_cache, int kv_type, int64_t num_blocks, int64_t block_size,       \
        int64_t kvh, const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,             \
        const int32_t *seq_lens, int64_t window, float softcap, void *out, int64_t n, int64_t H, int64_t d,      \
        float scale, int nt);                                                                                  \
    int izh_paged_attention_##SFX(                                                                             \
        const void *q, int64_t q_ts, int64_t q_hs, const void *k, int64_t k_ts, int64_t k_hs, const void *v,     \
        int64_t v_ts, int64_t v_hs, void *kv_cache, int kv_type, int64_t num_blocks, int64_t block_size,       \
        int64_t kvh,                                                                                           \
        const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks, const int32_t *row_seq,    \
        int64_t num_seqs, const int32_t *seq_lens, int64_t window, float softcap, void *out, int64_t n,          \
        int64_t H, int64_t d, float scale, int nt);
IZH_DECLARE_ROW_KERNELS(f32)
IZH_DECLARE_ROW_KERNELS(bf16)

/* The decode stacks' per-layer table (izh_decode_stack_bf16 in stack.c): num_layers rows of STACK_FIELDS
 * int64: input-norm weight, post-attention-norm weight, KV cache ([2, num_blocks, block_size, kvh, row] of
 * the stack's kv_type argument),
 * then (records, kind 4 or 8, bias or 0) for qkv, o, gate_up, down. The float32 stack also takes kind
 * STACK_GGUF: the linear's rows in GGUF blocks (gguf_blocks.c), the first field then pointing at int64
 * [1 + 4 * parts]: the number of parts, then per part (ggml type, blocks, row bytes, rows), stacked by rows. */
enum { STACK_IN_NORM, STACK_POST_NORM, STACK_KV, STACK_QKV, STACK_O = STACK_QKV + 3, STACK_GATE_UP = STACK_O + 3,
       STACK_DOWN = STACK_GATE_UP + 3, STACK_FIELDS = STACK_DOWN + 3 };
enum { STACK_GGUF = 1 };

/* records_f32.c: out [M, N] = x [M, K] @ W^T (+ bias) for a linear's (records or parts, kind, bias) fields of
 * the stack tables; 0, or a stack code (-4 out of memory, -6 a shape the matmul refused). */
int izh_stack_linear_f32(const int64_t *lin, const float *x, int64_t M, int64_t N, int64_t K, float *out, int nt);

/* gguf_blocks.c: out [M, N] = x [M, K] @ W^T over GGUF blocks (see there). */
int izh_gguf_matmul_f32(int type, const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int64_t M,
                        int64_t N, int64_t K, float *out, int64_t os, int nt);

/* The decode stacks' LoRA table (lora.c; izh.model.fused_stack builds it): num_layers rows of STACK_LORA_FIELDS
 * int64, for qkv, o, gate_up, down in turn: A [slots, n * R, K], Bt [slots, n * R, N] (0: no adapter on
 * that linear), n (the projections packed in it), and the n + 1 column bounds of its shards (padded to 4). */
enum { STACK_LORA_A, STACK_LORA_BT, STACK_LORA_N, STACK_LORA_BOUNDS, STACK_LORA_LINEAR = STACK_LORA_BOUNDS + 4,
       STACK_LORA_FIELDS = 4 * STACK_LORA_LINEAR };

/* lora.c: out [M, N] += each adapter row's delta (see there). Return 0 or -4 (out of memory). */
int izh_lora_add_f32(const float *x, int64_t M, int64_t K, float *out, int64_t N, const int64_t *lin, int64_t R,
                     const int32_t *row_slots, const int32_t *slot_ranks, int nt);
int izh_lora_add_bf16(const uint16_t *x, int64_t M, int64_t K, uint16_t *out, int64_t N, const int64_t *lin,
                      int64_t R, const int32_t *row_slots, const int32_t *slot_ranks, int nt);

/* qgemm_avx512.c (stubs returning -2, or 0 rows, without HAVE_QGEMM). izh_amx_permitted: 1 once Linux has
 * granted this process the AMX tile data (arch_prctl, asked on the first call), 0 without AMX in the build. */
int izh_amx_permitted(void);
int izh_qgemm_available(void);
int izh_qgemm_max_rows(void);
int izh_qgemm_uses_amx(int q8, int64_t M);
int izh_q4_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt);
int izh_q8_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt);


/* The body of the fused decode stacks (stack.c: bfloat16, records_f32.c: float32), after their row checks:
 * every layer through the dtype's kernels in the Python modules' order, then the final norm. T: the
 * element type; SFX: the kernels' suffix; LINEAR(lin, x, M, N, K, out, nt): a record matmul of the
 * STACK_* fields at lin, bias added, returning 0 or a stack code. When `lora` (the LoRA table) is not NULL,
 * each matmul is followed by its rows' adapter deltas (row_slots [M], slot_ranks [slots], lora_rank R).
 * Returns from the function. */
#define IZH_STACK_LORA(SFX, I, XIN, N, K, OUT)                                                                 \
    if (lora && (rc = izh_lora_add_##SFX(XIN, M, K, OUT, N, lora + l * STACK_LORA_FIELDS + (I) * STACK_LORA_LINEAR, \
                                         lora_rank, row_slots, slot_ranks, nt)))                              \
        break;

#define IZH_DECODE_STACK_BODY(T, SFX, LINEAR)                                                                  \
    const int64_t qkv_w = (H + 2 * kvh) * d;                                                                   \
    const size_t elems = (size_t)M * (size_t)(2 * hidden + qkv_w + H * d + 3 * inter);                         \
    T *buf = (T *)malloc(elems * sizeof(T));                                                                   \
    if (!buf) return -4;                                                                                       \
    T *normed = buf, *h = normed + M * hidden, *qkv = h + M * hidden, *attn = qkv + M * qkv_w;                \
    T *gate_up = attn + M * H * d, *act = gate_up + M * 2 * inter;                                             \
    int rc = 0;                                                                                                \
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {                                                      \
        const int64_t *lp = layers + l * STACK_FIELDS;                                                         \
        const T *in_norm = (const T *)(intptr_t)lp[STACK_IN_NORM];                                             \
        const T *post_norm = (const T *)(intptr_t)lp[STACK_POST_NORM];                                         \
        if (l == 0)                                                                                            \
            izh_rms_norm_##SFX(x, hidden, in_norm, normed, M, hidden, eps, nt);                                \
        else                                                                                                   \
            izh_add_rms_norm_##SFX(h, x, in_norm, normed, M, hidden, eps, nt);                                 \
        if ((rc = LINEAR(lp + STACK_QKV, normed, M, qkv_w, hidden, qkv, nt))) break;                           \
        IZH_STACK_LORA(SFX, 0, normed, qkv_w, hidden, qkv)                                                     \
        izh_rotary_##SFX(qkv, qkv_w, d, cos_sin, M, H + kvh, d, nt);                                           \
        rc = izh_paged_decode_attention_##SFX(qkv, qkv_w, d, qkv + H * d, qkv_w, d, qkv + (H + kvh) * d, qkv_w, \
                                              d, (void *)(intptr_t)lp[STACK_KV], (int)kv_type, num_blocks,     \
                                              block_size, kvh,                                                 \
                                              slot_mapping, block_tables, max_blocks, seq_lens, 0, 0.0f, attn, M, H, d, \
                                              scale, nt);                                                      \
        if (rc) break;                                                                                         \
        if ((rc = LINEAR(lp + STACK_O, attn, M, hidden, H * d, h, nt))) break;                                 \
        IZH_STACK_LORA(SFX, 1, attn, hidden, H * d, h)                                                         \
        izh_add_rms_norm_##SFX(h, x, post_norm, normed, M, hidden, eps, nt);                                   \
        if ((rc = LINEAR(lp + STACK_GATE_UP, normed, M, 2 * inter, hidden, gate_up, nt))) break;               \
        IZH_STACK_LORA(SFX, 2, normed, 2 * inter, hidden, gate_up)                                             \
        izh_silu_mul_##SFX(gate_up, 2 * inter, act, M, inter, nt);                                             \
        if ((rc = LINEAR(lp + STACK_DOWN, act, M, hidden, inter, h, nt))) break;                               \
        IZH_STACK_LORA(SFX, 3, act, hidden, inter, h)                                                          \
    }                                                                                                          \
    if (rc == 0) izh_add_rms_norm_##SFX(h, x, final_norm, out, M, hidden, eps, nt);                            \
    free(buf);                                                                                                 \
    return rc;

#endif /* IZH_CPU_COMMON_H */
