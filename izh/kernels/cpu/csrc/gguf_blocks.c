/* Matmuls over GGUF weight blocks as the file stores them, float32 activations, every variant.
 *
 * The weight [N, K] is N rows of the file's blocks (ggml's block structs, byte for byte), any row stride:
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL (32 inputs per block) and Q4_K, Q5_K, Q6_K, IQ4_XS (256 per
 * super-block). Nothing is re-quantized: each block is decoded, inside the kernel, into
 *   codes c[i] (int8), an integer scale s[j] per 16 inputs, an integer min m[j] per 16 inputs (K-quants),
 *   and its float scales: dw (the block's fp16 d) and mw (Q4_1 / Q5_1: the fp16 m; Q4_K / Q5_K: dmin),
 * such that the file's weight is w[i] = dw * s[i / 16] * c[i] (+ mw, or - mw * m[i / 16]) exactly as
 * ggml's dequantization defines it (Q4_0: c = q - 8; Q5_0: q - 16; Q6_K: q - 32; IQ4: the non-linear
 * table's value; the 6-bit sub-block scales and mins of Q4_K / Q5_K, the int8 ones of Q6_K, IQ4_XS's
 * ls - 32).
 *
 * Each row of x is quantized to int8 per group of G inputs, G the block's size (32, or 256 as llama.cpp's
 * Q8_K for the K-quants): dx = max |x| / 127, q = round-half-even(x * (1 / dx)) clamped to +-127 (0 where
 * dx = 0), with sums of q per 16 inputs and ex = dx * (sum of q over the group). Then per block, in order:
 *
 *   isum = sum over j of s[j] * (c . q over the 16 inputs of j)        (exact int32)
 *   msum = sum over j of m[j] * (sum of q over the 16 inputs of j)     (exact int32, K-quants)
 *   acc = acc + (float)isum * (dw * dx)
 *   Q4_1 / Q5_1: acc = acc + mw * ex;  Q4_K / Q5_K: acc = acc - (float)msum * (mw * dx)
 *
 * every float operation rounded on its own (-ffp-contract=off). The integer part is exact whatever the
 * instruction set, and the float part is one fixed sequence per output element, so every variant (and
 * `gguf_matmul_ref` in izh/kernels/cpu/gguf_blocks.py) gives bit-identical results, for any number of rows
 * and any thread split: a row's result never depends on the rest of the batch.
 *
 * Dot products: AVX2 vpmaddubsw on (|c|, q with c's sign) then vpmaddwd (|c| <= 128, |q| <= 127: a pair
 * sum stays below 2^15); AVX-512 VNNI vpdpbusd on the same operands, 64 inputs per instruction for the
 * 256-input blocks; in the amx build, from a few rows (gq_amx_min_rows), AMX-INT8 tiles (gguf_blocks_amx.h); on
 * aarch64 NEON, SDOT where the build targets dotprod (gguf_blocks_neon.h); plain C elsewhere (generic). */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

/* ggml's type ids (ggml.h) */
enum { GQ_Q4_0 = 2, GQ_Q4_1 = 3, GQ_Q5_0 = 6, GQ_Q5_1 = 7, GQ_Q8_0 = 8, GQ_Q4_K = 12, GQ_Q5_K = 13,
       GQ_Q6_K = 14, GQ_IQ4_NL = 20, GQ_IQ4_XS = 23 };
enum { GQ_MIN_NONE, GQ_MIN_FLOAT, GQ_MIN_INT };
#define GQ_MC 64 /* activation rows per pass over the weight */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define GQ_ZMM 1
#else
#define GQ_ZMM 0
#endif

static const int8_t gq_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* An fp16 value as float, exactly (subnormals included). */
INLINE float gq_f16(const uint8_t *p) {
#if defined(__F16C__)
    uint16_t v;
    memcpy(&v, p, 2);
    return _cvtsh_ss(v); /* exact, as below */
#endif
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    uint32_t u;
    if (exp == 0x1F)
        u = sign | 0x7F800000u | (man << 13);
    else if (exp != 0)
        u = sign | ((exp + 112) << 23) | (man << 13);
    else if (man == 0)
        u = sign;
    else {
        float f = (float)man * (1.0f / 16777216.0f); /* man * 2^-24: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* A decoded block: `n` codes, n / 16 integer scales (and mins), the float scales. */
typedef struct {
    int8_t c[256] __attribute__((aligned(64)));
    int32_t s[16];
    int32_t m[16];
    float dw, mw;
} gq_block;

/* Block size (inputs), bytes per block, and the kind of min, per type; 0 inputs for a type not served. */
static inline int gq_info(int type, int *bytes, int *min_kind) {
    int bs = 0, nb = 0, mk = GQ_MIN_NONE;
    switch (type) {
    case GQ_Q4_0: bs = 32, nb = 18; break;
    case GQ_Q4_1: bs = 32, nb = 20, mk = GQ_MIN_FLOAT; break;
    case GQ_Q5_0: bs = 32, nb = 22; break;
    case GQ_Q5_1: bs = 32, nb = 24, mk = GQ_MIN_FLOAT; break;
    case GQ_Q8_0: bs = 32, nb = 34; break;
    case GQ_IQ4_NL: bs = 32, nb = 18; break;
    case GQ_Q4_K: bs = 256, nb = 144, mk = GQ_MIN_INT; break;
    case GQ_Q5_K: bs = 256, nb = 176, mk = GQ_MIN_INT; break;
    case GQ_Q6_K: bs = 256, nb = 210; break;
    case GQ_IQ4_XS: bs = 256, nb = 136; break;
    default: break;
    }
    if (bytes) *bytes = nb;
    if (min_kind) *min_kind = mk;
    return bs;
}

/* The 32-input formats whose codes plus gq_small_off (Q4_0 8, Q5_0 16, Q4_1 and Q5_1 0) are unsigned (0..31). */
#define GQ_SMALL(T) (T == GQ_Q4_0 || T == GQ_Q5_0 || T == GQ_Q4_1 || T == GQ_Q5_1)
static inline int gq_small_off(int type) { return type == GQ_Q4_0 ? 8 : type == GQ_Q5_0 ? 16 : 0; }

/* ggml's get_scale_min_k4: sub-block j's 6-bit scale and min of a Q4_K / Q5_K block. */
INLINE void gq_scale_min_k4(int j, const uint8_t *q, int32_t *sc, int32_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

#if defined(__AVX2__)
/* The 32 codes of 16 bytes of nibbles (qs): the 16 low nibbles, then the 16 high ones (ggml's order). */
INLINE __m256i gq_nibbles32(const uint8_t *qs) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(15));
}

/* IQ4_NL's values of 32 codes 0..15. */
INLINE __m256i gq_iq4nl32(__m256i nib) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)gq_iq4nl)), nib);
}

/* The 32 codes 0..31 of a Q5_0 / Q5_1 block: byte j is the nibble j (low, then high) | bit j of h as bit 4
 * (llama.cpp's bytes_from_bits_32). */
INLINE __m256i gq_codes5(uint32_t h, const uint8_t *qs) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int32_t)h), _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bit =
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
    return _mm256_or_si256(gq_nibbles32(qs), _mm256_and_si256(bit, _mm256_set1_epi8(16)));
}

/* Bit `bit` of each byte of h, moved to bit 4: the fifth bit of Q5_K's codes from qh. */
INLINE __m256i gq_bit4(__m256i h, int bit) {
    return _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(bit)), _mm256_set1_epi8(1)), 4);
}
#endif

#if defined(__ARM_NEON) && defined(__aarch64__)
#define GQ_NEON 1
INLINE void gq_decode(const int type, const uint8_t *p, gq_block *b);
#include "gguf_blocks_neon.h"
#else
#define GQ_NEON 0
#endif

