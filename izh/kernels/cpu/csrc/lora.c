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
 * torch's: the dot products in LORA_LANES partial sums (16 / 8 / 4 by variant), summed pairwise; the
 * expansion in rank order over the shard's columns only (the zeros are skipped; so are rank rows whose t is
 * exactly 0 for every row of a block, e.g. a projection the adapter does not target). Rows go in blocks of
 * up to LORA_MR consecutive rows on one slot, so each weight vector loaded serves the whole block. Plain C
 * with GCC's generic vectors (vector_size), which every variant lowers to its own registers: no
 * intrinsics, so generic, avx2, avx512, amx and aarch64 (NEON) all build it. */
#include "common.h"

/* Lanes of one GCC generic vector: a register of the variant (zmm, ymm, xmm / NEON q). */
#if defined(__AVX512F__)
#define LORA_LANES 16
#elif defined(__AVX2__)
#define LORA_LANES 8
#else
#define LORA_LANES 4
#endif
#define LORA_MR 4 /* rows of x (same slot) per block: each weight vector loaded serves them all */
#define LORA_NR 2 /* rank rows of A per pass (LORA_MR x LORA_NR accumulators) */

typedef float lora_vf __attribute__((vector_size(4 * LORA_LANES)));
typedef uint32_t lora_vu __attribute__((vector_size(4 * LORA_LANES)));
typedef uint16_t lora_vh __attribute__((vector_size(2 * LORA_LANES)));

/* *v = p[i : i + LORA_LANES] as floats (by pointer: a vector return warns of an ABI change). */
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

/* The bf16 bit patterns of v (f2bf lane by lane: round to nearest even, NaN -> 0x7FC0), in 32-bit lanes. */
INLINE void lora_bf16_bits(const lora_vf *v, lora_vu *bits) {
    lora_vu u;
    memcpy(&u, v, sizeof u);
    const lora_vu r = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    const lora_vu nan = (lora_vu)(*v != *v);
    *bits = (r & ~nan) | (nan & 0x7FC0u);
}

/* p[i : i + LORA_LANES] = rnd(p[i : ...] + rnd(d)) in the dtype, as `st(p, i, ld(p, i) + rnd(d))` does. */
INLINE void lora_add_store(void *p, int64_t i, const lora_vf *d, const int bf) {
    lora_vf v;
    lora_load(&v, p, i, bf);
    if (bf) {
        lora_vu bits;
        lora_bf16_bits(d, &bits);
        v += (lora_vf)(bits << 16);
        lora_bf16_bits(&v, &bits);
        const lora_vh h = __builtin_convertvector(bits, lora_vh);
        memcpy((uint16_t *)p + i, &h, sizeof h);
    } else {
        v += *d;
        memcpy((float *)p + i, &v, sizeof v);
    }
}

INLINE float lora_hsum(lora_vf v) {
    float lanes[LORA_LANES];
    memcpy(lanes, &v, sizeof lanes);
    for (int w = LORA_LANES / 2; w >= 1; w /= 2)
        for (int i = 0; i < w; i++) lanes[i] += lanes[i + w];
    return lanes[0];
}

/* t[m * ts + r] = xf[m] . a[r] for MR rows of xf (float32, row stride K) and NR rows of a (row stride K):
 * LORA_LANES partial sums, summed pairwise, then the tail; rounded to the dtype. */
INLINE void lora_dots(const int MR, const int NR, const float *xf, const void *a, int64_t K, float *t, int64_t ts,
                      const int bf) {
    lora_vf acc[LORA_MR][LORA_NR];
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) acc[m][r] = (lora_vf){0};
    int64_t k = 0;
    for (; k + LORA_LANES <= K; k += LORA_LANES) {
        lora_vf av[LORA_NR];
        for (int r = 0; r < NR; r++) lora_load(&av[r], off(a, r * K, bf), k, bf);
        for (int m = 0; m < MR; m++) {
            lora_vf xv;
            memcpy(&xv, xf + m * K + k, sizeof xv);
            for (int r = 0; r < NR; r++) acc[m][r] += xv * av[r];
        }
    }
    for (int m = 0; m < MR; m++)
        for (int r = 0; r < NR; r++) {
            float sum = lora_hsum(acc[m][r]);
            const void *ar = off(a, r * K, bf);
            for (int64_t kk = k; kk < K; kk++) sum += xf[m * K + kk] * ld(ar, kk, bf);
            t[m * ts + r] = rnd(sum, bf);
        }
}

/* out[m, c0:c1] += rnd(sum over the live rank rows j, in order, of t[m, j] * bt[j, c0:c1]) for MR rows. */
INLINE void lora_expand(const int MR, const float *t, int64_t ts, const void *bt, int64_t N, const int32_t *live,
                        int64_t nlive, int64_t c0, int64_t c1, void *out, const int bf) {
    int64_t o = c0;
    for (; o + LORA_LANES <= c1; o += LORA_LANES) {
        lora_vf acc[LORA_MR];
        for (int m = 0; m < MR; m++) acc[m] = (lora_vf){0};
        for (int64_t q = 0; q < nlive; q++) {
            const int64_t j = live[q];
            lora_vf b;
            lora_load(&b, off(bt, j * N, bf), o, bf);
            for (int m = 0; m < MR; m++) acc[m] += t[m * ts + j] * b;
        }
        for (int m = 0; m < MR; m++) lora_add_store(off(out, m * N, bf), o, &acc[m], bf);
    }
    for (; o < c1; o++)
        for (int m = 0; m < MR; m++) {
            float sum = 0.0f;
            for (int64_t q = 0; q < nlive; q++) sum += t[m * ts + live[q]] * ld(bt, live[q] * N + o, bf);
            void *om = off(out, m * N, bf);
            st(om, o, ld(om, o, bf) + rnd(sum, bf), bf);
        }
}

