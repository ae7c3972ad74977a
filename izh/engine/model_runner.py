"""ModelRunner: owns the model, the KV cache tensors and the sampler; runs one scheduled step."""

from __future__ import annotations

import itertools
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from izh.config import EngineConfig, lora_enabled
from izh.engine.guided import GrammarManager, apply_bitmask
from izh.engine.lora_manager import LoraManager
from izh.engine.sampler import Sampler, SamplingMetadata, SamplingRow, make_generator, to_device
from izh.engine.scheduler import ScheduledRequest, SchedulerOutput
from izh.errors import ModelLoadError
from izh.kernels import cpu as cpu_ops
from izh.model.attention import AttentionMetadata, get_attention_backend
from izh.model.config import ModelConfig
from izh.model.llama import LlamaForCausalLM
from izh.model.loader import checkpoint_quant_types, load_model
from izh.model.packed import RECORDS_ANY_ROWS
from izh.model.packing import pack_model_weights, resolve_quantization
from izh.model.pooling import PoolingConfig, pool, resolve_pooling
from izh.pooling_params import PoolingParams
from izh.protocol import TokenLogprobs

if TYPE_CHECKING:
    from izh.engine.cuda_graphs import DecodeGraphRunner

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 4 << 30
"""The most a CPU KV cache takes when only kv_cache_memory_fraction is set."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for but CUDA is not available; use --device cpu")
    return torch.device(name)


def cpu_has_fast_bfloat16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 matmuls run natively (elsewhere they are emulated and slower)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_dtype(name: str, device: torch.device, *, quantized_checkpoint: bool = False) -> torch.dtype:
    """auto: bfloat16 on CUDA; on CPU float32, except bfloat16 for a quantized checkpoint (a Q4 GGUF's
    weights carry far less precision than bfloat16) where izh's bfloat16 record kernels run (the avx512
    and amx variants), or, without izh's C kernels, where the CPU has native bfloat16. Never a dtype the
    CPU only emulates."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if quantized_checkpoint and device.type == "cpu":
            fast_bf16 = cpu_ops.qgemm_available() if cpu_ops.available() else cpu_has_fast_bfloat16()
            if fast_bf16:
                return torch.bfloat16
        return torch.float32
    try:
        return _DTYPES[name]
    except KeyError:
        raise ModelLoadError(f"unknown dtype {name!r}; supported: auto, {', '.join(_DTYPES)}") from None


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
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
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
    ) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        # Which C kernel variant runs, and where it is cached; a forced variant this CPU lacks fails here.
        cpu_ops.configure(cpu_kernels_for(self.device, config.cpu_kernels), config.cache_dir)
        source_types = checkpoint_quant_types(config.model)
        self.dtype = resolve_dtype(config.dtype, self.device, quantized_checkpoint=bool(source_types))
        self.quantization = resolve_quantization(
            config.quantization, device=self.device, dtype=self.dtype, source_types=source_types
        )
        if config.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        start = time.perf_counter()
        model, self.model_config = load_model(
            config.model, dtype=self.dtype, device=self.device, progress=progress
        )
        # Every registered architecture but the encoders is a LlamaForCausalLM (see izh.model.registry);
        # an encoder (BERT) only runs forward, in the pooling path.
        self.model = cast(LlamaForCausalLM, model)
        self.model.eval()
        self.is_encoder = self.model_config.is_encoder
        """An encoder only embeds: no KV cache tensors, no logits, no sampling."""
        self.pooling: PoolingConfig = resolve_pooling(
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
        self.block_size = config.block_size
        self.vocab_size = self.model_config.vocab_size
        self.num_blocks = self._resolve_num_blocks()
        self.attention_backend = self._resolve_attention_backend(config.attention_backend)
        if self.is_encoder:
            # The scheduler's block accounting still runs (one budget for every request), over blocks
            # that hold no tensors: an encoder attends within its step and keeps nothing.
            self.kv_caches: list[torch.Tensor] = []
        else:
            self.kv_caches = self._allocate_kv_caches()
            self.model.bind_kv_caches(self.kv_caches)
            self.model.paged_backend = get_attention_backend(self.attention_backend)
        if not self.is_encoder and self.model.prepare_fused_decode():
            stack = self.model.fused_stack
            assert stack is not None
            limit = "any number of" if stack.max_tokens >= RECORDS_ANY_ROWS else f"<= {stack.max_tokens}"
            logger.info("decode steps of %s tokens run the fused C decoder stack", limit)
        self.lora: LoraManager | None = None
        """The LoRA adapters (when the config enables LoRA): attached before the CUDA graphs are captured,
        which then run base-only steps (a step with adapter tokens runs eagerly)."""
        if lora_enabled(config):
            if self.is_encoder:
                raise ModelLoadError("LoRA adapters are served on decoder (generative) models only")
            lora_model = self.model.attach_lora(config.max_loras, config.max_lora_rank)
            self.lora = LoraManager(lora_model, self.model_config)
        self.graph_runner = self._make_graph_runner()
        # Unseeded sampling draws from the engine's own generator, seeded by the engine seed setting.
        self.sampler = Sampler(make_generator(config.seed, self.device))
        self._generators: dict[str, torch.Generator] = {}
        self._logits: torch.Tensor | None = None
        # Start and end of the forward on the GPU's stream: forward_s without a host sync of its own (the
        # sampler's read of the tokens has already waited for the end event).
        self._forward_events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
        if self.device.type == "cuda":
            self._forward_events = (
                torch.cuda.Event(enable_timing=True),
                torch.cuda.Event(enable_timing=True),
            )

    # --- set-up ---------------------------------------------------------------------------------

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
            raise ModelLoadError(
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

    def _make_graph_runner(self) -> DecodeGraphRunner | None:
        """CUDA graphs for decode batches: on CUDA with the (graph-safe) Triton backend, unless eager."""
        if (
            self.device.type != "cuda"
            or self.is_encoder
            or self.config.enforce_eager
            or self.attention_backend != "triton_paged"
        ):
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

    def kv_bytes_per_block(self) -> int:
        mc = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * mc.num_hidden_layers * self.block_size * mc.num_key_value_heads * mc.head_dim * elem

    def _resolve_num_blocks(self) -> int:
        per_block = self.kv_bytes_per_block()
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            budget = int(available_memory_bytes(self.device) * self.config.kv_cache_memory_fraction)
            if self.device.type == "cpu":
                # CPU RAM is shared with everything else on the host (vLLM's CPU default is 4 GiB too).
                budget = min(budget, CPU_DEFAULT_KV_CACHE_BYTES)
        # More blocks than every sequence at full length could use is wasted memory.
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        useful = blocks_per_seq * self.config.max_num_seqs
        num_blocks = min(budget // per_block, useful)
        if self.is_encoder:
            return useful  # bookkeeping only: no KV tensors behind them
        if num_blocks < blocks_per_seq:
            raise ModelLoadError(
                f"the KV cache budget ({budget} bytes = {num_blocks} blocks of {self.block_size} tokens) "
                f"cannot hold one sequence of max_model_len {self.max_model_len} tokens "
                f"({blocks_per_seq} blocks, {blocks_per_seq * per_block} bytes); raise "
                "--kv-cache-memory-bytes or lower --max-model-len"
            )
        return int(num_blocks)

    def _allocate_kv_caches(self) -> list[torch.Tensor]:
        mc = self.model_config
        shape = (2, self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        # Zeroed, not empty: masked-out slots still flow through the attention matmul, and garbage
        # (NaN) there would poison the result even with a zero weight.
        return [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(mc.num_hidden_layers)]

    # --- one step -------------------------------------------------------------------------------

    def remove_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, grammar: GrammarManager | None = None) -> RunnerOutput:
        self.remove_requests(sched.finished_request_ids)
        scheduled = sched.scheduled
        if not scheduled:
            return RunnerOutput()
        # A step with LoRA tokens: adapters in their slots, the batch ordered by slot (izh.engine.lora_manager).
        lora_order = self.lora.prepare(scheduled, sched.running_lora_ids) if self.lora is not None else None
        try:
            return self._execute(lora_order or scheduled, grammar, lora_step=lora_order is not None)
        finally:
            if self.lora is not None:
                self.lora.finish()

    def _execute(
        self, scheduled: list[ScheduledRequest], grammar: GrammarManager | None, *, lora_step: bool
    ) -> RunnerOutput:
        input_ids, positions, attn_metadata = self._prepare_inputs(scheduled)
        sample_rows, prompt_rows, pool_rows = self._select_rows(scheduled, attn_metadata)
        logits_rows = [i for _, i in sample_rows]
        for _, token_rows, _ in prompt_rows:
            logits_rows.extend(token_rows)
        # Copied before the forward is enqueued: on CUDA a blocking host-to-device copy waits for the stream,
        # which would hold the logits back until the whole forward had run.
        index = to_device(torch.tensor(logits_rows, dtype=torch.long), self.device)
        events = self._forward_events
        start = time.perf_counter()
        if events is not None:
            events[0].record()
        if not lora_step and self.graph_runner is not None and self.graph_runner.can_run(attn_metadata):
            hidden = self.graph_runner.run(input_ids, positions, attn_metadata)
        else:
            hidden = self.model(input_ids, positions, attn_metadata)  # [num_tokens, hidden_size]
        embeddings = self._pool(scheduled, pool_rows, hidden) if pool_rows else {}
        if not logits_rows:
            # Only prompt-only requests, none of them at a prompt-logprob row: no logits to compute.
            out = RunnerOutput(embeddings=embeddings, forward_s=self._forward_time(start))
            self._prompt_logprobs(scheduled, prompt_rows, hidden.new_empty(0, 0), out)
            return out
        logits = self.model.compute_logits(  # [len(logits_rows), vocab]
            hidden.index_select(0, index), out=self._logits_buffer(len(logits_rows))
        )
        out = RunnerOutput(embeddings=embeddings, forward_s=self._forward_time(start))
        num_sampled = len(sample_rows)
        if num_sampled:
            self._sample(scheduled, sample_rows, logits[:num_sampled], out, grammar)
        self._prompt_logprobs(scheduled, prompt_rows, logits[num_sampled:], out)
        if events is not None:
            # The sampled tokens were read back, so the end event has completed: no extra wait here.
            events[1].synchronize()
            out.forward_s = events[0].elapsed_time(events[1]) / 1e3
        return out

    def _forward_time(self, start: float) -> float:
        """Host time since `start`; on CUDA, records the forward's end event (read back after sampling)."""
        if self._forward_events is not None:
            self._forward_events[1].record()
        return time.perf_counter() - start

    def _logits_buffer(self, num_rows: int) -> torch.Tensor | None:
        """A float32 [max_num_seqs, vocab] buffer reused by every step (None for more rows, as prompt
        logprobs can ask): the sampler works on it in place, and nothing keeps it past the step."""
        if num_rows > self.config.max_num_seqs:
            return None
        if self._logits is None:
            self._logits = torch.empty(
                (self.config.max_num_seqs, self.vocab_size), dtype=torch.float32, device=self.device
            )
        return self._logits

    def _prepare_inputs(
        self, scheduled: list[ScheduledRequest]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        num_seqs = len(scheduled)
        query_lens = np.fromiter((s.num_scheduled_tokens for s in scheduled), np.int64, num_seqs)
        starts = np.fromiter((s.num_computed_tokens_before for s in scheduled), np.int64, num_seqs)
        seq_lens = starts + query_lens
        query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])

        token_ids: list[int] = []
        for s in scheduled:
            start = s.num_computed_tokens_before
            token_ids.extend(s.request.all_token_ids[start : start + s.num_scheduled_tokens])
        seq_index = np.repeat(np.arange(num_seqs), query_lens)
        positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(
            query_start_loc[:-1] - starts, query_lens
        )

        max_blocks = max(len(s.block_ids) for s in scheduled)
        block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_ids)] = s.block_ids
        slot_mapping = block_tables[seq_index, positions // bs] * bs + positions % bs

        dev = self.device
        attn_metadata = AttentionMetadata(
            query_start_loc=to_device(torch.from_numpy(query_start_loc.astype(np.int32)), dev),
            seq_lens=to_device(torch.from_numpy(seq_lens.astype(np.int32)), dev),
            slot_mapping=to_device(torch.from_numpy(slot_mapping), dev),
            block_tables=to_device(torch.from_numpy(block_tables.astype(np.int32)), dev),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_lens_list=query_lens.tolist(),
            seq_lens_list=seq_lens.tolist(),
        )
        input_ids = to_device(torch.tensor(token_ids, dtype=torch.long), dev)
        return input_ids, to_device(torch.from_numpy(positions), dev), attn_metadata

    @staticmethod
    def _select_rows(
        scheduled: list[ScheduledRequest], attn_metadata: AttentionMetadata
    ) -> tuple[list[tuple[int, int]], list[tuple[int, list[int], list[int]]], list[tuple[int, int, int]]]:
        """Rows whose logits we need: (batch index, token row) that sample, and prompt-logprob rows;
        and the (batch index, first row, end row) of each pooling request (scheduled whole).

        A prompt row at position p gives the logprob of prompt token p + 1; position 0 has none. A
        request's first chunk is listed even without rows (a one-token prompt), for that None.
        """
        # From the host copy of the query lengths: no device sync on GPU.
        qsl = [0, *itertools.accumulate(attn_metadata.host_query_lens())]
        sample_rows = []
        prompt_rows = []
        pool_rows = []
        for i, s in enumerate(scheduled):
            if s.samples:
                sample_rows.append((i, qsl[i + 1] - 1))
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

    @staticmethod
    def _pool(
        scheduled: list[ScheduledRequest], pool_rows: list[tuple[int, int, int]], hidden: torch.Tensor
    ) -> dict[str, bytes]:
        """Each pooling request's vector from its rows of the final hidden states (izh.model.pooling)."""
        params: list[PoolingParams] = []
        for i, _, _ in pool_rows:
            pooling = scheduled[i].request.pooling_params
            assert pooling is not None
            params.append(pooling)
        vectors = pool(hidden, [(start, end) for _, start, end in pool_rows], params)
        return {scheduled[i].request.request_id: v for (i, _, _), v in zip(pool_rows, vectors, strict=True)}

    def _sample(
        self,
        scheduled: list[ScheduledRequest],
        sample_rows: list[tuple[int, int]],
        logits: torch.Tensor,
        out: RunnerOutput,
        grammar: GrammarManager | None,
    ) -> None:
        if grammar is not None and grammar.num_requests:
            ids = [scheduled[i].request.request_id for i, _ in sample_rows]
            bitmask = grammar.fill_bitmask([r if grammar.has_grammar(r) else None for r in ids])
            if bitmask is not None:
                apply_bitmask(logits, bitmask)
        rows = []
        for batch_index, _ in sample_rows:
            req = scheduled[batch_index].request
            params = req.sampling_params
            generator = None
            if params.seed is not None and not params.is_greedy:
                generator = self._generators.get(req.request_id)
                if generator is None:
                    generator = make_generator(params.seed, self.device)
                    self._generators[req.request_id] = generator
            rows.append(
                SamplingRow(
                    params=params,
                    prompt_token_ids=req.prompt_token_ids,
                    output_token_ids=req.output_token_ids,
                    eos_token_ids=req.eos_token_ids,
                    generator=generator,
                )
            )
        metadata = SamplingMetadata.build(rows, self.vocab_size, self.device)
        result = self.sampler(logits, metadata)
        for k, (batch_index, _) in enumerate(sample_rows):
            request_id = scheduled[batch_index].request.request_id
            out.sampled_token_ids[request_id] = [result.sampled_token_ids[k]]
            if result.logprobs is not None and result.logprobs[k] is not None:
                out.logprobs[request_id] = result.logprobs[k]  # type: ignore[assignment]

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
