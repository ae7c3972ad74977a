/* NEON tiles for records_f32.c (included there on aarch64, after the portable code): x8_tile with the
 * contract of the AVX2 one, baseline armv8-a NEON (no dot-product extension needed). The integer sums are
 * exact, as everywhere, and the float epilogue is x8_epilogue's sequence of operations four lanes at a
 * time, each product and sum rounded on its own (vmulq_f32 then vaddq_f32, never vmlaq/vfmaq), so the
 * results are bit-identical to the portable and AVX2 paths.
 *
 * int4: a block's 32 bytes are rows 0-7 (first 16) and 8-15 (next 16), byte 2i+e holding row i's codes
 * for inputs 4b+e (low nibble) and 4b+2+e (high nibble). The nibbles (0..15) are taken with vandq_u8 /
 * vshrq_n_u8 and multiplied by a broadcast activation pair (q[4b], q[4b+1]) or (q[4b+2], q[4b+3]) with
 * vmull_s8 / vmlal_s8 into int16 lanes, one lane per (row, e): over the record's 8 blocks a lane gets 16
 * products of |15 * 127| each, at most 30480, so int16 holds the sum exactly. vpaddlq_s16 then adds each
 * row's two lanes (e = 0, 1) into int32: 4 int32x4 per row of x, rows 0-3, 4-7, 8-11, 12-15.
 *
 * int8: the 16 codes of input k (one per output row) times q[k], inputs k and k+1 paired with vmull_s8 +
 * vmlal_s8 (|sum| <= 2 * 128 * 127 < 32768) and widened into int32 with vaddw_s16 / vaddw_high_s16.
 *
 * R rows of x (up to X8_NEON_MR) go through the tile's records together; the codes of a block are loaded
 * once for all of them. */

#define X8_NEON_MR 4 /* rows of x per pass over a tile (R = 1..4 below) */
#if !defined(__aarch64__) /* 32-bit ARM: the A64-only intrinsics below are missing; the portable tile */
static void x8_tile(const int q8, const uint8_t *tile, int64_t groups, const int8_t *xq, const uint32_t *xp,
                    int64_t K, int64_t xgs, const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
    (void)xp; /* the AVX2 tiles' broadcast-ready pairs */
    (void)xgs;
    x8_tile_c(q8, tile, groups, xq, K, xd, xe, rows, out, os);
}
#else
#include <arm_neon.h>

/* 16 bf16 at p as 4 float32x4 (lanes 0-3, 4-7, 8-11, 12-15). */
INLINE void x8_bf16x16_neon(const uint8_t *p, float32x4_t *f) {
    const uint16x8_t a = vld1q_u16((const uint16_t *)p), b = vld1q_u16((const uint16_t *)(p + 16));
    f[0] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16));
    f[1] = vreinterpretq_f32_u32(vshll_high_n_u16(a, 16));
    f[2] = vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16));
    f[3] = vreinterpretq_f32_u32(vshll_high_n_u16(b, 16));
}

/* acc[0..3] += isum * (s * d) (+ min * e), lane for lane as x8_epilogue. */
INLINE void x8_epilogue_neon(float32x4_t *acc, const int32x4_t *isum, const float32x4_t *s,
                             const float32x4_t *mn, float d, float e) {
    const float32x4_t vd = vdupq_n_f32(d);
    for (int j = 0; j < 4; j++) {
        const float32x4_t t = vmulq_f32(s[j], vd);
        acc[j] = vaddq_f32(acc[j], vmulq_f32(vcvtq_f32_s32(isum[j]), t));
    }
    if (mn) {
        const float32x4_t ve = vdupq_n_f32(e);
        for (int j = 0; j < 4; j++) acc[j] = vaddq_f32(acc[j], vmulq_f32(mn[j], ve));
    }
}

