"""EngineConfig: the frozen, resolved configuration the engine core needs (stdlib only)."""

from __future__ import annotations

from dataclasses import dataclass

SPEC_METHODS = ("ngram", "draft_model")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): how drafts are proposed, how many per step,
    and the load above which drafting pauses (izh.engine.spec_decode)."""

    method: str = "ngram"
    """ngram: prompt lookup over the prompt and the output so far; draft_model: a smaller model of the same
    tokenizer (`model`) decodes the drafts (izh.engine.draft_model)."""
    model: str | None = None
    """draft_model: the draft's GGUF file or Hugging Face folder (or a pulled registry name)."""
    draft_p_min: float = 0.0
    """draft_model: a request's drafting round stops at a draft the draft model gives less than this
    probability (llama.cpp's --draft-p-min); 0: always k drafts."""
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    """The shortest suffix of the known tokens an earlier occurrence must match (ngram)."""
    prompt_lookup_max: int = 5
    """The longest suffix tried first (ngram)."""
    disable_by_batch_size: int | None = 4
    """Drafting pauses while more requests than this run (a big batch needs the compute that verifying
    drafts takes); None: never."""


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything the engine core needs to start; made once by izh.settings and sent to the core."""

    model: str
    """A local GGUF file or Hugging Face folder (already resolved; never a bare model name)."""
    served_model_name: str = "model"
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16; auto is bfloat16 on CUDA, float32 on CPU."""
    quantization: str = "auto"
    """auto | none | int4 | int8: weight-only packed matmuls on CPU (every step in float32; with an explicit
    bfloat16 dtype, small steps only); auto packs what a GGUF stores quantized, int4 / int8 pack every linear."""
    device: str = "auto"
    """auto | cpu | cuda."""
    max_model_len: int | None = None
    """Context length; None takes the model's own."""
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    """KV cache size in bytes; None derives it from kv_cache_memory_fraction."""
    kv_cache_dtype: str = "auto"
    """auto | float32 | bfloat16 | float16 | fp8 | fp8_e4m3 | fp8_e5m2 | q8_0: the KV cache's element format
    (izh.kernels.kv_cache_dtype); auto is the model's dtype."""
    kv_cache_memory_fraction: float = 0.25
    """Fraction of free memory (device memory on GPU) given to the KV cache when no byte size is set
    (on CPU at most 4 GiB)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step; None: `default_batched_tokens(device)` (2048 on CUDA, 128 on CPU), and
    2048 for an encoder (EngineCore: it has no decodes whose gaps a long step would stretch)."""
    prefill_attention_budget: int | None = None
    """While other requests decode, the most (query token, context position) pairs the prefill chunks of
    one step attend to, so that a long prompt's chunks shrink as its context grows and the decoding
    streams' steps stay short (izh.engine.scheduler); 0: no limit. None: `default_prefill_attention_budget`
    (32,768 on CPU, 131,072 where attention runs in bfloat16 on vdpbf16ps, 196,608 on the AMX tiles, 0 on
    CUDA)."""
    max_num_seqs: int = 128
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    """fcfs | priority."""
    seed: int = 0
    num_threads: int | None = None
    """torch intra-op threads on CPU; None keeps torch's default."""
    enforce_eager: bool = False
    """Disable CUDA graphs."""
    attention_backend: str = "auto"
    """auto | torch_paged | triton_paged: auto takes Triton on CUDA (when installed), torch elsewhere."""
    cpu_kernels: str | None = None
    """auto | off | generic | avx2 | avx512 | amx | neon: izh's C kernels on CPU (izh.kernels.cpu); None
    takes the environment's (IZH_ENGINE__CPU_KERNELS / IZH_CPU_KERNELS, else auto)."""
    pooling: str = "auto"
    """auto | mean | cls | last: how embeddings pool the final hidden states; auto takes the model's
    (sentence-transformers' 1_Pooling/config.json, else cls for an encoder and last for a decoder)."""
    normalize_embeddings: bool | None = None
    """L2-normalize embeddings; None takes the model's (a sentence-transformers Normalize module, else
    True for a decoder, as vLLM does, and False for a bare encoder)."""
    lora_modules: tuple[tuple[str, str], ...] = ()
    """LoRA adapters to load at start: (name, local PEFT folder)."""
    enable_lora: bool = False
    """Give the model LoRA slots even without `lora_modules` (for adapters loaded at runtime); on
    whenever `lora_modules` is set."""
    max_loras: int = 4
    """LoRA adapters resident at once (slots); the running requests use at most this many."""
    max_lora_rank: int = 16
    """The largest adapter rank the slots take."""
    cache_dir: str | None = None
    """model.cache_dir: the C kernels are cached in <cache_dir>/kernels; None takes the environment's
    (IZH_MODEL__CACHE_DIR / IZH_CACHE_DIR, else ~/.cache/izh)."""
    tensor_parallel_size: int = 1
    """Ranks the model is split over (izh.model.parallel, izh.engine.tp_worker); 1 = no split."""
    dist_init_addr: str | None = None
    """host:port of rank 0's rendezvous store, for ranks on several hosts; None on one host (rank 0 picks
    a free loopback port and starts the other ranks itself)."""
    nnodes: int = 1
    """Hosts the ranks run on (tensor_parallel_size / nnodes ranks each)."""
    node_rank: int = 0
    """This host's index: 0 serves (scheduler, API); the others run their ranks as workers."""
    dist_timeout_s: float = 120.0
    """How long a collective (or the rendezvous) waits for a rank before failing."""
    dist_rank: int | None = None
    """Set under torchrun (RANK): this process is exactly that rank, starts no other, and joins through
    MASTER_ADDR / MASTER_PORT (env://); None: it is its node's first rank and starts the others."""
    dist_local_rank: int | None = None
    """LOCAL_RANK under torchrun: the CUDA device of this rank."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None: off."""

    def first_rank(self) -> int:
        """The global rank of this process: the torchrun RANK, else its node's first rank."""
        if self.dist_rank is not None:
            return self.dist_rank
        return self.node_rank * (self.tensor_parallel_size // max(self.nnodes, 1))

    @property
    def serves(self) -> bool:
        """Whether this process runs the scheduler (rank 0) rather than a tensor-parallel worker."""
        return self.tensor_parallel_size == 1 or self.first_rank() == 0


CUDA_BATCHED_TOKENS = 2048
CPU_BATCHED_TOKENS = 128
"""The CPU step budget: SmolLM2-135M prefills ~350 tokens/s on 2 AVX2 cores, so a 128-token chunk plus the
running decodes keeps a step (and so every stream's inter-token gap) well under a second, where 2048
tokens took ~6 s. Served with 8 streams of 1,000-token prompts, 256 gave an ITL p99 of 1.47 s and 128 of
0.71 s, with the same throughput and a shorter TTFT (bench_results/README.md)."""


def lora_enabled(config: EngineConfig) -> bool:
    """Whether the engine gives the model LoRA slots."""
    return config.enable_lora or bool(config.lora_modules)


def default_batched_tokens(device_type: str) -> int:
    """`max_num_batched_tokens` when it is unset, by the engine's device type ("cuda", "cpu")."""
    return CUDA_BATCHED_TOKENS if device_type == "cuda" else CPU_BATCHED_TOKENS


CPU_PREFILL_ATTENTION_BUDGET = 32768
"""About 40 ms of attention on two cores of an AVX-512 CPU for a 0.5B model (24 layers of 14 heads of 64,
~86 KFLOP a pair at ~75 GFLOP/s), about its decode step of 4 streams; for a 7B model (32 layers of 32 heads
of 128) ~230 ms, about its decode step. A step that carries a chunk then stays within ~2-3x a decode step
(bench_results/README.md, "Long prompts while streams decode")."""


CPU_TILES_PREFILL_ATTENTION_BUDGET = 196608
"""The same where attention runs on the AMX tiles (a bfloat16 cache in the amx variant), whose chunks also
count each token's own layers (izh.engine.scheduler.PREFILL_TOKEN_PAIRS): ~45 ms of a 0.5B model's chunk
work a step at ~400 GFLOP/s of attention, so that a step carrying a chunk stays within ~3x a 4-stream decode
step while a 32,000-token prompt's TTFT stays under half llama.cpp's (bench_results/README.md, "A
32,000-token prompt while 4 streams decode")."""


CPU_DPBF16_PREFILL_ATTENTION_BUDGET = 131072
"""The same where attention runs on AVX512-BF16's vdpbf16ps (a bfloat16 cache in the avx512 variant: AMD Zen
4/5, Intel CPUs without usable AMX), whose chunks count their tokens' own layers too (8,192 pairs a token):
~60-70 ms of a 0.5B model's chunk work a step on two Zen 4 cores (~250-290 GFLOP/s of attention, ~4 ms of
matmuls a token), about twice its 4-stream decode step (bench_results/README.md, "A 32,000-token prompt on
AVX512-BF16")."""

CPU_PREFILL_ATTENTION_BUDGETS = {
    "float32": CPU_PREFILL_ATTENTION_BUDGET,
    "dpbf16": CPU_DPBF16_PREFILL_ATTENTION_BUDGET,
    "tiles": CPU_TILES_PREFILL_ATTENTION_BUDGET,
}
"""By the kernel attention runs (`ModelRunner.attention_path`)."""


def default_prefill_attention_budget(device_type: str, attention_path: str = "float32") -> int:
    """`prefill_attention_budget` when it is unset: on CPU by the kernel attention runs
    (CPU_PREFILL_ATTENTION_BUDGETS: "float32", "dpbf16" or "tiles"), 0 (no limit) on CUDA, where attention is
    not what makes a step long."""
    if device_type == "cuda":
        return 0
    return CPU_PREFILL_ATTENTION_BUDGETS[attention_path]


def with_torchrun_env(config: EngineConfig, env: dict[str, str] | None) -> EngineConfig:
    """`config` for a process torchrun started (`env`: izh.settings.torchrun_env()): its rank, local rank,
    world size (the tensor-parallel size) and MASTER_ADDR:MASTER_PORT; unchanged when `env` is None.
    Raises ValueError when --tensor-parallel-size says otherwise than WORLD_SIZE."""
    if env is None:
        return config
    import dataclasses

    world = int(env["WORLD_SIZE"])
    if config.tensor_parallel_size not in (1, world):
        raise ValueError(
            f"tensor_parallel_size {config.tensor_parallel_size} differs from torchrun's WORLD_SIZE {world}"
        )
    return dataclasses.replace(
        config,
        tensor_parallel_size=world,
        dist_rank=int(env["RANK"]),
        dist_local_rank=int(env.get("LOCAL_RANK", "0")),
        dist_init_addr=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
    )