/* Decodes one block of `type` at p (see the header); returns nothing, `type` is one gq_info serves. */
INLINE void gq_decode(const int type, const uint8_t *p, gq_block *b) {
    int8_t *c = b->c;
#if GQ_NEON
    if (gq_decode_neon(type, p, b)) return;
#endif
    switch (type) {
    case GQ_Q4_0:
    case GQ_Q4_1:
    case GQ_IQ4_NL: {
        const int f = type == GQ_Q4_1;
        const uint8_t *qs = p + (f ? 4 : 2);
        b->dw = gq_f16(p);
        b->mw = f ? gq_f16(p + 2) : 0.0f;
        b->s[0] = b->s[1] = 1;
#if defined(__AVX2__)
        {   /* IQ4_NL's codes through its table, Q4_0's minus 8 */
            const __m256i nib = gq_nibbles32(qs);
            const __m256i v =
                type == GQ_IQ4_NL ? gq_iq4nl32(nib) : f ? nib : _mm256_sub_epi8(nib, _mm256_set1_epi8(8));
            _mm256_store_si256((__m256i *)c, v);
        }
#else
        for (int j = 0; j < 16; j++) {
            const int lo = qs[j] & 15, hi = qs[j] >> 4;
            if (type == GQ_IQ4_NL) {
                c[j] = gq_iq4nl[lo];
                c[j + 16] = gq_iq4nl[hi];
            } else {
                c[j] = (int8_t)(f ? lo : lo - 8);
                c[j + 16] = (int8_t)(f ? hi : hi - 8);
            }
        }
#endif
        break;
    }
    case GQ_Q5_0:
    case GQ_Q5_1: {
        const int f = type == GQ_Q5_1;
        const uint8_t *qh = p + (f ? 4 : 2), *qs = qh + 4;
        const uint32_t h = (uint32_t)qh[0] | ((uint32_t)qh[1] << 8) | ((uint32_t)qh[2] << 16) | ((uint32_t)qh[3] << 24);
        b->dw = gq_f16(p);
        b->mw = f ? gq_f16(p + 2) : 0.0f;
        const int off = f ? 0 : 16;
#if defined(__AVX2__)
        {
            _mm256_store_si256((__m256i *)c, _mm256_sub_epi8(gq_codes5(h, qs), _mm256_set1_epi8((char)off)));
            b->s[0] = b->s[1] = 1;
            break;
        }
#endif
        for (int j = 0; j < 16; j++) {
            const int h0 = (int)((h >> j) << 4) & 0x10, h1 = (int)(h >> (j + 12)) & 0x10;
            c[j] = (int8_t)(((qs[j] & 15) | h0) - off);
            c[j + 16] = (int8_t)(((qs[j] >> 4) | h1) - off);
        }
        b->s[0] = b->s[1] = 1;
        break;
    }
    case GQ_Q8_0:
        b->dw = gq_f16(p);
        b->mw = 0.0f;
        memcpy(c, p + 2, 32);
        b->s[0] = b->s[1] = 1;
        break;
    case GQ_Q4_K:
    case GQ_Q5_K: {
        const int five = type == GQ_Q5_K;
        const uint8_t *scales = p + 4, *qh = p + 16, *ql = p + (five ? 48 : 16);
        b->dw = gq_f16(p);
        b->mw = gq_f16(p + 2);
#if defined(__AVX2__)
        for (int g = 0; g < 4; g++) { /* the loop below, 32 bytes at a time */
            const __m256i q = _mm256_loadu_si256((const __m256i *)(ql + 32 * g)), m15 = _mm256_set1_epi8(15);
            __m256i lo = _mm256_and_si256(q, m15), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m15);
            if (five) { /* bit 2g (low) and 2g + 1 (high) of each qh byte, as the codes' bit 4 */
                const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
                lo = _mm256_or_si256(lo, gq_bit4(h, 2 * g));
                hi = _mm256_or_si256(hi, gq_bit4(h, 2 * g + 1));
            }
            _mm256_store_si256((__m256i *)(c + 64 * g), lo);
            _mm256_store_si256((__m256i *)(c + 64 * g + 32), hi);
        }
#else
        for (int g = 0; g < 4; g++) { /* 64 inputs: sub-blocks 2g (low nibbles) and 2g + 1 (high) */
            const uint8_t *q = ql + 32 * g;
            for (int l = 0; l < 32; l++) {
                int lo = q[l] & 15, hi = q[l] >> 4;
                if (five) {
                    lo |= ((qh[l] >> (2 * g)) & 1) << 4;
                    hi |= ((qh[l] >> (2 * g + 1)) & 1) << 4;
                }
                c[64 * g + l] = (int8_t)lo;
                c[64 * g + 32 + l] = (int8_t)hi;
            }
        }
#endif
        for (int j = 0; j < 8; j++) {
            int32_t sc, mn;
            gq_scale_min_k4(j, scales, &sc, &mn);
            b->s[2 * j] = b->s[2 * j + 1] = sc;
            b->m[2 * j] = b->m[2 * j + 1] = mn;
        }
        break;
    }
    case GQ_Q6_K: {
        const uint8_t *ql = p, *qh = p + 128;
        const int8_t *sc = (const int8_t *)(p + 192);
        b->dw = gq_f16(p + 208);
        b->mw = 0.0f;
#if defined(__AVX2__)
        for (int half = 0; half < 2; half++) { /* the loop below, 32 codes a vector */
            const __m256i a = _mm256_loadu_si256((const __m256i *)(ql + 64 * half));
            const __m256i bb = _mm256_loadu_si256((const __m256i *)(ql + 64 * half + 32));
            const __m256i h = _mm256_loadu_si256((const __m256i *)(qh + 32 * half));
            const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
            const __m256i lo[4] = {_mm256_and_si256(a, m15), _mm256_and_si256(bb, m15),
                                   _mm256_and_si256(_mm256_srli_epi16(a, 4), m15),
                                   _mm256_and_si256(_mm256_srli_epi16(bb, 4), m15)};
            const __m256i hi[4] = {_mm256_and_si256(h, m3), _mm256_and_si256(_mm256_srli_epi16(h, 2), m3),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 4), m3),
                                   _mm256_and_si256(_mm256_srli_epi16(h, 6), m3)};
            for (int j = 0; j < 4; j++)
                _mm256_store_si256((__m256i *)(c + 128 * half + 32 * j),
                                   _mm256_sub_epi8(_mm256_or_si256(lo[j], _mm256_slli_epi16(hi[j], 4)), k32));
        }
#else
        for (int half = 0; half < 2; half++) {
            const uint8_t *l8 = ql + 64 * half, *h8 = qh + 32 * half;
            int8_t *y = c + 128 * half;
            for (int l = 0; l < 32; l++) {
                y[l] = (int8_t)(((l8[l] & 15) | (((h8[l] >> 0) & 3) << 4)) - 32);
                y[l + 32] = (int8_t)(((l8[l + 32] & 15) | (((h8[l] >> 2) & 3) << 4)) - 32);
                y[l + 64] = (int8_t)(((l8[l] >> 4) | (((h8[l] >> 4) & 3) << 4)) - 32);
                y[l + 96] = (int8_t)(((l8[l + 32] >> 4) | (((h8[l] >> 6) & 3) << 4)) - 32);
            }
        }
#endif
        for (int j = 0; j < 16; j++) b->s[j] = sc[j];
        break;
    }
    case GQ_IQ4_XS: {
        const uint32_t sh = (uint32_t)p[2] | ((uint32_t)p[3] << 8);
        const uint8_t *sl = p + 4, *qs = p + 8;
        b->dw = gq_f16(p);
        b->mw = 0.0f;
        for (int ib = 0; ib < 8; ib++) {
            const int ls = ((sl[ib / 2] >> (4 * (ib % 2))) & 15) | (((sh >> (2 * ib)) & 3) << 4);
            b->s[2 * ib] = b->s[2 * ib + 1] = ls - 32;
#if defined(__AVX2__)
            _mm256_store_si256((__m256i *)(c + 32 * ib), gq_iq4nl32(gq_nibbles32(qs + 16 * ib)));
#else
            for (int j = 0; j < 16; j++) {
                c[32 * ib + j] = gq_iq4nl[qs[16 * ib + j] & 15];
                c[32 * ib + j + 16] = gq_iq4nl[qs[16 * ib + j] >> 4];
            }
#endif
        }
        break;
    }
    default:
        break;
    }
}

/* int32 words of qsg per group of G inputs: a 32-input group's sum of q; for a 256-input group, its 16 sums of 16
 * (qs16) as 16-bit pairs (8 words, the Q6_K kernels' correction), then its 8 sums of 32 as 16-bit pairs (4 words,
 * the Q4_K / Q5_K mins), then 4 unused: 64 bytes a group from a 64-byte aligned base, so that no load of them
 * straddles two cache lines. Each |sum| <= 32 * 127 fits 16 bits. */
#define GQ_QSG_WORDS(G) ((G) == 256 ? 16 : 1)

INLINE int32_t gq_pack16(int32_t lo, int32_t hi) { return (int32_t)((uint32_t)(uint16_t)lo | ((uint32_t)(uint16_t)hi << 16)); }

/* Quantizes rows [m0, m1) of x (row stride xs) to q int8 [., K] (row stride K), dx and ex [., K / G], the sums
 * of q per 16 inputs qs16 [., K / 16] and per group qsg [., K / G, GQ_QSG_WORDS(G)] (see the header; q8_group in
 * common.h). The kernels read qsg's sums where they would add them up again for every 8 weight rows. */
static void gq_quantize_rows(const float *x, int64_t xs, int64_t m0, int64_t m1, int64_t K, int G, int8_t *q,
                             float *dx, float *ex, int32_t *qs16, int32_t *qsg) {
    const int64_t groups = K / G;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t *s16 = qs16 + m * (K / 16) + g * (G / 16);
            const float d = q8_group(x + m * xs + g * G, G, q + m * K + g * G, s16);
            int32_t sum = 0;
            for (int j = 0; j < G / 16; j++) sum += s16[j];
            dx[m * groups + g] = d;
            ex[m * groups + g] = d * (float)sum;
            int32_t *ks = qsg + (m * groups + g) * GQ_QSG_WORDS(G);
            if (G == 32) {
                ks[0] = sum;
                continue;
            }
            for (int h = 0; h < 8; h++) ks[h] = gq_pack16(s16[2 * h], s16[2 * h + 1]);
            for (int h = 0; h < 4; h++)
                ks[8 + h] = gq_pack16(s16[4 * h] + s16[4 * h + 1], s16[4 * h + 2] + s16[4 * h + 3]);
        }
}

/* ---- integer dot products: sum over j of s[j] * (c . q over inputs 16 j .. 16 j + 15) ---- */

INLINE int32_t gq_dot_c(const int8_t *c, const int8_t *q, const int32_t *s, const int bs) {
    int32_t total = 0;
    for (int j = 0; j < bs / 16; j++) {
        int32_t d = 0;
        for (int k = 0; k < 16; k++) d += (int32_t)c[16 * j + k] * q[16 * j + k];
        total += s[j] * d;
    }
    return total;
}

#if defined(__AVX2__)
/* 8 int32 lanes of c . q for 32 inputs, lanes 0-3 inputs 0-15, lanes 4-7 inputs 16-31. */
INLINE __m256i gq_dot32(__m256i abs_c, __m256i c, __m256i q) {
    const __m256i sq = _mm256_sign_epi8(q, c);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), abs_c, sq);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(abs_c, sq), _mm256_set1_epi16(1));
#endif
}
#endif

/* ---- the kernel ---- */

