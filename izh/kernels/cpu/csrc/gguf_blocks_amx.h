/* AMX-INT8 tiles for the GGUF block matmuls at large row counts (included by gguf_blocks.c in the amx
 * build, after gq_decode; the recipe is that file's header, and nothing here changes it).
 *
 * The integer sums of a block are the same integers whatever computes them, so the tiles only have to
 * produce, per (activation row m, weight row n, block b), the exact isum (and msum) of the recipe; the
 * float epilogue then runs per output in the recipe's order, 16 activation rows in the lanes of a vector.
 *
 * The tiles compute out^T: C[n][m] = sum over k of W[n][k] * x[m][k], the weight rows as the A tile (row
 * major, as gq_decode leaves them: no transposition per block) and the int8 activations as the B tile,
 * put once per call in the VNNI layout (xv: per 16 rows, per 4 inputs, 16 x 4 bytes).
 * - 32-input blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL): isum = c . q over the block, one TDPBSSD
 *   (K = 32) per 16 x 16 outputs.
 * - 256-input blocks (Q4_K, Q5_K, Q6_K, IQ4_XS): the sub-block scale goes into the weight,
 *   p = c * s[i / 16] (|p| <= 128 * 32 for Q6_K, 127 * 32 for IQ4_XS), and p, 16 bits, is split into its
 *   low byte (unsigned) and its high byte (signed): p = lo + 256 * hi. Then
 *   isum = sum p * q = (TDPBUSD over lo) + 256 * (TDPBSSD over hi), both exact in int32
 *   (|lo sum| <= 256 * 255 * 127, |256 * hi sum| <= 256 * 256 * 16 * 127 < 2^31).
 * - The K-quants' mins: msum = sum over the 8 sub-blocks of 32 of m * (sum of q over the sub-block), with
 *   vpdpwssd (int16 pairs: |sum of q| <= 4064, m <= 63).
 *
 * Loop order, per thread (threads split the weight rows in groups of 16): for each group, for each pass of
 * up to GQ_AMX_MC activation rows, for each block: decode the group's 16 blocks once into A tiles, then
 * run every 32 rows of the pass through them (2 B tiles; activation rows padded with zeros to 32). Linux
 * hands out the tile data per process on request (izh_amx_permitted, qgemm_avx512.c). */
#include <cpuid.h>

#define GQ_AMX_MC 256 /* activation rows per pass: the accumulators, 16 KB, stay in L1 */

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} gq_tilecfg;

/* 1 when the CPU has AMX-INT8 (CPUID.7.0:EDX bit 25) and Linux lets this process use the tiles. */
static int gq_amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        const int int8 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
        usable = int8 && izh_amx_permitted();
    }
    return usable;
}

/* What the tiles' epilogue reads of the activations, per block b and activation row m (rows padded to 32,
 * the padding zero): xv, the int8 rows in the VNNI layout (16 rows a tile: xv + (m / 16) * 16 K holds
 * [K / 4][16 rows][4 bytes]); dxT, exT [blocks][Mq]; qpT [blocks][4][Mq] (K-quants with mins: the sums of q
 * per 32 inputs as int16 pairs). */
typedef struct {
    int8_t *xv;
    float *dxT, *exT;
    int32_t *qpT;
    int64_t Mq;
} gq_amx_act;

/* Fills act's rows of the 16-row tiles [t0, t1) from the quantized rows (xq, dx, ex, qs16: gq_quantize_rows'
 * output for M rows). */
static void gq_amx_prepare(const int8_t *xq, const float *dx, const float *ex, const int32_t *qs16, int64_t M,
                           int64_t K, int bs, int mins, int64_t t0, int64_t t1, gq_amx_act *act) {
    const int64_t blocks = K / bs, Mq = act->Mq;
    for (int64_t t = t0; t < t1; t++) {
        int8_t *dst = act->xv + t * 16 * K;
        for (int j = 0; j < 16; j++) {
            const int64_t m = 16 * t + j;
            if (m < M)
                for (int64_t k4 = 0; k4 < K / 4; k4++) memcpy(dst + 64 * k4 + 4 * j, xq + m * K + 4 * k4, 4);
            else
                for (int64_t k4 = 0; k4 < K / 4; k4++) memset(dst + 64 * k4 + 4 * j, 0, 4);
            for (int64_t b = 0; b < blocks; b++) {
                act->dxT[b * Mq + m] = m < M ? dx[m * blocks + b] : 0.0f;
                act->exT[b * Mq + m] = m < M ? ex[m * blocks + b] : 0.0f;
                for (int p = 0; mins && p < 4; p++) {
                    int32_t v = 0;
                    if (m < M) {
                        const int32_t *s = qs16 + m * (K / 16) + b * 16 + 4 * p;
                        v = (int32_t)(((uint32_t)(s[0] + s[1]) & 0xFFFF) | ((uint32_t)(s[2] + s[3]) << 16));
                    }
                    act->qpT[(b * 4 + p) * Mq + m] = v;
                }
            }
        }
    }
}

