/* Record matmuls for float32 models, and the float32 fused decode stack, for every variant.
 *
 * The bf16 kernels (qgemm_avx512.c) need AVX512-BF16. These take float32 activations and run on any
 * CPU, the way llama.cpp runs Q4 x Q8 dot products: each row of x is quantized to int8 per group of 32
 * inputs (d = max |x| / 127, q = round-half-even(x * (1 / d))), the dot products of codes are exact
 * int32 sums, and a fixed float32 epilogue per group applies the scales. The weights are the same
 * records as the bf16 kernels' (see qgemm_avx512.c): int4 (w = code * scale + min) or int8 (w = code *
 * scale), bf16 scales, 16 output rows x 32 inputs per record.
 *
 *   out[m, n] = sum over groups g, in order, of   isum * (s[n, g] * d[m, g])  (+ min[n, g] * e[m, g])
 *
 * with isum the exact integer dot product of the group's codes, e = d * (sum of q over the group), each
 * product and sum rounded to float32 on its own (no fused multiply-add: the library is built with
 * -ffp-contract=off). The integer part is exact and the float part is the same sequence of operations
 * everywhere, so every variant (and `q4_matmul_x8_ref` / `q8_matmul_x8_ref` in records.py) gives
 * bit-identical results, for any number of rows: a row's result does not depend on the others in the
 * batch.
 *
 * AVX2: vpmaddubsw multiplies 32 code bytes by 32 activation bytes at once; int4 codes feed it straight
 * from the nibbles (the record's byte 2i+e holds row i's codes for two neighbouring inputs, so a broadcast
 * activation pair lines up with them); int8 codes are widened to 16 bits and paired by input for
 * vpmaddwd. AVX-512 VNNI: vpdpbusd, 16 rows x 4 inputs a register (int4 records from 3 rows of x, int8
 * records at any row count; see x8_q4_tile_rows_vnni and x8_q8_tile_rows_vnni). NEON (records_neon.h):
 * vmlal_s8 / vmull_s8 into 16-bit lanes, widened per record. Generic: the same integer sums in plain C.
 * Quantizing x is common.h's q8_group (vectorised, the same bits). Threads split the output tiles
 * statically. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

#define X8_Q4_RECORD 320
#define X8_Q8_RECORD 544
#define X8_PREFETCH 8  /* records ahead */
#define X8_MC 64       /* rows per chunk (x8_tiles); the rows kernels' L1 buffers hold this many */

/* Quantizes rows [m0, m1) of x (fp32, row stride xs) to q int8 [M, K] (row stride K), d and e fp32
 * [M, K / 32]: q8_group's d and q (common.h); e = d * sum(q) for int4 records (the mins' factor), the sum
 * of q itself for int8 records (exact in float32, |sum| <= 32 * 127: the VNNI kernel's correction). */
static void x8_quantize_rows(const int q8, const float *x, int64_t xs, int64_t m0, int64_t m1, int64_t K,
                             int8_t *q, float *d, float *e) {
    const int64_t groups = K / 32;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t g = 0; g < groups; g++) {
            int32_t s16[2];
            const float dd = q8_group(x + m * xs + g * 32, 32, q + m * K + g * 32, s16);
            const float sum = (float)(s16[0] + s16[1]);
            d[m * groups + g] = dd;
            e[m * groups + g] = q8 ? sum : dd * sum;
        }
}

