"""ModelRunner: owns the model, the KV cache tensors and the sampler; runs one scheduled step."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from izh.config import CUDA_BATCHED_TOKENS, EngineConfig, default_batched_tokens, lora_enabled
from izh.engine.guided import GrammarManager, apply_bitmask
from izh.engine.kv_cache import blocks_per_request
from izh.engine.lora_manager import LoraManager
from izh.engine.sampler import (
    Sampler,
    SamplingMetadata,
    SamplingRow,
    make_generator,
    to_device,
    token_logprobs,
)
from izh.engine.scheduler import ScheduledRequest, SchedulerOutput
from izh.engine.spec_decode import verify_greedy, verify_random
from izh.engine_messages import ImageInput, TokenLogprobs
from izh.errors import ModelLoadError, ModelSettingsError
from izh.kernels import cpu as cpu_ops
from izh.kernels.kv_cache_dtype import KVCacheFormat, kv_cache_format
from izh.model.attention import AttentionMetadata, get_attention_backend
from izh.model.bert import BertModel
from izh.model.config import ModelConfig
from izh.model.cross_encoder import CrossEncoderModel, pair_token_types, resolve_score_activation, score_rows
from izh.model.idefics3 import Idefics3ForConditionalGeneration
from izh.model.layers import limit_rope_positions
from izh.model.llama import LlamaForCausalLM
from izh.model.loader import checkpoint_quant_types, load_model, load_model_config
from izh.model.packed import RECORDS_ANY_ROWS
from izh.model.packing import pack_model_weights, resolve_quantization
from izh.model.parallel import check_tensor_parallel
from izh.model.parallel import compute_logits as parallel_logits
from izh.model.pooling import PoolingConfig, pool, resolve_pooling
from izh.model.sliding_window import KVCacheLayout
from izh.pooling_params import PoolingParams
from izh.sampling_params import SamplingParams

if TYPE_CHECKING:
    from izh.engine.cuda_graphs import DecodeGraphRunner
    from izh.engine.tensor_parallel import TensorParallelRuntime

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30
"""The most a CPU KV cache takes when only kv_cache_memory_fraction is set."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelSettingsError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on a CPU. A CPU model packed in izh's records (a quantized GGUF)
    runs float32 activations with int8 ones inside the matmuls (izh.kernels.cpu, records_f32.c) on every
    kernel variant, prefills and decodes alike: exact integer dot products and one fixed float epilogue,
    so a request's logits do not depend on the batch (docs/operations.md, "Batch invariance")."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelSettingsError(f"unknown dtype {name!r}; supported: auto, {', '.join(_DTYPES)}") from None


def available_memory_bytes(device: torch.device) -> int:
    """Free memory the KV cache may take a fraction of: device memory on GPU, MemAvailable on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def cpu_kernels_for(device: torch.device, requested: str | None) -> str | None:
    """The `engine.cpu_kernels` setting to configure: as requested on a CPU; on CUDA "off" unless a variant
    is named, since the model's tensors never reach them there and the first forward would otherwise build
    the C library with gcc for nothing."""
    if device.type != "cpu" and (requested is None or requested.strip().lower() == "auto"):
        return "off"
    return requested


@dataclass(slots=True)
class RunnerOutput:
    """Per-request results of one step, keyed by request id (only requests that sampled)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    """The sampled tokens' logprobs (one per token), for requests that ask."""
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    embeddings: dict[str, bytes] = field(default_factory=dict)
    """Pooling requests' vectors (float32 bytes), for those whose prompt this step completed."""
    forward_s: float = 0.0
    """Time spent in the model forward and logits (for the benchmark's step split): wall time on a CPU,
    the GPU's time between two CUDA events on CUDA (the host only enqueues the kernels there)."""


