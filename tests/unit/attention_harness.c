/* Test harness for izh's paged attention (izh/kernels/cpu/csrc/attention.c): the same deterministic cache
 * history on every machine, each kernel call's output and the whole KV cache after it printed as hashes of
 * their bytes, so the builds for different instruction sets (portable C, AVX2, AVX-512, NEON under qemu)
 * can be compared byte for byte. Built with attention.c (or every csrc .c file) by
 * tests/unit/test_attention_neon.py.
 *
 *   attention_harness       one line per (act, kv, d, nt, step):
 *                           "act=f32 kv=q8_0 d=64 nt=2 step=decode out=<16 hex> cache=<16 hex>"
 *   attention_harness full  the same, the step's output floats (act=bf16: widened) in hex after it
 *
 * Per activation dtype (float32, bf16), kv type (every KV_* of common.h), head size (64, 128) and OpenMP team
 * (1, 2) one scenario on a fresh zeroed cache: 4 query heads over 2 KV heads (GQA), blocks of 16 positions
 * placed out of order in the cache, three sequences, five calls:
 *   prefill1  a mixed chunk: sequence 1's tokens 0..15, sequence 2's tokens 0..47 and one padding row
 *             (slot -1, length 0: its output is zeros)
 *   prefill2  sequence 2's tokens 48..98 appended to its 48 cached ones (a chunked prefill; enough work for
 *             the kernel to use a team of two for nt = 2)
 *   decode    one new token per sequence, lengths 1, 17, 100 (izh_paged_decode_attention_*)
 *   window    sequences 1 and 2 under a sliding window of 32 (sequence 2's first block-table entry -1: it
 *             lies before the window and must not be read)
 *   softcap   sequences 0 and 2 with scores soft-capped at 3
 * The inputs of a scenario depend on (act, kv, d) only, so nt = 1 and 2 must print the same hashes. q, k and
 * v are read from one fused row per token (with padding), as the model's qkv projection lays them out. The
 * output buffer's tail past n * H * d is filled with sentinels; a write there is reported as a CLOBBERED
 * line. The first line says how many threads an OpenMP team asked for 2 gets here. */
#include <inttypes.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h" /* rng, uniform, fnv1a */

#include "common.h" /* the prototypes of izh_paged_attention_* and the KV_* codes */

#define H 4          /* query heads */
#define KVH 2        /* KV heads */
#define BS 16        /* positions per block */
#define NUM_BLOCKS 20
#define MAX_BLOCKS 8 /* block-table columns: 128 positions per sequence */
#define NUM_SEQS 3
#define TAIL 64      /* output elements past n * H * d that must stay untouched */

static const char *const KV_NAMES[] = {"f32", "bf16", "f16", "e4m3", "e5m2", "q8_0"};