INLINE float x8_bf16(const uint8_t *p, int i) {
    uint16_t h;
    memcpy(&h, p + 2 * i, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* The epilogue of one group for one row of x and the tile's 16 output rows, in the order of the header.
 * (Scalar form; the AVX2 code does the same operations 8 lanes at a time.) */
INLINE void x8_epilogue(float *acc, const int32_t *isum, const uint8_t *scales, const uint8_t *mins, float d,
                        float e) {
    for (int i = 0; i < 16; i++) {
        const float t = x8_bf16(scales, i) * d;
        float a = acc[i] + (float)isum[i] * t;
        if (mins) a = a + x8_bf16(mins, i) * e;
        acc[i] = a;
    }
}

/* ---- portable integer sums (generic, NEON) ---- */

/* isum[i] for one int4 record and one row's 32 codes. */
INLINE void x8_q4_isum_c(const uint8_t *rec, const int8_t *q, int32_t *isum) {
    int32_t s[16] = {0};
    for (int b = 0; b < 8; b++) {
        const uint8_t *blk = rec + 32 * b;
        const int32_t q0 = q[4 * b], q1 = q[4 * b + 1], q2 = q[4 * b + 2], q3 = q[4 * b + 3];
        for (int i = 0; i < 16; i++) {
            const int32_t b0 = blk[2 * i], b1 = blk[2 * i + 1];
            s[i] += (b0 & 15) * q0 + (b1 & 15) * q1 + (b0 >> 4) * q2 + (b1 >> 4) * q3;
        }
    }
    memcpy(isum, s, sizeof s);
}

INLINE void x8_q8_isum_c(const uint8_t *rec, const int8_t *q, int32_t *isum) {
    int32_t s[16] = {0};
    const int8_t *codes = (const int8_t *)rec;
    for (int k = 0; k < 32; k++)
        for (int i = 0; i < 16; i++) s[i] += (int32_t)codes[16 * k + i] * q[k];
    memcpy(isum, s, sizeof s);
}

static __attribute__((unused)) void x8_tile_c(const int q8, const uint8_t *tile, int64_t groups, const int8_t *xq, int64_t K,
                      const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
    const int64_t record = q8 ? X8_Q8_RECORD : X8_Q4_RECORD;
    for (int64_t m = 0; m < rows; m++) {
        float acc[16] = {0};
        int32_t isum[16];
        const uint8_t *rec = tile;
        for (int64_t g = 0; g < groups; g++, rec += record) {
            if (q8) {
                x8_q8_isum_c(rec, xq + m * K + 32 * g, isum);
                x8_epilogue(acc, isum, rec + 512, NULL, xd[m * groups + g], 0.0f);
            } else {
                x8_q4_isum_c(rec, xq + m * K + 32 * g, isum);
                x8_epilogue(acc, isum, rec + 256, rec + 288, xd[m * groups + g], xe[m * groups + g]);
            }
        }
        memcpy(out + m * os, acc, sizeof acc);
    }
}

/* ---- AVX2 ---- */
#if defined(__AVX2__)
#include <immintrin.h>

INLINE __m256 x8_bf16x8(const uint8_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* acc[0..1] (rows 0-7, 8-15) += isum * (s * d) (+ min * e), lane for lane as x8_epilogue. */
INLINE void x8_epilogue_avx2(__m256 *acc, __m256i i0, __m256i i1, __m256 s0, __m256 s1, const __m256 *mn, float d,
                             float e) {
    const __m256 vd = _mm256_set1_ps(d);
    acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(_mm256_cvtepi32_ps(i0), _mm256_mul_ps(s0, vd)));
    acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(_mm256_cvtepi32_ps(i1), _mm256_mul_ps(s1, vd)));
    if (mn) {
        const __m256 ve = _mm256_set1_ps(e);
        acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(mn[0], ve));
        acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(mn[1], ve));
    }
}

/* R rows of x against one tile of int4 records. */
INLINE void x8_q4_tile_avx2(const int R, const uint8_t *rec, int64_t groups, const uint32_t *xp, int64_t xgs,
                            const float *xd, const float *xe, float *out, int64_t os) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256 acc[2][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += X8_Q4_RECORD) {
        for (int c = 0; c < X8_Q4_RECORD; c += 64) _mm_prefetch((const char *)rec + X8_PREFETCH * X8_Q4_RECORD + c, _MM_HINT_T0);
        __m256i i0[2], i1[2];
        for (int m = 0; m < R; m++) i0[m] = i1[m] = _mm256_setzero_si256();
        for (int half = 0; half < 2; half++) {
            /* 4 blocks: |sum| <= 8 * 15 * 127 * 2 < 32768, so int16 lanes hold it */
            __m256i s16[2];
            for (int m = 0; m < R; m++) s16[m] = _mm256_setzero_si256();
            for (int b = 4 * half; b < 4 * half + 4; b++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 32 * b));
                const __m256i lo = _mm256_and_si256(w, nib), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
                for (int m = 0; m < R; m++) {
                    const uint32_t *pm = xp + g * xgs + 16 * m + 2 * b; /* inputs 4b, 4b+1 | 4b+2, 4b+3 */
                    const __m256i xlo = _mm256_set1_epi32((int32_t)pm[0]), xhi = _mm256_set1_epi32((int32_t)pm[1]);
                    s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(lo, xlo));
                    s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(hi, xhi));
                }
            }
            for (int m = 0; m < R; m++) {
                const __m256i a = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16[m]));
                const __m256i c = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16[m], 1));
                i0[m] = _mm256_add_epi32(i0[m], a);
                i1[m] = _mm256_add_epi32(i1[m], c);
            }
        }
        const __m256 s0 = x8_bf16x8(rec + 256), s1 = x8_bf16x8(rec + 272);
        const __m256 mn[2] = {x8_bf16x8(rec + 288), x8_bf16x8(rec + 304)};
        for (int m = 0; m < R; m++)
            x8_epilogue_avx2(acc[m], i0[m], i1[m], s0, s1, mn, xd[m * groups + g], xe[m * groups + g]);
    }
    for (int m = 0; m < R; m++) {
        _mm256_storeu_ps(out + m * os, acc[m][0]);
        _mm256_storeu_ps(out + m * os + 8, acc[m][1]);
    }
}