class ModelRunner:
    """Flattens a SchedulerOutput into one batch, runs the model once and samples the rows that finish."""

    def __init__(
        self,
        config: EngineConfig,
        progress: Callable[[int, int, str], None] | None = None,
        *,
        tp_runtime: TensorParallelRuntime | None = None,
        extra_kv_bytes_per_block: int = 0,
        num_blocks: int | None = None,
    ) -> None:
        """With tensor_parallel_size > 1, rank 0 (no `tp_runtime`) starts the group and the other local
        ranks (izh.engine.tensor_parallel); a worker rank passes the runtime it joined with.

        Speculative decoding's draft model (izh.engine.draft_model) shares the target's block tables: the
        target's runner counts `extra_kv_bytes_per_block` (the draft's) into each block of its budget, and
        the draft's runner takes the target's `num_blocks` as they are."""
        self.config = config
        self._extra_kv_bytes_per_block = extra_kv_bytes_per_block
        self._forced_num_blocks = num_blocks
        self.device = resolve_device(config.device)
        self.tp_runtime = tp_runtime
        if config.tensor_parallel_size > 1 and tp_runtime is None:
            if not config.serves:
                raise ModelLoadError("only tensor-parallel rank 0 runs the engine; run the others as workers")
            from izh.engine.tensor_parallel import start

            # A model that cannot split N ways fails here, before any other rank is started.
            check_tensor_parallel(load_model_config(config.model), config.tensor_parallel_size)
            self.tp_runtime = start(config, self.device.type)
        try:
            self._set_up(config, progress)
        except BaseException:
            if self.tp_runtime is not None and tp_runtime is None:
                self.tp_runtime.abort()  # the ranks it started must not wait for it
            raise
        if self.tp_runtime is not None and self.tp_runtime.rank == 0:
            self.tp_runtime.start_heartbeat()

    def _set_up(self, config: EngineConfig, progress: Callable[[int, int, str], None] | None) -> None:
        if self.tp_runtime is not None and self.device.type == "cuda":
            self.device = torch.device("cuda", self.tp_runtime.local_rank)
        tp = self.tp_runtime.tp if self.tp_runtime is not None else None
        # Which C kernel variant runs, and where it is cached; a forced variant this CPU lacks fails here.
        cpu_ops.configure(cpu_kernels_for(self.device, config.cpu_kernels), config.cache_dir)
        source_types = checkpoint_quant_types(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.quantization = resolve_quantization(
            config.quantization, device=self.device, dtype=self.dtype, source_types=source_types
        )
        if self.device.type == "cpu" and (config.num_threads or tp is not None):
            torch.set_num_threads(self._cpu_threads(config))
        start = time.perf_counter()
        model, self.model_config = load_model(
            config.model,
            dtype=self.dtype,
            device=self.device,
            progress=progress,
            tp=tp,
            gguf_blocks=config.quantization == "auto" and self.quantization != "none",
        )
        # Every registered architecture but the encoders is a LlamaForCausalLM (see izh.model.registry);
        # an encoder (BERT) only runs forward, in the pooling path.
        self.model = cast(LlamaForCausalLM, model)
        self.model.eval()
        self.is_encoder = self.model_config.is_encoder
        """An encoder only pools: no KV cache tensors, no logits, no sampling."""
        self.score_activation: str | None = None
        """A cross-encoder's (izh.model.cross_encoder): the activation over its logit; its pooling
        requests score pairs (task "score"), and it embeds nothing."""
        if self.model_config.num_labels:
            self.score_activation = resolve_score_activation(config.model, self.model_config.num_labels)
            self.pooling = PoolingConfig(
                "cls", normalize=False, matryoshka_dimensions=None, max_seq_length=None
            )
        else:
            self.pooling = resolve_pooling(
                config.model,
                is_encoder=self.is_encoder,
                pooling=config.pooling,
                normalize=config.normalize_embeddings,
            )
        pack_model_weights(self.model, self.quantization, source_types, requested=config.quantization)
        logger.info("model loaded in %.2f s (%s, %s)", time.perf_counter() - start, self.device, self.dtype)
        if self.device.type == "cpu":
            # Build (or load the cached) fused CPU kernels now, not inside the first request.
            logger.info("fused CPU kernels: %s", "on" if cpu_ops.available() else "off (torch fallbacks)")
        self.max_model_len = self._resolve_max_model_len(config, self.model_config, self.pooling)
        limit_rope_positions(self.model, self.max_model_len)
        self.block_size = config.block_size
        self.vocab_size = self.model_config.vocab_size
        self.max_num_batched_tokens = config.max_num_batched_tokens or (
            # An encoder has no decode streams whose inter-token gap a long step would stretch: its
            # default budget is the throughput one (32 inputs of 64 tokens in one forward).
            CUDA_BATCHED_TOKENS if self.is_encoder else default_batched_tokens(self.device.type)
        )
        self.kv_layout = self._resolve_kv_layout()
        """The KV cache groups (izh.model.sliding_window): sliding-window layers in their own groups,
        whose blocks the KV cache manager frees once the window has passed them."""
        self.attention_backend = self._resolve_attention_backend(config.attention_backend)
        self.kv_format = self._resolve_kv_format(config.kv_cache_dtype)
        """The KV cache's element format (`engine.kv_cache_dtype`; auto: the model's dtype)."""
        self.num_blocks = self._resolve_num_blocks()
        if not self.is_encoder:
            logger.info(
                "KV cache: %s (%s), %d bytes per token, %d tokens per GiB, %d blocks of %d tokens",
                self.kv_format.name,
                f"engine.kv_cache_dtype = {config.kv_cache_dtype}",
                self.kv_bytes_per_token(),
                self.kv_tokens_per_gib(),
                self.num_blocks,
                self.block_size,
            )
        if self.kv_layout.windows != (None,):
            windows = self.kv_layout.windows
            logger.info(
                "KV cache: %d group(s) of %d layer(s), %d full attention, %d sliding (window %s): the "
                "sliding groups free the blocks their window has passed",
                len(windows),
                self.kv_layout.num_tensors,
                windows.count(None),
                len(windows) - windows.count(None),
                ", ".join(sorted({str(w) for w in windows if w is not None})),
            )
        if self.tp_runtime is not None:
            mc = self.model_config
            shape = [
                mc.num_hidden_layers,
                mc.hidden_size,
                mc.vocab_size,
                mc.num_attention_heads,
                self.block_size,
            ]
            self.tp_runtime.agree(shape, "the model (layers, hidden size, vocabulary, heads) or block size")
            self.num_blocks = self.tp_runtime.minimum(self.num_blocks)  # every rank holds as many blocks
        if self.is_encoder:
            # The scheduler's block accounting still runs (one budget for every request), over blocks
            # that hold no tensors: an encoder attends within its step and keeps nothing.
            self.kv_caches: list[torch.Tensor] = []
        else:
            self.kv_caches = self._allocate_kv_caches()
            self.model.bind_kv_caches(self.kv_caches)
            self.model.paged_backend = get_attention_backend(self.attention_backend)
        # The fused C decode stack runs every layer inside one C call, with no all-reduce between: under
        # tensor parallelism each layer runs as modules (packed records per shard still apply).
        if not self.is_encoder and self.tp_runtime is None and self.model.prepare_fused_decode():
            rows = self.model.decode_stack_rows()
            assert rows is not None
            limit = "any number of" if rows >= RECORDS_ANY_ROWS else f"<= {rows}"
            logger.info("decode steps of %s tokens run the fused C decoder stack", limit)
        self.lora: LoraManager | None = None
        """The LoRA adapters (when the config enables LoRA): attached before the CUDA graphs are captured,
        which then run base-only steps (a step with adapter tokens runs eagerly)."""
        if lora_enabled(config):
            if self.is_encoder:
                raise ModelSettingsError("LoRA adapters are served on decoder (generative) models only")
            if self.model_config.vision is not None:
                raise ModelSettingsError(
                    "LoRA adapters are served on text-only decoders; this vision-language model takes none "
                    "(serve it without --lora-modules / engine.enable_lora)"
                )
            if self.tp_runtime is not None:
                raise ModelSettingsError(
                    "LoRA adapters are not split across tensor-parallel ranks: serve adapters with "
                    "--tensor-parallel-size 1"
                )
            lora_model = self.model.attach_lora(config.max_loras, config.max_lora_rank)
            self.lora = LoraManager(lora_model, self.model_config)
        self.graph_runner = self._make_graph_runner()
        # Unseeded sampling draws from the engine's own generator, seeded by the engine seed setting.
        self.sampler = Sampler(make_generator(config.seed, self.device))
        self._generators: dict[str, torch.Generator] = {}
        self._logits: torch.Tensor | None = None
        self.image_token_id = (
            self.model_config.image_token_id if self.model_config.vision is not None else None
        )
        """A VLM's `<image>` placeholder id; None for a text-only model."""
        self._image_features: dict[str, dict[int, torch.Tensor]] = {}
        """Request id -> image index -> its encoder output, kept from the chunk that first needs it until
        the chunk that computes its last placeholder (chunked prefill may split an image's range)."""
        # Start and end of the forward on the GPU's stream: forward_s without a host sync of its own (the
        # sampler's read of the tokens has already waited for the end event).
        self._forward_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self.device.type == "cuda":
            self._forward_events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )
        if self.device.type == "cpu" and not self.is_encoder and self.tp_runtime is None:
            self._warm_up()

    # --- set-up ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One prefill chunk and two decode steps of a dummy sequence in the KV cache's first blocks (then
        zeroed again), with their logits into the step buffer: the first requests then find the buffers
        the steps keep (the logits buffer's first row, the kernels' per-thread activation buffers, the allocator's
        arenas) already grown and faulted in, the OpenMP team started, and every code path of a step run
        once, instead of paying for it inside the first responses."""
        tokens = min(64, self.max_model_len - 2, self.num_blocks * self.block_size - 2)
        if tokens < 1:
            return
        blocks = list(range(-(-(tokens + 2) // self.block_size)))
        dev = self.device
        logits = self._logits_buffer(1)
        if logits is not None:
            logits.zero_()  # fault in the reused buffer's pages now (it grows with the batch later)
        token_id = min(1, self.vocab_size - 1)
        for start, count in ((0, tokens), (tokens, 1), (tokens + 1, 1)):
            meta = AttentionMetadata.from_block_tables(
                [count], [start + count], [blocks], self.block_size, dev
            )
            ids = torch.full((count,), token_id, dtype=torch.long, device=dev)
            positions = torch.arange(start, start + count, dtype=torch.long, device=dev)
            hidden = self.model(ids, positions, meta)
            self.model.compute_logits(hidden[-1:], out=logits)
        index = torch.tensor(blocks, dtype=torch.long, device=dev)
        for cache in {id(cache): cache for cache in self.kv_caches}.values():  # a shared one once
            cache.view(torch.uint8).index_fill_(1, index, 0)  # zero bits are 0.0 in every format

    @staticmethod
    def _cpu_threads(config: EngineConfig) -> int:
        """num_threads, shared out between the tensor-parallel ranks of one host: ranks that together
        ask for more threads than the cores spin against each other (OpenMP waits busily)."""
        threads = config.num_threads or os.cpu_count() or 1
        if config.tensor_parallel_size == 1:
            return threads
        per_node = config.tensor_parallel_size // max(config.nnodes, 1)
        cores = os.cpu_count() or 1
        return max(1, min(threads, cores // per_node))

    @staticmethod
    def _resolve_max_model_len(
        config: EngineConfig, model_config: ModelConfig, pooling: PoolingConfig
    ) -> int:
        """--max-model-len, else the model's context: its max positions, or a sentence-transformers
        folder's max_seq_length where that is shorter (its inputs are refused past it, not truncated)."""
        model_len = model_config.max_position_embeddings
        if config.max_model_len is None:
            if pooling.max_seq_length is not None:
                return min(model_len, pooling.max_seq_length)
            return model_len
        if config.max_model_len > model_len:
            raise ModelSettingsError(
                f"max_model_len {config.max_model_len} is longer than the model's context "
                f"({model_len} tokens); lower --max-model-len"
            )
        return config.max_model_len

    def _resolve_attention_backend(self, name: str) -> str:
        if name != "auto":
            return name
        if self.device.type == "cuda":
            from izh.kernels import is_available

            if is_available():
                return "triton_paged"
            logger.warning("triton is not installed: attention runs in plain torch (pip install 'izh[gpu]')")
        return "torch_paged"

    def _uses_cuda_graphs(self) -> bool:
        """CUDA graphs for decode batches: on CUDA with the (graph-safe) Triton backend, unless eager."""
        return (
            self.device.type == "cuda"
            and self.tp_runtime is None
            and not self.is_encoder
            and not self.config.enforce_eager
            and self._resolve_attention_backend(self.config.attention_backend) == "triton_paged"
        )

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        if not self._uses_cuda_graphs():
            return None
        from izh.engine.cuda_graphs import DecodeGraphRunner

        runner = DecodeGraphRunner(
            self.model,
            max_num_seqs=self.config.max_num_seqs,
            max_blocks_per_seq=-(-self.max_model_len // self.block_size),
            block_size=self.block_size,
            device=self.device,
        )
        runner.capture()
        return runner

    @property
    def max_decode_rows(self) -> int | None:
        """The most single-token rows a decode step runs through the fused C decode stack (None: no
        stack). Speculative verification stays within it: past it the step runs through the modules,
        whose bfloat16 matmuls over more than a few rows are not the decode's (another row order)."""
        return None if self.is_encoder else self.model.decode_stack_rows()

    @property
    def attention_path(self) -> str:
        """Which kernel this model's attention over its cache runs: "tiles" (AMX-BF16) or "dpbf16"
        (AVX512-BF16's vdpbf16ps) for a bfloat16 cache under float32 activations where the variant has
        them (`cpu_ops.bf16_cache_path`), about 3x and 2.7x the float32 path's prefill attention; else
        "float32" (every other cache, dtype or device). The scheduler's default prefill attention budget
        follows it."""
        mc = self.model_config
        if not (
            self.device.type == "cpu"
            and not self.is_encoder
            and self.dtype == torch.float32
            and self.kv_format.storage == torch.bfloat16
            and cpu_ops.available()
        ):
            return "float32"
        return cpu_ops.bf16_cache_path(mc.head_dim, mc.num_attention_heads // mc.num_key_value_heads)

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads this rank's cache holds (all of them without tensor parallelism)."""
        world = self.tp_runtime.tp.world_size if self.tp_runtime is not None else 1
        return self.model_config.num_key_value_heads // world

    def _resolve_kv_layout(self) -> KVCacheLayout:
        """The model's KV cache groups; one group of full attention for an encoder, under tensor
        parallelism (the step plan carries one block table) and on CUDA graphs (captured with one)."""
        num_layers = self.model_config.num_hidden_layers
        if self.is_encoder or self.tp_runtime is not None:
            return KVCacheLayout.single(num_layers)
        layout = self.model.kv_cache_layout()
        if layout.windows != (None,) and self._uses_cuda_graphs():
            logger.info(
                "sliding-window blocks are kept (not freed) with CUDA graphs; --enforce-eager frees them"
            )
            return KVCacheLayout.single(num_layers)
        return layout

    @property
    def kv_group_windows(self) -> tuple[int | None, ...]:
        """Per KV cache group, its sliding window (None: full attention), for the KV cache manager."""
        return self.kv_layout.windows

    def _resolve_kv_format(self, name: str) -> KVCacheFormat:
        """`engine.kv_cache_dtype` as a format this device and model run; ModelSettingsError names the choices."""
        try:
            fmt = kv_cache_format(name, self.dtype)
        except ValueError as exc:
            raise ModelSettingsError(f"engine.kv_cache_dtype: {exc}") from None
        problem = None if self.is_encoder else fmt.check_head_dim(self.model_config.head_dim)
        if problem is not None:
            raise ModelSettingsError(f"engine.kv_cache_dtype = {name}: {problem}; choose another format")
        if (
            self.device.type == "cuda"
            and self.attention_backend == "triton_paged"
            and fmt.storage != self.dtype
        ):
            raise ModelSettingsError(
                f"engine.kv_cache_dtype = {name}: izh's Triton attention on CUDA reads the model's dtype only; "
                "use --kv-cache-dtype auto (or --attention-backend torch_paged, which converts in torch)"
            )
        return fmt

    def kv_bytes_per_token(self) -> int:
        """Bytes one token of context takes in this rank's KV cache when every layer keeps it: 2 (K, V) x
        layers x KV heads x a row's bytes (head_dim x the format's bytes per element; q8_0: 34 per 32)."""
        mc = self.model_config
        return self.kv_format.bytes_per_token(mc.num_hidden_layers, self.num_local_kv_heads, mc.head_dim)

    def kv_tokens_per_gib(self) -> int:
        """Tokens of context a GiB of KV cache holds (`kv_bytes_per_token`; a sliding-window layer keeps
        fewer)."""
        return (1 << 30) // self.kv_bytes_per_token()

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block: block_size tokens of K and V in each of the layout's cache tensors."""
        per_token = self.kv_format.bytes_per_token(
            self.kv_layout.num_tensors, self.num_local_kv_heads, self.model_config.head_dim
        )
        return self.block_size * per_token

    def _resolve_num_blocks(self) -> int:
        if self._forced_num_blocks is not None:
            return self._forced_num_blocks
        per_block = self.kv_bytes_per_block() + self._extra_kv_bytes_per_block
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = int(available_memory_bytes(self.device) * self.config.kv_cache_memory_fraction)
            if self.device.type == "cpu":
                # CPU RAM is shared with everything else on the host (vLLM's CPU default is 4 GiB too).
                budget = min(budget, CPU_DEFAULT_KV_CACHE_BYTES)
        # More blocks than every sequence at full length could use is wasted memory. A sliding group
        # holds at most its window (and a step's tokens), whatever the length: izh.engine.kv_cache.
        blocks_per_seq = blocks_per_request(
            self.kv_layout.windows, self.block_size, self.max_model_len, self.max_num_batched_tokens
        )
        useful = blocks_per_seq * self.config.max_num_seqs
        num_blocks = min(budget // per_block, useful)
        if self.is_encoder:
            return useful  # bookkeeping only: no KV tensors behind them
        if num_blocks < blocks_per_seq:
            raise ModelSettingsError(
                f"the KV cache budget ({budget} bytes = {num_blocks} blocks of {self.block_size} tokens) "
                f"cannot hold one sequence of max_model_len {self.max_model_len} tokens "
                f"({blocks_per_seq} blocks, {blocks_per_seq * per_block} bytes); raise "
                "--kv-cache-memory-bytes or lower --max-model-len"
            )
        return int(num_blocks)

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        """One cache per layer: the layout's tensors, each shared by the layers at that index of every
        group (a block belongs to one group at a time)."""
        mc = self.model_config
        row = self.kv_format.row_size(mc.head_dim)
        shape = (2, self.num_blocks, self.block_size, self.num_local_kv_heads, row)
        # Zeroed, not empty: masked-out slots still flow through the attention matmul, and garbage
        # (NaN) there would poison the result even with a zero weight.
        tensors = [
            torch.zeros(shape, dtype=self.kv_format.storage, device=self.device)
            for _ in range(self.kv_layout.num_tensors)
        ]
        return [tensors[index] for index in self.kv_layout.layer_tensors]

    # --- one step -------------------------------------------------------------------------------

    def remove_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
            self._image_features.pop(request_id, None)

    # --- images ---------------------------------------------------------------------------------

    def image_seq_len(self, tile: int) -> int:
        """Embeddings (placeholder tokens) per tile of edge `tile` pixels."""
        vision = self.model_config.vision
        assert vision is not None
        return (tile // vision.patch_size) ** 2 // self.model_config.scale_factor**2

    def check_images(self, images: list[ImageInput], prompt: list[int]) -> str | None:
        """What is wrong with a request's images (None: nothing), for EngineCore's invariant check."""
        vision = self.model_config.vision
        if vision is None or self.image_token_id is None:
            return "it has images, but this model takes no images"
        end = 0
        for k, image in enumerate(images):
            n, channels, height, width = image.shape
            side = height // vision.patch_size
            if (
                n < 1
                or channels != vision.num_channels
                or height != width
                or height % vision.patch_size
                or side % self.model_config.scale_factor
            ):
                return f"image {k} has tiles of shape {image.shape}"
            if len(image.pixel_values) != 4 * n * channels * height * width:
                return f"image {k} has {len(image.pixel_values)} bytes for shape {image.shape}"
            if image.offset < end or image.length < 1 or image.offset + image.length > len(prompt):
                return f"image {k}'s placeholders [{image.offset}, +{image.length}) are out of place"
            end = image.offset + image.length
            span = prompt[image.offset : end]
            if span[0] != self.image_token_id or span[-1] != self.image_token_id:
                return f"image {k}'s placeholder range does not start and end on an image token"
            if span.count(self.image_token_id) != n * self.image_seq_len(height):
                return f"image {k}'s placeholder range does not hold {n} tiles of image tokens"
        return None

    def _image_embeddings(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The step's input embeddings with image features in place of the `<image>` tokens that this
        step computes; None when it computes none (every decode step, every text-only prefill)."""
        if self.image_token_id is None:
            return None
        rows: list[int] = []
        features: list[torch.Tensor] = []
        row = 0
        for s in scheduled:
            images = s.request.images
            start = s.num_computed_tokens_before
            end = start + s.num_scheduled_tokens
            if images and start < images[-1].offset + images[-1].length:
                for k, image in enumerate(images):
                    image_end = image.offset + image.length
                    lo, hi = max(start, image.offset), min(end, image_end)
                    if lo >= hi:
                        continue
                    span = np.asarray(s.request.all_token_ids[image.offset : image_end])
                    is_image = span == self.image_token_id
                    index = np.cumsum(is_image) - 1  # feature row of each placeholder position
                    positions = np.nonzero(is_image[lo - image.offset : hi - image.offset])[0] + lo
                    if len(positions):
                        encoded = self._encoded_image(s.request.request_id, k, image)
                        rows.extend((row + positions - start).tolist())
                        features.append(encoded[index[positions - image.offset]])
                    if end >= image_end:  # its last placeholder is computed now
                        self._image_features.get(s.request.request_id, {}).pop(k, None)
            row += s.num_scheduled_tokens
        if not rows:
            return None
        embeds = self.model.model.embed_tokens(input_ids)
        embeds[to_device(torch.tensor(rows, dtype=torch.long), self.device)] = torch.cat(features).to(
            embeds.dtype
        )
        return embeds

    def _encoded_image(self, request_id: str, k: int, image: ImageInput) -> torch.Tensor:
        """Image k's features [num_tiles * image_seq_len, hidden_size], run through the vision encoder once
        per request (kept while its placeholders are being prefilled)."""
        cache = self._image_features.setdefault(request_id, {})
        encoded = cache.get(k)
        if encoded is None:
            pixels = np.frombuffer(image.pixel_values, dtype="<f4").reshape(image.shape)
            tiles = to_device(torch.from_numpy(pixels.copy()), self.device)
            encoded = cache[k] = cast(Idefics3ForConditionalGeneration, self.model).encode_images(tiles)
        return encoded

    @torch.inference_mode()
    def execute(
        self,
        sched: SchedulerOutput,
        grammar: GrammarManager | None = None,
        draft_probs: dict[str, torch.Tensor] | None = None,
    ) -> RunnerOutput:
        """Run one scheduled step. `draft_probs`: a draft model's distributions q [k, vocab] of the drafts
        of its random requests (izh.engine.draft_model), which their verification weighs them by."""
        self.remove_requests(sched.finished_request_ids)
        scheduled = sched.scheduled
        if not scheduled:
            return RunnerOutput()
        # A step with LoRA tokens: adapters in their slots, the batch ordered by slot (izh.engine.lora_manager).
        lora_order = self.lora.prepare(scheduled, sched.running_lora_ids) if self.lora is not None else None
        try:
            return self._execute(
                lora_order or scheduled, grammar, draft_probs or {}, lora_step=lora_order is not None
            )
        finally:
            if self.lora is not None:
                self.lora.finish()

    def _execute(
        self,
        scheduled: list[ScheduledRequest],
        grammar: GrammarManager | None,
        draft_probs: dict[str, torch.Tensor],
        *,
        lora_step: bool,
    ) -> RunnerOutput:
        input_ids, positions, attn_metadata = self._prepare_inputs(scheduled)
        sample_rows, prompt_rows, pool_rows = self._select_rows(scheduled)
        logits_rows = [row + j for _, row, num_rows in sample_rows for j in range(num_rows)]
        for _, token_rows, _ in prompt_rows:
            logits_rows.extend(token_rows)
        # Copied before the forward is enqueued: on CUDA a blocking host-to-device copy waits for the stream,
        # which would hold the logits back until the whole forward had run.
        index = to_device(torch.tensor(logits_rows, dtype=torch.long), self.device)
        events = self._forward_events
        start = time.perf_counter()
        if events is not None:
            events[0].record()
        tp_logits: torch.Tensor | None = None
        inputs_embeds = self._image_embeddings(scheduled, input_ids)
        if self.tp_runtime is not None:
            # Every rank runs this step: the plan goes out, then the forward and the LM head's gather.
            with self.tp_runtime.step():
                self.tp_runtime.send_plan(input_ids, positions, attn_metadata, index)
                hidden, tp_logits = self.run_plan(
                    input_ids, positions, attn_metadata, index, self._logits_buffer(len(logits_rows))
                )
        elif inputs_embeds is not None:
            hidden = self.model(input_ids, positions, attn_metadata, inputs_embeds)
        elif not lora_step and self.graph_runner is not None and self.graph_runner.can_run(attn_metadata):
            hidden = self.graph_runner.run(input_ids, positions, attn_metadata)
        elif self.is_encoder:
            types = self._token_type_ids(scheduled, pool_rows, int(input_ids.shape[0]))
            hidden = cast(BertModel, self.model)(input_ids, positions, attn_metadata, types)
        else:
            hidden = self.model(input_ids, positions, attn_metadata)  # [num_tokens, hidden_size]
        embeddings = self._pool(scheduled, pool_rows, hidden) if pool_rows else {}
        if not logits_rows:
            # Only prompt-only requests, none of them at a prompt-logprob row: no logits to compute.
            out = RunnerOutput(embeddings=embeddings, forward_s=self._forward_time(start))
            self._prompt_logprobs(scheduled, prompt_rows, hidden.new_empty(0, 0), out)
            return out
        if tp_logits is not None:
            logits = tp_logits
        else:
            logits = self.model.compute_logits(  # [len(logits_rows), vocab]
                hidden.index_select(0, index), out=self._logits_buffer(len(logits_rows))
            )
        out = RunnerOutput(embeddings=embeddings, forward_s=self._forward_time(start))
        num_sampled = sum(num_rows for _, _, num_rows in sample_rows)
        if num_sampled:
            self._sample(scheduled, sample_rows, logits[:num_sampled], out, grammar, draft_probs)
        self._prompt_logprobs(scheduled, prompt_rows, logits[num_sampled:], out)
        if events is not None:
            # The sampled tokens were read back, so the end event has completed: no extra wait here.
            events[1].synchronize()
            out.forward_s = events[0].elapsed_time(events[1]) / 1e3
        return out

    def run_plan(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        logits_index: torch.Tensor,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One tensor-parallel step on this rank, as rank 0 planned it: the forward, then (when rows are
        asked for) the vocabulary-parallel LM head. Returns the hidden states and, on rank 0, the logits
        of the `logits_index` rows (in `out` when given); None elsewhere."""
        assert self.tp_runtime is not None
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, attn_metadata)
            if logits_index.shape[0] == 0:
                return hidden, None
            rows = hidden.index_select(0, logits_index)
            return hidden, parallel_logits(self.model, rows, self.tp_runtime.tp, out)

    def shutdown(self) -> None:
        """Free the KV caches; rank 0 of a tensor-parallel group also stops the other ranks."""
        self.model.bind_kv_caches(None)
        self.kv_caches.clear()
        if self.tp_runtime is not None:
            self.tp_runtime.shutdown()

    def _forward_time(self, start: float) -> float:
        """Host time since `start`; on CUDA, records the forward's end event (read back after sampling)."""
        if self._forward_events is not None:
            self._forward_events[1].record()
        return time.perf_counter() - start

    def logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        """The step's logits buffer for `num_rows` rows (None: too many rows for it)."""
        return self._logits_buffer(num_rows)

    def _logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        """A float32 [rows, vocab] buffer reused by every step (None for more than max_num_seqs rows, as
        prompt logprobs can ask): the sampler works on it in place, and nothing keeps it past the step.

        It grows with the batch (to the next power of two rows, at most max_num_seqs), so a server that
        runs a few streams holds a few rows: 128 rows of a 152k vocabulary are 74 MB."""
        if num_rows > self.config.max_num_seqs:
            return None
        if self._logits is None or self._logits.shape[0] < num_rows:
            rows = min(self.config.max_num_seqs, 1 << max(num_rows - 1, 0).bit_length())
            self._logits = torch.empty((rows, self.vocab_size), dtype=torch.float32, device=self.device)
        return self._logits

    def _prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        # A request verifying drafts (izh.engine.spec_decode) attends as k + 1 single-token decodes of one
        # block table: each row is computed exactly as a decode step would compute it (the same kernels,
        # the fused decode stack included), so verification never changes a row's logits. Every layer
        # writes the whole batch's KV before it attends, so row i sees the drafts before it.
        pieces: list[ScheduledRequest] = []
        piece_starts: list[int] = []
        piece_lens: list[int] = []
        for s in scheduled:
            if s.spec_token_ids:
                for j in range(s.num_scheduled_tokens):
                    pieces.append(s)
                    piece_starts.append(s.num_computed_tokens_before + j)
                    piece_lens.append(1)
            else:
                pieces.append(s)
                piece_starts.append(s.num_computed_tokens_before)
                piece_lens.append(s.num_scheduled_tokens)
        num_seqs = len(pieces)
        query_lens = np.asarray(piece_lens, dtype=np.int64)
        starts = np.asarray(piece_starts, dtype=np.int64)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids: list[int] = []
        for s in scheduled:
            start = s.num_computed_tokens_before
            num_known = s.num_scheduled_tokens - len(s.spec_token_ids)
            token_ids.extend(s.request.all_token_ids[start : start + num_known])
            token_ids.extend(s.spec_token_ids)
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1] - starts, query_lens
        )

        dev = self.device
        max_blocks = max(len(s.block_ids) for s in scheduled)
        query_start = to_device(torch.from_numpy(query_start_loc.astype(np.int32)), dev)
        seq_lens_dev = to_device(torch.from_numpy(seq_lens.astype(np.int32)), dev)
        query_lens_list, seq_lens_list = query_lens.tolist(), seq_lens.tolist()
        block_offsets = positions // bs
        slot_offsets = positions % bs

        def group_metadata(group: int | None) -> AttentionMetadata:
            # group None: the one block table every layer reads
            block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
            for i, s in enumerate(pieces):
                ids = s.block_ids if group is None else s.group_block_ids[group]
                block_tables[i, : len(ids)] = ids
            slot_mapping = block_tables[seq_index, block_offsets] * bs + slot_offsets
            return AttentionMetadata(
                query_start_loc=query_start,
                seq_lens=seq_lens_dev,
                slot_mapping=to_device(torch.from_numpy(slot_mapping), dev),
                block_tables=to_device(torch.from_numpy(block_tables.astype(np.int32)), dev),
                max_query_len=int(query_lens.max()),
                max_seq_len=int(seq_lens.max()),
                query_lens_list=query_lens_list,
                seq_lens_list=seq_lens_list,
            )

        num_groups = len(self.kv_layout.windows)
        if num_groups == 1:
            attn_metadata = group_metadata(None)
        else:
            groups = tuple(group_metadata(g) for g in range(num_groups))
            attn_metadata = dataclasses.replace(groups[0], groups=groups)
        input_ids = to_device(torch.tensor(token_ids, dtype=torch.long), dev)
        return input_ids, to_device(torch.from_numpy(positions), dev), attn_metadata

    @staticmethod
    def _select_rows(
        scheduled: list[ScheduledRequest],
    ) -> tuple[
        list[tuple[int, int, int]], list[tuple[int, list[int], list[int]]], list[tuple[int, int, int]]
    ]:
        """Rows whose logits we need: (batch index, first token row, rows) that sample (one row, or the
        k + 1 rows of a request verifying k drafts), and prompt-logprob rows; and the (batch index,
        first row, end row) of each pooling request (scheduled whole).

        A prompt row at position p gives the logprob of prompt token p + 1; position 0 has none. A
        request's first chunk is listed even without rows (a one-token prompt), for that None.
        """
        qsl = [0, *itertools.accumulate(s.num_scheduled_tokens for s in scheduled)]
        sample_rows = []
        prompt_rows = []
        pool_rows = []
        for i, s in enumerate(scheduled):
            if s.samples:
                num_rows = len(s.spec_token_ids) + 1
                sample_rows.append((i, qsl[i + 1] - num_rows, num_rows))
            elif s.request.pooling_params is not None:
                assert s.num_computed_tokens_before == 0 and s.num_scheduled_tokens == s.request.num_tokens
                pool_rows.append((i, qsl[i], qsl[i + 1]))
            if s.request.sampling_params.prompt_logprobs is None:
                continue
            start = s.num_computed_tokens_before
            num_prompt = s.request.num_prompt_tokens
            last = min(start + s.num_scheduled_tokens, num_prompt - 1)
            if start >= last and start > 0:
                continue
            rows = [qsl[i] + (p - start) for p in range(start, last)]
            targets = s.request.prompt_token_ids[start + 1 : last + 1]
            prompt_rows.append((i, rows, targets))
        return sample_rows, prompt_rows, pool_rows

    def _token_type_ids(
        self, scheduled: list[ScheduledRequest], pool_rows: list[tuple[int, int, int]], num_tokens: int
    ) -> torch.Tensor | None:
        """An encoder step's token types: 1 over each pair's second segment (from its segment_start),
        0 elsewhere; None (all 0) without pairs or for a model with one token type (XLM-RoBERTa,
        whose tokenizer passes no token_type_ids)."""
        if self.model_config.type_vocab_size < 2:
            return None
        segments = []
        for i, start, end in pool_rows:
            pooling = scheduled[i].request.pooling_params
            if pooling is not None and pooling.segment_start is not None:
                segments.append((start + pooling.segment_start, end))
        return pair_token_types(num_tokens, segments, self.device) if segments else None

    def _pool(
        self, scheduled: list[ScheduledRequest], pool_rows: list[tuple[int, int, int]], hidden: torch.Tensor
    ) -> dict[str, bytes]:
        """Each pooling request's result from its rows of the final hidden states: a vector
        (izh.model.pooling), or a cross-encoder's score (izh.model.cross_encoder)."""
        params: list[PoolingParams] = []
        for i, _, _ in pool_rows:
            pooling = scheduled[i].request.pooling_params
            assert pooling is not None
            params.append(pooling)
        ids = [scheduled[i].request.request_id for i, _, _ in pool_rows]
        if self.score_activation is not None:
            assert all(p.task == "score" for p in params)
            model = cast(CrossEncoderModel, self.model)
            scores = score_rows(model, hidden, [start for _, start, _ in pool_rows], self.score_activation)
            return dict(zip(ids, scores, strict=True))
        vectors = pool(hidden, [(start, end) for _, start, end in pool_rows], params)
        return dict(zip(ids, vectors, strict=True))

    def _sample(
        self,
        scheduled: list[ScheduledRequest],
        sample_rows: list[tuple[int, int, int]],
        logits: torch.Tensor,
        out: RunnerOutput,
        grammar: GrammarManager | None,
        draft_probs: dict[str, torch.Tensor],
    ) -> None:
        """Sample every sampling request's token; a request verifying drafts gets its accepted drafts
        and one token of the target's own (izh.engine.spec_decode)."""
        drafts = [scheduled[i].spec_token_ids for i, _, _ in sample_rows]
        if grammar is not None and grammar.num_requests:
            ids: list[str | None] = [
                r if grammar.has_grammar(r) else None
                for r in (scheduled[i].request.request_id for i, _, _ in sample_rows)
            ]
            if len(logits) > len(sample_rows):
                # A row per draft position; a draft the grammar rejects ends its request's rows there.
                bitmask, lengths = grammar.fill_bitmask_drafts(list(zip(ids, drafts, strict=True)))
                drafts = [d[:n] for d, n in zip(drafts, lengths, strict=True)]
            else:
                bitmask = grammar.fill_bitmask(ids)
            if bitmask is not None:
                apply_bitmask(logits, bitmask)
        rows = []
        for batch_index, _, num_rows in sample_rows:
            s = scheduled[batch_index]
            req = s.request
            params = req.sampling_params
            generator = self._generator(req.request_id, params)
            for j in range(num_rows):
                # Row j of a draft follows the drafts before it: penalties, min_tokens and bad words
                # see the output as it would be had they been sampled.
                output = req.output_token_ids if j == 0 else req.output_token_ids + s.spec_token_ids[:j]
                rows.append(
                    SamplingRow(
                        params=params,
                        prompt_token_ids=req.prompt_token_ids,
                        output_token_ids=output,
                        eos_token_ids=req.eos_token_ids,
                        generator=generator,
                    )
                )
        if len(rows) == len(sample_rows):
            self._sample_plain(scheduled, sample_rows, logits, rows, out)
            return
        # A step with drafts: the requests without any sample as in any step (their draws, seeded or
        # not, do not depend on the batch), those with drafts go through verification.
        first_rows = list(itertools.accumulate((n for _, _, n in sample_rows), initial=0))
        plain = [k for k, (_, _, n) in enumerate(sample_rows) if n == 1]
        verified = [k for k, (_, _, n) in enumerate(sample_rows) if n > 1]
        if plain:
            index = torch.tensor([first_rows[k] for k in plain], dtype=torch.long, device=logits.device)
            self._sample_plain(
                scheduled,
                [sample_rows[k] for k in plain],
                logits.index_select(0, index),
                [rows[first_rows[k]] for k in plain],
                out,
            )
        index_list = [r for k in verified for r in range(first_rows[k], first_rows[k + 1])]
        index = torch.tensor(index_list, dtype=torch.long, device=logits.device)
        self._verify(
            scheduled,
            [sample_rows[k] for k in verified],
            [drafts[k] for k in verified],
            logits.index_select(0, index),
            SamplingMetadata.build([rows[r] for r in index_list], self.vocab_size, self.device),
            out,
            draft_probs,
        )

    def _sample_plain(
        self,
        scheduled: list[ScheduledRequest],
        sample_rows: list[tuple[int, int, int]],
        logits: torch.Tensor,
        rows: list[SamplingRow],
        out: RunnerOutput,
    ) -> None:
        """One token per request, one row each: the sampler."""
        result = self.sampler(logits, SamplingMetadata.build(rows, self.vocab_size, self.device))
        for k, (batch_index, _, _) in enumerate(sample_rows):
            request_id = scheduled[batch_index].request.request_id
            out.sampled_token_ids[request_id] = [result.sampled_token_ids[k]]
            if result.logprobs is not None and result.logprobs[k] is not None:
                out.logprobs[request_id] = [result.logprobs[k]]  # type: ignore[list-item]

    def generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """The generator a random request's draws come from: its own when seeded, else the engine's."""
        return self._generator(request_id, params) or self.sampler.generator

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator | None:
        """A seeded random request's own generator (made on its first sample, kept until it ends)."""
        if params.seed is None or params.is_greedy:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = self._generators[request_id] = make_generator(params.seed, self.device)
        return generator

    def _verify(
        self,
        scheduled: list[ScheduledRequest],
        sample_rows: list[tuple[int, int, int]],
        drafts: list[list[int]],
        logits: torch.Tensor,
        metadata: SamplingMetadata,
        out: RunnerOutput,
        draft_probs: dict[str, torch.Tensor],
    ) -> None:
        """A step with drafts: each request's rows through izh.engine.spec_decode's verification (one row
        without drafts is a verification of none: the same distribution as the sampler's)."""
        raw_logprobs, greedy, probs = self.sampler.distributions(logits, metadata)
        greedy_ids = greedy.tolist() if greedy is not None else None
        row = 0
        for (batch_index, _, num_rows), draft in zip(sample_rows, drafts, strict=True):
            req = scheduled[batch_index].request
            params = req.sampling_params
            used = len(draft) + 1  # a grammar may have cut the draft: the rows past it go unused
            if params.is_greedy:
                assert greedy_ids is not None
                result = verify_greedy(greedy_ids[row : row + used], draft)
            else:
                assert probs is not None
                result = verify_random(
                    probs[row : row + used],
                    draft,
                    self.generator(req.request_id, params),
                    draft_probs.get(req.request_id),
                )
            out.sampled_token_ids[req.request_id] = result.token_ids
            if raw_logprobs is not None and params.logprobs is not None:
                out.logprobs[req.request_id] = token_logprobs(
                    raw_logprobs[row : row + num_rows], result.token_ids, params.logprobs
                )
            row += num_rows

    def _prompt_logprobs(
        self,
        scheduled: list[ScheduledRequest],
        prompt_rows: list[tuple[int, list[int], list[int]]],
        logits: torch.Tensor,
        out: RunnerOutput,
    ) -> None:
        offset = 0
        for batch_index, rows, targets in prompt_rows:
            s = scheduled[batch_index]
            chunk = logits[offset : offset + len(rows)]
            offset += len(rows)
            num_top = s.request.sampling_params.prompt_logprobs or 0
            entries: list[TokenLogprobs | None] = []
            if s.num_computed_tokens_before == 0:
                entries.append(None)  # the first prompt token has no logprob
            if rows:
                entries.extend(self.sampler.compute_prompt_logprobs(chunk, targets, num_top))
            out.prompt_logprobs[s.request.request_id] = entries
