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
 * Building the A tiles (the weight re-layout, per block and 16 weight rows) is most of the work up to a few
 * dozen rows, so Q4_K and Q6_K, most of a Q4_K_M file, build them straight from the file's bytes in
 * registers: Q4_K's products by table lookup (vpshufb; its tiles take the inputs in the order the nibbles
 * unpack, and the activations' copy the same order), Q6_K's by vpmullw on the even and odd bytes. The other
 * formats decode each block with gq_decode first.
 *
 * Loop order, per thread (threads split the weight rows in groups of 16): for each group, for each pass of
 * up to GQ_AMX_MC activation rows, for each block: build the group's 16 blocks once into A tiles, then
 * run every 32 rows of the pass through them (2 B tiles; activation rows padded with zeros to 32),
 * software-pipelined (gq_amx_cols): the next block is built while the tiles compute, and a pair's sums are
 * read an item after they are stored. Linux hands out the tile data per process on request
 * (izh_amx_permitted, qgemm_avx512.c). */
#include <cpuid.h>

#define GQ_AMX_MC 256 /* activation rows per pass: the accumulators, 16 KB, stay in L1 */


/* Q4_K's products p = c * s (code c 0..15, sub-block scale s 0..63) by table: gq_q4k_tab[0][s] holds the low
 * bytes of c * s at c, gq_q4k_tab[1][s] the high bytes (0..3), each 16-byte table repeated in the 4 lanes of a
 * zmm, so that vpshufb of a vector of codes gives their products' bytes directly (gq_amx_a_tiles_q4k). */
static uint8_t gq_q4k_tab[2][64][64] __attribute__((aligned(64)));

/* 1 when the CPU has AMX-INT8 (CPUID.7.0:EDX bit 25) and Linux lets this process use the tiles. */
static int gq_amx_usable(void) {
    static int usable = -1;
    if (usable < 0) {
        unsigned a, b, c, d;
        const int int8 = __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 25 & 1);
        for (int s = 0; s < 64; s++) /* before the first matmul on the tiles: this runs outside its threads */
            for (int j = 0; j < 64; j++) {
                gq_q4k_tab[0][s][j] = (uint8_t)((j % 16) * s & 255);
                gq_q4k_tab[1][s][j] = (uint8_t)((j % 16) * s >> 8);
            }
        usable = int8 && izh_amx_permitted();
    }
    return usable;
}

/* The input of a Q4_K block at position t (0..255) of its A tiles' rows: gq_amx_a_tiles_q4k lays a block out
 * as it unpacks the file's bytes, 64 at a time (low nibbles, then high ones), and the activations' tile copy
 * takes the same order (gq_amx_prepare), so each product is the recipe's (c * s) * q and isum the same
 * integer. Byte j of the 64 at offset 64 h: low nibble input 64 (2 h + j / 32) + j % 32, high nibble + 32. */