/* Two neighbouring activation codes, broadcast: bytes 2i, 2i+1 = q[0], q[1]. */
INLINE int8x8_t x8_pair_neon(const int8_t *q) {
    int16_t v;
    memcpy(&v, q, 2);
    return vreinterpret_s8_s16(vdup_n_s16(v));
}

INLINE void x8_store16_neon(float *o, const float32x4_t *acc) {
    for (int j = 0; j < 4; j++) vst1q_f32(o + 4 * j, acc[j]);
}

/* R rows of x against one tile of int4 records. */
INLINE void x8_q4_tile_neon(const int R, const uint8_t *rec, int64_t groups, const int8_t *xq, int64_t K,
                            const float *xd, const float *xe, float *out, int64_t os) {
    const uint8x16_t nib = vdupq_n_u8(0x0F);
    float32x4_t acc[X8_NEON_MR][4];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; g++, rec += X8_Q4_RECORD) {
        for (int c = 0; c < X8_Q4_RECORD; c += 64) __builtin_prefetch(rec + X8_PREFETCH * X8_Q4_RECORD + c, 0, 3);
        int16x8_t s16[X8_NEON_MR][4]; /* per row of x: lanes (row i, e) for rows 0-3, 4-7, 8-11, 12-15 */
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 4; j++) s16[m][j] = vdupq_n_s16(0);
        for (int b = 0; b < 8; b++) {
            const uint8x16_t w0 = vld1q_u8(rec + 32 * b), w1 = vld1q_u8(rec + 32 * b + 16);
            const int8x16_t lo0 = vreinterpretq_s8_u8(vandq_u8(w0, nib)), hi0 = vreinterpretq_s8_u8(vshrq_n_u8(w0, 4));
            const int8x16_t lo1 = vreinterpretq_s8_u8(vandq_u8(w1, nib)), hi1 = vreinterpretq_s8_u8(vshrq_n_u8(w1, 4));
            for (int m = 0; m < R; m++) {
                const int8_t *qm = xq + m * K + 32 * g + 4 * b;
                const int8x8_t p01 = x8_pair_neon(qm), p23 = x8_pair_neon(qm + 2);
                s16[m][0] = vmlal_s8(s16[m][0], vget_low_s8(lo0), p01);
                s16[m][1] = vmlal_s8(s16[m][1], vget_high_s8(lo0), p01);
                s16[m][2] = vmlal_s8(s16[m][2], vget_low_s8(lo1), p01);
                s16[m][3] = vmlal_s8(s16[m][3], vget_high_s8(lo1), p01);
                s16[m][0] = vmlal_s8(s16[m][0], vget_low_s8(hi0), p23);
                s16[m][1] = vmlal_s8(s16[m][1], vget_high_s8(hi0), p23);
                s16[m][2] = vmlal_s8(s16[m][2], vget_low_s8(hi1), p23);
                s16[m][3] = vmlal_s8(s16[m][3], vget_high_s8(hi1), p23);
            }
        }
        float32x4_t s[4], mn[4];
        x8_bf16x16_neon(rec + 256, s);
        x8_bf16x16_neon(rec + 288, mn);
        for (int m = 0; m < R; m++) {
            int32x4_t isum[4];
            for (int j = 0; j < 4; j++) isum[j] = vpaddlq_s16(s16[m][j]);
            x8_epilogue_neon(acc[m], isum, s, mn, xd[m * groups + g], xe[m * groups + g]);
        }
    }
    for (int m = 0; m < R; m++) x8_store16_neon(out + m * os, acc[m]);
}

