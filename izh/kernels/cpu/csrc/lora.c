/* LoRA deltas inside the fused decode stacks (stack.c, records_f32.c), for every variant.
 * See common.h for the conventions, izh/model/lora.py for the adapters' layout.
 *
 * After a record matmul out [M, N] = x [M, K] W^T, each row m whose slot s = row_slots[m] is >= 0 gets its
 * adapter's delta, the same products as the module path's hook (izh.model.lora.LoraLinear.hook):
 *
 *   t = x[m] A[s, :kr]^T          (kr = slot_ranks[s] * n rows; rounded to the dtype, as torch's bmm)
 *   delta = t Bt[s, :kr]           (rounded to the dtype)
 *   out[m] = out[m] + delta        (rounded to the dtype)
 *
 * A is [slots, n * R, K] and Bt [slots, n * R, N] (R the slots' rank, n the projections packed in the
 * linear, rank-major: row j * n + i is shard i's rank-j row, whose Bt row is zero outside the shard's
 * columns [bounds[i], bounds[i + 1]); the scaling is folded into Bt). Only the summation order differs from
 * torch's: the dot products in 16 lanes, summed pairwise, the expansion row by row over the shard's columns
 * only (the zeros are skipped; so are rank rows whose t is exactly 0, e.g. a projection the adapter does not
 * target). Plain C with GCC's generic vectors for the dot products, which every variant lowers to its own
 * registers (no intrinsics). */
#include "common.h"

#define LORA_LANES 16
#define LORA_ROWS 4 /* rank rows of A per pass over x (independent accumulators) */

/* 16 float lanes in GCC's generic vectors: one zmm (avx512), two ymm (avx2), four xmm (generic, NEON). */
typedef float lora_vf __attribute__((vector_size(4 * LORA_LANES)));
typedef uint32_t lora_vu __attribute__((vector_size(4 * LORA_LANES)));
typedef uint16_t lora_vh __attribute__((vector_size(2 * LORA_LANES)));

/* *v = p[i : i + 16] as floats (by pointer: a vector return would warn of an ABI change in narrower variants) */
INLINE void lora_load(lora_vf *v, const void *p, int64_t i, const int bf) {
    if (bf) {
        lora_vh h;
        memcpy(&h, (const uint16_t *)p + i, sizeof h);
        const lora_vu u = __builtin_convertvector(h, lora_vu) << 16;
        *v = (lora_vf)u;
    } else {
        memcpy(v, (const float *)p + i, sizeof *v);
    }
}

/* t[r] = x . a[r] for NR rows of a (row stride K): 16 lanes each, summed pairwise, then the tail. */
INLINE void lora_dots(const int NR, const void *x, const void *a, int64_t K, float *t, const int bf) {
    lora_vf acc[LORA_ROWS];
    for (int r = 0; r < NR; r++) acc[r] = (lora_vf){0};
    int64_t k = 0;
    for (; k + LORA_LANES <= K; k += LORA_LANES) {
        lora_vf xv, av;
        lora_load(&xv, x, k, bf);
        for (int r = 0; r < NR; r++) {
            lora_load(&av, off(a, r * K, bf), k, bf);
            acc[r] += xv * av;
        }
    }
    for (int r = 0; r < NR; r++) {
        float lanes[LORA_LANES];
        memcpy(lanes, &acc[r], sizeof lanes);
        for (int w = LORA_LANES / 2; w >= 1; w /= 2)
            for (int i = 0; i < w; i++) lanes[i] += lanes[i + w];
        float s = lanes[0];
        const void *ar = off(a, r * K, bf);
        for (int64_t kk = k; kk < K; kk++) s += ld(x, kk, bf) * ld(ar, kk, bf);
        t[r] = rnd(s, bf);
    }
}

INLINE void lora_row(const void *x, int64_t K, void *out, int64_t N, const void *a, const void *bt, int64_t n,
                     const int64_t *bounds, int64_t r, float *t, float *delta, const int bf) {
    const int64_t kr = r * n;
    int64_t j = 0;
    for (; j + LORA_ROWS <= kr; j += LORA_ROWS) lora_dots(LORA_ROWS, x, off(a, j * K, bf), K, t + j, bf);
    for (; j < kr; j++) lora_dots(1, x, off(a, j * K, bf), K, t + j, bf);
    const int64_t lo = bounds[0], hi = bounds[n];
    for (int64_t o = lo; o < hi; o++) delta[o] = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const int64_t c0 = bounds[i], c1 = bounds[i + 1];
        for (int64_t rr = 0; rr < r; rr++) {
            const int64_t jj = rr * n + i;
            const float tj = t[jj];
            if (tj == 0.0f) continue;
            const void *b = off(bt, jj * N, bf);
            for (int64_t o = c0; o < c1; o++) delta[o] += tj * ld(b, o, bf);
        }
    }
    for (int64_t o = lo; o < hi; o++) st(out, o, ld(out, o, bf) + rnd(delta[o], bf), bf);
}

/* lin: this linear's STACK_LORA_* fields (A, Bt, n, bounds[n + 1]); R: the slots' rank. Returns 0, or -4
 * out of memory. */
INLINE int lora_add(const void *x, int64_t M, int64_t K, void *out, int64_t N, const int64_t *lin, int64_t R,
                    const int32_t *row_slots, const int32_t *slot_ranks, int nt, const int bf) {
    const void *a = (const void *)(intptr_t)lin[STACK_LORA_A];
    const void *bt = (const void *)(intptr_t)lin[STACK_LORA_BT];
    const int64_t n = lin[STACK_LORA_N];
    const int64_t *bounds = lin + STACK_LORA_BOUNDS;
    if (!a || !bt || n < 1) return 0;
    int64_t rows = 0, work = 0;
    for (int64_t m = 0; m < M; m++) {
        const int32_t s = row_slots[m];
        if (s >= 0 && slot_ranks[s] > 0) rows++, work += slot_ranks[s] * n * (K + N);
    }
    if (rows == 0) return 0;
    const int64_t kmax = n * R;
    int team = nt < 1 ? 1 : nt;
    if (team > rows) team = (int)rows;
    if (work < PAR_MIN_ELEMS) team = 1;
    float *buf = (float *)malloc(sizeof(float) * (size_t)team * (size_t)(kmax + N));
    if (!buf) return -4;
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t m = 0; m < M; m++) {
        const int32_t s = row_slots[m];
        if (s < 0 || slot_ranks[s] <= 0) continue;
        float *t = buf + (int64_t)omp_get_thread_num() * (kmax + N);
        lora_row(off(x, m * K, bf), K, off(out, m * N, bf), N, off(a, s * kmax * K, bf), off(bt, s * kmax * N, bf), n,
                 bounds, slot_ranks[s], t, t + kmax, bf);
    }
    free(buf);
    return 0;
}

int izh_lora_add_f32(const float *x, int64_t M, int64_t K, float *out, int64_t N, const int64_t *lin, int64_t R,
                     const int32_t *row_slots, const int32_t *slot_ranks, int nt) {
    return lora_add(x, M, K, out, N, lin, R, row_slots, slot_ranks, nt, 0);
}

int izh_lora_add_bf16(const uint16_t *x, int64_t M, int64_t K, uint16_t *out, int64_t N, const int64_t *lin,
                      int64_t R, const int32_t *row_slots, const int32_t *slot_ranks, int nt) {
    return lora_add(x, M, K, out, N, lin, R, row_slots, slot_ranks, nt, 1);
}
