/* Mixture-of-experts routing: router logits, softmax, top-k and the routing weights of each token.
 * See common.h for the conventions, izh/kernels/cpu/moe.py for the contract.
 *
 * Every token's result depends on its own row only: one thread computes a whole row, the dot products
 * sum in one fixed order (8 interleaved partial sums, then a fixed tree), and nothing depends on how
 * many rows the call has, so a token routes (and weighs its experts) bit-identically alone or in any
 * batch. */
#include "common.h"

#define MOE_MAX_EXPERTS 1024
#define MOE_LANES 8

/* sum_h x[h] * w[h] in a fixed order: lane l sums the products h = l (mod 8), the lanes then pairwise. */
static float dot_fixed(const float *x, const float *w, int64_t n) {
    float acc[MOE_LANES] = {0};
    int64_t h = 0;
    for (; h + MOE_LANES <= n; h += MOE_LANES) {
        for (int l = 0; l < MOE_LANES; l++) acc[l] += x[h + l] * w[h + l];
    }
    for (int l = 0; h < n; h++, l++) acc[l] += x[h] * w[h];
    const float a = (acc[0] + acc[4]) + (acc[2] + acc[6]);
    const float b = (acc[1] + acc[5]) + (acc[3] + acc[7]);
    return a + b;
}

/* One token: logits -> softmax over all experts (max subtracted, float32) -> the k largest
 * probabilities (ties to the lower expert id) -> divided by their sum when `renormalize` -> written in
 * ascending expert order, the order the caller adds the experts' outputs in. */
static void route_row(const float *x, const float *w, int64_t hidden, int64_t E, int64_t k, int renormalize,
                      int64_t *ids, float *weights) {
    float p[MOE_MAX_EXPERTS];
    float m = -INFINITY;
    for (int64_t e = 0; e < E; e++) {
        p[e] = dot_fixed(x, w + e * hidden, hidden);
        if (p[e] > m) m = p[e];
    }
    float total = 0.0f;
    for (int64_t e = 0; e < E; e++) {
        p[e] = expf(p[e] - m);
        total += p[e];
    }
    for (int64_t e = 0; e < E; e++) p[e] /= total;
    unsigned char taken[MOE_MAX_EXPERTS] = {0};
    int32_t chosen[MOE_MAX_EXPERTS];
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++) {
            if (!taken[e] && (best < 0 || p[e] > p[best])) best = e;
        }
        taken[best] = 1;
        chosen[j] = (int32_t)best;
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < k; j++) sum += p[chosen[j]];
    int64_t j = 0;
    for (int64_t e = 0; e < E; e++) {
        if (!taken[e]) continue;
        ids[j] = e;
        weights[j] = renormalize ? p[e] / sum : p[e];
        j++;
    }
}

/* x: fp32 [T, hidden] with row stride xs; w: fp32 [E, hidden] contiguous; ids: int64 [T, k]; weights: fp32
 * [T, k]. Then the T * k pairs (pair p = token p / k, slot p % k) grouped by expert, stably (tokens
 * ascending within an expert): order int64 [T * k] (the pairs), tokens int64 [T * k] (their tokens),
 * counts int64 [E] (pairs per expert). Returns 0, or -1 when E or k is out of range. */
int izh_moe_route_f32(const float *x, int64_t xs, const float *w, int64_t T, int64_t hidden, int64_t E,
                      int64_t k, int renormalize, int64_t *ids, float *weights, int64_t *order, int64_t *tokens,
                      int64_t *counts, int nt) {
    if (E < 1 || E > MOE_MAX_EXPERTS || k < 1 || k > E) return -1;
    if (nt <= 1 || T < 2 || T * E * hidden < PAR_MIN_ELEMS) {
        for (int64_t t = 0; t < T; t++) route_row(x + t * xs, w, hidden, E, k, renormalize, ids + t * k, weights + t * k);
    } else {
        _Pragma("omp parallel for num_threads(nt) schedule(static)") for (int64_t t = 0; t < T; t++)
            route_row(x + t * xs, w, hidden, E, k, renormalize, ids + t * k, weights + t * k);
    }
    /* A counting sort of the pairs by expert. */
    int64_t start[MOE_MAX_EXPERTS];
    for (int64_t e = 0; e < E; e++) counts[e] = 0;
    for (int64_t p = 0; p < T * k; p++) counts[ids[p]]++;
    int64_t at = 0;
    for (int64_t e = 0; e < E; e++) {
        start[e] = at;
        at += counts[e];
    }
    for (int64_t p = 0; p < T * k; p++) {
        const int64_t slot = start[ids[p]]++;
        order[slot] = p;
        tokens[slot] = p / k;
    }
    return 0;
}

/* The experts of one sparse block over a step's (token, slot) pairs grouped by expert (izh_moe_route_f32's
 * order, tokens and counts): for each expert that has pairs, its tokens' rows of x are gathered, then
 * gate_up -> silu_mul -> down run through izh_stack_linear_f32 and izh_silu_mul_f32 (the calls that
 * GatedMLP's modules make from Python, with the same rows, so the results are the same bits), and each
 * result row goes to out at its pair: out is [T * k, hidden] in (token, slot) order.
 * table: E rows of MOE_EXPERT_FIELDS int64, gate_up's (records or parts, kind, bias) then down's, as
 * izh.model.fused_stack.linear_fields gives them; x: fp32 [T, hidden] with row stride xs.
 * Returns 0; -4 out of memory; -6 a matmul refused its shape. */
#define MOE_EXPERT_FIELDS 6
int izh_moe_experts_f32(const int64_t *table, int64_t E, const int64_t *counts, const int64_t *order,
                        const int64_t *tokens, const float *x, int64_t xs, int64_t hidden, int64_t inter, float *out,
                        int nt) {
    int64_t most = 0;
    for (int64_t e = 0; e < E; e++) most = counts[e] > most ? counts[e] : most;
    if (most == 0) return 0;
    float *buf = (float *)malloc((size_t)most * (size_t)(2 * hidden + 3 * inter) * sizeof(float));
    if (!buf) return -4;
    float *rows = buf, *gate_up = rows + most * hidden, *act = gate_up + most * 2 * inter, *y = act + most * inter;
    int rc = 0;
    for (int64_t e = 0, start = 0; e < E && rc == 0; start += counts[e], e++) {
        const int64_t c = counts[e];
        if (c == 0) continue;
        for (int64_t i = 0; i < c; i++)
            memcpy(rows + i * hidden, x + tokens[start + i] * xs, (size_t)hidden * sizeof(float));
        const int64_t *lin = table + e * MOE_EXPERT_FIELDS;
        if ((rc = izh_stack_linear_f32(lin, rows, c, 2 * inter, hidden, gate_up, nt))) break;
        izh_silu_mul_f32(gate_up, 2 * inter, act, c, inter, nt);
        if ((rc = izh_stack_linear_f32(lin + 3, act, c, hidden, inter, y, nt))) break;
        for (int64_t i = 0; i < c; i++)
            memcpy(out + order[start + i] * hidden, y + i * hidden, (size_t)hidden * sizeof(float));
    }
    free(buf);
    return rc;
}
