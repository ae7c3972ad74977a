"""load_tokenizer: a model's Tokenizer from a HF folder or a GGUF file."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from izh.errors import ModelLoadError
from izh.tokenizer.gguf_tokenizer import load_gguf_tokenizer
from izh.tokenizer.hf_tokenizer import load_hf_tokenizer
from izh.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """The Tokenizer of a model: `path` is a HF folder holding tokenizer.json, or a .gguf file.

    Raises ModelLoadError when the path holds neither, or the tokenizer cannot be built.
    """
    path = Path(path)
    start_s = time.perf_counter()
    if path.is_file() and path.suffix.lower() == ".gguf":
        tokenizer = load_gguf_tokenizer(path)
    elif path.is_dir():
        tokenizer = load_hf_tokenizer(path)
    elif not path.exists():
        raise ModelLoadError(f"tokenizer path {path} does not exist")
    else:
        raise ModelLoadError(f"{path} is neither a model folder nor a .gguf file")
    logger.info("loaded tokenizer from %s in %.2fs: %r", path, time.perf_counter() - start_s, tokenizer)
    return tokenizer
