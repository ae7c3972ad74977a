"""Bad GGUF files get a ModelLoadError that says what is wrong and where: a tensor type izh cannot serve
(named with its tensor), a file cut short or corrupt (named by byte offset), never a crash in a kernel."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from izh.errors import ModelLoadError
from izh.model import load_model, load_model_config
from tests.model.test_gguf_blocks_model import Q4_K_M, write_random_gguf


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return Path(write_random_gguf(tmp_path_factory.mktemp("bad") / "good.gguf", "qwen2", Q4_K_M, tied=True))


def _both_fail(path: Path, match: str) -> None:
    with pytest.raises(ModelLoadError, match=match):
        load_model_config(str(path))
    with pytest.raises(ModelLoadError, match=match):
        load_model(str(path), dtype=torch.float32, gguf_blocks=True)


@pytest.mark.parametrize(
    ("qtype", "bytes_per_row"),
    [("Q8_K", 292), ("I32", 4 * 256), ("Q8_1", 8 * 40)],  # no kernel, not dequantizable / not a weight type
)
def test_a_tensor_type_izh_cannot_serve_names_the_tensor_and_the_type(
    qtype: str, bytes_per_row: int, tmp_path: Path
) -> None:
    raw_type = gguf.GGMLQuantizationType[qtype]
    data = np.zeros((512, bytes_per_row), dtype=np.uint8)
    path = write_random_gguf(
        tmp_path / "x.gguf", "qwen2", Q4_K_M, tied=True, replace={"blk.1.ffn_up.weight": (data, raw_type)}
    )
    _both_fail(Path(path), rf"GGUF tensor blk\.1\.ffn_up\.weight has type {qtype}, which izh cannot serve")


def test_a_file_cut_inside_the_tensor_data_names_the_tensor_and_its_offset(
    good_file: Path, tmp_path: Path
) -> None:
    data = good_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    _both_fail(
        cut,
        rf"tensor \S+ \(\w+, \d+ bytes at byte offset \d+\) runs past the end of the file at byte {len(data) - 1000}",
    )


@pytest.mark.parametrize("keep", [3, 10, 30, 200, 1000])  # the header: ~1.9 kB
def test_a_file_cut_inside_the_header_names_the_byte_offset(
    good_file: Path, tmp_path: Path, keep: int
) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good_file.read_bytes()[:keep])
    match = "not a GGUF file" if keep < 4 else r"corrupt or truncated header at byte offset \d+"
    _both_fail(cut, match)


def test_a_corrupt_string_length_names_its_offset(good_file: Path, tmp_path: Path) -> None:
    data = bytearray(good_file.read_bytes())
    data[24:32] = struct.pack("<Q", 1 << 40)  # the first key's length
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    _both_fail(bad, r"a string of 1099511627776 bytes at byte 32 runs past the end of the file")


def test_a_corrupt_tensor_type_id_is_named(good_file: Path, tmp_path: Path) -> None:
    data = bytearray(good_file.read_bytes())
    # The first tensor descriptor: name, n_dims, dims, type id. Find it by the first tensor's name.
    name = b"token_embd.weight"
    at = data.index(name) + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    data[type_at : type_at + 4] = struct.pack("<I", 9999)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    _both_fail(bad, r"GGUF tensor token_embd\.weight has type id 9999, which izh does not know")
