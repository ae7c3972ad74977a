"""Tokenizers from tokenizer.json or GGUF metadata, chat templates in a jinja2 sandbox, and the
incremental detokenizer. Imports no torch: this runs in the API process."""

from __future__ import annotations

from izh.tokenizer.detokenizer import IncrementalDetokenizer
from izh.tokenizer.loader import load_tokenizer
from izh.tokenizer.tokenizer import Tokenizer

__all__ = ["IncrementalDetokenizer", "Tokenizer", "load_tokenizer"]