static void put(void *p, int64_t i, float f, int bf) {
    if (bf) { /* truncation: any bf16 will do */
        uint32_t u;
        memcpy(&u, &f, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = f;
    }
}

static uint32_t out_bits(const void *p, int64_t i, int bf) {
    uint32_t u;
    if (bf) return (uint32_t)((const uint16_t *)p)[i] << 16;
    memcpy(&u, (const float *)p + i, 4);
    return u;
}

/* Block tables: sequence s's block b is table[s][b]; the blocks are handed out in a shuffled order
 * (the same for every scenario), entries a sequence never reaches are -1. */
static int32_t table[NUM_SEQS][MAX_BLOCKS];
static const int seq_blocks[NUM_SEQS] = {1, 2, 7}; /* up to 16, 32 and 112 positions */

static void make_tables(void) {
    int32_t perm[NUM_BLOCKS];
    for (int b = 0; b < NUM_BLOCKS; b++) perm[b] = b;
    for (int b = NUM_BLOCKS - 1; b > 0; b--) { /* Fisher-Yates */
        const int j = (int)(rng() % (uint64_t)(b + 1));
        const int32_t t = perm[b];
        perm[b] = perm[j];
        perm[j] = t;
    }
    int next = 0;
    for (int s = 0; s < NUM_SEQS; s++)
        for (int b = 0; b < MAX_BLOCKS; b++) table[s][b] = b < seq_blocks[s] ? perm[next++] : -1;
}

static int64_t slot_of(int s, int64_t pos) { return (int64_t)table[s][pos / BS] * BS + pos % BS; }

/* One token's fused q|k|v row (d per head, 8 elements of padding): per (token, head) a scale from 0.05 to
 * 6.4, some heads all zero (q8_0's d = 0), some value heads beyond float8 e4m3's range (clamped). */
static void fill_qkv(void *qkv, int64_t row, int64_t ts, int d, int bf) {
    for (int h = 0; h < H + 2 * KVH; h++) {
        const int kind = (int)(rng() % 16);
        float scale = (float)(1u << (rng() % 8)) * 0.05f;
        if (kind == 0) scale = 0.0f;
        if (kind == 1 && h >= H + KVH) scale = 600.0f;
        for (int j = 0; j < d; j++) put(qkv, row * ts + (int64_t)h * d + j, uniform(-1.0f, 1.0f) * scale, bf);
    }
    for (int j = (H + 2 * KVH) * d; j < ts; j++) put(qkv, row * ts + j, 1e30f, bf); /* padding: never read */
}

struct step {
    const char *name;
    int n;
    int seq[72], pos[72]; /* per row: its sequence and position (pos < 0: a padding row, slot -1, length 0) */
    int64_t window;
    float softcap;
    int decode;      /* izh_paged_decode_attention_* (row i is sequence i) */
    int drop_first;  /* sequence 2's first block-table entry set to -1 */
};

static int n_steps;
static struct step steps[5];

static void make_steps(void) {
    struct step *s = &steps[n_steps++];
    s->name = "prefill1";
    for (int p = 0; p < 16; p++) s->seq[s->n] = 1, s->pos[s->n++] = p;
    s->seq[s->n] = 0, s->pos[s->n++] = -1;
    for (int p = 0; p < 48; p++) s->seq[s->n] = 2, s->pos[s->n++] = p;

    s = &steps[n_steps++];
    s->name = "prefill2";
    for (int p = 48; p < 99; p++) s->seq[s->n] = 2, s->pos[s->n++] = p;

    s = &steps[n_steps++];
    s->name = "decode";
    s->decode = 1;
    s->seq[s->n] = 0, s->pos[s->n++] = 0;
    s->seq[s->n] = 1, s->pos[s->n++] = 16;
    s->seq[s->n] = 2, s->pos[s->n++] = 99;

    s = &steps[n_steps++];
    s->name = "window";
    s->window = 32;
    s->drop_first = 1;
    s->seq[s->n] = 1, s->pos[s->n++] = 17;
    s->seq[s->n] = 2, s->pos[s->n++] = 100;

    s = &steps[n_steps++];
    s->name = "softcap";
    s->softcap = 3.0f;
    s->seq[s->n] = 0, s->pos[s->n++] = 1;
    s->seq[s->n] = 2, s->pos[s->n++] = 101;
}

static int scenario(int bf, int kt, int d, int nt, int full) {
    rng_state = 0x5EED0000ull + (uint64_t)(bf * 1000 + kt * 10) + (uint64_t)d * 100000;
    const int64_t rb = kv_row_bytes(kt, d);
    const size_t cache_bytes = (size_t)2 * NUM_BLOCKS * BS * KVH * rb, es = bf ? 2 : 4;
    const int64_t ts = (H + 2 * KVH) * d + 8;
    const float scale = d == 64 ? 0.125f : 0.088388347648318f; /* 1 / sqrt(d) */
    uint8_t *cache = calloc(cache_bytes, 1);
    void *qkv = malloc(es * 72 * (size_t)ts);
    void *out = malloc(es * ((size_t)72 * H * d + TAIL));
    int bad = 0;
    for (int si = 0; si < n_steps; si++) {
        const struct step *s = &steps[si];
        int64_t slots[72];
        int32_t lens[72], rows[72], tables[NUM_SEQS][MAX_BLOCKS], dec_tables[3][MAX_BLOCKS];
        memcpy(tables, table, sizeof tables);
        if (s->drop_first) tables[2][0] = -1;
        for (int r = 0; r < s->n; r++) {
            fill_qkv(qkv, r, ts, d, bf);
            rows[r] = s->seq[r];
            slots[r] = s->pos[r] < 0 ? -1 : slot_of(s->seq[r], s->pos[r]);
            lens[r] = s->pos[r] < 0 ? 0 : s->pos[r] + 1;
            if (s->decode) memcpy(dec_tables[r], tables[s->seq[r]], sizeof dec_tables[r]);
        }
        const int64_t total = (int64_t)s->n * H * d;
        memset(out, 0x7F, es * (size_t)(total + TAIL));
        const char *q = qkv, *k = (const char *)qkv + es * H * d, *v = (const char *)qkv + es * (H + KVH) * d;
        int rc;
        if (s->decode)
            rc = (bf ? izh_paged_decode_attention_bf16 : izh_paged_decode_attention_f32)(
                q, ts, d, k, ts, d, v, ts, d, cache, kt, NUM_BLOCKS, BS, KVH, slots, &dec_tables[0][0],
                MAX_BLOCKS, lens, s->window, s->softcap, out, s->n, H, d, scale, nt);
        else
            rc = (bf ? izh_paged_attention_bf16 : izh_paged_attention_f32)(
                q, ts, d, k, ts, d, v, ts, d, cache, kt, NUM_BLOCKS, BS, KVH, slots, &tables[0][0], MAX_BLOCKS,
                rows, NUM_SEQS, lens, s->window, s->softcap, out, s->n, H, d, scale, nt);
        printf("act=%s kv=%s d=%d nt=%d step=%s", bf ? "bf16" : "f32", KV_NAMES[kt], d, nt, s->name);
        if (rc) {
            printf(" rc=%d\n", rc);
            bad = 1;
            break;
        }
        for (int64_t i = total; i < total + TAIL; i++)
            if (out_bits(out, i, bf) != (bf ? 0x7F7F0000u : 0x7F7F7F7Fu)) {
                printf(" CLOBBERED out[%" PRId64 "]", i);
                bad = 1;
                break;
            }
        for (int r = 0; r < s->n; r++) /* the padding row (length 0) attends to nothing: zeros */
            for (int64_t j = 0; lens[r] == 0 && j < (int64_t)H * d; j++)
                if (out_bits(out, (int64_t)r * H * d + j, bf) != 0) {
                    printf(" NONZERO row %d", r);
                    bad = 1;
                    break;
                }
        printf(" out=%016" PRIx64 " cache=%016" PRIx64, fnv1a(out, es * (size_t)total), fnv1a(cache, cache_bytes));
        if (full)
            for (int64_t i = 0; i < total; i++) printf(" %08" PRIx32, out_bits(out, i, bf));
        printf("\n");
    }
    free(out);
    free(qkv);
    free(cache);
    return bad;
}

int main(int argc, char **argv) {
    const int full = argc > 1 && strcmp(argv[1], "full") == 0;
    int bad = 0, team = 0;
#pragma omp parallel num_threads(2)
    {
#pragma omp single
        team = omp_get_num_threads();
    }
    printf("team %d\n", team);
    rng_state = 0xA77E4710ull;
    make_tables();
    make_steps();
    static const int ds[] = {64, 128};
    for (int bf = 0; bf < 2; bf++)
        for (int kt = KV_F32; kt <= KV_Q8_0; kt++)
            for (int di = 0; di < 2; di++)
                for (int nt = 1; nt <= 2; nt++) bad |= scenario(bf, kt, ds[di], nt, full);
    printf("done\n");
    return bad;
}
