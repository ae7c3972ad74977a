/* The fused decode stack (bfloat16, every linear in records).
 * See common.h for the conventions, izh/kernels/cpu/ops.py for the contract. */
#include "common.h"

/* A whole decode step through the decoder stack in one call, for up to 8 single-token decodes with
 * every linear in izh's records (bf16 activations, Llama-style layers: no per-head q/k norm). It makes
 * exactly the calls the Python modules make (izh.model.llama with the kernels above), in the same order
 * and with the same roundings, so its output is bit-identical to theirs; it only skips the Python between
 * them (about 80 us a layer on a 2-core CPU, as much as the layer's matmuls).
 *
 * layers: num_layers rows of STACK_FIELDS int64 (the enum in common.h).
 * x: [M, hidden] embeddings, used as the residual stream (overwritten); out: [M, hidden] final-normed.
 * lora: NULL, or the LoRA table (STACK_LORA_* in common.h) with row_slots int32 [M] (-1: the base model),
 * slot_ranks int32 [slots] and lora_rank the slots' rank R: each matmul is then followed by its adapter
 * rows' deltas (lora.c), as the module path's hooks add them.
 * Returns 0; attention's -1..-3 for an index outside the cache (found in layer 0, before any K/V is
 * written); -4 out of memory; -5 M outside 1..izh_qgemm_max_rows(); -6 a matmul refused its shape. */
#if HAVE_QGEMM
static int stack_linear(const int64_t *lin, const uint16_t *x, int64_t M, int64_t N, int64_t K, uint16_t *out,
                        int nt) {
    const uint8_t *rec = (const uint8_t *)(intptr_t)lin[0];
    int rc = lin[1] == 4 ? izh_q4_gemm(x, K, rec, M, N, K, out, N, 0, nt) : izh_q8_gemm(x, K, rec, M, N, K, out, N, 0, nt);
    if (rc == -1) return -6; /* a shape the matmul refused: not attention's -1 (a slot past the cache) */
    const uint16_t *bias = (const uint16_t *)(intptr_t)lin[2];
    if (rc == 0 && bias)
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < N; j++) out[m * N + j] = f2bf(bf2f(out[m * N + j]) + bf2f(bias[j]));
    return rc;
}

int izh_decode_stack_bf16(const int64_t *layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t H,
                          int64_t kvh, int64_t d, int64_t inter, float eps, float scale, uint16_t *x,
                          const uint16_t *final_norm, uint16_t *out, const uint16_t *cos_sin,
                          const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,
                          const int32_t *seq_lens, int64_t num_blocks, int64_t block_size, int64_t kv_type,
                          const int64_t *lora, int64_t lora_rank, const int32_t *row_slots,
                          const int32_t *slot_ranks, int nt) {
    if (M < 1 || M > izh_qgemm_max_rows()) return -5;
    IZH_DECODE_STACK_BODY(uint16_t, bf16, stack_linear)
}
#else
int izh_decode_stack_bf16(const int64_t *layers, int64_t num_layers, int64_t M, int64_t hidden, int64_t H,
                          int64_t kvh, int64_t d, int64_t inter, float eps, float scale, uint16_t *x,
                          const uint16_t *final_norm, uint16_t *out, const uint16_t *cos_sin,
                          const int64_t *slot_mapping, const int32_t *block_tables, int64_t max_blocks,
                          const int32_t *seq_lens, int64_t num_blocks, int64_t block_size, int64_t kv_type,
                          const int64_t *lora, int64_t lora_rank, const int32_t *row_slots,
                          const int32_t *slot_ranks, int nt) {
    (void)layers, (void)num_layers, (void)M, (void)hidden, (void)H, (void)kvh, (void)d, (void)inter, (void)eps;
    (void)scale, (void)x, (void)final_norm, (void)out, (void)cos_sin, (void)slot_mapping, (void)block_tables;
    (void)max_blocks, (void)seq_lens, (void)num_blocks, (void)block_size, (void)kv_type, (void)lora, (void)lora_rank;
    (void)row_slots, (void)slot_ranks, (void)nt;
    return -2;
}
#endif
