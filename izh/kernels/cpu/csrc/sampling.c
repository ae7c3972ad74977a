/* Greedy argmax, sampling and top-p over float32 logits rows.
 * See common.h for the conventions, izh/kernels/cpu/ops.py for the contract. */
#include "common.h"

/* Greedy decoding: per fp32 row, the index of the first maximum, a NaN counting as the maximum (the first
 * NaN wins), as torch.max(dim=-1).indices on a CPU. Rows in parallel when there are several. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t j = 0, best = 0;
    float m = -INFINITY;
#if HAVE_DPBF16
    if (n >= 16) {
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512i vidx = _mm512_setzero_si512(), cur = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        __mmask16 nan = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 v = _mm512_loadu_ps(x + j);
            nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            const __mmask16 gt = _mm512_cmp_ps_mask(v, vmax, _CMP_GT_OQ);
            vmax = _mm512_mask_mov_ps(vmax, gt, v);
            vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
            cur = _mm512_add_epi32(cur, step);
        }
        if (nan) {
            j = 0; /* the scalar loop below finds the first NaN */
        } else {
            m = _mm512_reduce_max_ps(vmax);
            const __mmask16 eq = _mm512_cmp_ps_mask(vmax, _mm512_set1_ps(m), _CMP_EQ_OQ);
            best = _mm512_mask_reduce_min_epi32(eq, vidx);
        }
    }
#endif
    for (; j < n; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > m) {
            m = x[j];
            best = j;
        }
    }
    return best;
}

/* x: fp32 [rows, n] with row stride xs; out: int64 [rows]. */
void izh_argmax_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t n, int64_t *out, int nt) {
    if (nt <= 1 || rows * n < PAR_MIN_ELEMS || rows < 2) {
        for (int64_t r = 0; r < rows; r++) out[r] = argmax_row(x + r * xs, n);
    } else {
        _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t r = 0; r < rows; r++) out[r] =
            argmax_row(x + r * xs, n);
    }
}

/* ------------------------------------------------------------------------------------------------ */
/* Sampling: per fp32 row of (temperature-scaled, masked) logits x and a uniform u in [0, 1), the first
 * token j whose cumulative exp(x - max) exceeds u times the row's total, i.e. inverse-CDF sampling from
 * softmax(x). Sums are in fp64 by chunks of SAMPLE_CHUNK tokens (vectorised); the scan skips whole chunks
 * by their sums and walks the one where the target falls, adding sequentially (should rounding leave the
 * target past that walk, the next chunk's first token of nonzero weight is taken). A row whose total
 * rounds to u * total picks its last token of nonzero probability; an all -inf (or NaN) row token 0. */
#define SAMPLE_CHUNK 256

static FAST_FP int64_t sample_row(const float *x, int64_t V, double u, double *csum) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
    if (!(m > -INFINITY) || m != m) return 0;
    const int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    float e[SAMPLE_CHUNK];
    double total = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        const int64_t n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
        const float *xc = x + c * SAMPLE_CHUNK;
#pragma omp simd
        for (int64_t i = 0; i < n; i++) e[i] = exp_f32(xc[i] - m);
        double sum = 0.0;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) sum += e[i];
        csum[c] = sum;
        total += sum;
    }
    const double target = u * total;
    double cum = 0.0;
    for (int64_t c = 0; c < chunks; c++) {
        if (cum + csum[c] > target) {
            const int64_t n = V - c * SAMPLE_CHUNK < SAMPLE_CHUNK ? V - c * SAMPLE_CHUNK : SAMPLE_CHUNK;
            const float *xc = x + c * SAMPLE_CHUNK;
#pragma omp simd
            for (int64_t i = 0; i < n; i++) e[i] = exp_f32(xc[i] - m);
            double local = 0.0;
            for (int64_t i = 0; i < n; i++) {
                local += e[i];
                if (e[i] > 0.0f && cum + local > target) return c * SAMPLE_CHUNK + i;
            }
        }
        cum += csum[c];
    }
    for (int64_t j = V - 1; j > 0; j--)
        if (exp_f32(x[j] - m) > 0.0f) return j;
    return 0;
}

/* x: fp32 [rows, V] with row stride xs; u: fp64 [rows]; out: int64 [rows]. Returns -4 out of memory. */
int izh_sample_rows_f32(const float *x, int64_t xs, int64_t rows, int64_t V, const double *u, int64_t *out,
                        int nt) {
    const int64_t chunks = (V + SAMPLE_CHUNK - 1) / SAMPLE_CHUNK;
    int failed = 0;
    if (nt <= 1 || rows * V < PAR_MIN_ELEMS || rows < 2) {
        double *csum = (double *)malloc(sizeof(double) * (size_t)chunks);
        if (!csum) return -4;
        for (int64_t r = 0; r < rows; r++) out[r] = sample_row(x + r * xs, V, u[r], csum);
        free(csum);
    } else {
        _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {
            double *csum = (double *)malloc(sizeof(double) * (size_t)chunks);
            failed |= csum == NULL;
            _Pragma("omp for schedule(static)") for (int64_t r = 0; r < rows; r++) if (csum) out[r] =
                sample_row(x + r * xs, V, u[r], csum);
            free(csum);
        }
    }
    return failed ? -4 : 0;
}