INLINE int gq_q4k_input(int t) {
    const int h = t / 128, hi = t / 64 % 2, j = t % 64;
    return 64 * (2 * h + j / 32) + 32 * hi + j % 32;
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
                           int64_t K, int bs, int mins, int q4k, int64_t t0, int64_t t1, gq_amx_act *act) {
    const int64_t blocks = K / bs, Mq = act->Mq;
    for (int64_t t = t0; t < t1; t++) {
        int8_t *dst = act->xv + t * 16 * K;
        for (int j = 0; j < 16; j++) {
            const int64_t m = 16 * t + j;
            if (m < M && q4k) /* the 4 inputs at each position are consecutive ones (gq_q4k_input) */
                for (int64_t k4 = 0; k4 < K / 4; k4++)
                    memcpy(dst + 64 * k4 + 4 * j, xq + m * K + k4 / 64 * 256 + gq_q4k_input((int)(4 * k4 % 256)), 4);
            else if (m < M)
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

/* Row i's 1/16 of the pf_bytes at pf prefetched: a build spreads the prefetch of the next weight rows over its
 * 16 rows, so that the compute between them goes on while the lines arrive (a burst of prefetches stalls
 * once the fill buffers are full). */
INLINE void gq_amx_prefetch_share(const char *pf, int64_t pf_bytes, int i) {
    for (int64_t x = pf_bytes * i / 16 & ~(int64_t)63; x < (pf_bytes * (i + 1) / 16 & ~(int64_t)63); x += 64)
        __builtin_prefetch(pf + x, 0, 3);
}

/* The 16 weight rows [n0, n0 + nn) of block b as A tiles: 32-input blocks the codes, wt[i * 32 ..]; 256-input
 * blocks the low bytes of p at wt[i * 256 ..] and the high bytes at wt[4096 + i * 256 ..] (see the header).
 * Rows past nn are zeros (their outputs are never stored). Also the blocks' dw, mw, and the mins as int16
 * pairs (mnp[i][p]: m of sub-blocks 2p and 2p + 1 of weight row i). */
INLINE void gq_amx_a_tiles(const int type, const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t b,
                           uint8_t *wt, float *dw, float *mw, int32_t (*mnp)[4], const char *pf, int64_t pf_bytes) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    if (nn < 16) {
        memset(wt, 0, bs == 32 ? 512 : 8192);
        memset(dw, 0, 16 * sizeof(float));
        memset(mw, 0, 16 * sizeof(float));
        memset(mnp, 0, 16 * 4 * sizeof(int32_t));
    }
    for (int i = 0; i < nn; i++) {
        gq_amx_prefetch_share(pf, pf_bytes, i);
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

/* gq_amx_a_tiles for Q4_K, straight from the file's bytes: per 64 bytes of codes, the low and the high nibbles
 * (positions in gq_q4k_input's order) are looked up in their sub-blocks' gq_q4k_tab tables by vpshufb, which
 * gives the low and the high bytes of c * s at once; the scales and mins unpacked as gq_rows8_k does. */
INLINE void gq_amx_a_tiles_q4k(const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t b, uint8_t *wt,
                               float *dw, float *mw, int32_t (*mnp)[4], const char *pf, int64_t pf_bytes) {
    if (nn < 16) {
        memset(wt, 0, 8192);
        memset(dw, 0, 16 * sizeof(float));
        memset(mw, 0, 16 * sizeof(float));
        memset(mnp, 0, 16 * 4 * sizeof(int32_t));
    }
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int i = 0; i < nn; i++) {
        gq_amx_prefetch_share(pf, pf_bytes, i);
        const uint8_t *p = w + (n0 + i) * row_bytes + b * 144;
        uint32_t u[4];
        memcpy(u, p + 4, 12);
        u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
        const uint32_t mn_lo = u[1] & 0x3f3f3f3fu;
        u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
        u[2] = mn_lo;
        u[0] &= 0x3f3f3f3fu;
        uint8_t sc[8], mn[8]; /* per 32 inputs */
        memcpy(sc, u, 8);
        memcpy(mn, u + 2, 8);
        dw[i] = gq_f16(p);
        mw[i] = gq_f16(p + 2);
        for (int h = 0; h < 2; h++) {
            const __m512i v = _mm512_loadu_si512((const void *)(p + 16 + 64 * h));
            const __m512i ln = _mm512_and_si512(v, m4), hn = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            for (int x = 0; x < 2; x++) { /* the products' low bytes, then their high bytes */
                /* low nibbles: sub-block 4 h in lanes 0-1, 4 h + 2 in lanes 2-3; high: 4 h + 1, 4 h + 3 */
                const __m512i ta = _mm512_mask_blend_epi64(0xF0, _mm512_load_si512(gq_q4k_tab[x][sc[4 * h]]),
                                                           _mm512_load_si512(gq_q4k_tab[x][sc[4 * h + 2]]));
                const __m512i tb = _mm512_mask_blend_epi64(0xF0, _mm512_load_si512(gq_q4k_tab[x][sc[4 * h + 1]]),
                                                           _mm512_load_si512(gq_q4k_tab[x][sc[4 * h + 3]]));
                uint8_t *dst = wt + 4096 * x + 256 * i + 128 * h;
                _mm512_store_si512((void *)dst, _mm512_shuffle_epi8(ta, ln));
                _mm512_store_si512((void *)(dst + 64), _mm512_shuffle_epi8(tb, hn));
            }
        }
        for (int q = 0; q < 4; q++) mnp[i][q] = (int32_t)((uint32_t)mn[2 * q] | ((uint32_t)mn[2 * q + 1] << 16));
    }
}

/* gq_amx_a_tiles for Q6_K, straight from the file's bytes, in the inputs' order: per 64 inputs, the codes
 * c = u - 32 unpacked from ql and qh as gq_decode does, then p = c * s in 16 bits, the even and the odd bytes
 * apart (vpmullw), and p's low and high bytes put back in the byte order (vpternlogd). */
INLINE void gq_amx_a_tiles_q6k(const uint8_t *w, int64_t row_bytes, int64_t n0, int nn, int64_t b, uint8_t *wt,
                               float *dw, float *mw, int32_t (*mnp)[4], const char *pf, int64_t pf_bytes) {
    if (nn < 16) {
        memset(wt, 0, 8192);
        memset(dw, 0, 16 * sizeof(float));
        memset(mw, 0, 16 * sizeof(float));
        memset(mnp, 0, 16 * 4 * sizeof(int32_t));
    }
    const __m512i m4 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3), k32 = _mm512_set1_epi8(32);
    const __m512i lo8 = _mm512_set1_epi16(0x00FF), hi8 = _mm512_set1_epi16((short)0xFF00);
    /* the 2-bit fields of qh: inputs 0-31 of the 64 at bits 0-1 (low nibbles' half) or 4-5 (high), 32-63 at
     * 2-3 or 6-7 */
    const __m512i sh_lo = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    /* word w of 64 inputs from 64 v: the scale of sub-block (64 v + 2 w) / 16 */
    __m512i pick[4];
    for (int v = 0; v < 4; v++) {
        int16_t ix[32];
        for (int x = 0; x < 32; x++) ix[x] = (int16_t)(4 * v + x / 8);
        pick[v] = _mm512_loadu_si512((const void *)ix);
    }
    for (int i = 0; i < nn; i++) {
        gq_amx_prefetch_share(pf, pf_bytes, i);
        const uint8_t *p = w + (n0 + i) * row_bytes + b * 210;
        const __m512i s16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + 192))));
        dw[i] = gq_f16(p + 208);
        mw[i] = 0.0f;
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(p + 64 * h));
            const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(p + 128 + 32 * h)));
            __m512i u[2];
            u[0] = _mm512_or_si512(_mm512_and_si512(l, m4),
                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh_lo), m3), 4));
            u[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                   _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh_hi), m3), 4));
            for (int x = 0; x < 2; x++) { /* inputs 128 h + 64 x .. + 63 */
                const __m512i c = _mm512_sub_epi8(u[x], k32);
                const __m512i sv = _mm512_permutexvar_epi16(pick[2 * h + x], s16);
                const __m512i pe = _mm512_mullo_epi16(_mm512_srai_epi16(_mm512_slli_epi16(c, 8), 8), sv);
                const __m512i po = _mm512_mullo_epi16(_mm512_srai_epi16(c, 8), sv);
                uint8_t *dst = wt + 256 * i + 128 * h + 64 * x;
                /* 0xEC: (a & c) | b; 0xF8: a | (b & c) */
                _mm512_store_si512((void *)dst, _mm512_ternarylogic_epi32(pe, _mm512_slli_epi16(po, 8), lo8, 0xEC));
                _mm512_store_si512((void *)(dst + 4096), _mm512_ternarylogic_epi32(_mm512_srli_epi16(pe, 8), po, hi8, 0xF8));
            }
        }
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