/* Every row of a chunk (up to X8_MC) against one tile of int4 records, a half record (4 blocks, 16
 * inputs) at a time: the half's codes are unpacked once into 8 registers and stay there while each row
 * runs its 8 vpmaddubsw. Register pressure decides the speed here (AVX2 has 16 vector registers): the
 * per-row integer sums and the float accumulators live in two small L1 buffers, and the epilogue is a
 * second pass over the rows with the record's scales in registers, so no row count spills the codes.
 * Same integer sums and the same epilogue as above. */
INLINE __m256i x8_q4_half_avx2(const __m256i *lo, const __m256i *hi, const uint32_t *px) {
    /* two chains (the low and the high nibbles) so that the adds do not wait on each other */
    __m256i a = _mm256_maddubs_epi16(lo[0], _mm256_set1_epi32((int32_t)px[0]));
    __m256i b = _mm256_maddubs_epi16(hi[0], _mm256_set1_epi32((int32_t)px[1]));
    for (int k = 1; k < 4; k++) {
        a = _mm256_add_epi16(a, _mm256_maddubs_epi16(lo[k], _mm256_set1_epi32((int32_t)px[2 * k])));
        b = _mm256_add_epi16(b, _mm256_maddubs_epi16(hi[k], _mm256_set1_epi32((int32_t)px[2 * k + 1])));
    }
    return _mm256_add_epi16(a, b);
}

static __attribute__((noinline)) void x8_q4_tile_rows_avx2(const uint8_t *rec, int64_t groups, const uint32_t *xp,
                                                           int64_t xgs, const float *xd, const float *xe,
                                                           int64_t rows, float *out, int64_t os) {
    const __m256i nib = _mm256_set1_epi8(0x0F);
    __m256i isum[X8_MC][2] __attribute__((aligned(32)));
    __m256 acc[X8_MC][2] __attribute__((aligned(32)));
    for (int64_t m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += X8_Q4_RECORD) {
        for (int c = 0; c < X8_Q4_RECORD; c += 64) _mm_prefetch((const char *)rec + X8_PREFETCH * X8_Q4_RECORD + c, _MM_HINT_T0);
        for (int half = 0; half < 2; half++) {
            __m256i lo[4], hi[4];
            for (int b = 0; b < 4; b++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(rec + 32 * (4 * half + b)));
                lo[b] = _mm256_and_si256(w, nib);
                hi[b] = _mm256_and_si256(_mm256_srli_epi16(w, 4), nib);
            }
            const uint32_t *px = xp + g * xgs + 8 * half; /* inputs 16 half .. 16 half + 15 of row 0 */
            for (int64_t m = 0; m < rows; m++, px += 16) {
                const __m256i s16 = x8_q4_half_avx2(lo, hi, px);
                __m256i i0 = _mm256_cvtepi16_epi32(_mm256_castsi256_si128(s16));
                __m256i i1 = _mm256_cvtepi16_epi32(_mm256_extracti128_si256(s16, 1));
                if (half) {
                    i0 = _mm256_add_epi32(isum[m][0], i0);
                    i1 = _mm256_add_epi32(isum[m][1], i1);
                }
                isum[m][0] = i0;
                isum[m][1] = i1;
            }
        }
        const __m256 s0 = x8_bf16x8(rec + 256), s1 = x8_bf16x8(rec + 272);
        const __m256 mn[2] = {x8_bf16x8(rec + 288), x8_bf16x8(rec + 304)};
        for (int64_t m = 0; m < rows; m++)
            x8_epilogue_avx2(acc[m], isum[m][0], isum[m][1], s0, s1, mn, xd[m * groups + g], xe[m * groups + g]);
    }
    for (int64_t m = 0; m < rows; m++) {
        _mm256_storeu_ps(out + m * os, acc[m][0]);
        _mm256_storeu_ps(out + m * os + 8, acc[m][1]);
    }
}

/* R rows of x against one tile of int8 records. Inputs k, k+1 are interleaved into 16-bit row pairs by
 * unpacking, which orders the rows 0-3, 8-11 | 4-7, 12-15 across the two halves: the scales are put in the
 * same order and the result is put back at the end. */