/* Output rows [n0, n1) for activation rows [m0, m1): out[m, n] for every m, one weight row at a time. */
INLINE void gq_rows(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t m0,
                    int64_t m1, int64_t K, const int8_t *xq, const float *dx, const float *ex, const int32_t *qs16,
                    float *out, int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    const int64_t blocks = K / bs;
    gq_block blk;
    float acc[GQ_MC];
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t *row = w + n * row_bytes;
        for (int64_t m = m0; m < m1; m++) acc[m - m0] = 0.0f;
        for (int64_t b = 0; b < blocks; b++) {
            gq_decode(type, row + b * bytes, &blk);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
            __m512i ac4[4], c4[4], s4[4];
            if (bs == 256)
                for (int r = 0; r < 4; r++) {
                    c4[r] = _mm512_load_si512((const void *)(blk.c + 64 * r));
                    ac4[r] = _mm512_abs_epi8(c4[r]);
                    s4[r] = _mm512_set_epi32(blk.s[4 * r + 3], blk.s[4 * r + 3], blk.s[4 * r + 3], blk.s[4 * r + 3],
                                             blk.s[4 * r + 2], blk.s[4 * r + 2], blk.s[4 * r + 2], blk.s[4 * r + 2],
                                             blk.s[4 * r + 1], blk.s[4 * r + 1], blk.s[4 * r + 1], blk.s[4 * r + 1],
                                             blk.s[4 * r], blk.s[4 * r], blk.s[4 * r], blk.s[4 * r]);
                }
#endif
#if defined(__AVX2__)
            __m256i ac[8], cc[8], sv[8];
            const int nr = GQ_ZMM && bs == 256 ? 0 : bs / 32; /* 0: the AVX-512 code takes this block */
            for (int r = 0; r < nr; r++) {
                cc[r] = _mm256_load_si256((const __m256i *)(blk.c + 32 * r));
                ac[r] = _mm256_abs_epi8(cc[r]);
                sv[r] = _mm256_setr_epi32(blk.s[2 * r], blk.s[2 * r], blk.s[2 * r], blk.s[2 * r], blk.s[2 * r + 1],
                                          blk.s[2 * r + 1], blk.s[2 * r + 1], blk.s[2 * r + 1]);
            }
#endif
            for (int64_t m = m0; m < m1; m++) {
                const int8_t *q = xq + m * K + b * bs;
                int32_t isum;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
                if (bs == 256) {
                    __m512i t = _mm512_setzero_si512();
                    for (int r = 0; r < 4; r++) {
                        const __m512i xv = _mm512_loadu_si512((const void *)(q + 64 * r));
                        const __mmask64 neg = _mm512_movepi8_mask(c4[r]);
                        const __m512i sq = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                        const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ac4[r], sq);
                        t = _mm512_add_epi32(t, _mm512_mullo_epi32(d, s4[r]));
                    }
                    isum = _mm512_reduce_add_epi32(t);
                } else
#endif
                {
#if defined(__AVX2__)
                    __m256i t = _mm256_setzero_si256();
                    for (int r = 0; r < nr; r++) {
                        const __m256i d = gq_dot32(ac[r], cc[r], _mm256_loadu_si256((const __m256i *)(q + 32 * r)));
                        t = _mm256_add_epi32(t, bs == 32 ? d : _mm256_mullo_epi32(d, sv[r]));
                    }
                    isum = hsum8_epi32(t);
#else
                    isum = gq_dot_c(blk.c, q, blk.s, bs);
#endif
                }
                const int64_t g = m * blocks + b;
                float a = acc[m - m0] + (float)isum * (blk.dw * dx[g]);
                if (mk == GQ_MIN_FLOAT) a = a + blk.mw * ex[g];
                if (mk == GQ_MIN_INT) {
                    const int32_t *s16 = qs16 + m * (K / 16) + b * (bs / 16);
                    int32_t msum = 0;
                    for (int j = 0; j < bs / 16; j++) msum += blk.m[j] * s16[j];
                    a = a - (float)msum * (blk.mw * dx[g]);
                }
                acc[m - m0] = a;
            }
        }
        for (int64_t m = m0; m < m1; m++) out[m * os + n] = acc[m - m0];
    }
}

#if defined(__AVX2__)
/* The 8 lanes' sums of 8 vectors, as one vector (lane i: the sum of v[i]'s lanes). */
INLINE __m256i gq_reduce8(const __m256i *v) {
    /* a transpose by unpacks, summing at each level (vphaddd is several micro-ops on AMD's cores) */
    __m256i p[4], q[2];
    for (int i = 0; i < 4; i++) /* lanes: v[2i] 0+1, v[2i+1] 0+1, v[2i] 2+3, v[2i+1] 2+3 per 128-bit half */
        p[i] = _mm256_add_epi32(_mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 2; i++) /* lanes: v[4i .. 4i+3]'s half sums per 128-bit half */
        q[i] = _mm256_add_epi32(_mm256_unpacklo_epi64(p[2 * i], p[2 * i + 1]), _mm256_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q[0], q[1], 0x20), _mm256_permute2x128_si256(q[0], q[1], 0x31));
}

/* isum - off * qsum in every lane, off a power of two (a small format's offset, or 128): qsum, the block's sum of
 * q, is gq_quantize_rows' per group (one broadcast load; from qs16 it took two loads, an add, a multiply and a move
 * from a general register, for every 8 weight rows). */
INLINE __m256i gq_sub_off(__m256i isum, int32_t qsum, int off) {
    return _mm256_sub_epi32(isum, _mm256_slli_epi32(_mm256_set1_epi32(qsum), __builtin_ctz((unsigned)off)));
}

/* The recipe's float epilogue for the 8 outputs of a block, one per lane (the header's order, every operation
 * rounded on its own): acc + (float)isum * (dw * dx), then for the integer mins - (float)msum * (mw * dx). */
INLINE __m256 gq_epilogue8(__m256 acc, __m256i isum, __m256 dwv, __m256 vdx) {
    return _mm256_add_ps(acc, _mm256_mul_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(dwv, vdx)));
}
INLINE __m256 gq_epilogue8_mins(__m256 a, const int32_t *msum, __m256 mwv, __m256 vdx) {
    const __m256 vm = _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)msum));
    return _mm256_sub_ps(a, _mm256_mul_ps(vm, _mm256_mul_ps(mwv, vdx)));
}

/* out[m, n0 .. n0 + 7] = the lanes of acc[m - m0], for m in [m0, m1). */
INLINE void gq_store8(const __m256 *acc, int64_t m0, int64_t m1, float *out, int64_t os, int64_t n0) {
    for (int64_t m = m0; m < m1; m++) {
        float v[8];
        _mm256_storeu_ps(v, acc[m - m0]);
        for (int i = 0; i < 8; i++) out[m * os + n0 + i] = v[i];
    }
}

/* Slice b (`slice` bytes) of the next 8 weight rows (contiguous: 8 * row_bytes bytes), prefetched while block
 * b of the current 8 is used. The 8 rows' blocks are read at 8 strided places, which the hardware
 * prefetchers pick up too late: at one activation row the kernel otherwise waits on memory (132 -> 82 ms a
 * decode step of a 1.5B Q4_K_M model, bench_results/README.md). Prefetches never fault: the slice past the
 * matrix, or into another thread's rows, costs only the bandwidth. */
INLINE void gq_prefetch_slice(const char *next, int64_t b, int64_t slice) {
    for (int64_t x = b * slice; x < (b + 1) * slice; x += 64) __builtin_prefetch(next + x, 0, 3);
}

/* Activation rows up to which Q6_K matmuls take gq_rows8_k (codes unpacked in registers, straight from the
 * file's bytes) rather than gq_rows8 (each block decoded once into a gq_block, then read for every row): the
 * unpacking is repeated per activation row, the decoding is not. Past 6 rows gq_rows8 was the faster in the AVX2
 * build (which now takes gq_rows8_q6k_il from GQ_IL_Q6K_MIN_ROWS), past 10 in the VNNI ones (one 1536 x 1536 matmul: 0.9x gq_rows8's time at 7-8 rows, equal at 12,
 * 1.05x at 16; bench_results/README.md). Q4_K, whose unpacking is two instructions, takes gq_rows8_k rather
 * than gq_rows8 at any row count (0.6x its time at 1-64 rows), but for gq_rows8_q4k_il from
 * GQ_IL_Q4K_MIN_ROWS rows in the AVX2 build; so does Q5_K, whose fifth bit adds three (0.56x gq_rows8's time
 * at 1 row, 0.75x at 32). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GQ_Q6K_DIRECT_ROWS 10
#else
#define GQ_Q6K_DIRECT_ROWS 6
#endif

/* Output rows [n0, n0 + 8) of a Q4_K, Q5_K or Q6_K weight for activation rows [m0, m1): gq_rows8's integers and
 * epilogue, with the codes and scales unpacked in registers from the block's bytes as gq_decode defines them
 * (ggml's layout). Exact integer sums taken in another order:
 *  - Q4_K: codes 0..15, so c . q is vpmaddubsw(c, q) directly (gq_rows8 takes |c| and q with c's sign: the
 *    same products); the 6-bit scales and mins of the 12 scale bytes unpacked as llama.cpp does (utmp);
 *    msum = sum over the 8 sub-blocks of min * (the sub-block's 32 q's sum) by vpmaddwd.
 *  - Q5_K: Q4_K's with each code's bit 4 from qh (codes 0..31: a vpmaddubsw pair stays within 2 * 31 * 127).
 *  - Q6_K: codes u - 32 with u = 0..63, so c . q = u . q - 32 * (sum of q): vpmaddubsw(u, q), and
 *    32 * sum_j s[j] * qs16[j] subtracted.
 * isum and msum are the same integers, so every output is gq_rows8's to the bit. */
