/* Test harness for izh's float32 record matmuls (izh/kernels/cpu/csrc/records_f32.c): the same
 * deterministic records and activations on every machine, each output row printed as a hash of its
 * bytes, so the builds for different instruction sets (portable C, AVX2, NEON under qemu) can be compared
 * byte for byte. Built with records_f32.c (or every csrc .c file) by tests/unit/test_records_neon.py.
 *
 *   records_harness         one line per (kind, K, N, M, nt, row): the FNV-1a hash of the row's floats
 *   records_harness full    the same, each row's floats in hex after the hash
 *
 * x is read with a row stride of K + 8 and out written with one of N + 16; the padding of both is filled
 * with sentinels, and a write into out's padding is reported as a CLOBBERED line. The first line says how
 * many threads an OpenMP team asked for 2 gets here (the nt = 2 cases run on two threads only if it is 2). */
#include <inttypes.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h" /* rng, uniform, fnv1a */

int izh_q4_gemm_f32(const float *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, float *out,
                    int64_t os, int nt);
int izh_q8_gemm_f32(const float *x, int64_t xs, const uint8_t *w, int64_t M, int64_t N, int64_t K, float *out,
                    int64_t os, int nt);

static void put_bf16(uint8_t *p, float f) { /* truncation: any bf16 will do */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint16_t h = (uint16_t)(u >> 16);
    memcpy(p, &h, 2);
}

static float from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint32_t to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* N / 16 tiles of K / 32 records each, tile after tile. */
static uint8_t *make_records(int q8, int N, int K) {
    const int record = q8 ? 544 : 320, n = (N / 16) * (K / 32);
    uint8_t *w = malloc((size_t)n * record);
    for (int r = 0; r < n; r++) {
        uint8_t *rec = w + (size_t)r * record;
        const int codes = q8 ? 512 : 256;
        for (int i = 0; i < codes; i++) rec[i] = (uint8_t)(rng() >> 56); /* int8 codes: -128..127 */
        for (int i = 0; i < 16; i++) {
            const float s = uniform(0.001f, 0.1f);
            put_bf16(rec + codes + 2 * i, (rng() & 7) == 0 ? -s : s);
            if (!q8) put_bf16(rec + 288 + 2 * i, uniform(-0.5f, 0.25f));
        }
    }
    return w;
}

/* rows x K activations, row stride K + 8 (padding NaN: reading it would show). Groups of several kinds:
 * all zero (d = 0), integers up to 127 (exact codes), half-integers (round-half-even ties), and
 * uniform values at scales from 1e-3 to 1e2. */
static float *make_x(int rows, int K) {
    const int xs = K + 8;
    float *x = malloc(sizeof(float) * (size_t)rows * xs);
    for (int m = 0; m < rows; m++) {
        for (int k = K; k < xs; k++) x[m * xs + k] = from_bits(0x7FC00000u);
        for (int g = 0; g < K / 32; g++) {
            float *xg = x + m * xs + 32 * g;
            const int kind = (int)(rng() % 8);
            const float scale = (float)(1u << (rng() % 17)) * 0.001f;
            for (int k = 0; k < 32; k++) {
                switch (kind) {
                case 0: xg[k] = 0.0f; break;
                case 1: xg[k] = (float)((int)(rng() % 255) - 127); break;
                case 2: xg[k] = (float)((int)(rng() % 254) - 127) + 0.5f; break;
                default: xg[k] = uniform(-1.0f, 1.0f) * scale; break;
                }
            }
            if (kind == 1) xg[rng() % 32] = 127.0f;  /* d = 1 exactly */
            if (kind == 2) xg[rng() % 32] = -127.0f; /* d = 1: the halves are ties */
        }
    }
    return x;
}

int main(int argc, char **argv) {
    const int full = argc > 1 && strcmp(argv[1], "full") == 0;
    static const int Ms[] = {1, 2, 3, 5, 9, 17}, Ns[] = {16, 48, 96}, Ks[] = {32, 64, 288};
    const uint32_t sentinel = 0x7F7F7F7Fu;
    int bad = 0;
    rng_state = 0x1234567887654321ull;
    int team = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    printf("team %d\n", team);
    for (int q8 = 0; q8 < 2; q8++)
        for (int ki = 0; ki < 3; ki++) {
            const int K = Ks[ki];
            float *x = make_x(17, K);
            for (int ni = 0; ni < 3; ni++) {
                const int N = Ns[ni], os = N + 16;
                uint8_t *w = make_records(q8, N, K);
                float *out = malloc(sizeof(float) * (size_t)17 * os);
                for (int mi = 0; mi < 6; mi++)
                    for (int nt = 1; nt <= 2; nt++) {
                        const int M = Ms[mi];
                        for (int i = 0; i < 17 * os; i++) out[i] = from_bits(sentinel);
                        const int rc = q8 ? izh_q8_gemm_f32(x, K + 8, w, M, N, K, out, os, nt)
                                          : izh_q4_gemm_f32(x, K + 8, w, M, N, K, out, os, nt);
                        if (rc) {
                            printf("q%d K=%d N=%d M=%d nt=%d rc=%d\n", q8 ? 8 : 4, K, N, M, nt, rc);
                            bad = 1;
                            continue;
                        }
                        for (int i = 0; i < 17 * os; i++)
                            if ((i % os >= N || i / os >= M) && to_bits(out[i]) != sentinel) {
                                printf("q%d K=%d N=%d M=%d nt=%d CLOBBERED out[%d]\n", q8 ? 8 : 4, K, N, M, nt, i);
                                bad = 1;
                                break;
                            }
                        for (int m = 0; m < M; m++) {
                            printf("q%d K=%d N=%d M=%d nt=%d row=%d %016" PRIx64, q8 ? 8 : 4, K, N, M, nt, m,
                                   fnv1a(out + m * os, sizeof(float) * (size_t)N));
                            if (full)
                                for (int n = 0; n < N; n++) printf(" %08" PRIx32, to_bits(out[m * os + n]));
                            printf("\n");
                        }
                    }
                free(out);
                free(w);
            }
            free(x);
        }
    printf("done\n");
    return bad;
}