INLINE void x8_q8_tile_avx2(const int R, const uint8_t *rec, int64_t groups, const uint32_t *xp, int64_t xgs,
                            const float *xd, float *out, int64_t os) {
    __m256 acc[2][2];
    for (int m = 0; m < R; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += X8_Q8_RECORD) {
        for (int c = 0; c < X8_Q8_RECORD; c += 64) _mm_prefetch((const char *)rec + X8_PREFETCH * X8_Q8_RECORD + c, _MM_HINT_T0);
        __m256i i0[2], i1[2];
        for (int m = 0; m < R; m++) i0[m] = i1[m] = _mm256_setzero_si256();
        for (int k = 0; k < 32; k += 2) {
            const __m256i wk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 16 * k)));
            const __m256i wk1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 16 * k + 16)));
            const __m256i a = _mm256_unpacklo_epi16(wk, wk1), b = _mm256_unpackhi_epi16(wk, wk1);
            for (int m = 0; m < R; m++) {
                const __m256i pair = _mm256_set1_epi32((int32_t)xp[g * xgs + 16 * m + k / 2]);
                i0[m] = _mm256_add_epi32(i0[m], _mm256_madd_epi16(a, pair));
                i1[m] = _mm256_add_epi32(i1[m], _mm256_madd_epi16(b, pair));
            }
        }
        const __m256 n0 = x8_bf16x8(rec + 512), n1 = x8_bf16x8(rec + 528);
        const __m256 s0 = _mm256_permute2f128_ps(n0, n1, 0x20), s1 = _mm256_permute2f128_ps(n0, n1, 0x31);
        for (int m = 0; m < R; m++) x8_epilogue_avx2(acc[m], i0[m], i1[m], s0, s1, NULL, xd[m * groups + g], 0.0f);
    }
    for (int m = 0; m < R; m++) {
        _mm256_storeu_ps(out + m * os, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20));
        _mm256_storeu_ps(out + m * os + 8, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31));
    }
}

/* Every row of a chunk against one tile of int8 records, the same way as x8_q4_tile_rows_avx2: a
 * quarter record (8 inputs, as 4 pairs widened to 16 bits) in 8 registers while each row runs its 8
 * vpmaddwd, the per-row sums and accumulators in L1, the epilogue a pass of its own. */
static __attribute__((noinline)) void x8_q8_tile_rows_avx2(const uint8_t *rec, int64_t groups, const uint32_t *xp,
                                                           int64_t xgs, const float *xd, int64_t rows, float *out,
                                                           int64_t os) {
    __m256i isum[X8_MC][2] __attribute__((aligned(32)));
    __m256 acc[X8_MC][2] __attribute__((aligned(32)));
    for (int64_t m = 0; m < rows; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += X8_Q8_RECORD) {
        for (int c = 0; c < X8_Q8_RECORD; c += 64) _mm_prefetch((const char *)rec + X8_PREFETCH * X8_Q8_RECORD + c, _MM_HINT_T0);
        for (int quarter = 0; quarter < 4; quarter++) {
            __m256i a[4], b[4];
            for (int j = 0; j < 4; j++) {
                const int k = 8 * quarter + 2 * j;
                const __m256i wk = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 16 * k)));
                const __m256i wk1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(rec + 16 * k + 16)));
                a[j] = _mm256_unpacklo_epi16(wk, wk1);
                b[j] = _mm256_unpackhi_epi16(wk, wk1);
            }
            const uint32_t *px = xp + g * xgs + 4 * quarter;
            for (int64_t m = 0; m < rows; m++, px += 16) {
                __m256i p = _mm256_set1_epi32((int32_t)px[0]);
                __m256i i0 = _mm256_madd_epi16(a[0], p), i1 = _mm256_madd_epi16(b[0], p);
                for (int j = 1; j < 4; j++) {
                    p = _mm256_set1_epi32((int32_t)px[j]);
                    i0 = _mm256_add_epi32(i0, _mm256_madd_epi16(a[j], p));
                    i1 = _mm256_add_epi32(i1, _mm256_madd_epi16(b[j], p));
                }
                if (quarter) {
                    i0 = _mm256_add_epi32(isum[m][0], i0);
                    i1 = _mm256_add_epi32(isum[m][1], i1);
                }
                isum[m][0] = i0;
                isum[m][1] = i1;
            }
        }
        const __m256 n0 = x8_bf16x8(rec + 512), n1 = x8_bf16x8(rec + 528);
        const __m256 s0 = _mm256_permute2f128_ps(n0, n1, 0x20), s1 = _mm256_permute2f128_ps(n0, n1, 0x31);
        for (int64_t m = 0; m < rows; m++)
            x8_epilogue_avx2(acc[m], isum[m][0], isum[m][1], s0, s1, NULL, xd[m * groups + g], 0.0f);
    }
    for (int64_t m = 0; m < rows; m++) {
        _mm256_storeu_ps(out + m * os, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x20));
        _mm256_storeu_ps(out + m * os + 8, _mm256_permute2f128_ps(acc[m][0], acc[m][1], 0x31));
    }
}