INLINE void gq_rows8_k(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0, int64_t m1,
                       int64_t K, const int8_t *xq, const float *dx, const int32_t *qsg, float *out, int64_t os) {
    /* q4: Q4_K or Q5_K, the formats with 8 scales and 8 mins of 32 inputs (Q5_K: a fifth bit from qh) */
    const int q5 = type == GQ_Q5_K, q4 = type == GQ_Q4_K || q5, bytes = q5 ? 176 : q4 ? 144 : 210;
    const int64_t blocks = K / 256;
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    /* the shuffle putting 16-bit lane w of each 128-bit half in all 8 of its lanes: word 2r of the low half
     * in the low 128 bits and word 2r + 1 of the high half in the high ones, for scales of 16 inputs */
    __m256i pick[4];
    for (int r = 0; r < 4; r++) {
        const int8_t lo = (int8_t)(4 * r), hi = (int8_t)(4 * r + 2);
        pick[r] = _mm256_setr_epi8(lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1, lo, lo + 1,
                                   lo, lo + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1, hi, hi + 1,
                                   hi, hi + 1, hi, hi + 1);
    }
    __m256 acc[GQ_MC];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const char *next = (const char *)(w + (n0 + 8) * row_bytes);
    const int64_t slice = (8 * row_bytes / blocks + 63) & ~(int64_t)63;
    for (int64_t b = 0; b < blocks; b++) {
        gq_prefetch_slice(next, b, slice);
        float dw[8], mw[8];
        __m256i sv[8][8]; /* row i, 32-input chunk r: the scale of inputs 0-15 in the low half, 16-31 high */
        __m128i mins[8];  /* Q4_K: row i's 8 mins, 16-bit */
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = w + (n0 + i) * row_bytes + b * bytes;
            __m256i s16; /* the 16 scales (one per 16 inputs) as 16-bit lanes */
            if (q4) {
                uint32_t u[4];
                memcpy(u, p + 4, 12);
                u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
                const uint32_t mn_lo = u[1] & 0x3f3f3f3fu;
                u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
                u[2] = mn_lo;
                u[0] &= 0x3f3f3f3fu;
                /* u[0..1]: the 8 scales, u[2..3]: the 8 mins (bytes); each scale covers 32 inputs */
                const __m128i sc8 = _mm_cvtsi64_si128((int64_t)((uint64_t)u[0] | ((uint64_t)u[1] << 32)));
                const __m128i mn8 = _mm_cvtsi64_si128((int64_t)((uint64_t)u[2] | ((uint64_t)u[3] << 32)));
                s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8));
                mins[i] = _mm_cvtepu8_epi16(mn8);
                dw[i] = gq_f16(p);
                mw[i] = gq_f16(p + 2);
            } else {
                s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
                dw[i] = gq_f16(p + 208);
                mw[i] = 0.0f;
            }
            const __m256i lo = _mm256_permute2x128_si256(s16, s16, 0x00), hi = _mm256_permute2x128_si256(s16, s16, 0x11);
            for (int r = 0; r < 4; r++) {
                sv[i][r] = _mm256_shuffle_epi8(lo, pick[r]);
                sv[i][4 + r] = _mm256_shuffle_epi8(hi, pick[r]);
            }
        }
        const __m256 dwv = _mm256_loadu_ps(dw), mwv = _mm256_loadu_ps(mw);
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *q = xq + m * K + b * 256;
            const int32_t *ks = qsg + (m * blocks + b) * GQ_QSG_WORDS(256);
            __m256i t[8];
            int32_t ms[8];
            if (q4) {
                /* the 8 sub-blocks' sums of q, 16-bit (|sum| <= 32 * 127) */
                const __m128i p16 = _mm_loadu_si128((const __m128i *)(ks + 8));
                for (int i = 0; i < 8; i++) {
                    const uint8_t *blk = w + (n0 + i) * row_bytes + b * bytes, *p = blk + (q5 ? 48 : 16);
                    const __m256i qh = q5 ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : _mm256_setzero_si256();
                    __m256i a = _mm256_setzero_si256();
                    for (int g = 0; g < 4; g++) {
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 32 * g));
                        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + 64 * g));
                        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + 64 * g + 32));
                        __m256i c0 = _mm256_and_si256(v, m4), c1 = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
                        if (q5) { /* bit 2g (c0) and 2g + 1 (c1) of each qh byte as bit 4: codes 0..31, and a
                                   * pair's sum in vpmaddubsw stays within 2 * 31 * 127 */
                            c0 = _mm256_or_si256(c0, gq_bit4(qh, 2 * g));
                            c1 = _mm256_or_si256(c1, gq_bit4(qh, 2 * g + 1));
                        }
                        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(c0, x0), sv[i][2 * g]));
                        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(c1, x1), sv[i][2 * g + 1]));
                    }
                    t[i] = a;
                    __m128i mm = _mm_madd_epi16(mins[i], p16);
                    mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0x4E));
                    mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0xB1));
                    ms[i] = _mm_cvtsi128_si32(mm);
                }
            } else {
                /* sum_j s[j] * qs16[j] is subtracted 32 times: qs16 as 16-bit lanes (|qs16| <= 16 * 127) */
                const __m256i q16 = _mm256_loadu_si256((const __m256i *)ks);
                for (int i = 0; i < 8; i++) {
                    const uint8_t *p = w + (n0 + i) * row_bytes + b * bytes;
                    __m256i a = _mm256_setzero_si256();
                    for (int h = 0; h < 2; h++) {
                        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(p + 64 * h));
                        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(p + 64 * h + 32));
                        const __m256i hb = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h));
                        const __m256i u[4] = {
                            _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 4), m2)),
                            _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(hb, 2), m2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(hb, m2)),
                            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m2))};
                        for (int k = 0; k < 4; k++) {
                            const __m256i x = _mm256_loadu_si256((const __m256i *)(q + 128 * h + 32 * k));
                            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(u[k], x), sv[i][4 * h + k]));
                        }
                    }
                    /* the scales as 16-bit lanes in qs16's order: the low words of the sv vectors are not it, so
                     * read them again from the block */
                    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192)));
                    t[i] = _mm256_sub_epi32(a, _mm256_slli_epi32(_mm256_madd_epi16(s16, q16), 5));
                }
            }
            const int64_t g = m * blocks + b;
            const __m256 vdx = _mm256_set1_ps(dx[g]);
            const __m256 a = gq_epilogue8(acc[m - m0], gq_reduce8(t), dwv, vdx);
            acc[m - m0] = q4 ? gq_epilogue8_mins(a, ms, mwv, vdx) : a;
        }
    }
    gq_store8(acc, m0, m1, out, os, n0);
}


/* Activation rows from which gq_rows8 takes a 32-input format's codes interleaved (gq_interleave8): in the AVX2
 * build every 32-input format from 4 rows; with VNNI only the signed ones (Q8_0, IQ4_NL) from 8 rows, the others'
 * shifted codes with one vpdpbusd and a horizontal sum per row being as fast (bench_results/README.md). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GQ_IL_MIN_ROWS 8
#else
#define GQ_IL_MIN_ROWS 4
#endif

/* The 32 codes of 8 weight rows (blk[i].c + at) as 8 vectors of 4 consecutive inputs per row: lane i of W[j] holds
 * row i's inputs 4j .. 4j + 3 (an 8 x 8 transpose of 32-bit words). A product with the 4 activations 4j .. 4j + 3
 * broadcast to every lane then lands in its output's lane: no horizontal sum per block and activation row. */
INLINE void gq_interleave8(const gq_block *blk, int at, __m256i *W) {
    __m256i r[8], t[8], u[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_load_si256((const __m256i *)(blk[i].c + at));
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);     /* words 0, 1 (and 4, 5) of rows i, i + 1 */
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]); /* words 2, 3 (and 6, 7) */
    }
    for (int h = 0; h < 8; h += 4) { /* rows h .. h + 3 */
        u[h] = _mm256_unpacklo_epi64(t[h], t[h + 2]);     /* word 0 (4) */
        u[h + 1] = _mm256_unpackhi_epi64(t[h], t[h + 2]); /* word 1 (5) */
        u[h + 2] = _mm256_unpacklo_epi64(t[h + 1], t[h + 3]);
        u[h + 3] = _mm256_unpackhi_epi64(t[h + 1], t[h + 3]);
    }
    for (int j = 0; j < 4; j++) {
        W[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        W[4 + j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* The 4 bytes at p in every 32-bit lane: one load (vbroadcastss), where a copy to the stack and vpbroadcastd from it
 * stalled on the store. */
INLINE __m256i gq_bcast4(const int8_t *p) {
    float f;
    memcpy(&f, p, 4);
    return _mm256_castps_si256(_mm256_set1_ps(f));
}

/* Lane i: row i's 32 codes (W, gq_interleave8's) . the block's 32 activations q. With VNNI the codes are unsigned
 * (shifted: 0..255). Without, codes 0..31: the pairs of 4 words are summed in 16 bits first (|pair| <= 2 * 31 *
 * 127, four of them <= 31496); signed codes (A: their magnitudes) take q with their signs, a word at a time. */
INLINE __m256i gq_dot_il(const __m256i *W, const __m256i *A, const int8_t *q) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    (void)A;
    __m256i t = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) t = _mm256_dpbusd_epi32(t, W[j], gq_bcast4(q + 4 * j));
    return t;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    if (A) {
        __m256i t = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) {
            const __m256i sq = _mm256_sign_epi8(gq_bcast4(q + 4 * j), W[j]);
            t = _mm256_add_epi32(t, _mm256_madd_epi16(_mm256_maddubs_epi16(A[j], sq), ones));
        }
        return t;
    }
    __m256i lo = _mm256_maddubs_epi16(W[0], gq_bcast4(q));
    __m256i hi = _mm256_maddubs_epi16(W[4], gq_bcast4(q + 16));
    for (int j = 1; j < 4; j++) {
        lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(W[j], gq_bcast4(q + 4 * j)));
        hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(W[4 + j], gq_bcast4(q + 16 + 4 * j)));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones));
