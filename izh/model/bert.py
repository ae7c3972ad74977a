"""BERT, the encoder of sentence-transformers models (all-MiniLM-L6-v2 and kin), over a flat batch.

Bidirectional attention over each whole sequence (no causal mask, no KV cache: the engine schedules
an encoder's request whole and pools it in the same step), absolute position embeddings (from
`position_offset`: RoBERTa's start past its padding index), token types (0 unless the runner passes
a pair's types: a cross-encoder's second segment is type 1), post-LayerNorm residual blocks, GELU. Module and parameter names are transformers'
`BertModel`'s, so its checkpoints load as they are (a `bert.` prefix, as BertForMaskedLM writes, is
stripped by the loader; the unused pooler and heads are skipped).

The linears run on the flat [num_tokens, hidden] batch; only attention pads it to
[num_seqs, longest, ...] for torch's scaled_dot_product_attention with a key-padding mask (none when
every sequence has the same length), built once per step and shared by every layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from izh.errors import ModelLoadError
from izh.model.attention import AttentionMetadata
from izh.model.config import ModelConfig
from izh.model.layers import Linear

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


class LayerNorm(nn.Module):
    """transformers' BERT LayerNorm (weight and bias), uninitialized until loaded."""

    def __init__(self, size: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Embedding(nn.Module):
    def __init__(self, num: int, size: int, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, size, dtype=dtype), requires_grad=False)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, h, dtype=dtype)
        self.position_offset = config.position_offset
        num_positions = config.max_position_embeddings + config.position_offset
        self.position_embeddings = Embedding(num_positions, h, dtype=dtype)
        self.token_type_embeddings = Embedding(max(config.type_vocab_size, 1), h, dtype=dtype)
        self.LayerNorm = LayerNorm(h, config.rms_norm_eps, dtype=dtype)

    def forward(self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        x = F.embedding(input_ids, self.word_embeddings.weight)
        x = x + F.embedding(positions + self.position_offset, self.position_embeddings.weight)
        if token_type_ids is None:
            x = x + self.token_type_embeddings.weight[0]  # token type 0 for every token
        else:
            x = x + F.embedding(token_type_ids, self.token_type_embeddings.weight)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    """q, k and v in one matmul (checkpoint shards query, key, value)."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.qkv = Linear(h, (h, h, h), bias=True, dtype=dtype, shard_names=("query", "key", "value"))


class BertSelfOutput(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, (config.hidden_size,), bias=True, dtype=dtype)
        self.LayerNorm = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, dtype=dtype)
        self.output = BertSelfOutput(config, dtype=dtype)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(config.hidden_size, (config.intermediate_size,), bias=True, dtype=dtype)


class BertOutput(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.dense = Linear(config.intermediate_size, (config.hidden_size,), bias=True, dtype=dtype)
        self.LayerNorm = LayerNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)


class _Padding:
    """How a step's flat tokens sit in a padded [num_seqs, longest] batch, for attention."""

    def __init__(self, query_lens: list[int], device: torch.device) -> None:
        self.num_seqs = len(query_lens)
        self.longest = max(query_lens)
        self.uniform = min(query_lens) == self.longest
        self.index: Tensor | None = None
        self.mask: Tensor | None = None
        if not self.uniform:
            lens = torch.tensor(query_lens, device=device)
            slots = torch.arange(self.longest, device=device)
            valid = slots.unsqueeze(0) < lens.unsqueeze(1)  # [num_seqs, longest]
            self.index = valid.flatten().nonzero().squeeze(1)  # flat token -> padded slot
            self.mask = valid[:, None, None, :]  # keys each query may see


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.approximate = _ACTIVATIONS[config.hidden_act]
        self.attention = BertAttention(config, dtype=dtype)
        self.intermediate = BertIntermediate(config, dtype=dtype)
        self.output = BertOutput(config, dtype=dtype)

    def _attend(self, x: Tensor, padding: _Padding) -> Tensor:
        hidden = x.shape[1]
        qkv = self.attention.self.qkv(x)  # [num_tokens, 3 * hidden]
        if not padding.uniform:
            assert padding.index is not None
            padded = qkv.new_zeros(padding.num_seqs * padding.longest, 3 * hidden)
            qkv = padded.index_copy_(0, padding.index, qkv)
        qkv = qkv.view(padding.num_seqs, padding.longest, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [num_seqs, heads, longest, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding.mask)
        out = out.transpose(1, 2).reshape(padding.num_seqs * padding.longest, hidden)
        if not padding.uniform:
            assert padding.index is not None
            out = out.index_select(0, padding.index)
        return out

    def forward(self, x: Tensor, padding: _Padding) -> Tensor:
        attn = self.attention.output
        x = attn.LayerNorm(attn.dense(self._attend(x, padding)) + x)
        h = F.gelu(self.intermediate.dense(x), approximate=self.approximate)
        return self.output.LayerNorm(self.output.dense(h) + x)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype=dtype) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """An encoder over a flat batch of whole sequences; returns the last layer's hidden states."""

    is_encoder = True

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(
                f"hidden_act {config.hidden_act!r} is not supported for BERT ({', '.join(_ACTIVATIONS)})"
            )
        self.config = config
        self.dtype = dtype
        self.embeddings = BertEmbeddings(config, dtype=dtype)
        self.encoder = BertEncoder(config, dtype=dtype)

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attn_metadata: AttentionMetadata,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """Hidden states [num_tokens, hidden_size] of whole sequences (each sequence's tokens are all
        in this batch: query lengths equal sequence lengths); `token_type_ids` [num_tokens] or None
        (type 0 throughout)."""
        query_lens = attn_metadata.host_query_lens()
        padding = _Padding(query_lens, input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, padding)
        return x

    def bind_kv_caches(self, kv_caches: list[Tensor] | None) -> None:
        """An encoder keeps no KV cache: only an empty list (or None) is accepted."""
        if kv_caches:
            raise ValueError("an encoder takes no KV caches")