#define DEFINE_X8_TILE(R)                                                                                     \
    static __attribute__((noinline)) void x8_tile_avx2_##R(const int q8, const uint8_t *tile, int64_t groups, \
                                                           const uint32_t *xp, int64_t xgs, const float *xd, \
                                                           const float *xe, float *out, int64_t os) {        \
        if (q8)                                                                                               \
            x8_q8_tile_avx2(R, tile, groups, xp, xgs, xd, out, os);                                           \
        else                                                                                                  \
            x8_q4_tile_avx2(R, tile, groups, xp, xgs, xd, xe, out, os);                                       \
    }
DEFINE_X8_TILE(1)
DEFINE_X8_TILE(2)

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define X8_VNNI 1
/* AVX-512 VNNI (the avx512 and amx variants): the records for any number of rows (x8_tile_rows_vnni below;
 * exact int32 sums, the same as the AVX2 and portable code's, and x8_epilogue's operations on 16 lanes). */
INLINE __m512i x8_bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* *acc += isum * (s * d) + min * e, x8_epilogue's operations in its order on 16 lanes. */
INLINE void x8_epilogue_16(__m512 *acc, __m512i isum, __m512 s, __m512 mn, float d, float e) {
    const __m512 a = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(d))));
    *acc = _mm512_add_ps(a, _mm512_mul_ps(mn, _mm512_set1_ps(e)));
}

/* *acc += isum * (s * d): x8_epilogue's operations for int8 records (no mins) on 16 lanes. */
INLINE void x8_epilogue_16q8(__m512 *acc, __m512i isum, __m512 s, float d) {
    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s, _mm512_set1_ps(d))));
}

/* A record's 32 inputs as 8 registers of 16 rows x 4 codes (w[b]: inputs 4b .. 4b+3, one 32-bit lane per
 * row), the form vpdpbusd takes. int4: the low nibbles of the row's two bytes, then the high ones. int8: a
 * block's 64 bytes (input-major, 16 rows each) by a dword permutation across the 128-bit lanes and a byte
 * shuffle within them, each code offset by 128 (c ^ 0x80 = c + 128, 0..255: vpdpbusd multiplies unsigned
 * by signed bytes). */
INLINE void x8_codes16(const int q8, const uint8_t *rec, __m512i *w) {
    if (q8) {
        const __m512i lanes = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512i bytes =
            _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
        const __m512i offset = _mm512_set1_epi8((char)0x80);
        for (int b = 0; b < 8; b++) {
            const __m512i raw = _mm512_xor_si512(_mm512_loadu_si512((const void *)(rec + 64 * b)), offset);
            w[b] = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(lanes, raw), bytes);
        }
    } else {
        const __m256i nib = _mm256_set1_epi8(0x0F);
        for (int b = 0; b < 8; b++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(rec + 32 * b));
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_and_si256(raw, nib));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nib));
            w[b] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
        }
    }
}

/* 16 bf16 scales as float32. */
INLINE __m512 x8_bf16x16(const uint8_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Row m's sums against the record's codes w, 8 vpdpbusd in two chains (even and odd blocks). The int8
 * codes' offset is taken back at the start: e holds 128 * sum(q) negated (x8_gemm leaves sum(q) in xe for
 * int8 records), so isum = sum (c + 128) q - 128 sum q, exact in int32. */
INLINE __m512i x8_start_vnni(const int q8, const float *xe, int64_t i) {
    return q8 ? _mm512_set1_epi32(-128 * (int32_t)xe[i]) : _mm512_setzero_si512();
}

/* The epilogue of one row and group: x8_epilogue's operations in its order on 16 lanes. */
INLINE void x8_epilogue_vnni(const int q8, __m512 *acc, __m512i isum, __m512 s, __m512 mn, const float *xd,
                             const float *xe, int64_t i) {
    if (q8)
        x8_epilogue_16q8(acc, isum, s, xd[i]);
    else
        x8_epilogue_16(acc, isum, s, mn, xd[i], xe[i]);
}