#endif
}

/* Lane i: the integer sum of weight row i's block (blk[i], decoded; sv its 16-bit scales when bs = 256) with the
 * 32 or 256 activations q, one row's products at a time and a horizontal sum. `uns`: 32 unsigned codes (VNNI). */
INLINE __m256i gq_sums8(const gq_block *blk, __m256i sv[8][8], const int8_t *q, const int bs, const int uns) {
    __m256i t[8];
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones, (void)uns; /* the VNNI build has no use for ones, the AVX2 build none for uns */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    if (uns) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)q);
        for (int i = 0; i < 8; i++)
            t[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_load_si256((const __m256i *)blk[i].c), xv);
        return gq_reduce8(t);
    }
#endif
    for (int i = 0; i < 8; i++) {
        __m256i a = _mm256_setzero_si256();
        for (int r = 0; r < bs / 32; r++) {
            const __m256i c = _mm256_load_si256((const __m256i *)(blk[i].c + 32 * r));
            const __m256i sq = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(q + 32 * r)), c);
            if (bs == 256) {
                a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), sq), sv[i][r]));
            } else {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
                a = _mm256_dpbusd_epi32(a, _mm256_abs_epi8(c), sq);
#else
                a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(c), sq), ones));
#endif
            }
        }
        t[i] = a;
    }
    return gq_reduce8(t);
}

/* Output rows [n0, n0 + 8) for activation rows [m0, m1): gq_rows' arithmetic, 8 outputs in the lanes of
 * one vector, so that the epilogue (the same operations per output, in the same order) runs once for all
 * 8 and no per-block horizontal sum stands in the way. Sub-block scales are applied in 16-bit lanes
 * (vpmaddwd of the pair sums by the scale: |pair| <= 32512, |scale| <= 128).
 * Q4_0, Q5_0, Q4_1 and Q5_1 codes plus a constant `off` (8, 16, 0, 0) are unsigned (0..31), and with VNNI
 * signed bytes plus 128 are too (0..255), so c . q = (c + off) . q - off * (the block's sum of q, qsg):
 * each block's codes are shifted once, and each activation row's products need no sign and magnitude per row.
 * With VNNI the small codes take one vpdpbusd a row (1.1x at 8 rows of a Qwen2.5-Coder-0.5B Q4_K_M decode step,
 * avx512; 1.1-1.2x at 4 rows, amx). From GQ_IL_MIN_ROWS rows the 32-input codes are interleaved (gq_interleave8),
 * so that the sums land in their output's lane (a 32-row step of that model in the AVX2 build 1.24x). The same
 * integers either way, so the same bits. bench_results/README.md. */
INLINE void gq_rows8(const int type, const int il_rows, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0,
                     int64_t m1, int64_t K, const int8_t *xq, const float *dx, const float *ex, const int32_t *qs16,
                     const int32_t *qsg, float *out, int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    const int nr = bs / 32;
    const int64_t blocks = K / bs;
    gq_block blk[8];
    __m256i sv[8][8];
    __m256 acc[GQ_MC];
    /* codes 0..31 after a shift of `small_off`; the other 32-input formats' (Q8_0, IQ4_NL) are signed bytes */
    const int small = GQ_SMALL(type);
    const int small_off = gq_small_off(type);
    __m256i W[8], A[8];
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    const int il = il_rows && bs == 32 && !small;
    const int uns = small || il; /* vpdpbusd on unsigned codes: signed ones + 128 */
    const int off = small ? small_off : il ? 128 : 0;
#else
    const int il = il_rows && bs == 32;
    const int uns = il && small; /* not below: vpmaddubsw + vpmaddwd on shifted codes measured no faster */
    const int off = uns ? small_off : 0;
#endif
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const char *next = (const char *)(w + (n0 + 8) * row_bytes);
    const int64_t slice = (8 * row_bytes / blocks + 63) & ~(int64_t)63;
    for (int64_t b = 0; b < blocks; b++) {
        float dw[8], mw[8];
        gq_prefetch_slice(next, b, slice);
        for (int i = 0; i < 8; i++) {
            gq_decode(type, w + (n0 + i) * row_bytes + b * bytes, &blk[i]);
            if (off)
                _mm256_store_si256((__m256i *)blk[i].c, _mm256_add_epi8(_mm256_load_si256((const __m256i *)blk[i].c),
                                                                         _mm256_set1_epi8((char)off)));
            dw[i] = blk[i].dw;
            mw[i] = blk[i].mw;
            if (bs == 256)
                for (int r = 0; r < nr; r++)
                    sv[i][r] = _mm256_setr_m128i(_mm_set1_epi16((int16_t)blk[i].s[2 * r]),
                                                 _mm_set1_epi16((int16_t)blk[i].s[2 * r + 1]));
        }
        const __m256 dwv = _mm256_loadu_ps(dw), mwv = _mm256_loadu_ps(mw);
        if (il) {
            gq_interleave8(blk, 0, W);
            if (!uns)
                for (int j = 0; j < 8; j++) A[j] = _mm256_abs_epi8(W[j]);
        }
        for (int64_t m = m0; m < m1; m++) {
            const int8_t *q = xq + m * K + b * bs;
            __m256i isum = il ? gq_dot_il(W, uns ? NULL : A, q) : gq_sums8(blk, sv, q, bs, uns);
            const int64_t g = m * blocks + b;
            const __m256 vdx = _mm256_set1_ps(dx[g]);
            if (off) isum = gq_sub_off(isum, qsg[g], off);
            __m256 a = gq_epilogue8(acc[m - m0], isum, dwv, vdx);
            if (mk == GQ_MIN_FLOAT) a = _mm256_add_ps(a, _mm256_mul_ps(mwv, _mm256_set1_ps(ex[g])));
            if (mk == GQ_MIN_INT) {
                const int32_t *s16 = qs16 + m * (K / 16) + b * (bs / 16);
                int32_t ms[8];
                for (int i = 0; i < 8; i++) {
                    int32_t msum = 0;
                    for (int j = 0; j < bs / 16; j++) msum += blk[i].m[j] * s16[j];
                    ms[i] = msum;
                }
                a = gq_epilogue8_mins(a, ms, mwv, vdx);
            }
            acc[m - m0] = a;
        }
    }
    gq_store8(acc, m0, m1, out, os, n0);
}

/* Activation rows up to which the AVX2 build takes the 32-input formats through gq_rows8_direct rather than gq_rows8
 * (from GQ_IL_MIN_ROWS its interleaved codes): the small formats to 3 rows, Q8_0 and IQ4_NL to 6. Every linear
 * weight of Qwen2.5-Coder-0.5B Q4_K_M in turn on a Zen 3, 2 threads (gguf_blocks_ab.py --sweep): Q5_0 1.22x at 1
 * row, 1.19x at 3, 0.90x at 4; Q8_0 1.86x at 1, 1.21x at 6, 1.03x at 8 (bench_results/README.md); IQ4_NL, signed
 * too, as Q8_0 (not measured: no such file here). Never in the VNNI builds, whose gq_rows8 takes the small formats'
 * shifted codes with one vpdpbusd a row (not measured there). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GQ_DIRECT_SMALL_ROWS 0
#define GQ_DIRECT_SIGNED_ROWS 0
#else
#define GQ_DIRECT_SMALL_ROWS 3
#define GQ_DIRECT_SIGNED_ROWS 6
#endif

/* The 32 codes of the 32-input block at p as gq_decode gives them, in a register: Q4_0 and Q5_0 plus their
 * offsets (8, 16), so that every small format's codes are unsigned (0..31); Q8_0's and IQ4_NL's signed. */
INLINE __m256i gq_codes32(const int type, const uint8_t *p) {
    uint32_t h;
    switch (type) {
    case GQ_Q4_0:
    case GQ_IQ4_NL: {
        const __m256i nib = gq_nibbles32(p + 2);
        return type == GQ_Q4_0 ? nib : gq_iq4nl32(nib);
    }
    case GQ_Q4_1: return gq_nibbles32(p + 4);
    case GQ_Q5_0:
        memcpy(&h, p + 2, 4);
        return gq_codes5(h, p + 6);
    case GQ_Q5_1:
        memcpy(&h, p + 4, 4);
        return gq_codes5(h, p + 8);
    default: return _mm256_loadu_si256((const __m256i *)(p + 2)); /* Q8_0 */
    }
}

/* The fp16 at p of 8 rows `stride` bytes apart, as floats (exactly, as gq_f16). */
INLINE __m256 gq_f16x8(const uint8_t *p, int64_t stride) {
    uint16_t v[8];
    for (int i = 0; i < 8; i++) memcpy(&v[i], p + i * stride, 2);
    return _mm256_cvtph_ps(_mm_setr_epi16((int16_t)v[0], (int16_t)v[1], (int16_t)v[2], (int16_t)v[3], (int16_t)v[4],
                                          (int16_t)v[5], (int16_t)v[6], (int16_t)v[7]));
}

/* Output rows [n0, n0 + 8) of a 32-input format for a few activation rows [m0, m1): gq_rows8's integers and
 * epilogue with each block's codes unpacked in registers from the file's bytes for each activation row (gq_rows8
 * decodes them once into gq_blocks on the stack and reads them back per row: at 1 row the stores, the reloads and
 * the scales gathered through memory cost more than the products). The small formats' codes plus their offset
 * (unsigned) take q as it is: c . q = (c + off) . q - off * (the block's sum of q), as gq_rows8's shifted codes; Q8_0
 * and IQ4_NL take |c| and q with c's sign. The same integers, so the same bits. */
