/* NEON for the GGUF block matmuls (included by gguf_blocks.c on aarch64; the recipe is that file's header).
 *
 * - Decoding: Q4_0, Q5_0, Q4_K and Q6_K unpack 16 codes per instruction (gq_decode_neon; the other types
 *   keep gq_decode's C, which gcc vectorises as it can).
 * - Dot products, 4 weight rows at a time (gq_rows4): c . q per 16 inputs with SDOT (vdotq_s32) where the
 *   build targets it (the neon variant: armv8.2-a + dotprod), else with SMULL + SADALP (generic aarch64:
 *   |c * q| <= 128 * 127 fits 16 bits); the sub-block scale multiplies the 16 inputs' int32 sums; the 4 rows'
 *   sums meet in one vector by pairwise adds, and the float epilogue runs on 4 outputs at once (each
 *   operation a separate vmulq / vaddq, rounded on its own as the recipe wants).
 * Every sum is exact in int32, so the results are the reference's bits, as every other variant's. */
#include <arm_neon.h>

/* Unpacks 16 bytes' low nibbles into c[0..15] and high ones into c[16..31], minus `off`. */
INLINE void gq_nibbles_neon(const uint8_t *qs, int8_t *c, int off) {
    const uint8x16_t v = vld1q_u8(qs);
    const int8x16_t o = vdupq_n_s8((int8_t)off);
    vst1q_s8(c, vsubq_s8(vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))), o));
    vst1q_s8(c + 16, vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(v, 4)), o));
}

/* 0x10 in byte j where bit j of the 16 bits `bits` is set. */
INLINE uint8x16_t gq_bits16_neon(uint32_t bits) {
    static const uint8_t mask[16] = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
    const uint8x16_t b = vcombine_u8(vdup_n_u8((uint8_t)bits), vdup_n_u8((uint8_t)(bits >> 8)));
    return vandq_u8(vtstq_u8(b, vld1q_u8(mask)), vdupq_n_u8(16));
}

/* gq_decode for the types with a NEON decoder: returns 1 when it decoded the block, 0 to leave it to C. */
INLINE int gq_decode_neon(const int type, const uint8_t *p, gq_block *b) {
    int8_t *c = b->c;
    switch (type) {
    case GQ_Q4_0:
        b->dw = gq_f16(p);
        b->mw = 0.0f;
        gq_nibbles_neon(p + 2, c, 8);
        b->s[0] = b->s[1] = 1;
        return 1;
    case GQ_Q5_0: {
        const uint8_t *qs = p + 6;
        uint32_t h;
        memcpy(&h, p + 2, 4);
        b->dw = gq_f16(p);
        b->mw = 0.0f;
        const uint8x16_t v = vld1q_u8(qs);
        const uint8x16_t lo = vorrq_u8(vandq_u8(v, vdupq_n_u8(15)), gq_bits16_neon(h & 0xFFFF));
        const uint8x16_t hi = vorrq_u8(vshrq_n_u8(v, 4), gq_bits16_neon(h >> 16));
        vst1q_s8(c, vsubq_s8(vreinterpretq_s8_u8(lo), vdupq_n_s8(16)));
        vst1q_s8(c + 16, vsubq_s8(vreinterpretq_s8_u8(hi), vdupq_n_s8(16)));
        b->s[0] = b->s[1] = 1;
        return 1;
    }
    case GQ_Q4_K: {
        const uint8_t *scales = p + 4, *ql = p + 16;
        b->dw = gq_f16(p);
        b->mw = gq_f16(p + 2);
        for (int g = 0; g < 4; g++) /* 64 inputs: sub-blocks 2g (low nibbles) and 2g + 1 (high) */
            for (int h = 0; h < 2; h++) {
                const uint8x16_t v = vld1q_u8(ql + 32 * g + 16 * h);
                vst1q_s8(c + 64 * g + 16 * h, vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(15))));
                vst1q_s8(c + 64 * g + 32 + 16 * h, vreinterpretq_s8_u8(vshrq_n_u8(v, 4)));
            }
        for (int j = 0; j < 8; j++) {
            int32_t sc, mn;
            gq_scale_min_k4(j, scales, &sc, &mn);
            b->s[2 * j] = b->s[2 * j + 1] = sc;
            b->m[2 * j] = b->m[2 * j + 1] = mn;
        }
        return 1;
    }
    case GQ_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        const uint8x16_t m4 = vdupq_n_u8(15), m2 = vdupq_n_u8(3);
        const int8x16_t o = vdupq_n_s8(32);
        b->dw = gq_f16(p + 208);
        b->mw = 0.0f;
        for (int half = 0; half < 2; half++)
            for (int l = 0; l < 32; l += 16) {
                const uint8_t *l8 = ql + 64 * half, *h8 = qh + 32 * half;
                int8_t *y = c + 128 * half + l;
                const uint8x16_t a = vld1q_u8(l8 + l), a2 = vld1q_u8(l8 + l + 32), hb = vld1q_u8(h8 + l);
                const uint8x16_t y0 = vorrq_u8(vandq_u8(a, m4), vshlq_n_u8(vandq_u8(hb, m2), 4));
                const uint8x16_t y1 = vorrq_u8(vandq_u8(a2, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m2), 4));
                const uint8x16_t y2 = vorrq_u8(vshrq_n_u8(a, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m2), 4));
                const uint8x16_t y3 = vorrq_u8(vshrq_n_u8(a2, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4));
                vst1q_s8(y, vsubq_s8(vreinterpretq_s8_u8(y0), o));
                vst1q_s8(y + 32, vsubq_s8(vreinterpretq_s8_u8(y1), o));
                vst1q_s8(y + 64, vsubq_s8(vreinterpretq_s8_u8(y2), o));
                vst1q_s8(y + 96, vsubq_s8(vreinterpretq_s8_u8(y3), o));
            }
        for (int j = 0; j < 16; j++) b->s[j] = sc[j];
        return 1;
    }
    default:
        return 0;
    }
}