/* The records for any number of rows (int4 from 3 rows, int8 at any count: x8_tile): a record's codes are
 * built once (x8_codes16) and shared by every row of the chunk; each row then takes 8 vpdpbusd against its
 * 4-code words broadcast, 4 rows at a time. One body, stamped for int4 and int8. */
INLINE void x8_tile_rows_vnni(const int q8, const uint8_t *rec, int64_t groups, const int8_t *xq, int64_t K,
                              const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
    const int64_t record = q8 ? X8_Q8_RECORD : X8_Q4_RECORD;
    __m512 acc[X8_MC] __attribute__((aligned(64)));
    for (int64_t m = 0; m < rows; m++) acc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++, rec += record) {
        for (int c = 0; c < record; c += 64) _mm_prefetch((const char *)rec + X8_PREFETCH * record + c, _MM_HINT_T0);
        __m512i w[8];
        x8_codes16(q8, rec, w);
        const __m512 s = x8_bf16x16(rec + (q8 ? 512 : 256)), mn = q8 ? _mm512_setzero_ps() : x8_bf16x16(rec + 288);
        const int8_t *xg = xq + 32 * g;
        int64_t m = 0;
        /* 4 rows at a time, two chains each (even and odd blocks): vpdpbusd's latency is hidden */
        for (; m + 4 <= rows; m += 4) {
            __m512i e[4], o[4];
            for (int r = 0; r < 4; r++) {
                const int8_t *xr = xg + (m + r) * K;
                e[r] = _mm512_dpbusd_epi32(x8_start_vnni(q8, xe, (m + r) * groups + g), w[0], x8_bcast4(xr));
                o[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], x8_bcast4(xr + 4));
            }
            for (int b = 2; b < 8; b += 2)
                for (int r = 0; r < 4; r++) {
                    const int8_t *xr = xg + (m + r) * K + 4 * b;
                    e[r] = _mm512_dpbusd_epi32(e[r], w[b], x8_bcast4(xr));
                    o[r] = _mm512_dpbusd_epi32(o[r], w[b + 1], x8_bcast4(xr + 4));
                }
            for (int r = 0; r < 4; r++)
                x8_epilogue_vnni(q8, &acc[m + r], _mm512_add_epi32(e[r], o[r]), s, mn, xd, xe, (m + r) * groups + g);
        }
        for (; m < rows; m++) {
            const int8_t *xr = xg + m * K;
            __m512i e = _mm512_dpbusd_epi32(x8_start_vnni(q8, xe, m * groups + g), w[0], x8_bcast4(xr));
            __m512i o = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[1], x8_bcast4(xr + 4));
            for (int b = 2; b < 8; b += 2) {
                e = _mm512_dpbusd_epi32(e, w[b], x8_bcast4(xr + 4 * b));
                o = _mm512_dpbusd_epi32(o, w[b + 1], x8_bcast4(xr + 4 * b + 4));
            }
            x8_epilogue_vnni(q8, &acc[m], _mm512_add_epi32(e, o), s, mn, xd, xe, m * groups + g);
        }
    }
    for (int64_t m = 0; m < rows; m++) _mm512_storeu_ps(out + m * os, acc[m]);
}

static __attribute__((noinline)) void x8_q4_tile_rows_vnni(const uint8_t *rec, int64_t groups, const int8_t *xq,
                                                           int64_t K, const float *xd, const float *xe,
                                                           int64_t rows, float *out, int64_t os) {
    x8_tile_rows_vnni(0, rec, groups, xq, K, xd, xe, rows, out, os);
}

static __attribute__((noinline)) void x8_q8_tile_rows_vnni(const uint8_t *rec, int64_t groups, const int8_t *xq,
                                                           int64_t K, const float *xd, const float *xe,
                                                           int64_t rows, float *out, int64_t os) {
    x8_tile_rows_vnni(1, rec, groups, xq, K, xd, xe, rows, out, os);
}
#else
#define X8_VNNI 0
#endif

/* With VNNI, int8 records take their VNNI kernel at any row count (at 1 row as fast as the AVX2 register
 * tile, 1.5x at 2); int4 records keep one or two rows in the AVX2 registers and take the VNNI kernel from
 * three. Without, the AVX2 tiles: registers for one or two rows, the rows kernels from three. */