INLINE void gq_rows8_direct_n(const int type, const int nm, const uint8_t *w, int64_t row_bytes, int64_t n0,
                              int64_t m0, int64_t K, const int8_t *xq, const float *dx, const float *ex,
                              const int32_t *qsg, float *out, int64_t os) {
    const int64_t m1 = m0 + nm;
    int bytes, mk;
    gq_info(type, &bytes, &mk);
    const int64_t blocks = K / 32;
    const int small = GQ_SMALL(type), off = gq_small_off(type);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[6]; /* nm <= GQ_DIRECT_SIGNED_ROWS */
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const uint8_t *rows = w + n0 * row_bytes;
    const char *next = (const char *)(rows + 8 * row_bytes);
    const int64_t slice = (8 * row_bytes / blocks + 63) & ~(int64_t)63;
    for (int64_t b = 0; b < blocks; b++) {
        gq_prefetch_slice(next, b, slice);
        const uint8_t *p = rows + b * bytes;
        const __m256 dwv = gq_f16x8(p, row_bytes);
        const __m256 mwv = mk == GQ_MIN_FLOAT ? gq_f16x8(p + 2, row_bytes) : _mm256_setzero_ps();
        for (int64_t m = m0; m < m1; m++) {
            const __m256i q = _mm256_loadu_si256((const __m256i *)(xq + m * K + b * 32));
            __m256i t[8];
            for (int i = 0; i < 8; i++) {
                const __m256i c = gq_codes32(type, p + i * row_bytes);
                const __m256i prod = small ? _mm256_maddubs_epi16(c, q)
                                           : _mm256_maddubs_epi16(_mm256_abs_epi8(c), _mm256_sign_epi8(q, c));
                t[i] = _mm256_madd_epi16(prod, ones);
            }
            const int64_t g = m * blocks + b;
            __m256i isum = gq_reduce8(t);
            if (off) isum = gq_sub_off(isum, qsg[g], off);
            __m256 a = gq_epilogue8(acc[m - m0], isum, dwv, _mm256_set1_ps(dx[g]));
            if (mk == GQ_MIN_FLOAT) a = _mm256_add_ps(a, _mm256_mul_ps(mwv, _mm256_set1_ps(ex[g])));
            acc[m - m0] = a;
        }
    }
    gq_store8(acc, m0, m1, out, os, n0);
}

/* gq_rows8_direct_n with the row count a constant: the accumulators stay in registers. */
INLINE void gq_rows8_direct(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0, int64_t m1,
                            int64_t K, const int8_t *xq, const float *dx, const float *ex, const int32_t *qsg,
                            float *out, int64_t os) {
    switch (m1 - m0) {
    case 1: gq_rows8_direct_n(type, 1, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    case 2: gq_rows8_direct_n(type, 2, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    case 3: gq_rows8_direct_n(type, 3, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    case 4: gq_rows8_direct_n(type, 4, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    case 5: gq_rows8_direct_n(type, 5, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    default: gq_rows8_direct_n(type, 6, w, row_bytes, n0, m0, K, xq, dx, ex, qsg, out, os); break;
    }
}

/* Activation rows from which Q4_K matmuls take gq_rows8_q4k_il rather than gq_rows8_k: in the AVX2 build from 8
 * (one 896 x 4864 matmul, one thread: 1.2x at 8 rows, 1.5x at 32-64, even at 4); the VNNI builds keep gq_rows8_k,
 * which measured about as fast there (bench_results/README.md; the amx build's tiles take Q4_K from 4 rows). */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GQ_IL_Q4K_MIN_ROWS 0 /* never */
#else
#define GQ_IL_Q4K_MIN_ROWS 8
#endif

/* Activation rows that the interleaved K-quant kernels take at once: each of a block's 64 code vectors (in memory)
 * and its scales are loaded once for all of them instead of once a row. Every linear weight of
 * Qwen2.5-Coder-0.5B Q4_K_M on a Zen 3, 2 threads (gguf_blocks_ab.py --sweep), against one row at a time: Q6_K 1.05-1.2x
 * at 8-128 rows with 4 (1.05x at 32 with 2), Q4_K 1.04-1.07x with 2 (about 1.0x with 4). The same integers. */
#define GQ_Q4K_IL_ROWS 2
#define GQ_Q6K_IL_ROWS 4

/* gq_rows8_q4k_il's sums and epilogue for activation rows m .. m + R - 1 (acc: row m's accumulator). */
INLINE void gq_q4k_il_rows(const int R, __m256i W[8][8], const __m256i *SC, const __m256i *MN, __m256 dwv, __m256 mwv,
                           const int8_t *xq, const float *dx, const int32_t *qsg, int64_t K, int64_t blocks, int64_t b,
                           int64_t m, __m256 *acc) {
    const int8_t *q = xq + m * K + b * 256;
    __m256i isum[GQ_Q4K_IL_ROWS];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i s[GQ_Q4K_IL_ROWS];
        for (int r = 0; r < R; r++) s[r] = _mm256_maddubs_epi16(W[j][0], gq_bcast4(q + r * K + 32 * j));
        for (int v = 1; v < 8; v++) {
            const __m256i wv = W[j][v];
            for (int r = 0; r < R; r++)
                s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(wv, gq_bcast4(q + r * K + 32 * j + 4 * v)));
        }
        const __m256i sc = SC[j];
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(s[r], sc));
    }
    for (int r = 0; r < R; r++) {
        const int32_t *ks = qsg + ((m + r) * blocks + b) * GQ_QSG_WORDS(256);
        __m256i msum = _mm256_setzero_si256();
        for (int h = 0; h < 4; h++) /* sub-blocks 2h and 2h + 1's sums of q, 16-bit */
            msum = _mm256_add_epi32(msum, _mm256_madd_epi16(MN[h], _mm256_set1_epi32(ks[8 + h])));
        int32_t ms[8];
        _mm256_storeu_si256((__m256i *)ms, msum);
        const __m256 vdx = _mm256_set1_ps(dx[(m + r) * blocks + b]);
        acc[r] = gq_epilogue8_mins(gq_epilogue8(acc[r], isum[r], dwv, vdx), ms, mwv, vdx);
    }
}

/* Output rows [n0, n0 + 8) of a Q4_K weight for activation rows [m0, m1): gq_rows8_k's integers and epilogue with
 * each 32-input sub-block's codes interleaved (gq_interleave8), so that the sums land in their output's lane. The
 * codes are unpacked and interleaved once per block for every activation row (gq_rows8_k unpacks them again for
 * each). A sub-block's 8 vpmaddubsw sum in 16 bits (codes 0..15: |sum| <= 8 * 2 * 15 * 127 = 30480), then one
 * vpmaddwd by the sub-block's scale, held in both 16-bit halves of each row's lane; the mins' sum by vpmaddwd of
 * two sub-blocks' mins against their sums of q (16-bit: |sum| <= 32 * 127). The same integers, so the same bits. */
INLINE void gq_rows8_q4k_il(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0, int64_t m1, int64_t K,
                            const int8_t *xq, const float *dx, const int32_t *qsg, float *out, int64_t os) {
    const int64_t blocks = K / 256;
    const __m256i m4 = _mm256_set1_epi8(15);
    __m256 acc[GQ_MC];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const char *next = (const char *)(w + (n0 + 8) * row_bytes);
    const int64_t slice = (8 * row_bytes / blocks + 63) & ~(int64_t)63;
    gq_block codes[8]; /* row i's 256 codes in input order (only .c is used) */
    __m256i W[8][8];   /* sub-block j, word v: lane i holds row i's inputs 32 j + 4 v .. 32 j + 4 v + 3 */
    __m256i SC[8], MN[4];
    for (int64_t b = 0; b < blocks; b++) {
        gq_prefetch_slice(next, b, slice);
        float dw[8], mw[8];
        int32_t sc[8][8], mn[8][8]; /* [sub-block][row] */
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = w + (n0 + i) * row_bytes + b * 144;
            dw[i] = gq_f16(p);
            mw[i] = gq_f16(p + 2);
            for (int j = 0; j < 8; j++) gq_scale_min_k4(j, p + 4, &sc[j][i], &mn[j][i]);
            for (int g = 0; g < 4; g++) { /* 64 inputs: sub-blocks 2g (low nibbles) and 2g + 1 (high) */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(p + 16 + 32 * g));
                _mm256_store_si256((__m256i *)(codes[i].c + 64 * g), _mm256_and_si256(v, m4));
                _mm256_store_si256((__m256i *)(codes[i].c + 64 * g + 32), _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            }
        }
        for (int j = 0; j < 8; j++) {
            gq_interleave8(codes, 32 * j, W[j]);
            int32_t s2[8];
            for (int i = 0; i < 8; i++) s2[i] = sc[j][i] * 0x10001;
            SC[j] = _mm256_loadu_si256((const __m256i *)s2);
        }
        for (int h = 0; h < 4; h++) {
            int32_t m2[8];
            for (int i = 0; i < 8; i++) m2[i] = gq_pack16(mn[2 * h][i], mn[2 * h + 1][i]);
            MN[h] = _mm256_loadu_si256((const __m256i *)m2);
        }
        const __m256 dwv = _mm256_loadu_ps(dw), mwv = _mm256_loadu_ps(mw);
        int64_t m = m0;
        for (; m + GQ_Q4K_IL_ROWS <= m1; m += GQ_Q4K_IL_ROWS)
            gq_q4k_il_rows(GQ_Q4K_IL_ROWS, W, SC, MN, dwv, mwv, xq, dx, qsg, K, blocks, b, m, acc + (m - m0));
        for (; m < m1; m++) gq_q4k_il_rows(1, W, SC, MN, dwv, mwv, xq, dx, qsg, K, blocks, b, m, acc + (m - m0));
    }
    gq_store8(acc, m0, m1, out, os, n0);
}

/* Activation rows from which Q6_K matmuls take gq_rows8_q6k_il in the AVX2 build (gq_rows8_k below, which
 * unpacks the codes again for each row; gq_rows8 took 7 rows and more before: one 896 x 4864 matmul of a real
 * file 1.1x at 8 rows, 1.2x at 32 on a Zen 3); never in the VNNI builds, not measured there.
 * bench_results/README.md. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GQ_IL_Q6K_MIN_ROWS 0 /* never */
#else
#define GQ_IL_Q6K_MIN_ROWS 7
#endif

/* gq_rows8_q6k_il's sums and epilogue for activation rows m .. m + R - 1 (acc: row m's accumulator). */
INLINE void gq_q6k_il_rows(const int R, __m256i W[8][8], const __m256i *SC, const __m256i *SP, __m256 dwv,
                           const int8_t *xq, const float *dx, const int32_t *qsg, int64_t K, int64_t blocks, int64_t b,
                           int64_t m, __m256 *acc) {
    const int8_t *q = xq + m * K + b * 256;
    __m256i isum[GQ_Q6K_IL_ROWS];
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int g = 0; g < 8; g++)
        for (int v = 0; v < 8; v += 2) {
            const __m256i w0 = W[g][v], w1 = W[g][v + 1], sc = SC[2 * g + v / 4];
            for (int r = 0; r < R; r++) {
                const int8_t *qr = q + r * K + 32 * g + 4 * v;
                const __m256i t = _mm256_add_epi16(_mm256_maddubs_epi16(w0, gq_bcast4(qr)),
                                                   _mm256_maddubs_epi16(w1, gq_bcast4(qr + 4)));
                isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(t, sc));
            }
        }
    for (int r = 0; r < R; r++) {
        const int32_t *ks = qsg + ((m + r) * blocks + b) * GQ_QSG_WORDS(256);
        __m256i corr = _mm256_setzero_si256();
        for (int h = 0; h < 8; h++) /* qs16 2h and 2h + 1, 16-bit */
            corr = _mm256_add_epi32(corr, _mm256_madd_epi16(SP[h], _mm256_set1_epi32(ks[h])));
        acc[r] = gq_epilogue8(acc[r], _mm256_sub_epi32(isum[r], _mm256_slli_epi32(corr, 5)), dwv,
                              _mm256_set1_ps(dx[(m + r) * blocks + b]));
    }
}