/* The 16 weight rows [n0, n0 + nn) of block b as A tiles: 32-input blocks the codes, wt[i * 32 ..]; 256-input
 * blocks the low bytes of p at wt[i * 256 ..] and the high bytes at wt[4096 + i * 256 ..] (see the header).
 * Rows past nn are zeros (their outputs are never stored). Also the blocks' dw, mw, and the mins as int16
 * pairs (mnp[i][p]: m of sub-blocks 2p and 2p + 1 of weight row i). */
INLINE void gq_amx_a_tiles(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t b,
                           uint8_t *wt, float *dw, float *mw, int32_t (*mnp)[4]) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    if (nn < 16) {
        memset(wt, 0, bs == 32 ? 512 : 8192);
        memset(dw, 0, 16 * sizeof(float));
        memset(mw, 0, 16 * sizeof(float));
        memset(mnp, 0, 16 * 4 * sizeof(int32_t));
    }
    for (int i = 0; i < nn; i++) {
        gq_block blk;
        gq_decode(type, w + (n0 + i) * row_bytes + b * bytes, &blk);
        dw[i] = blk.dw;
        mw[i] = blk.mw;
        if (bs == 32) {
            memcpy(wt + 32 * i, blk.c, 32);
            continue;
        }
        for (int h = 0; h < 8; h++) { /* 32 inputs: sub-blocks 2h and 2h + 1 */
            const __m512i c = _mm512_cvtepi8_epi16(_mm256_load_si256((const __m256i *)(blk.c + 32 * h)));
            const __m512i s = _mm512_inserti64x4(_mm512_set1_epi16((int16_t)blk.s[2 * h]),
                                                 _mm256_set1_epi16((int16_t)blk.s[2 * h + 1]), 1);
            const __m512i p = _mm512_mullo_epi16(c, s);
            _mm256_storeu_si256((__m256i *)(wt + 256 * i + 32 * h), _mm512_cvtepi16_epi8(p));
            _mm256_storeu_si256((__m256i *)(wt + 4096 + 256 * i + 32 * h),
                                _mm512_cvtepi16_epi8(_mm512_srai_epi16(p, 8)));
        }
        if (mk == GQ_MIN_INT)
            for (int p = 0; p < 4; p++)
                mnp[i][p] = (int32_t)(((uint32_t)blk.m[4 * p] & 0xFFFF) | ((uint32_t)blk.m[4 * p + 2] << 16));
    }
}

/* The recipe's epilogue for weight row i and the 16 activation rows from m, block b, from the sums `isum`. */
INLINE __m512 gq_amx_epilogue(const int mk, __m512 acc, __m512i isum, float dw, float mw, const int32_t *mnp,
                              const gq_amx_act *act, int64_t b, int64_t m) {
    const int64_t Mq = act->Mq;
    const __m512 dxv = _mm512_loadu_ps(act->dxT + b * Mq + m);
    __m512 a = _mm512_add_ps(acc, _mm512_mul_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(dw), dxv)));
    if (mk == GQ_MIN_FLOAT) a = _mm512_add_ps(a, _mm512_mul_ps(_mm512_set1_ps(mw), _mm512_loadu_ps(act->exT + b * Mq + m)));
    if (mk == GQ_MIN_INT) {
        __m512i msum = _mm512_setzero_si512();
        for (int p = 0; p < 4; p++)
            msum = _mm512_dpwssd_epi32(msum, _mm512_set1_epi32(mnp[p]), _mm512_loadu_si512(act->qpT + (b * 4 + p) * Mq + m));
        a = _mm512_sub_ps(a, _mm512_mul_ps(_mm512_cvtepi32_ps(msum), _mm512_mul_ps(_mm512_set1_ps(mw), dxv)));
    }
    return a;
}