static void x8_tile(const int q8, const uint8_t *tile, int64_t groups, const int8_t *xq, const uint32_t *xp,
                    int64_t K, int64_t xgs, const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
#if X8_VNNI
    if (q8) {
        x8_q8_tile_rows_vnni(tile, groups, xq, K, xd, xe, rows, out, os);
        return;
    }
    if (rows > 2 || !xp) { /* xp NULL: x8_gemm made no pairs (M > 2) */
        x8_q4_tile_rows_vnni(tile, groups, xq, K, xd, xe, rows, out, os);
        return;
    }
#endif
    (void)xq;
    (void)K;
    if (rows == 1)
        x8_tile_avx2_1(q8, tile, groups, xp, xgs, xd, xe, out, os);
    else if (rows == 2)
        x8_tile_avx2_2(q8, tile, groups, xp, xgs, xd, xe, out, os);
    else if (q8)
        x8_q8_tile_rows_avx2(tile, groups, xp, xgs, xd, rows, out, os);
    else
        x8_q4_tile_rows_avx2(tile, groups, xp, xgs, xd, xe, rows, out, os);
}
#elif defined(__ARM_NEON)
#include "records_neon.h" /* x8_tile for NEON */
#else
static void x8_tile(const int q8, const uint8_t *tile, int64_t groups, const int8_t *xq, const uint32_t *xp,
                    int64_t K, int64_t xgs, const float *xd, const float *xe, int64_t rows, float *out, int64_t os) {
    (void)xp;
    (void)xgs;
    x8_tile_c(q8, tile, groups, xq, K, xd, xe, rows, out, os);
}
#endif

/* Each two neighbouring codes of x as one 32-bit word that a broadcast turns into the vector operand of
 * the AVX2 tiles: for int4 records the two bytes twice (vpmaddubsw pairs bytes), for int8 records the
 * two codes as 16-bit numbers (vpmaddwd pairs 16-bit lanes). Group-major, [groups][M][16]: the rows
 * kernels read one group of every row in turn, so those 64-byte pieces lie next to each other. */
static __attribute__((unused)) void x8_pairs(const int q8, const int8_t *q, int64_t M, int64_t K, uint32_t *p) {
    const int64_t groups = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < groups; g++) {
            const int8_t *qg = q + m * K + 32 * g;
            uint32_t *pg = p + (g * M + m) * 16;
            for (int i = 0; i < 16; i++) {
                const uint32_t a = (uint8_t)qg[2 * i], b = (uint8_t)qg[2 * i + 1];
                const uint32_t a16 = (uint16_t)(int16_t)qg[2 * i], b16 = (uint16_t)(int16_t)qg[2 * i + 1];
                pg[i] = q8 ? a16 | b16 << 16 : (a | b << 8) * 0x00010001u;
            }
        }
}

/* Rows go X8_MC at a time through every tile (a tile's records stay in L1 across the rows). */
static void x8_tiles(const int q8, const uint8_t *w, int64_t M, int64_t K, int64_t t0, int64_t t1,
                     const int8_t *xq, const uint32_t *xp, const float *xd, const float *xe, float *out,
                     int64_t os) {
    const int64_t record = q8 ? X8_Q8_RECORD : X8_Q4_RECORD, groups = K / 32;
    for (int64_t m0 = 0; m0 < M; m0 += X8_MC) {
        const int64_t mc = M - m0 < X8_MC ? M - m0 : X8_MC;
        for (int64_t t = t0; t < t1; t++) {
            const uint8_t *tile = w + t * groups * record;
            const int8_t *q = xq + m0 * K;
            const uint32_t *p = xp ? xp + 16 * m0 : NULL;
            const float *d = xd + m0 * groups, *e = xe + m0 * groups;
            float *o = out + m0 * os + 16 * t;
            x8_tile(q8, tile, groups, q, p, K, 16 * M, d, e, mc, o, os);
        }
    }
}

/* The quantized activations' buffer: kept per calling thread up to X8_KEEP bytes (a decode or prefill
 * step's sizes), so that a step's hundred matmuls do not each map, fault in and unmap fresh pages
 * (glibc serves blocks over 128 KiB with mmap); larger ones are allocated per call. */
#define X8_KEEP ((size_t)4 << 20)
static __thread char *x8_kept;
static __thread size_t x8_kept_size;

static char *x8_buffer(size_t size) {
    if (size > X8_KEEP) return (char *)malloc(size);
    if (size > x8_kept_size) { /* grown to what the steps use: 64 KiB steps, so never past X8_KEEP */
        const size_t grown = (size + 0xFFFF) & ~(size_t)0xFFFF;
        free(x8_kept);
        x8_kept = (char *)malloc(grown);
        x8_kept_size = x8_kept ? grown : 0;
    }
    return x8_kept;
}