/* Output rows [n0, n0 + 8) of a Q6_K weight for activation rows [m0, m1): gq_rows8's integers and epilogue with the
 * codes u = c + 32 (0..63) unpacked once per block as gq_decode does and interleaved per 32 inputs
 * (gq_interleave8), so that the sums land in their output's lane. A 16-input sub-block's four vpmaddubsw are summed
 * in pairs in 16 bits (|two pairs| <= 2 * 2 * 63 * 127 = 32004), each by vpmaddwd with the sub-block's scale held in
 * both 16-bit halves of each row's lane; 32 * sum_j s[j] * qs16[j] (vpmaddwd of the rows' pairs of scales against
 * qs16's, |qs16| <= 16 * 127) is subtracted, so isum = sum_j s[j] * (c . q over sub-block j): the same integers, so
 * the same bits. */
INLINE void gq_rows8_q6k_il(const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t m0, int64_t m1, int64_t K,
                            const int8_t *xq, const float *dx, const int32_t *qsg, float *out, int64_t os) {
    const int64_t blocks = K / 256;
    const __m256i m4 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    __m256 acc[GQ_MC];
    for (int64_t m = m0; m < m1; m++) acc[m - m0] = _mm256_setzero_ps();
    const char *next = (const char *)(w + (n0 + 8) * row_bytes);
    const int64_t slice = (8 * row_bytes / blocks + 63) & ~(int64_t)63;
    gq_block codes[8]; /* row i's 256 codes u in input order (only .c is used) */
    __m256i W[8][8];   /* 32 inputs g, word v: lane i holds row i's inputs 32 g + 4 v .. 32 g + 4 v + 3 */
    __m256i SC[16], SP[8];
    for (int64_t b = 0; b < blocks; b++) {
        gq_prefetch_slice(next, b, slice);
        float dw[8];
        int16_t sc[16][8]; /* [sub-block][row] */
        for (int i = 0; i < 8; i++) {
            const uint8_t *p = w + (n0 + i) * row_bytes + b * 210;
            dw[i] = gq_f16(p + 208);
            for (int j = 0; j < 16; j++) sc[j][i] = (int8_t)p[192 + j];
            for (int half = 0; half < 2; half++) { /* gq_decode's Q6_K unpacking, without its - 32 */
                const __m256i a = _mm256_loadu_si256((const __m256i *)(p + 64 * half));
                const __m256i bb = _mm256_loadu_si256((const __m256i *)(p + 64 * half + 32));
                const __m256i h = _mm256_loadu_si256((const __m256i *)(p + 128 + 32 * half));
                const __m256i u[4] = {
                    _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(bb, m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4)),
                    _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(bb, 4), m4),
                                    _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4))};
                for (int j = 0; j < 4; j++) _mm256_store_si256((__m256i *)(codes[i].c + 128 * half + 32 * j), u[j]);
            }
        }
        for (int g = 0; g < 8; g++) gq_interleave8(codes, 32 * g, W[g]);
        for (int j = 0; j < 16; j++) {
            int32_t s2[8];
            for (int i = 0; i < 8; i++) s2[i] = (int32_t)(uint16_t)sc[j][i] * 0x10001;
            SC[j] = _mm256_loadu_si256((const __m256i *)s2);
        }
        for (int h = 0; h < 8; h++) {
            int32_t p2[8];
            for (int i = 0; i < 8; i++) p2[i] = gq_pack16(sc[2 * h][i], sc[2 * h + 1][i]);
            SP[h] = _mm256_loadu_si256((const __m256i *)p2);
        }
        const __m256 dwv = _mm256_loadu_ps(dw);
        int64_t m = m0;
        for (; m + GQ_Q6K_IL_ROWS <= m1; m += GQ_Q6K_IL_ROWS)
            gq_q6k_il_rows(GQ_Q6K_IL_ROWS, W, SC, SP, dwv, xq, dx, qsg, K, blocks, b, m, acc + (m - m0));
        for (; m < m1; m++) gq_q6k_il_rows(1, W, SC, SP, dwv, xq, dx, qsg, K, blocks, b, m, acc + (m - m0));
    }
    gq_store8(acc, m0, m1, out, os, n0);
}

#define GQ_ROWS(T)                                                                                            \
    do {                                                                                                      \
        int64_t n = n0;                                                                                       \
        if (T == GQ_Q4_K && GQ_IL_Q4K_MIN_ROWS && m1 - m0 >= GQ_IL_Q4K_MIN_ROWS)                              \
            for (; n + 8 <= n1; n += 8) gq_rows8_q4k_il(w, row_bytes, n, m0, m1, K, xq, dx, qsg, out, os);     \
        if (T == GQ_Q6_K && GQ_IL_Q6K_MIN_ROWS && m1 - m0 >= GQ_IL_Q6K_MIN_ROWS)                              \
            for (; n + 8 <= n1; n += 8) gq_rows8_q6k_il(w, row_bytes, n, m0, m1, K, xq, dx, qsg, out, os);     \
        if (T == GQ_Q4_K || T == GQ_Q5_K || (T == GQ_Q6_K && m1 - m0 <= GQ_Q6K_DIRECT_ROWS))                   \
            for (; n + 8 <= n1; n += 8) gq_rows8_k(T, w, row_bytes, n, m0, m1, K, xq, dx, qsg, out, os);      \
        if (m1 - m0 <= (GQ_SMALL(T) ? GQ_DIRECT_SMALL_ROWS : T == GQ_Q8_0 || T == GQ_IQ4_NL ? GQ_DIRECT_SIGNED_ROWS : 0)) \
            for (; n + 8 <= n1; n += 8) gq_rows8_direct(T, w, row_bytes, n, m0, m1, K, xq, dx, ex, qsg, out, os); \
        const int il_rows = m1 - m0 >= GQ_IL_MIN_ROWS;                                                        \
        if (GQ_SMALL(T) && il_rows) /* a copy of its own: measured faster both ways for these types, slower */ \
            for (; n + 8 <= n1; n += 8) /* at 1 row for Q8_0 (gcc's register allocation) */                   \
                gq_rows8(T, 1, w, row_bytes, n, m0, m1, K, xq, dx, ex, qs16, qsg, out, os);                     \
        for (; n + 8 <= n1; n += 8)                                                                           \
            gq_rows8(T, !GQ_SMALL(T) && il_rows, w, row_bytes, n, m0, m1, K, xq, dx, ex, qs16, qsg, out, os);    \
        if (n < n1) gq_rows(T, w, row_bytes, n, n1, m0, m1, K, xq, dx, ex, qs16, out, os);                  \
    } while (0)
#elif GQ_NEON
#define GQ_ROWS(T)                                                                                            \
    do {                                                                                                      \
        int64_t n = n0;                                                                                       \
        for (; n + 4 <= n1; n += 4) gq_rows4(T, w, row_bytes, n, m0, m1, K, xq, dx, ex, qs16, out, os);       \
        if (n < n1) gq_rows(T, w, row_bytes, n, n1, m0, m1, K, xq, dx, ex, qs16, out, os);                  \
    } while (0)
#else
#define GQ_ROWS(T) gq_rows(T, w, row_bytes, n0, n1, m0, m1, K, xq, dx, ex, qs16, out, os)
#endif

/* One function per type, each compiled on its own: inlined into one switch, every type's loops shared one stack
 * frame and one register allocation, and a change to one type's kernel moved another's speed (Q8_0 at 1 row
 * lost 10% to Q6_K's interleaved kernel beside it). */
