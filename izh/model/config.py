"""ModelConfig: the architecture hyper-parameters the model code needs, from HF config.json or GGUF metadata."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from izh.errors import ModelLoadError, UnsupportedModel

# RoPE variants the model code implements. "freq_factors" is llama3 scaling as GGUF stores it: a
# per-frequency divisor tensor (rope_freqs.weight) instead of the four llama3 parameters.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn", "longrope")

_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")

# HF `model_type` / GGUF `general.architecture` for each HF `architectures` entry we know; anything else
# keeps its own name and is rejected (with the supported list) by the registry.
_HF_ARCH_TO_TYPE = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "BertModel": "bert",
    "BertForSequenceClassification": "bert_classifier",
    "XLMRobertaForSequenceClassification": "xlm_roberta_classifier",
    "Idefics3ForConditionalGeneration": "idefics3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MistralForCausalLM": "mistral",
    "Phi3ForCausalLM": "phi3",
    # mixture of experts
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "mixtral",
}
MOE_ARCHITECTURES = ("qwen3moe", "mixtral")

CLASSIFIER_ARCHITECTURES = ("bert_classifier", "xlm_roberta_classifier")
"""Cross-encoders: a BERT-style encoder and a sequence-classification head (izh.model.cross_encoder)."""

GEMMA_ARCHITECTURES = frozenset({"gemma2", "gemma3"})


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A VLM's vision encoder (Idefics3's SigLIP-style ViT): config.json's `vision_config`."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> VisionConfig:
        act = str(d.get("hidden_act", "gelu_pytorch_tanh"))
        if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
            raise UnsupportedModel(f"vision hidden_act {act!r} is not supported (only gelu variants)")
        try:
            return cls(
                hidden_size=int(d.get("hidden_size", 1152)),
                intermediate_size=int(d.get("intermediate_size", 3072)),
                num_hidden_layers=int(d.get("num_hidden_layers", 12)),
                num_attention_heads=int(d.get("num_attention_heads", 16)),
                image_size=int(d.get("image_size", 224)),
                patch_size=int(d.get("patch_size", 32)),
                num_channels=int(d.get("num_channels", 3)),
                layer_norm_eps=float(d.get("layer_norm_eps", 1e-6)),
                hidden_act=act,
            )
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"config.json's vision_config is malformed: {e}") from e


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse MLP blocks of a mixture-of-experts model (izh.model.moe)."""

    num_experts: int
    num_experts_per_tok: int
    expert_intermediate_size: int
    norm_topk_prob: bool
    """Divide the top-k routing weights by their sum (always for Mixtral; Qwen3-MoE's config says)."""
    dense_layers: tuple[int, ...] = ()
    """Layers whose MLP is dense (`intermediate_size`) instead of sparse: Qwen3-MoE's mlp_only_layers
    and the layers decoder_sparse_step skips."""

    def __post_init__(self) -> None:
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ModelLoadError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be between 1 and num_experts "
                f"({self.num_experts})"
            )

    def is_sparse(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Decoder-only transformer shape and numerics; `architecture` is the registry key."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    """None, or a dict with "rope_type" in SUPPORTED_ROPE_TYPES and that type's parameters."""
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    """Bias on the q/k/v projections (and on o_proj for llama and qwen3, as in transformers)."""
    qk_norm: bool
    """Per-head RMSNorm on q and k before RoPE (Qwen3)."""
    is_encoder: bool = False
    """A bidirectional encoder (BERT): no causal mask, no KV cache, no LM head; it only embeds.
    `rms_norm_eps` then holds its LayerNorm's eps, and `rope_theta` is unused."""
    hidden_act: str = "silu"
    type_vocab_size: int = 0
    num_labels: int = 0
    """A cross-encoder's classifier outputs (izh serves 1: a relevance score); 0 without a head."""
    position_offset: int = 0
    """The position id of the first token (RoBERTa's padding_idx + 1); `max_position_embeddings`
    counts the positions left after it."""
    vision: VisionConfig | None = None
    """A vision-language model's image encoder (Idefics3); None for a text-only model."""
    image_token_id: int = -1
    """The `<image>` placeholder whose embeddings the image features replace (a VLM only)."""
    scale_factor: int = 1
    """The connector's pixel-shuffle factor (Idefics3)."""
    sliding_window: int | None = None
    """A sliding-window layer's query at position p sees the keys at positions (p - sliding_window, p]."""
    sliding_layers: tuple[bool, ...] = ()
    """Per layer, whether it attends through `sliding_window` (Gemma); Mistral's window, when set,
    applies to every layer and leaves this empty."""
    rope_local_theta: float = 0.0
    """RoPE base of the sliding-window layers, unscaled (Gemma 3); 0: they use the global rotary."""
    query_pre_attn_scalar: float = 0.0
    """Attention scale query_pre_attn_scalar**-0.5 when set (Gemma), else head_dim**-0.5."""
    attn_logit_softcapping: float = 0.0
    """Attention scores become cap * tanh(score / cap) when set (Gemma 2)."""
    final_logit_softcapping: float = 0.0
    """Logits become cap * tanh(logit / cap) when set (Gemma 2)."""
    moe: MoeConfig | None = None
    """A mixture-of-experts model's routing and expert shape (Qwen3-MoE, Mixtral); None when dense."""
    rotary_dim: int = 0
    """RoPE rotates the first rotary_dim dimensions of each head, the rest pass through (Phi-4-mini's
    partial_rotary_factor 0.75); 0: the whole head."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rotary_dim and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ModelLoadError(
                f"rotary_dim {self.rotary_dim} must be even and within head_dim {self.head_dim}"
            )
        _check_rope_scaling(self.rope_scaling)

    @property
    def rope_dim(self) -> int:
        """The dimensions of each head RoPE rotates (its leading ones)."""
        return self.rotary_dim or self.head_dim

    @property
    def num_query_groups(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face config.json; raises ModelLoadError for unsupported features."""
        architecture = hf_architecture(d)
        if architecture == "bert" or architecture in CLASSIFIER_ARCHITECTURES:
            return cls._from_hf_bert_config(d, architecture)
        if architecture == "idefics3":
            return cls._from_hf_idefics3_config(d)
        if architecture in GEMMA_ARCHITECTURES:
            return cls._from_hf_gemma_config(d, architecture)
        if architecture in ("mistral", "phi3"):
            llama = {**d, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
            partial = float(d.get("partial_rotary_factor", 1.0))
            if architecture == "phi3":
                llama.pop("partial_rotary_factor", None)  # Phi-4-mini rotates 3/4 of each head
            base = cls.from_hf_config(llama)
            rotary_dim = int(base.head_dim * partial) if architecture == "phi3" and partial != 1.0 else 0
            return replace(
                base,
                architecture=architecture,
                sliding_window=_window_within(d.get("sliding_window"), base.max_position_embeddings),
                rotary_dim=rotary_dim,
            )
        _reject_unsupported_hf_features(d)
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            rope_theta, rope_scaling = _hf_rope(d)
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden_size // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=True if architecture == "qwen2" else bool(d.get("attention_bias", False)),
                qk_norm=architecture in ("qwen3", "qwen3moe"),
                moe=_hf_moe(d, architecture),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from e

    @classmethod
    def _from_hf_gemma_config(cls, d: Mapping[str, Any], architecture: str) -> ModelConfig:
        """Gemma 2 / Gemma 3 text: GeGLU, sandwich norms, query pre-scaling, local/global layers."""
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedModel(
                f"{architecture} hidden_activation {act!r} is not supported (only gelu_pytorch_tanh)"
            )
        base = cls.from_hf_config({**d, "architectures": ["LlamaForCausalLM"], "hidden_act": "silu"})
        num_layers = base.num_hidden_layers
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = int(d.get("sliding_window_pattern") or (2 if architecture == "gemma2" else 6))
            sliding = tuple(bool((i + 1) % pattern) for i in range(num_layers))
        else:
            if len(layer_types) != num_layers:
                raise ModelLoadError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        theta, scaling = base.rope_theta, base.rope_scaling
        local_theta = 0.0
        params = d.get("rope_parameters")
        if isinstance(params, Mapping) and "full_attention" in params:
            # transformers 5: one rope_parameters entry per layer type.
            theta, scaling = _hf_rope({"rope_parameters": params["full_attention"]})
            local_theta, _ = _hf_rope({"rope_parameters": params.get("sliding_attention") or {}})
        elif architecture == "gemma3":
            local_theta = float(d.get("rope_local_base_freq", 10000.0))
        window = d.get("sliding_window")
        return replace(
            base,
            architecture=architecture,
            hidden_act="gelu_pytorch_tanh",
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=architecture == "gemma3",
            sliding_window=int(window) if window and any(sliding) else None,
            sliding_layers=sliding if window else (),
            rope_local_theta=local_theta,
            query_pre_attn_scalar=float(d.get("query_pre_attn_scalar") or base.head_dim),
            attn_logit_softcapping=float(d.get("attn_logit_softcapping") or 0.0),
            final_logit_softcapping=float(d.get("final_logit_softcapping") or 0.0),
        )

    @classmethod
    def _from_hf_idefics3_config(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Idefics3 / SmolVLM: its text_config is a Llama (the decoder), plus the vision encoder."""
        text = d.get("text_config")
        if not isinstance(text, Mapping):
            raise ModelLoadError("an idefics3 config.json needs a text_config object")
        text_type = text.get("model_type", "llama")
        if text_type != "llama":
            raise UnsupportedModel(f"idefics3 text model type {text_type!r} is not supported (only 'llama')")
        decoder = cls.from_hf_config({**text, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        if "image_token_id" not in d:
            raise ModelLoadError("config.json lacks the required field 'image_token_id'")
        vision = VisionConfig.from_hf_config(d.get("vision_config") or {})
        scale_factor = int(d.get("scale_factor", 2))
        side = vision.image_size // vision.patch_size
        if side % scale_factor:
            raise ModelLoadError(
                f"the vision encoder's {side} patches per side are not a multiple of scale_factor {scale_factor}"
            )
        return replace(
            decoder,
            architecture="idefics3",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", decoder.tie_word_embeddings)),
            vision=vision,
            image_token_id=int(d["image_token_id"]),
            scale_factor=scale_factor,
        )

    @classmethod
    def _from_hf_bert_config(cls, d: Mapping[str, Any], architecture: str) -> ModelConfig:
        """BERT, and the cross-encoders over it: BertForSequenceClassification and
        XLMRobertaForSequenceClassification (positions from padding_idx + 1, a tanh head)."""
        position_type = d.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise UnsupportedModel(
                f"position_embedding_type {position_type!r} is not supported (only 'absolute')"
            )
        if d.get("is_decoder"):
            raise UnsupportedModel(
                "is_decoder=true is not supported for BERT (izh serves BERT as an encoder)"
            )
        num_labels = _hf_num_labels(d) if architecture in CLASSIFIER_ARCHITECTURES else 0
        if architecture in CLASSIFIER_ARCHITECTURES and num_labels != 1:
            raise UnsupportedModel(
                f"this cross-encoder has {num_labels} labels; izh scores with single-label cross-encoders "
                "(num_labels 1, one relevance score per pair, as rerankers are), not multi-label classifiers"
            )
        offset = int(d.get("pad_token_id", 1)) + 1 if architecture == "xlm_roberta_classifier" else 0
        try:
            hidden_size = int(d["hidden_size"])
            num_heads = int(d["num_attention_heads"])
            return cls(
                architecture=architecture,
                vocab_size=int(d["vocab_size"]),
                hidden_size=hidden_size,
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=num_heads,
                num_key_value_heads=num_heads,
                head_dim=hidden_size // num_heads,
                rms_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
                rope_theta=0.0,
                rope_scaling=None,
                max_position_embeddings=int(d.get("max_position_embeddings", 512)) - offset,
                tie_word_embeddings=False,
                attention_bias=True,
                qk_norm=False,
                is_encoder=True,
                hidden_act=str(d.get("hidden_act", "gelu")),
                type_vocab_size=int(d.get("type_vocab_size", 2)),
                num_labels=num_labels,
                position_offset=offset,
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from e

    @classmethod
    def from_gguf_metadata(
        cls,
        metadata: Mapping[str, Any],
        tensor_shapes: Mapping[str, Sequence[int]],
        rope_freq_factors: Sequence[float] | None = None,
    ) -> ModelConfig:
        """Build from GGUF key/values (plain Python values) and the file's tensor shapes by GGUF name.

        Tensors decide what metadata may not say: tied embeddings (no `output.weight`), q/k/v biases,
        q/k norms, the vocabulary size. `rope_freq_factors` are the values of a `rope_freqs.weight`
        tensor when there is one (llama3-style scaling as llama.cpp's converter writes it).
        """
        names = set(tensor_shapes)
        arch = metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelLoadError("GGUF metadata lacks general.architecture")

        def get(key: str, default: Any = None) -> Any:
            value = metadata.get(f"{arch}.{key}", default)
            if value is None:
                raise ModelLoadError(f"GGUF metadata lacks {arch}.{key}")
            return value

        hidden_size = int(get("embedding_length"))
        num_heads = int(get("attention.head_count"))
        head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden_size // num_heads)
        vocab_size = metadata.get(f"{arch}.vocab_size")
        if vocab_size is None and "token_embd.weight" in tensor_shapes:
            vocab_size = tensor_shapes["token_embd.weight"][0]
        if vocab_size is None:
            raise ModelLoadError(f"GGUF file has neither {arch}.vocab_size nor a token_embd.weight tensor")
        config = cls(
            architecture="mixtral" if arch == "llama" and metadata.get("llama.expert_count") else arch,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(get("feed_forward_length")),
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(metadata, arch, rope_freq_factors),
            max_position_embeddings=int(get("context_length", 2048)),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            moe=_gguf_moe(metadata, arch, get, names),
        )
        if arch in GEMMA_ARCHITECTURES:
            return _gguf_gemma(config, metadata)
        rope_dims = metadata.get(f"{arch}.rope.dimension_count")
        if rope_dims is not None and int(rope_dims) != head_dim:
            if arch != "phi3":
                raise UnsupportedModel(
                    f"{arch}.rope.dimension_count {rope_dims} differs from the head size {head_dim}: partial "
                    "rotary embeddings are served for phi3 (Phi-4-mini) only"
                )
            config = replace(config, rotary_dim=int(rope_dims))
        if arch == "phi3":
            window = metadata.get("phi3.attention.sliding_window")
            return replace(config, sliding_window=_window_within(window, config.max_position_embeddings))
        return config


def with_gguf_longrope(
    config: ModelConfig, metadata: Mapping[str, Any], factors: Mapping[str, Any]
) -> ModelConfig:
    """LongRoPE scaling from a GGUF file: the factor tensors (rope_factors_short/long), the original
    context and the attention factor llama.cpp's converter writes."""
    arch = config.architecture
    original = metadata.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ModelLoadError(f"GGUF LongRoPE factors without {arch}.rope.scaling.original_context_length")
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        "short_factor": tuple(float(f) for f in factors["short_factor"]),
        "long_factor": tuple(float(f) for f in factors["long_factor"]),
        "original_max_position_embeddings": int(original),
        "factor": config.max_position_embeddings / int(original),
    }
    attn_factor = metadata.get(f"{arch}.rope.scaling.attn_factor")
    if attn_factor is not None:
        scaling["attention_factor"] = float(attn_factor)
    return replace(config, rope_scaling=scaling)


def _window_within(window: Any, max_positions: int) -> int | None:
    """A sliding window that can matter: None when unset or at least the context (Phi-4-mini sets
    262144 for a 131072-token context), so such a model attends, and caches, as one without."""
    if not window or int(window) >= max_positions:
        return None
    return int(window)


def _gguf_gemma(config: ModelConfig, metadata: Mapping[str, Any]) -> ModelConfig:
    """Gemma's extras as llama.cpp reads them: the window and its layer pattern (every 2nd layer of
    Gemma 2 global, every 6th of Gemma 3), Gemma 3's local RoPE base 10000, and the query scale
    (hidden / heads for the 27B models, head_dim for the others)."""
    arch = config.architecture
    n = config.num_hidden_layers
    gemma2 = arch == "gemma2"
    pattern = metadata.get(f"{arch}.attention.sliding_window_pattern") or (2 if gemma2 else 6)
    window = metadata.get(f"{arch}.attention.sliding_window")
    if isinstance(pattern, list):  # one flag per layer, true = sliding window
        if len(pattern) != n:
            raise ModelLoadError(
                f"{arch}.attention.sliding_window_pattern has {len(pattern)} flags for {n} layers"
            )
        sliding = tuple(bool(p) for p in pattern)
    else:
        sliding = tuple(bool((i + 1) % int(pattern)) for i in range(n))
    is_27b = n == (46 if gemma2 else 62)
    scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
    return replace(
        config,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(window) if window else None,
        sliding_layers=sliding if window else (),
        rope_local_theta=0.0 if gemma2 else 10000.0,
        query_pre_attn_scalar=float(scalar),
        attn_logit_softcapping=float(metadata.get(f"{arch}.attn_logit_softcapping") or 0.0),
        final_logit_softcapping=float(metadata.get(f"{arch}.final_logit_softcapping") or 0.0),
    )


def _hf_num_labels(d: Mapping[str, Any]) -> int:
    """transformers' rule: as many labels as id2label names, else num_labels, else 2."""
    id2label = d.get("id2label")
    if isinstance(id2label, Mapping) and id2label:
        return len(id2label)
    return int(d.get("num_labels", 2))


def hf_architecture(d: Mapping[str, Any]) -> str:
    """The registry key of a config.json: the model type of a known `architectures` entry, else that
    entry (or the model_type) as is."""
    archs = d.get("architectures") or []
    for name in archs:
        if name in _HF_ARCH_TO_TYPE:
            return _HF_ARCH_TO_TYPE[name]
    model_type = d.get("model_type")
    if isinstance(model_type, str) and not archs:
        return model_type
    if archs:
        return str(archs[0])
    raise ModelLoadError("config.json has neither 'architectures' nor 'model_type'")


def _reject_unsupported_hf_features(d: Mapping[str, Any]) -> None:
    # Refuse loudly rather than compute something subtly different from the reference model.
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModel(f"hidden_act {act!r} is not supported (only 'silu')")
    if d.get("mlp_bias"):
        raise UnsupportedModel("mlp_bias=true is not supported")
    if d.get("use_sliding_window"):
        raise UnsupportedModel("use_sliding_window=true is not supported")
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModel("partial_rotary_factor != 1 is not supported")


def _hf_moe(d: Mapping[str, Any], architecture: str) -> MoeConfig | None:
    """A Qwen3-MoE or Mixtral config.json's experts (None for a dense architecture)."""
    if architecture not in MOE_ARCHITECTURES:
        return None
    num_layers = int(d["num_hidden_layers"])
    if architecture == "mixtral":
        window = d.get("sliding_window")
        if window is not None and int(window) < int(d.get("max_position_embeddings", 2048)):
            raise ModelLoadError("a Mixtral sliding_window shorter than the context is not supported")
        return MoeConfig(
            num_experts=int(d.get("num_local_experts", 8)),
            num_experts_per_tok=int(d.get("num_experts_per_tok", 2)),
            expert_intermediate_size=int(d["intermediate_size"]),
            norm_topk_prob=True,
        )
    step = int(d.get("decoder_sparse_step", 1))
    mlp_only = {int(i) for i in d.get("mlp_only_layers") or ()}
    num_experts = int(d.get("num_experts", 128))
    dense = tuple(
        i for i in range(num_layers) if i in mlp_only or num_experts == 0 or step < 1 or (i + 1) % step
    )
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(d.get("num_experts_per_tok", 8)),
        expert_intermediate_size=int(d.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(d.get("norm_topk_prob", False)),
        dense_layers=dense,
    )


def _gguf_moe(metadata: Mapping[str, Any], arch: str, get: Any, names: set[str]) -> MoeConfig | None:
    """A GGUF file's experts: qwen3moe, or llama with expert_count (Mixtral). llama.cpp always
    renormalizes the top-k weights of both (as transformers' GGUF loader sets norm_topk_prob); a layer
    without a router tensor (ffn_gate_inp) is dense."""
    num_experts = int(metadata.get(f"{arch}.expert_count") or 0)
    if arch not in ("qwen3moe", "llama") or num_experts == 0:
        return None
    expert_size = metadata.get(f"{arch}.expert_feed_forward_length") or get("feed_forward_length")
    return MoeConfig(
        num_experts=num_experts,
        num_experts_per_tok=int(get("expert_used_count")),
        expert_intermediate_size=int(expert_size),
        norm_topk_prob=True,
        dense_layers=tuple(
            i for i in range(int(get("block_count"))) if f"blk.{i}.ffn_gate_inp.weight" not in names
        ),
    )


def _hf_rope(d: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic fields or transformers 5's `rope_parameters`."""
    params = dict(d.get("rope_parameters") or {})
    theta = float(d.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = d.get("rope_scaling") or params or None
    if scaling is None:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type in ("su", "longrope", "yarn"):
        # Phi-3 keeps the original context at the top level ("su" is LongRoPE's first name); a missing
        # factor is the context extension, as transformers derives it.
        rope_type = "longrope" if rope_type == "su" else rope_type
        if "original_max_position_embeddings" in d:
            scaling.setdefault("original_max_position_embeddings", d["original_max_position_embeddings"])
        if scaling.get("factor") is None and "original_max_position_embeddings" in scaling:
            scaling["factor"] = float(d.get("max_position_embeddings", 2048)) / float(
                scaling["original_max_position_embeddings"]
            )
    return theta, {"rope_type": rope_type, **scaling}


def _gguf_rope_scaling(
    metadata: Mapping[str, Any], arch: str, rope_freq_factors: Sequence[float] | None
) -> dict[str, Any] | None:
    if rope_freq_factors is not None:
        return {"rope_type": "freq_factors", "freq_factors": tuple(float(f) for f in rope_freq_factors)}
    scaling_type = metadata.get(f"{arch}.rope.scaling.type")
    if scaling_type in (None, "none"):
        return None
    if scaling_type == "linear":
        return {"rope_type": "linear", "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if scaling_type == "yarn":
        # llama.cpp's keys (convert_hf_to_gguf writes the factor and the original context length).
        factor = metadata.get(f"{arch}.rope.scaling.factor")
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if factor is None or original is None:
            raise ModelLoadError(
                f"GGUF yarn rope scaling needs {arch}.rope.scaling.factor and .original_context_length"
            )
        yarn: dict[str, Any] = {
            "rope_type": "yarn",
            "factor": float(factor),
            "original_max_position_embeddings": int(original),
        }
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in metadata:
                yarn[name] = float(metadata[f"{arch}.rope.scaling.{key}"])
        return yarn
    raise UnsupportedModel(
        f"GGUF rope scaling type {scaling_type!r} is not supported (supported: none, linear, yarn, rope_freqs)"
    )


def _check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    if scaling is None:
        return
    rope_type = scaling.get("rope_type")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModel(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    required: tuple[str, ...] = {
        "default": (),
        "linear": ("factor",),
        "llama3": _LLAMA3_KEYS,
        "freq_factors": ("freq_factors",),
        "yarn": ("factor", "original_max_position_embeddings"),
        "longrope": ("short_factor", "long_factor", "original_max_position_embeddings"),
    }[rope_type]
    missing = [k for k in required if k not in scaling]
    if missing:
        raise ModelLoadError(f"rope_scaling type {rope_type!r} lacks {', '.join(missing)}")
