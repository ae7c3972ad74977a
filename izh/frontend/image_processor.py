"""The image processor of an Idefics3 (SmolVLM) model, in numpy and Pillow (the API process loads no torch).

It does what transformers' Idefics3ImageProcessor (its Pillow backend) and Idefics3Processor do, read from
the model folder's preprocessor_config.json, processor_config.json and config.json:

- an image is converted to RGB (transparency composited onto white), its longest edge resized to
  `size.longest_edge` (the other edge keeping the aspect ratio, rounded up to even), then both edges up
  to multiples of the tile edge (`max_image_size.longest_edge`);
- an image larger than one tile is cut into rows x cols tiles, followed by the whole image squeezed into
  one tile (the global image); a smaller one is a single tile;
- each tile is rescaled (1/255) and normalized (mean, std) into float32 [3, tile, tile];
- the prompt's `<image>` (one per image, from the chat template) becomes `<fake_token_around_image>`,
  `<row_R_col_C>` and `image_seq_len` `<image>` tokens per tile, a newline after each row, then the
  global image's `<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
  `<fake_token_around_image>`.

The vision encoder (izh.model.idefics3) turns each tile into `image_seq_len` embeddings, which replace the
`<image>` tokens' embeddings in order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from izh.engine_messages import ImageInput
from izh.errors import InvalidRequest, ModelLoadError

FAKE_IMAGE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_IMAGE_TOKEN = "<global-img>"
MAX_IMAGE_SIZE = 4096
"""transformers' absolute bound on a resized image's edge."""

_RESAMPLE = {
    0: Image.Resampling.NEAREST,
    1: Image.Resampling.LANCZOS,
    2: Image.Resampling.BILINEAR,
    3: Image.Resampling.BICUBIC,
    4: Image.Resampling.BOX,
    5: Image.Resampling.HAMMING,
}


@dataclass(frozen=True, slots=True)
class ProcessedImage:
    """One image ready for the vision encoder: its tiles and where they go in the prompt."""

    pixel_values: np.ndarray
    """float32 [num_tiles, 3, tile, tile]: the rows x cols tiles (row-major), then the global image."""
    rows: int
    cols: int
    """0 and 0 for an image that fit in one tile."""

    @property
    def num_tiles(self) -> int:
        return int(self.pixel_values.shape[0])


@dataclass(frozen=True, slots=True)
class Idefics3ImageProcessor:
    """The model's preprocessing settings and prompt layout (from its folder: `load_image_processor`)."""

    image_token_id: int
    image_seq_len: int
    """<image> tokens per tile."""
    tile: int
    """The tile edge in pixels (the vision encoder's input size)."""
    longest_edge: int
    """An image's longest edge is resized to this before tiling."""
    do_resize: bool = True
    do_image_splitting: bool = True
    do_convert_rgb: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: int = 1

    # --- pixels -------------------------------------------------------------------------------------

    def preprocess(self, image: Image.Image) -> ProcessedImage:
        """The tiles of one decoded image (as Idefics3ImageProcessor's Pillow backend makes them)."""
        pixels = _to_rgb(image) if self.do_convert_rgb else np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        if self.do_resize:
            h, w = _rescale_to_max_len(pixels.shape[0], pixels.shape[1], self.longest_edge)
            h, w = _scale_below_upper_bound(h, w, MAX_IMAGE_SIZE)
            pixels = self._resize(pixels, h, w)
        tile = self.tile
        rows = cols = 0
        if self.do_image_splitting:
            pixels = self._resize(pixels, *_multiples_of(pixels.shape[0], pixels.shape[1], tile))
            height, width = pixels.shape[:2]
            if height > tile or width > tile:
                rows = (height - tile) // tile + 1
                cols = (width - tile) // tile + 1
                tiles = [
                    pixels[r * tile : (r + 1) * tile, c * tile : (c + 1) * tile]
                    for r in range(rows)
                    for c in range(cols)
                ]
                tiles.append(self._resize(pixels, tile, tile))
            else:
                tiles = [pixels]
        else:
            tiles = [self._resize(pixels, tile, tile)]
        stacked = np.stack([np.moveaxis(t, -1, 0) for t in tiles])  # [n, C, tile, tile] uint8
        values = stacked.astype(np.float32)
        if self.do_rescale:
            values = (stacked.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            mean = np.asarray(self.image_mean, dtype=np.float32)[None, :, None, None]
            std = np.asarray(self.image_std, dtype=np.float32)[None, :, None, None]
            values = (values - mean) / std
        return ProcessedImage(np.ascontiguousarray(values, dtype=np.float32), rows, cols)

    def _resize(self, pixels: np.ndarray, height: int, width: int) -> np.ndarray:
        if pixels.shape[:2] == (height, width):
            return pixels
        channels = pixels.shape[2]
        image = Image.fromarray(pixels[:, :, 0] if channels == 1 else pixels)
        resized = np.asarray(image.resize((width, height), resample=_RESAMPLE.get(self.resample)))
        return resized[:, :, None] if resized.ndim == 2 else resized

    # --- the prompt ---------------------------------------------------------------------------------

    def placeholder_text(self, image: ProcessedImage) -> str:
        """What one `<image>` of the rendered prompt becomes (Idefics3Processor's expansion)."""
        image_tokens = IMAGE_TOKEN * self.image_seq_len
        global_part = f"{FAKE_IMAGE_TOKEN}{GLOBAL_IMAGE_TOKEN}{image_tokens}{FAKE_IMAGE_TOKEN}"
        if image.rows == 0 and image.cols == 0:
            return global_part
        text = ""
        for r in range(image.rows):
            for c in range(image.cols):
                text += f"{FAKE_IMAGE_TOKEN}<row_{r + 1}_col_{c + 1}>{image_tokens}"
            text += "\n"
        return f"{text}\n{global_part}"

    def expand_prompt(self, text: str, images: list[ProcessedImage]) -> str:
        """The rendered prompt with its `<image>` markers (exactly one per image) expanded."""
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise ValueError(
                f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} markers for {len(images)} images"
            )
        out = [pieces[0]]
        for image, piece in zip(images, pieces[1:], strict=True):
            out.append(self.placeholder_text(image))
            out.append(piece)
        return "".join(out)

    def build_prompt(
        self,
        text: str,
        images: Sequence[tuple[Image.Image, str]],
        encode: Callable[[str], list[int]],
        *,
        low_detail: Sequence[bool] = (),
    ) -> tuple[list[int], list[ImageInput]]:
        """A rendered prompt with one `<image>` per image, and its (decoded image, content hash) pairs ->
        the token ids of the expanded prompt and the images as the engine takes them. An image whose
        `low_detail` is true is one tile (not split: OpenAI's detail "low"). ValueError when the markers or
        the placeholder tokens do not match the images (the text itself holds `<image>`)."""
        single = replace(self, do_image_splitting=False)
        processed = [
            (single if k < len(low_detail) and low_detail[k] else self).preprocess(image)
            for k, (image, _) in enumerate(images)
        ]
        token_ids = encode(self.expand_prompt(text, processed))
        ranges = self.placeholder_ranges(token_ids, processed)
        inputs = [
            ImageInput(
                pixel_values=p.pixel_values.astype("<f4", copy=False).tobytes(),
                shape=(
                    p.num_tiles,
                    p.pixel_values.shape[1],
                    p.pixel_values.shape[2],
                    p.pixel_values.shape[3],
                ),
                offset=offset,
                length=length,
                content_hash=content_hash,
            )
            for p, (offset, length), (_, content_hash) in zip(processed, ranges, images, strict=True)
        ]
        return token_ids, inputs

    def placeholder_ranges(self, token_ids: list[int], images: list[ProcessedImage]) -> list[tuple[int, int]]:
        """(offset, length) of each image's placeholders in the tokenized expanded prompt: from its first
        `<image>` token to its last (the tile separators between them included). Raises ValueError when the
        prompt holds another number of `<image>` tokens than the images fill (`<image>` typed as text)."""
        positions = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        needed = [image.num_tiles * self.image_seq_len for image in images]
        if len(positions) != sum(needed):
            raise ValueError(
                f"the prompt holds {len(positions)} {IMAGE_TOKEN} tokens, its images fill {sum(needed)}"
            )
        ranges = []
        start = 0
        for count in needed:
            first, last = positions[start], positions[start + count - 1]
            ranges.append((first, last - first + 1))
            start += count
        return ranges