/* MR consecutive rows of x (one slot: its A, Bt and rank r) get their deltas. xf: MR * K floats, t: MR *
 * n * r floats, live: n * r ints of scratch. */
INLINE void lora_block(const int MR, const void *x, int64_t K, void *out, int64_t N, const void *a, const void *bt,
                       int64_t n, const int64_t *bounds, int64_t r, float *xf, float *t, int32_t *live, const int bf) {
    const int64_t kr = r * n;
    for (int m = 0; m < MR; m++)
        for (int64_t k = 0; k < K; k++) xf[m * K + k] = ld(x, m * K + k, bf);
    int64_t j = 0;
    for (; j + LORA_NR <= kr; j += LORA_NR) lora_dots(MR, LORA_NR, xf, off(a, j * K, bf), K, t + j, kr, bf);
    for (; j < kr; j++) lora_dots(MR, 1, xf, off(a, j * K, bf), K, t + j, kr, bf);
    for (int64_t i = 0; i < n; i++) {
        int64_t nlive = 0;
        for (int64_t rr = 0; rr < r; rr++) {
            const int64_t jj = rr * n + i;
            int zero = 1;
            for (int m = 0; m < MR; m++) zero &= t[m * kr + jj] == 0.0f;
            if (!zero) live[nlive++] = (int32_t)jj;
        }
        if (nlive) lora_expand(MR, t, kr, bt, N, live, nlive, bounds[i], bounds[i + 1], out, bf);
    }
}

/* lin: this linear's STACK_LORA_* fields (A, Bt, n, bounds[n + 1]); R: the slots' rank. Rows go in blocks
 * of up to LORA_MR consecutive rows on one slot (a decode batch is sorted by slot). Returns 0, or -4 out of
 * memory. */
INLINE int lora_add(const void *x, int64_t M, int64_t K, void *out, int64_t N, const int64_t *lin, int64_t R,
                    const int32_t *row_slots, const int32_t *slot_ranks, int nt, const int bf) {
    const void *a = (const void *)(intptr_t)lin[STACK_LORA_A];
    const void *bt = (const void *)(intptr_t)lin[STACK_LORA_BT];
    const int64_t n = lin[STACK_LORA_N];
    const int64_t *bounds = lin + STACK_LORA_BOUNDS;
    if (!a || !bt || n < 1) return 0;
    const int64_t kmax = n * R;
    /* blocks: (first row, rows) */
    int64_t *blocks = (int64_t *)malloc(sizeof(int64_t) * 2 * (size_t)M);
    if (!blocks) return -4;
    int64_t nb = 0, work = 0;
    for (int64_t m = 0; m < M;) {
        const int32_t s = row_slots[m];
        int64_t e = m + 1;
        while (e < M && e - m < LORA_MR && row_slots[e] == s) e++;
        if (s >= 0 && slot_ranks[s] > 0) {
            blocks[2 * nb] = m, blocks[2 * nb + 1] = e - m, nb++;
            work += (e - m) * slot_ranks[s] * n * (K + N);
        }
        m = e;
    }
    int team = nt < 1 ? 1 : nt;
    if (team > nb) team = (int)nb;
    if (work < PAR_MIN_ELEMS) team = 1;
    const int64_t per = LORA_MR * (K + kmax) + kmax;
    float *buf = nb ? (float *)malloc(sizeof(float) * (size_t)team * (size_t)per) : NULL;
    if (nb && !buf) {
        free(blocks);
        return -4;
    }
#pragma omp parallel for num_threads(team) schedule(static) if (team > 1)
    for (int64_t b = 0; b < nb; b++) {
        const int64_t m = blocks[2 * b], mr = blocks[2 * b + 1];
        const int32_t s = row_slots[m];
        float *xf = buf + (int64_t)omp_get_thread_num() * per, *t = xf + LORA_MR * K;
        int32_t *live = (int32_t *)(t + LORA_MR * kmax);
        const void *xm = off(x, m * K, bf), *as = off(a, s * kmax * K, bf), *bs = off(bt, s * kmax * N, bf);
        void *om = off(out, m * N, bf);
        const int64_t r = slot_ranks[s];
        switch (mr) {
        case 1: lora_block(1, xm, K, om, N, as, bs, n, bounds, r, xf, t, live, bf); break;
        case 2: lora_block(2, xm, K, om, N, as, bs, n, bounds, r, xf, t, live, bf); break;
        case 3: lora_block(3, xm, K, om, N, as, bs, n, bounds, r, xf, t, live, bf); break;
        default: lora_block(4, xm, K, om, N, as, bs, n, bounds, r, xf, t, live, bf); break;
        }
    }
    free(buf);
    free(blocks);
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