/* R rows of x against one tile of int8 records. */
INLINE void x8_q8_tile_neon(const int R, const uint8_t *rec, int64_t groups, const int8_t *xq, int64_t K,
                            const float *xd, float *out, int64_t os) {
    float32x4_t acc[X8_NEON_MR][4];
    for (int m = 0; m < R; m++)
        for (int j = 0; j < 4; j++) acc[m][j] = vdupq_n_f32(0.0f);
    for (int64_t g = 0; g < groups; g++, rec += X8_Q8_RECORD) {
        for (int c = 0; c < X8_Q8_RECORD; c += 64) __builtin_prefetch(rec + X8_PREFETCH * X8_Q8_RECORD + c, 0, 3);
        int32x4_t isum[X8_NEON_MR][4];
        for (int m = 0; m < R; m++)
            for (int j = 0; j < 4; j++) isum[m][j] = vdupq_n_s32(0);
        for (int k = 0; k < 32; k += 2) {
            const int8x16_t wk = vld1q_s8((const int8_t *)rec + 16 * k);
            const int8x16_t wk1 = vld1q_s8((const int8_t *)rec + 16 * k + 16);
            for (int m = 0; m < R; m++) {
                const int8_t *qm = xq + m * K + 32 * g + k;
                const int8x8_t a = vdup_n_s8(qm[0]), b = vdup_n_s8(qm[1]);
                const int16x8_t p0 = vmlal_s8(vmull_s8(vget_low_s8(wk), a), vget_low_s8(wk1), b);   /* rows 0-7 */
                const int16x8_t p1 = vmlal_s8(vmull_s8(vget_high_s8(wk), a), vget_high_s8(wk1), b); /* rows 8-15 */
                isum[m][0] = vaddw_s16(isum[m][0], vget_low_s16(p0));
                isum[m][1] = vaddw_high_s16(isum[m][1], p0);
                isum[m][2] = vaddw_s16(isum[m][2], vget_low_s16(p1));
                isum[m][3] = vaddw_high_s16(isum[m][3], p1);
            }
        }
        float32x4_t s[4];
        x8_bf16x16_neon(rec + 512, s);
        for (int m = 0; m < R; m++) x8_epilogue_neon(acc[m], isum[m], s, NULL, xd[m * groups + g], 0.0f);
    }
    for (int m = 0; m < R; m++) x8_store16_neon(out + m * os, acc[m]);
}

#define DEFINE_X8_TILE_NEON(R)                                                                                \
    static __attribute__((noinline)) void x8_tile_neon_##R(const int q8, const uint8_t *tile, int64_t groups, \
                                                           const int8_t *xq, int64_t K, const float *xd,     \
                                                           const float *xe, float *out, int64_t os) {        \
        if (q8)                                                                                               \
            x8_q8_tile_neon(R, tile, groups, xq, K, xd, out, os);                                             \
        else                                                                                                  \
            x8_q4_tile_neon(R, tile, groups, xq, K, xd, xe, out, os);                                         \
    }
DEFINE_X8_TILE_NEON(1)
DEFINE_X8_TILE_NEON(2)
DEFINE_X8_TILE_NEON(3)
DEFINE_X8_TILE_NEON(4)

static void x8_tile(const int q8, const uint8_t *tile, int64_t groups, const int8_t *xq, const uint32_t *xp,
                    int64_t K, int64_t xgs, const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
    (void)xp; /* the AVX2 tiles' broadcast-ready pairs */
    (void)xgs;
    for (int64_t m0 = 0; m0 < rows; m0 += X8_NEON_MR) {
        const int64_t R = rows - m0 < X8_NEON_MR ? rows - m0 : X8_NEON_MR;
        const int8_t *q = xq + m0 * K;
        const float *d = xd + m0 * groups, *e = xe + m0 * groups;
        float *o = out + m0 * os;
        switch (R) {
        case 1: x8_tile_neon_1(q8, tile, groups, q, K, d, e, o, os); break;
        case 2: x8_tile_neon_2(q8, tile, groups, q, K, d, e, o, os); break;
        case 3: x8_tile_neon_3(q8, tile, groups, q, K, d, e, o, os); break;
        default: x8_tile_neon_4(q8, tile, groups, q, K, d, e, o, os); break;
        }
    }
}
#endif /* __aarch64__ */