/* Weight rows [16 g0, min(16 g1, N)) for every activation row: out[m, n] (see the header). Software-pipelined
 * over (block, pair of activation tiles) items: item k's tile instructions go first; then, at a block's first
 * pair, the next block's A tiles are built into the other half of wt, vector code that runs while the tiles
 * compute; then item k - 1's epilogue reads its sums (cbuf, double-buffered), stored an item earlier. The
 * stores of a build thus have an epilogue's time to drain before the tiles load them. */
INLINE void gq_amx_cols(const int type, const uint8_t *w, int64_t row_bytes, int64_t N, int64_t g0, int64_t g1,
                        int64_t M, int64_t K, const gq_amx_act *act, float *out, int64_t os) {
    int bytes, mk;
    const int bs = gq_info(type, &bytes, &mk);
    const int64_t blocks = K / bs;
    amx_tilecfg cfg = amx_cfg_16x64(8);
    if (bs == 32) { /* tile 0: A (K = 32); 2, 3: B (8 rows); 4, 5: C */
        cfg.colsb[0] = 32;
        cfg.rows[2] = cfg.rows[3] = 8;
    } /* else 0, 1: A low and high bytes; 2, 3: B; 4, 5: C of B0 (low, high); 6, 7: C of B1 */
    _tile_loadconfig(&cfg);
    uint8_t wt[2][8192] __attribute__((aligned(64)));
    int32_t cbuf[2][4][256] __attribute__((aligned(64)));
    int32_t mnp[3][16][4]; /* [block % 3]: a block's are read by its last epilogue, after the next block's build */
    float dw[3][16], mw[3][16];
    __m512 acc[16][GQ_AMX_MC / 16]; /* [weight row][16 activation rows] */
    /* each build also prefetches a slice of the next 16 weight rows (contiguous), as gq_rows8 does: the 16
     * rows' blocks are read at 16 strided places, which the hardware prefetchers follow late (a 7-row step of
     * a 1.5B Q4_K_M model: 158 -> 108 ms) */
    const int64_t slice = (16 * row_bytes / blocks + 63) & ~(int64_t)63;
#define GQ_AMX_BUILD(bb)                                                                                      \
    do {                                                                                                      \
        const int z_ = (int)((bb) & 1), y_ = (int)((bb) % 3);                                                 \
        const char *pf_ = (const char *)(w + (n0 + 16) * row_bytes) + (bb) * slice;                           \
        if (type == GQ_Q4_K)                                                                                  \
            gq_amx_a_tiles_q4k(w, row_bytes, n0, nn, (bb), wt[z_], dw[y_], mw[y_], mnp[y_], pf_, slice);     \
        else if (type == GQ_Q6_K)                                                                             \
            gq_amx_a_tiles_q6k(w, row_bytes, n0, nn, (bb), wt[z_], dw[y_], mw[y_], mnp[y_], pf_, slice);     \
        else                                                                                                  \
            gq_amx_a_tiles(type, w, row_bytes, n0, nn, (bb), wt[z_], dw[y_], mw[y_], mnp[y_], pf_, slice);   \
    } while (0)
    for (int64_t gi = g0; gi < g1; gi++) {
        const int64_t n0 = 16 * gi;
        const int nn = (int)(N - n0 < 16 ? N - n0 : 16);
        for (int64_t mc0 = 0; mc0 < M; mc0 += GQ_AMX_MC) {
            const int64_t mc1 = mc0 + GQ_AMX_MC < M ? mc0 + GQ_AMX_MC : M;
            const int tiles = (int)((mc1 - mc0 + 15) / 16), pairs = (tiles + 1) / 2;
            for (int i = 0; i < 16; i++)
                for (int t = 0; t < tiles; t++) acc[i][t] = _mm512_setzero_ps();
            GQ_AMX_BUILD(0);
            const int64_t items = blocks * pairs;
            for (int64_t k = 0; k <= items; k++) {
                if (k < items) {
                    const int64_t b = k / pairs;
                    const int t = 2 * (int)(k % pairs), two = t + 1 < tiles;
                    const uint8_t *a = wt[b & 1];
                    int32_t(*c)[256] = cbuf[k & 1];
                    const int8_t *xv = act->xv + (mc0 / 16 + t) * 16 * K + b * bs * 16;
                    /* tileloadd's asm names no memory operand: keep the stores to wt before it */
                    __asm__ volatile("" ::: "memory");
                    if (bs == 32) {
                        _tile_loadd(0, a, 32);
                        _tile_loadd(2, xv, 64);
                        _tile_zero(4);
                        _tile_dpbssd(4, 0, 2);
                        _tile_stored(4, c[0], 64);
                        if (two) {
                            _tile_loadd(3, xv + 16 * K, 64);
                            _tile_zero(5);
                            _tile_dpbssd(5, 0, 3);
                            _tile_stored(5, c[1], 64);
                        }
                    } else {
                        _tile_zero(4);
                        _tile_zero(5);
                        _tile_zero(6);
                        _tile_zero(7);
                        for (int q = 0; q < 4; q++) { /* 64 inputs: 16 rows of the VNNI layout, 1 KB */
                            _tile_loadd(0, a + 64 * q, 256);
                            _tile_loadd(1, a + 4096 + 64 * q, 256);
                            _tile_loadd(2, xv + 1024 * q, 64);
                            _tile_dpbusd(4, 0, 2);
                            _tile_dpbssd(5, 1, 2);
                            if (two) {
                                _tile_loadd(3, xv + 16 * K + 1024 * q, 64);
                                _tile_dpbusd(6, 0, 3);
                                _tile_dpbssd(7, 1, 3);
                            }
                        }
                        _tile_stored(4, c[0], 64);
                        _tile_stored(5, c[1], 64);
                        if (two) {
                            _tile_stored(6, c[2], 64);
                            _tile_stored(7, c[3], 64);
                        }
                    }
                    if (t == 0 && b + 1 < blocks) GQ_AMX_BUILD(b + 1);
                }
                if (k > 0) { /* item k - 1's epilogue */
                    const int64_t b = (k - 1) / pairs;
                    const int t = 2 * (int)((k - 1) % pairs), two = t + 1 < tiles, z = (int)(b % 3);
                    int32_t(*c)[256] = cbuf[(k - 1) & 1];
                    for (int u = 0; u < 1 + two; u++) {
                        const int64_t m = mc0 + 16 * (t + u);
                        for (int i = 0; i < nn; i++) {
                            __m512i isum;
                            if (bs == 32)
                                isum = _mm512_load_si512(c[u] + 16 * i);
                            else
                                isum = _mm512_add_epi32(_mm512_load_si512(c[2 * u] + 16 * i),
                                                        _mm512_slli_epi32(_mm512_load_si512(c[2 * u + 1] + 16 * i), 8));
                            acc[i][t + u] = gq_amx_epilogue(mk, acc[i][t + u], isum, dw[z][i], mw[z][i], mnp[z][i], act, b, m);
                        }
                    }
                }
            }
            /* per 16 activation rows, the 16 x 16 outputs transposed through a buffer: one store of the 16 weight
             * rows' outputs per activation row, not 16 scattered ones (out's rows are far apart) */
            const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                   _mm512_set1_epi32(16));
            const __mmask16 keep = (__mmask16)((1u << nn) - 1);
            for (int t = 0; t < tiles; t++) {
                float v[16][16] __attribute__((aligned(64)));
                for (int i = 0; i < 16; i++) _mm512_store_ps(v[i], acc[i][t]);
                const int64_t m0 = mc0 + 16 * t;
                for (int j = 0; j < 16 && m0 + j < mc1; j++)
                    _mm512_mask_storeu_ps(out + (m0 + j) * os + n0, keep, _mm512_i32gather_ps(col, &v[0][j], 4));
            }
        }
    }
#undef GQ_AMX_BUILD
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
