/* Weight-only int4 / int8 record matmuls: AVX512-BF16, and AMX where built and allowed.
 * See common.h for the conventions, izh/kernels/cpu/ops.py for the contract. */
#include "common.h"

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
#define QGEMM_MAX_M 8
/* Software prefetch distance, in records: the hardware prefetcher alone leaves ~25% of the bandwidth. */
#define QGEMM_PREFETCH 8

#if HAVE_QGEMM
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
    amx_tilecfg cfg = amx_cfg_16x64(6);
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

/* 1 when this process may use the AMX tiles (asked once; common.h). */
int izh_amx_permitted(void) { return amx_available(); }

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
#else
int izh_amx_permitted(void) { return 0; }
int izh_qgemm_available(void) { return 0; }
int izh_qgemm_max_rows(void) { return 0; }
int izh_qgemm_uses_amx(int q8, int64_t M) {
    (void)q8, (void)M;
    return 0;
}
int izh_q4_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt) {
    (void)x, (void)xs, (void)w, (void)M, (void)N, (void)K, (void)out, (void)os, (void)out_f32, (void)nt;
    return -2;
}
int izh_q8_gemm(const uint16_t *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, void *out,
                int64_t os, int out_f32, int nt) {
    (void)x, (void)xs, (void)w, (void)M, (void)N, (void)K, (void)out, (void)os, (void)out_f32, (void)nt;
    return -2;
}
#endif