/* Weight rows [16 g0, min(16 g1, N)) for every activation row: out[m, n] (see the header). */
INLINE void gq_amx_cols(const int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1,
                        int64_t M, int64_t K, const gq_amx_act *act, float *out, int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    const int64_t blocks = K / bs;
    gq_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    if (bs == 32) { /* tile 0: A (K = 32); 2, 3: B (8 rows); 4, 5: C */
        cfg.colsb[0] = 32;
        cfg.rows[2] = cfg.rows[3] = 8;
    } /* else 0, 1: A low and high bytes; 2, 3: B; 4, 5: C of B0 (low, high); 6, 7: C of B1 */
    _tile_loadconfig(&cfg);
    uint8_t wt[8192] __attribute__((aligned(64)));
    int32_t cbuf[4][256] __attribute__((aligned(64)));
    int32_t mnp[16][4];
    float dw[16], mw[16];
    __m512 acc[16][GQ_AMX_MC / 16]; /* [weight row][16 activation rows] */
    for (int64_t gi = g0; gi < g1; gi++) {
        const int64_t n0 = 16 * gi;
        const int nn = (int)(N - n0 < 16 ? N - n0 : 16);
        for (int64_t mc0 = 0; mc0 < M; mc0 += GQ_AMX_MC) {
            const int64_t mc1 = mc0 + GQ_AMX_MC < M ? mc0 + GQ_AMX_MC : M;
            const int tiles = (int)((mc1 - mc0 + 15) / 16);
            for (int i = 0; i < 16; i++)
                for (int t = 0; t < tiles; t++) acc[i][t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < blocks; b++) {
                gq_amx_a_tiles(type, w, row_bytes, n0, nn, b, wt, dw, mw, mnp);
                /* tileloadd's asm names no memory operand: keep the stores to wt before it */
                __asm__ volatile("" ::: "memory");
                for (int t = 0; t < tiles; t += 2) {
                    const int two = t + 1 < tiles;
                    const int8_t *xv = act->xv + (mc0 / 16 + t) * 16 * K + b * bs * 16;
                    if (bs == 32) {
                        _tile_loadd(0, wt, 32);
                        _tile_loadd(2, xv, 64);
                        _tile_zero(4);
                        _tile_dpbssd(4, 0, 2);
                        _tile_stored(4, cbuf[0], 64);
                        if (two) {
                            _tile_loadd(3, xv + 16 * K, 64);
                            _tile_zero(5);
                            _tile_dpbssd(5, 0, 3);
                            _tile_stored(5, cbuf[1], 64);
                        }
                    } else {
                        _tile_zero(4);
                        _tile_zero(5);
                        _tile_zero(6);
                        _tile_zero(7);
                        for (int c = 0; c < 4; c++) { /* 64 inputs: 16 rows of the VNNI layout, 1 KB */
                            _tile_loadd(0, wt + 64 * c, 256);
                            _tile_loadd(1, wt + 4096 + 64 * c, 256);
                            _tile_loadd(2, xv + 1024 * c, 64);
                            _tile_dpbusd(4, 0, 2);
                            _tile_dpbssd(5, 1, 2);
                            if (two) {
                                _tile_loadd(3, xv + 16 * K + 1024 * c, 64);
                                _tile_dpbusd(6, 0, 3);
                                _tile_dpbssd(7, 1, 3);
                            }
                        }
                        _tile_stored(4, cbuf[0], 64);
                        _tile_stored(5, cbuf[1], 64);
                        if (two) {
                            _tile_stored(6, cbuf[2], 64);
                            _tile_stored(7, cbuf[3], 64);
                        }
                    }
                    for (int u = 0; u < 1 + two; u++) {
                        const int64_t m = mc0 + 16 * (t + u);
                        for (int i = 0; i < nn; i++) {
                            __m512i isum;
                            if (bs == 32)
                                isum = _mm512_load_si512(cbuf[u] + 16 * i);
                            else
                                isum = _mm512_add_epi32(_mm512_load_si512(cbuf[2 * u] + 16 * i),
                                                        _mm512_slli_epi32(_mm512_load_si512(cbuf[2 * u + 1] + 16 * i), 8));
                            acc[i][t + u] = gq_amx_epilogue(mk, acc[i][t + u], isum, dw[i], mw[i], mnp[i], act, b, m);
                        }
                    }
                }
            }
            for (int i = 0; i < nn; i++)
                for (int t = 0; t < tiles; t++) {
                    float v[16] __attribute__((aligned(64)));
                    _mm512_store_ps(v, acc[i][t]);
                    const int64_t m0 = mc0 + 16 * t;
                    for (int j = 0; j < 16 && m0 + j < mc1; j++) out[(m0 + j) * os + n0 + i] = v[j];
                }
        }
    }
    _tile_release();
}

#define GQ_AMX_CASE(T)                                                                                        \
    case T: gq_amx_cols(T, w, row_bytes, N, g0, g1, M, K, act, out, os); break;

static void gq_amx_dispatch(int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1,
                            int64_t M, int64_t K, const gq_amx_act *act, float *out, int64_t os) {
    switch (type) {
        GQ_AMX_CASE(GQ_Q4_0)
        GQ_AMX_CASE(GQ_Q4_1)
        GQ_AMX_CASE(GQ_Q5_0)
        GQ_AMX_CASE(GQ_Q5_1)
        GQ_AMX_CASE(GQ_Q8_0)
        GQ_AMX_CASE(GQ_IQ4_NL)
        GQ_AMX_CASE(GQ_Q4_K)
        GQ_AMX_CASE(GQ_Q5_K)
        GQ_AMX_CASE(GQ_Q6_K)
        GQ_AMX_CASE(GQ_IQ4_XS)
    default: break;
    }
}