def _to_rgb(image: Image.Image) -> np.ndarray:
    """transformers' convert_to_rgb: transparency composited onto a white background."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(background, rgba).convert("RGB"))
    return np.asarray(image.convert("RGB"))


def _rescale_to_max_len(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height:
        width = max_len
        height = int(width / aspect_ratio)
        if height % 2 != 0:
            height += 1
    else:
        height = max_len
        width = int(height * aspect_ratio)
        if width % 2 != 0:
            width += 1
    return max(height, 1), max(width, 1)


def _scale_below_upper_bound(height: int, width: int, max_len: int) -> tuple[int, int]:
    aspect_ratio = width / height
    if width >= height and width > max_len:
        width = max_len
        height = int(width / aspect_ratio)
    elif height > width and height > max_len:
        height = max_len
        width = int(height * aspect_ratio)
    return max(height, 1), max(width, 1)


def _multiples_of(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both edges up to multiples of the tile (transformers' resize_for_vision_encoder)."""
    aspect_ratio = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = int(width / aspect_ratio)
        height = math.ceil(height / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = int(height * aspect_ratio)
        width = math.ceil(width / tile) * tile
    return height, width


def check_no_image_placeholders(prompt_token_ids: list[int], image_token_id: int, param: str) -> None:
    """A VLM's prompt without images may not hold its image placeholder token: the model would read the
    placeholder's own embedding where features belong (transformers refuses it too)."""
    if image_token_id in prompt_token_ids:
        raise InvalidRequest(
            f"the {param} holds the model's image placeholder token but no image; send images as image_url "
            "parts of a chat message",
            param=param,
        )


IMAGE_MODEL_TYPES = frozenset({"idefics3"})


def load_image_processor(model: str) -> Idefics3ImageProcessor | None:
    """The image processor of a VLM's Hugging Face folder; None for a text-only model (or a GGUF file)."""
    folder = Path(model)
    config = _read_json(folder / "config.json") if folder.is_dir() else {}
    if config.get("model_type") not in IMAGE_MODEL_TYPES:
        return None
    pre = _read_json(folder / "preprocessor_config.json")
    proc = _read_json(folder / "processor_config.json")
    vision = config.get("vision_config") or {}
    try:
        image_size = int(vision.get("image_size", 224))
        patch_size = int(vision.get("patch_size", 32))
        scale_factor = int(config.get("scale_factor", 2))
        image_seq_len = int(
            proc.get("image_seq_len") or ((image_size // patch_size) ** 2) // (scale_factor**2)
        )
        max_image_size = pre.get("max_image_size") or {"longest_edge": image_size}
        size = pre.get("size") or {"longest_edge": 4 * int(max_image_size["longest_edge"])}
        return Idefics3ImageProcessor(
            image_token_id=int(config["image_token_id"]),
            image_seq_len=image_seq_len,
            tile=int(max_image_size["longest_edge"]),
            longest_edge=int(size["longest_edge"]),
            do_resize=bool(pre.get("do_resize", True)),
            do_image_splitting=bool(pre.get("do_image_splitting", True)),
            do_convert_rgb=bool(pre.get("do_convert_rgb", True)),
            do_rescale=bool(pre.get("do_rescale", True)),
            rescale_factor=float(pre.get("rescale_factor", 1 / 255)),
            do_normalize=bool(pre.get("do_normalize", True)),
            image_mean=_triple(pre.get("image_mean", 0.5)),
            image_std=_triple(pre.get("image_std", 0.5)),
            resample=int(pre.get("resample", 1)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"cannot read the image processor settings of {model}: {e!r}") from e


def _triple(value: Any) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    a, b, c = (float(v) for v in value)
    return a, b, c


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}
