/* The fused decode stack of Gemma 2 / Gemma 3 in float32 (izh.model.gemma_stack builds its tables).
 * See common.h for the conventions, izh/kernels/cpu/gemma.py for the contract.
 *
 * The same calls as izh.model.gemma's modules make with the C kernels, in the same order, so the result is
 * bit-identical to theirs: per layer
 *   normed = rms_norm(x, in) (layer 0) or add_rms_norm(h, x, in)        (x: the residual stream)
 *   qkv = normed @ Wqkv; q, k heads rms-normed in place (Gemma 3); q, k rotated with the layer's RoPE
 *   (local or global); attention over the layer's KV cache group (its block tables and slots), with its
 *   sliding window and the score soft-cap; h = attn @ Wo
 *   normed = rms_norm(h, post_attn); h = add_rms_norm(normed, x, pre_ffw)
 *   h = rms_norm(down(gelu_tanh(gate) * up)(h), post_ffw)
 * then out = add_rms_norm(h, x, final). The embeddings (already scaled by sqrt(hidden)) come in as x.
 *
 * layers: num_layers rows of GEMMA_FIELDS int64 (the enum below); groups: G rows of (slot_mapping int64
 * [M], block_tables int32 [M, max_blocks], max_blocks), one per KV cache group; seq_lens int32 [M], the
 * same for every group; kv_type: the caches' format (the KV_* enum in common.h). Returns 0; attention's
 * -1..-3 for an index outside the cache (before any K/V of that layer is written); -4 out of memory; -5
 * M < 1; -6 a matmul refused its shape; -7 a layer's group outside [0, G). */
#include "common.h"

enum { GEMMA_IN_NORM, GEMMA_POST_ATTN_NORM, GEMMA_PRE_FFW_NORM, GEMMA_POST_FFW_NORM, GEMMA_Q_NORM, GEMMA_K_NORM,
       GEMMA_KV, GEMMA_GROUP, GEMMA_WINDOW, GEMMA_LOCAL_ROPE, GEMMA_QKV, GEMMA_O = GEMMA_QKV + 3,
       GEMMA_GATE_UP = GEMMA_O + 3, GEMMA_DOWN = GEMMA_GATE_UP + 3, GEMMA_FIELDS = GEMMA_DOWN + 3 };

int izh_gemma_stack_fields(void) { return GEMMA_FIELDS; }

int izh_gemma_stack_f32(const int64_t *layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t H,
                        int64_t kvh, int64_t d, int64_t inter, float eps, float scale, float softcap, float *x,
                        const float *final_norm, float *out, const float *cos_sin_global,
                        const float *cos_sin_local, const int64_t *groups, int64_t num_groups,
                        const int32_t *seq_lens, int64_t num_blocks, int64_t block_size, int64_t kv_type, int nt) {
    if (M < 1) return -5;
    const int64_t qkv_w = (H + 2 * kvh) * d;
    const size_t elems = (size_t)M * (size_t)(2 * hidden + qkv_w + H * d + 3 * inter);
    float *buf = (float *)malloc(elems * sizeof(float));
    if (!buf) return -4;
    float *normed = buf, *h = normed + M * hidden, *qkv = h + M * hidden, *attn = qkv + M * qkv_w;
    float *gate_up = attn + M * H * d, *act = gate_up + M * 2 * inter;
    int rc = 0;
    for (int64_t l = 0; l < num_layers && rc == 0; l++) {
        const int64_t *lp = layers + l * GEMMA_FIELDS;
        const int64_t group = lp[GEMMA_GROUP];
        if (group < 0 || group >= num_groups) {
            rc = -7;
            break;
        }
        const int64_t *g = groups + 3 * group;
        const float *in_norm = (const float *)(intptr_t)lp[GEMMA_IN_NORM];
        if (l == 0)
            izh_rms_norm_f32(x, hidden, in_norm, normed, M, hidden, eps, nt);
        else
            izh_add_rms_norm_f32(h, x, in_norm, normed, M, hidden, eps, nt);
        if ((rc = izh_stack_linear_f32(lp + GEMMA_QKV, normed, M, qkv_w, hidden, qkv, nt))) break;
        if (lp[GEMMA_Q_NORM]) {
            izh_rms_norm_heads_f32(qkv, qkv_w, d, (const void *)(intptr_t)lp[GEMMA_Q_NORM], M, H, d, eps, nt);
            izh_rms_norm_heads_f32(qkv + H * d, qkv_w, d, (const void *)(intptr_t)lp[GEMMA_K_NORM], M, kvh, d,
                                   eps, nt);
        }
        izh_rotary_f32(qkv, qkv_w, d, lp[GEMMA_LOCAL_ROPE] ? cos_sin_local : cos_sin_global, M, H + kvh, d, nt);
        rc = izh_paged_decode_attention_f32(
            qkv, qkv_w, d, qkv + H * d, qkv_w, d, qkv + (H + kvh) * d, qkv_w, d, (void *)(intptr_t)lp[GEMMA_KV],
            (int)kv_type, num_blocks, block_size, kvh, (const int64_t *)(intptr_t)g[0],
            (const int32_t *)(intptr_t)g[1], g[2], seq_lens, lp[GEMMA_WINDOW], softcap, attn, M, H, d, scale, nt);
        if (rc) break;
        if ((rc = izh_stack_linear_f32(lp + GEMMA_O, attn, M, hidden, H * d, h, nt))) break;
        izh_rms_norm_f32(h, hidden, (const float *)(intptr_t)lp[GEMMA_POST_ATTN_NORM], normed, M, hidden, eps, nt);
        izh_add_rms_norm_f32(normed, x, (const float *)(intptr_t)lp[GEMMA_PRE_FFW_NORM], h, M, hidden, eps, nt);
        if ((rc = izh_stack_linear_f32(lp + GEMMA_GATE_UP, h, M, 2 * inter, hidden, gate_up, nt))) break;
        izh_gelu_tanh_mul_f32(gate_up, 2 * inter, act, M, inter, nt);
        if ((rc = izh_stack_linear_f32(lp + GEMMA_DOWN, act, M, hidden, inter, normed, nt))) break;
        izh_rms_norm_f32(normed, hidden, (const float *)(intptr_t)lp[GEMMA_POST_FFW_NORM], h, M, hidden, eps, nt);
    }
    if (rc == 0) izh_add_rms_norm_f32(h, x, final_norm, out, M, hidden, eps, nt);
    free(buf);
    return rc;
}
