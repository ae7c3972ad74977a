/* Test harness for izh's GGUF block matmuls (izh/kernels/cpu/csrc/gguf_blocks.c) on another machine (NEON
 * under qemu-aarch64): tests/unit/test_gguf_blocks_neon.py writes the cases, this program runs each through
 * izh_gguf_matmul_f32 and writes the outputs, and the test compares them with gguf_matmul_ref bit for bit.
 *
 *   gguf_blocks_harness CASES OUT
 *
 * CASES: one case after another, each int64 type, M, N, K, row_bytes, nt, then x float32 [M, K] and the
 * weight uint8 [N, row_bytes] (little-endian, as both machines are). OUT: each case's int64 return code,
 * then out float32 [M, N]. The first line of stdout says how many threads an OpenMP team asked for 2 gets
 * here (the nt = 2 cases run on two threads only if it is 2). */
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

int izh_gguf_matmul_f32(int type, const float *x, int64_t xs, const uint8_t *w, int64_t row_bytes, int64_t M,
                        int64_t N, int64_t K, float *out, int64_t os, int nt);

static void *read_exact(FILE *f, size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || fread(p, 1, bytes, f) != bytes) {
        fprintf(stderr, "truncated case file\n");
        exit(2);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s CASES OUT\n", argv[0]);
        return 2;
    }
    int team = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    printf("team %d\n", team);
    FILE *in = fopen(argv[1], "rb"), *out = fopen(argv[2], "wb");
    if (!in || !out) {
        fprintf(stderr, "cannot open the files\n");
        return 2;
    }
    int64_t head[6];
    int cases = 0;
    while (fread(head, sizeof head, 1, in) == 1) {
        const int64_t type = head[0], M = head[1], N = head[2], K = head[3], row_bytes = head[4], nt = head[5];
        float *x = read_exact(in, sizeof(float) * (size_t)(M * K));
        uint8_t *w = read_exact(in, (size_t)(N * row_bytes));
        float *y = calloc((size_t)(M * N), sizeof(float));
        const int64_t rc = izh_gguf_matmul_f32((int)type, x, K, w, row_bytes, M, N, K, y, N, (int)nt);
        fwrite(&rc, sizeof rc, 1, out);
        fwrite(y, sizeof(float), (size_t)(M * N), out);
        free(x), free(w), free(y);
        cases++;
    }
    fclose(in);
    fclose(out);
    printf("cases %d\n", cases);
    return 0;
}