/* 4 int32 lanes whose sum is c . q over 16 inputs. */
INLINE int32x4_t gq_dot16_neon(const int8_t *c, const int8_t *q) {
    const int8x16_t cv = vld1q_s8(c), qv = vld1q_s8(q);
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(vdupq_n_s32(0), cv, qv);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(cv), vget_low_s8(qv));
    return vpadalq_s16(vpaddlq_s16(lo), vmull_high_s8(cv, qv));
#endif
}

/* Output rows [n0, n0 + 4) for activation rows [m0, m1): gq_rows' arithmetic, the 4 outputs in one vector. */
INLINE void gq_rows4(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0, int64_t m1,
                     int64_t K, const int8_t *xq, const float *dx, const float *ex, const int32_t *qs16, float *out,
                     int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    const int64_t blocks = K / bs;
    gq_block blk[4];
    float32x4_t acc[GQ_MC];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = vdupq_n_f32(0.0f);
    for (int64_t b = 0; b < blocks; b++) {
        float dw[4], mw[4];
        for (int i = 0; i < 4; i++) {
            gq_decode(type, w + (n0 + i) * row_bytes + b * bytes, &blk[i]);
            dw[i] = blk[i].dw;
            mw[i] = blk[i].mw;
        }
        const float32x4_t dwv = vld1q_f32(dw), mwv = vld1q_f32(mw);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *q = xq + m * K + b * bs;
            int32x4_t t[4];
            for (int i = 0; i < 4; i++) {
                int32x4_t a = vdupq_n_s32(0);
                for (int j = 0; j < bs / 16; j++) {
                    const int32x4_t d = gq_dot16_neon(blk[i].c + 16 * j, q + 16 * j);
                    a = bs == 32 ? vaddq_s32(a, d) : vmlaq_n_s32(a, d, blk[i].s[j]);
                }
                t[i] = a;
            }
            const int32x4_t isum = vpaddq_s32(vpaddq_s32(t[0], t[1]), vpaddq_s32(t[2], t[3]));
            const int64_t g = m * blocks + b;
            const float32x4_t vdx = vdupq_n_f32(dx[g]);
            float32x4_t a = vaddq_f32(acc[m - m0], vmulq_f32(vcvtq_f32_s32(isum), vmulq_f32(dwv, vdx)));
            if (mk == GQ_MIN_FLOAT) a = vaddq_f32(a, vmulq_f32(mwv, vdupq_n_f32(ex[g])));
            if (mk == GQ_MIN_INT) {
                const int32_t *s16 = qs16 + m * (K / 16) + b * (bs / 16);
                int32_t ms[4];
                for (int i = 0; i < 4; i++) {
                    int32x4_t v = vdupq_n_s32(0);
                    for (int j = 0; j < bs / 16; j += 4) v = vmlaq_s32(v, vld1q_s32(blk[i].m + j), vld1q_s32(s16 + j));
                    ms[i] = vaddvq_s32(v);
                }
                a = vsubq_f32(a, vmulq_f32(vcvtq_f32_s32(vld1q_s32(ms)), vmulq_f32(mwv, vdx)));
            }
            acc[m - m0] = a;
        }
    }
    for (int64_t m = m0; m < m1; m++) vst1q_f32(out + m * os + n0, acc[m - m0]);
}