/* ------------------------------------------------------------------------------------------------ */
/* Top-p in place: per fp32 row of (temperature-scaled, top-k masked) logits and its top_p < 1, every
 * token outside the nucleus becomes -inf. The nucleus: tokens in descending probability, ties by token
 * id, kept while the probability mass before them is < top_p (the top token always). Probabilities are
 * exp(x - max) / sum in fp64. Only the tokens that can be in the nucleus are sorted: a histogram of the
 * row (buckets of TOP_P_WIDTH below its maximum, weighted by probability) finds the top buckets holding
 * at least top_p + TOP_P_MARGIN of the mass; their tokens are the candidates (all of them when the
 * margin cannot be had). Rows with top_p >= 1 are left alone. */
#define TOP_P_BUCKETS 1024
#define TOP_P_WIDTH 0.05f
#define TOP_P_MARGIN 1e-3

typedef struct {
    float x;
    int32_t id;
} top_p_cand;

static int top_p_order(const void *a, const void *b) {
    const top_p_cand *p = (const top_p_cand *)a, *q = (const top_p_cand *)b;
    if (p->x != q->x) return p->x > q->x ? -1 : 1;
    return (p->id > q->id) - (p->id < q->id);
}

/* scratch: e [V] floats, cand [V]. */
static FAST_FP void top_p_row(float *x, int64_t V, float top_p, float *e, top_p_cand *cand) {
    if (!(top_p < 1.0f)) return;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; j++) m = x[j] > m ? x[j] : m;
    if (!(m > -INFINITY) || m != m) return;
    double mass[TOP_P_BUCKETS] = {0};
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < V; j++) {
        e[j] = exp_f32(x[j] - m);
        total += e[j];
    }
    /* The last bucket (everything further down, masked tokens included) is never summed: it is reached
     * only when the others do not hold the needed mass. */
    for (int64_t j = 0; j < V; j++) {
        const float d = (m - x[j]) * (1.0f / TOP_P_WIDTH); /* +inf for a masked token */
        if (d < (float)(TOP_P_BUCKETS - 1)) mass[(int)d] += e[j];
    }
    double needed = ((double)top_p + TOP_P_MARGIN) * total, cum = 0.0;
    int crossing = TOP_P_BUCKETS - 1;
    for (int b = 0; b < TOP_P_BUCKETS - 1; b++) {
        cum += mass[b];
        if (cum >= needed) {
            crossing = b;
            break;
        }
    }
    int64_t k = 0;
    if (crossing == TOP_P_BUCKETS - 1) {
        for (int64_t j = 0; j < V; j++) cand[k++] = (top_p_cand){x[j], (int32_t)j};
    } else {
        /* Bucket <= crossing, computed as in the histogram. */
        for (int64_t j = 0; j < V; j++)
            if ((m - x[j]) * (1.0f / TOP_P_WIDTH) < (float)(crossing + 1)) cand[k++] = (top_p_cand){x[j], (int32_t)j};
    }
    qsort(cand, (size_t)k, sizeof *cand, top_p_order);
    const double limit = (double)top_p * total;
    double before = 0.0;
    int64_t last = 0; /* the last kept candidate */
    for (int64_t c = 0; c < k; c++) {
        if (before >= limit) break;
        last = c;
        before += (double)e[cand[c].id];
    }
    const float lx = cand[last].x;
    const int32_t lid = cand[last].id;
    /* Kept: ahead of the last kept candidate in (x descending, id ascending) order, or it. */
    for (int64_t j = 0; j < V; j++)
        if (!(x[j] > lx || (x[j] == lx && j <= lid))) x[j] = -INFINITY;
}

/* x: fp32 [rows, V], row stride xs, modified in place; top_p: fp32 [rows]. Returns -4 out of memory. */
int izh_top_p_rows_f32(float *x, int64_t xs, int64_t rows, int64_t V, const float *top_p, int nt) {
    const size_t scratch = (size_t)V * (sizeof(float) + sizeof(top_p_cand));
    int failed = 0;
    if (nt <= 1 || rows < 2) {
        char *buf = (char *)malloc(scratch);
        if (!buf) return -4;
        for (int64_t r = 0; r < rows; r++)
            top_p_row(x + r * xs, V, top_p[r], (float *)buf, (top_p_cand *)(buf + V * sizeof(float)));
        free(buf);
    } else {
        _Pragma("omp parallel num_threads(nt) reduction(| : failed)") {
            char *buf = (char *)malloc(scratch);
            failed |= buf == NULL;
            _Pragma("omp for schedule(dynamic, 1)") for (int64_t r = 0; r < rows; r++) if (buf)
                top_p_row(x + r * xs, V, top_p[r], (float *)buf, (top_p_cand *)(buf + V * sizeof(float)));
            free(buf);
        }
    }
    return failed ? -4 : 0;
}
