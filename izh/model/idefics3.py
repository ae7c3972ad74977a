"""Idefics3 (SmolVLM): a SigLIP-style vision encoder and a pixel-shuffle connector in front of izh's Llama.

`encode_images` turns image tiles (izh.frontend.image_processor) into embeddings of the text model's width,
`image_seq_len` per tile; the caller puts them in place of the `<image>` tokens' embeddings and runs the
decoder on `inputs_embeds`. Text-only steps, and every decode step, are plain Llama steps (the fused
decode stack included).

Parameter names: the vision tower and connector keep transformers' (`vision_model.`, `connector.`) and the
decoder is LlamaForCausalLM's; the loader maps the checkpoint's `model.text_model.` / `model.vision_model.`
/ `model.connector.` prefixes onto them (`checkpoint_name`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from izh.model.config import ModelConfig, VisionConfig
from izh.model.llama import LlamaForCausalLM


class VisionEmbeddings(nn.Module):
    """Patch convolution + learned position embeddings (bucketed, as Idefics3VisionEmbeddings does)."""

    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = vision.patch_size
        self.num_patches_per_side = vision.image_size // vision.patch_size
        self.patch_embedding = nn.Conv2d(
            vision.num_channels,
            vision.hidden_size,
            kernel_size=vision.patch_size,
            stride=vision.patch_size,
            padding="valid",
            dtype=dtype,
        )
        self.position_embedding = nn.Embedding(self.num_patches_per_side**2, vision.hidden_size, dtype=dtype)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """[n, C, H, W] -> [n, patches, hidden]. Every tile is whole (no padding), so each patch's position
        is its fractional coordinate bucketed onto the trained num_patches_per_side grid."""
        n, _, height, width = pixel_values.shape
        embeddings = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        patches_h, patches_w = height // self.patch_size, width // self.patch_size
        side = self.num_patches_per_side
        device = pixel_values.device
        boundaries = torch.arange(1 / side, 1.0, 1 / side, device=device)
        # As transformers computes them (float32 steps from int64 patch counts), so that positions on a
        # bucket edge fall the same way.
        counts = torch.tensor([patches_h, patches_w], device=device)
        step = 1.0 / counts
        coords_h = torch.arange(patches_h, device=device, dtype=torch.float32) * step[0]
        coords_w = torch.arange(patches_w, device=device, dtype=torch.float32) * step[1]
        coords_h = torch.clamp(coords_h, max=1.0 - 1e-6)
        coords_w = torch.clamp(coords_w, max=1.0 - 1e-6)
        bucket_h = torch.bucketize(coords_h, boundaries, right=True)
        bucket_w = torch.bucketize(coords_w, boundaries, right=True)
        position_ids = (bucket_h[:, None] * side + bucket_w[None, :]).reshape(-1)
        return embeddings + self.position_embedding(position_ids)[None].expand(n, -1, -1)


class VisionAttention(nn.Module):
    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden = vision.hidden_size
        self.num_heads = vision.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.k_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.v_proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, hidden, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        n, length, hidden = x.shape
        shape = (n, length, self.num_heads, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(1, 2)
        k = self.k_proj(x).view(shape).transpose(1, 2)
        v = self.v_proj(x).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional, within each tile
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class VisionMLP(nn.Module):
    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.fc1 = nn.Linear(vision.hidden_size, vision.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(vision.intermediate_size, vision.hidden_size, dtype=dtype)
        self.approximate = "tanh" if vision.hidden_act in ("gelu_pytorch_tanh", "gelu_new") else "none"

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class VisionEncoderLayer(nn.Module):
    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, eps = vision.hidden_size, vision.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.self_attn = VisionAttention(vision, dtype)
        self.layer_norm2 = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.mlp = VisionMLP(vision, dtype)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class VisionEncoder(nn.Module):
    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            VisionEncoderLayer(vision, dtype) for _ in range(vision.num_hidden_layers)
        )

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class VisionTransformer(nn.Module):
    """transformers' Idefics3VisionTransformer (its `model.vision_model.` tensors)."""

    def __init__(self, vision: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.embeddings = VisionEmbeddings(vision, dtype)
        self.encoder = VisionEncoder(vision, dtype)
        self.post_layernorm = nn.LayerNorm(vision.hidden_size, eps=vision.layer_norm_eps, dtype=dtype)

    def forward(self, pixel_values: Tensor) -> Tensor:
        return self.post_layernorm(self.encoder(self.embeddings(pixel_values)))


class ModalityProjection(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.proj = nn.Linear(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class Connector(nn.Module):
    """Pixel shuffle (scale_factor^2 neighbouring patches into one vector) and a linear projection."""

    def __init__(
        self, vision: VisionConfig, text_hidden_size: int, scale_factor: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.scale_factor = scale_factor
        self.modality_projection = ModalityProjection(
            vision.hidden_size * scale_factor**2, text_hidden_size, dtype
        )

    def pixel_shuffle(self, x: Tensor) -> Tensor:
        n, seq, dim = x.shape
        s = self.scale_factor
        side = int(seq**0.5)
        x = x.view(n, side, side // s, dim * s)
        x = x.permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, dim * s * s)
        x = x.permute(0, 2, 1, 3)
        return x.reshape(n, seq // (s * s), dim * s * s)

    def forward(self, x: Tensor) -> Tensor:
        return self.modality_projection(self.pixel_shuffle(x))


class Idefics3ForConditionalGeneration(LlamaForCausalLM):
    """The Llama decoder plus the vision tower; `encode_images` is the only addition to its interface."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(config, dtype=dtype)
        vision = config.vision
        if vision is None:
            raise ValueError("an Idefics3 ModelConfig needs its vision config")
        self.vision_model = VisionTransformer(vision, dtype)
        self.connector = Connector(vision, config.hidden_size, config.scale_factor, dtype)

    def encode_images(self, pixel_values: Tensor) -> Tensor:
        """Tiles [n, 3, tile, tile] (any float dtype) -> [n * image_seq_len, hidden_size] embeddings,
        tile by tile in order."""
        features = self.connector(self.vision_model(pixel_values.to(self.dtype)))
        return features.reshape(-1, features.shape[-1])

    @staticmethod
    def checkpoint_name(name: str) -> str | None:
        """This model's name for a transformers checkpoint tensor (None: not one of ours)."""
        for prefix, replacement in _CHECKPOINT_PREFIXES:
            if name.startswith(prefix):
                return replacement + name[len(prefix) :]
        return name if name.startswith("lm_head.") else None


_CHECKPOINT_PREFIXES = (
    ("model.text_model.", "model."),
    ("model.vision_model.", "vision_model."),
    ("model.connector.", "connector."),
)