static int x8_gemm(const int q8, const float *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K,
                   float *out, int64_t os, int nt) {
    if (M < 1 || N <= 0 || K <= 0 || N % 16 || K % 32) return -1;
    const int64_t groups = K / 32, tiles = N / 16;
    /* q int8 [M, K]; the same codes as broadcast-ready pairs (x8_pairs) [groups, M, 16]; d, e [M, groups] */
    const size_t size = (size_t)(M * K) + sizeof(uint32_t) * (size_t)(M * K / 2) +
                        2 * sizeof(float) * (size_t)(M * groups) + 64;
    char *buf = x8_buffer(size);
    if (!buf) return -4;
    int8_t *xq = (int8_t *)buf;
    uint32_t *xp = (uint32_t *)(((uintptr_t)(buf + M * K) + 63) & ~(uintptr_t)63);
    float *xd = (float *)(xp + M * K / 2), *xe = xd + M * groups;
    /* Quantizing x is ~1% of the work: done here, it saves the team a barrier (costly on a busy machine). */
    x8_quantize_rows(q8, x, xs, 0, M, K, xq, xd, xe);
#if defined(__AVX2__)
    if (!X8_VNNI || (M <= 2 && !q8))
        x8_pairs(q8, xq, M, K, xp);
    else
        xp = NULL; /* the VNNI kernels read xq themselves */
#endif
    if (nt <= 1 || tiles < 2) {
        x8_tiles(q8, w, M, K, 0, tiles, xq, xp, xd, xe, out, os);
    } else {
#pragma omp parallel num_threads(nt)
        {
            const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
            x8_tiles(q8, w, M, K, tiles * me / team, tiles * (me + 1) / team, xq, xp, xd, xe, out, os);
        }
    }
    if (buf != x8_kept) free(buf);
    return 0;
}

/* x: fp32 [M, K], row stride xs (elements); w: the records; out: fp32 [M, N], row stride os. Returns 0, -1
 * for a bad shape (M < 1, N % 16, K % 32), -4 out of memory. */
int izh_q4_gemm_f32(const float *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, float *out,
                    int64_t os, int nt) {
    return x8_gemm(0, x, xs, w, M, N, K, out, os, nt);
}

int izh_q8_gemm_f32(const float *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, float *out,
                    int64_t os, int nt) {
    return x8_gemm(1, x, xs, w, M, N, K, out, os, nt);
}

/* ------------------------------------------------------------------------------------------------ */
/* The decode stack in float32: izh_decode_stack_bf16's contract (stack.c) with float32 activations and
 * the matmuls above, any number of rows. The same calls as the Python modules in the same order, so the
 * result is bit-identical to theirs. Returns 0; attention's -1..-3; -4 out of memory; -5 M < 1; -6 a
 * matmul refused its shape. */
int izh_stack_linear_f32(const int64_t *lin, const float *x, int64_t M, int64_t N, int64_t K, float *out,
                         int nt) {
    if (lin[1] == STACK_GGUF) { /* the parts' matmuls into their columns, as GGUFBlocks.matmul makes them */
        const int64_t *parts = (const int64_t *)(intptr_t)lin[0];
        int64_t start = 0;
        for (int64_t p = 0; p < parts[0]; p++) {
            const int64_t *part = parts + 1 + 4 * p;
            if (start + part[3] > N) return -6;
            const int rc = izh_gguf_matmul_f32((int)part[0], x, K, (const uint8_t *)(intptr_t)part[1], part[2], M,
                                               part[3], K, out + start, N, nt);
            if (rc) return rc == -1 ? -6 : rc;
            start += part[3];
        }
        if (start != N) return -6;
    } else {
        const uint8_t *rec = (const uint8_t *)(intptr_t)lin[0];
        const int rc = x8_gemm(lin[1] == 8, x, K, rec, M, N, K, out, N, nt);
        if (rc) return rc == -1 ? -6 : rc;
    }
    const float *bias = (const float *)(intptr_t)lin[2];
    if (bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) out[m * N + j] += bias[j];
    return 0;
}

int izh_decode_stack_f32(const int64_t *layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t H,
                         int64_t kvh, int64_t d, int64_t inter, float eps, float scale, float *x,
                         const float *final_norm, float *out, const float *cos_sin, const int64_t *slot_mapping,
                         const int32_t *block_tables, int64_t max_blocks, const int32_t *seq_lens,
                         int64_t num_blocks, int64_t block_size, int64_t kv_type, const int64_t *lora, int64_t lora_rank,
                         const int32_t *row_slots, const int32_t *slot_ranks, int nt) {
    if (M < 1) return -5;
    IZH_DECODE_STACK_BODY(float, f32, izh_stack_linear_f32)
}