#define GQ_TYPE_FN(T)                                                                                         \
    static __attribute__((noinline)) void gq_rows_##T(const uint8_t *w, int64_t row_bytes, int64_t n0,        \
                                                      int64_t n1, int64_t m0, int64_t m1, int64_t K,          \
                                                      const int8_t *xq, const float *dx, const float *ex,     \
                                                      const int32_t *qs16, const int32_t *qsg, float *out,    \
                                                      int64_t os) {                                           \
        (void)qsg; /* the AVX2 and AVX-512 kernels' offset corrections */                                     \
        GQ_ROWS(T);                                                                                           \
    }
GQ_TYPE_FN(GQ_Q4_0)
GQ_TYPE_FN(GQ_Q4_1)
GQ_TYPE_FN(GQ_Q5_0)
GQ_TYPE_FN(GQ_Q5_1)
GQ_TYPE_FN(GQ_Q8_0)
GQ_TYPE_FN(GQ_IQ4_NL)
GQ_TYPE_FN(GQ_Q4_K)
GQ_TYPE_FN(GQ_Q5_K)
GQ_TYPE_FN(GQ_Q6_K)
GQ_TYPE_FN(GQ_IQ4_XS)

#define GQ_CASE(T)                                                                                            \
    case T: gq_rows_##T(w, row_bytes, n0, n1, m0, m1, K, xq, dx, ex, qs16, qsg, out, os); break;

static void gq_dispatch(int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int64_t n1, int64_t m0,
                        int64_t m1, int64_t K, const int8_t *xq, const float *dx, const float *ex,
                        const int32_t *qs16, const int32_t *qsg, float *out, int64_t os) {
    switch (type) {
        GQ_CASE(GQ_Q4_0)
        GQ_CASE(GQ_Q4_1)
        GQ_CASE(GQ_Q5_0)
        GQ_CASE(GQ_Q5_1)
        GQ_CASE(GQ_Q8_0)
        GQ_CASE(GQ_IQ4_NL)
        GQ_CASE(GQ_Q4_K)
        GQ_CASE(GQ_Q5_K)
        GQ_CASE(GQ_Q6_K)
        GQ_CASE(GQ_IQ4_XS)
    default: break;
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512VNNI__) && defined(__linux__)
#include "gguf_blocks_amx.h"
#define GQ_AMX 1
#else
#define GQ_AMX 0
#endif
/* Rows from which the amx build's matmuls run on the AMX tiles, by type: Q4_K and Q6_K from 4 rows, the other
 * formats from 8. The tiles' time hardly grows with the rows up to 16, while the AVX-512 kernel's grows with
 * each row; at 1 row the latter is the faster. Measured as whole decode steps of real Q4_K_M models, whose
 * weights stream from memory (bench_results/README.md, "AMX tiles built from the file's bytes"; a
 * microbenchmark's weights can sit in a large L3 and favour the tiles). A speculative step's k + 1
 * verification rows of a Q4_K_M model run on the tiles from k = 3. */
#if GQ_AMX
static int gq_amx_min_rows(int type, int bs) {
#ifdef GQ_AMX_MIN_M /* benchmarks/gguf_amx.py builds its own with -D, one threshold for every type */
    (void)type, (void)bs;
    return GQ_AMX_MIN_M;
#else
    switch (type) {
    case GQ_Q4_K:
    case GQ_Q6_K: return 4;
    default: return 8;
    }
#endif
}
#endif

/* 1 when a matmul of M rows of `type` (with `bs`-input blocks) runs on the AMX tiles. */
static int gq_uses_amx(int type, int bs, int64_t M) {
#if GQ_AMX
    return M >= gq_amx_min_rows(type, bs) && gq_amx_usable();
#else
    (void)type, (void)bs, (void)M;
    return 0;
#endif
}

/* The block size (inputs) of a ggml type this file serves, else 0. */
int izh_gguf_block_size(int type) { return gq_info(type, NULL, NULL); }

/* 1 when a matmul of M rows of `type` (a served one) runs on the AMX tiles in this library (the amx build, on
 * a CPU with AMX-INT8 where Linux allows it, from gq_amx_min_rows rows), else 0. The result is
 * the same bits. */
int izh_gguf_uses_amx(int type, int64_t M) {
    const int bs = gq_info(type, NULL, NULL);
    return bs && gq_uses_amx(type, bs, M);
}

/* out [M, N] (row stride os) = x [M, K] (fp32, row stride xs) @ W^T, W = N rows of `type` blocks, row n at
 * w + n * row_bytes. Returns 0; -1 for a type not served, a bad shape (M, N < 1, K not a multiple of the
 * block, row_bytes below a row's bytes); -4 out of memory. */
int izh_gguf_matmul_f32(int type, const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int64_t M,
                        int64_t N, int64_t K, float *out, int64_t os, int nt) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    if (bs == 0 || M < 1 || N < 1 || K < bs || K % bs || row_bytes < K / bs * bytes || xs < K || os < N)
        return -1;
    const int amx = gq_uses_amx(type, bs, M);
    const size_t groups = (size_t)M * (size_t)(K / bs), xq_bytes = ((size_t)M * (size_t)K + 63) & ~(size_t)63;
    const size_t act_bytes = (groups * 8 + (size_t)M * (size_t)(K / 16) * 4 + 63) & ~(size_t)63;
    const size_t qsg_bytes = (groups * GQ_QSG_WORDS(bs) * 4 + 63) & ~(size_t)63;
    char *buf = (char *)aligned_alloc(64, xq_bytes + act_bytes + qsg_bytes);
    if (!buf) return -4;
    int8_t *xq = (int8_t *)buf;
    float *dx = (float *)(buf + xq_bytes);
    float *ex = dx + groups;
    int32_t *qs16 = (int32_t *)(ex + groups);
    int32_t *qsg = (int32_t *)(buf + xq_bytes + act_bytes); /* 64-byte aligned */
#if GQ_AMX
    /* the tiles' copy of the activations (gq_amx_act), rows padded to 16 */
    gq_amx_act act = {NULL, NULL, NULL, NULL, (M + 15) / 16 * 16};
    char *abuf = NULL;
    if (amx) {
        const size_t blocks = (size_t)(K / bs), Mq = (size_t)act.Mq, xv_bytes = Mq * (size_t)K;
        abuf = (char *)aligned_alloc(64, ((xv_bytes + 63) & ~(size_t)63) + blocks * Mq * (mk == GQ_MIN_INT ? 24 : 8) + 64);
        if (!abuf) {
            free(buf);
            return -4;
        }
        act.xv = (int8_t *)abuf;
        act.dxT = (float *)(abuf + ((xv_bytes + 63) & ~(size_t)63));
        act.exT = act.dxT + blocks * Mq;
        act.qpT = (int32_t *)(act.exT + blocks * Mq);
    }
#endif
    const int64_t work = N * K;
    if (nt < 1) nt = 1;
    if (work * M < PAR_MIN_ELEMS) nt = 1;
#pragma omp parallel num_threads(nt)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        gq_quantize_rows(x, xs, M * me / team, M * (me + 1) / team, K, bs, xq, dx, ex, qs16, qsg);
#pragma omp barrier
#if GQ_AMX
        if (amx) {
            const int64_t tiles = act.Mq / 16, col_groups = (N + 15) / 16;
            gq_amx_prepare(xq, dx, ex, qs16, M, K, bs, mk == GQ_MIN_INT, type == GQ_Q4_K, tiles * me / team, tiles * (me + 1) / team,
                           &act);
#pragma omp barrier
            gq_amx_dispatch(type, w, row_bytes, N, col_groups * me / team, col_groups * (me + 1) / team, M, K, &act,
                            out, os);
        } else
#endif
        {
            const int64_t n0 = N * me / team, n1 = N * (me + 1) / team;
            for (int64_t m0 = 0; m0 < M; m0 += GQ_MC) {
                const int64_t m1 = m0 + GQ_MC < M ? m0 + GQ_MC : M;
                gq_dispatch(type, w, row_bytes, n0, n1, m0, m1, K, xq, dx, ex, qs16, qsg, out, os);
            }
        }
    }
#if GQ_AMX
    free(abuf);
#endif
    free(buf);
    return 0;
}

/* Rows ids[0..n) of W (as above), dequantized to fp32 out [n, K] (row stride os) the way ggml does it:
 * w = dw * s * c (+ mw, - mw * m) per block, in float32: (dw * s) * c for the 32-blocks' s = 1 reads as dw * c.
 * (The embedding gather; transformers' own dequantization, gguf-py's, is the reference of `gguf_rows`.)
 * Returns 0, or -1 for a type not served or an id outside [0, rows). */
int izh_gguf_dequant_rows(int type, const uint8_t *w, int64_t row_bytes, int64_t rows, const int64_t *ids,
                          int64_t n, int64_t K, float *out, int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    if (bs == 0 || K % bs) return -1;
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= rows) return -1;
    gq_block blk;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *row = w + ids[i] * row_bytes;
        float *y = out + i * os;
        for (int64_t b = 0; b < K / bs; b++) {
            gq_decode(type, row + b * bytes, &blk);
            for (int k = 0; k < bs; k++) {
                const int j = k / 16;
                float v;
                if (mk == GQ_MIN_INT)
                    v = blk.dw * (float)blk.s[j] * (float)blk.c[k] - blk.mw * (float)blk.m[j];
                else if (mk == GQ_MIN_FLOAT)
                    v = blk.dw * (float)blk.c[k] + blk.mw;
                else
                    v = bs == 32 ? blk.dw * (float)blk.c[k] : blk.dw * (float)blk.s[j] * (float)blk.c[k];
                y[b * bs + k] = v;
            }
        }
    }
    return 0;
}
