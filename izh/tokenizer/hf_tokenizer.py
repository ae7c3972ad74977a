"""Loading the Tokenizer of a Hugging Face model folder (tokenizer.json and its companions)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import tokenizers

from izh.errors import ModelLoadError
from izh.tokenizer.tokenizer import SPECIAL_TOKEN_NAMES, Tokenizer

logger = logging.getLogger(__name__)


def load_hf_tokenizer(folder: str | Path) -> Tokenizer:
    """The Tokenizer of a HF folder: tokenizer.json (required), tokenizer_config.json,
    special_tokens_map.json, generation_config.json, chat_template.jinja / chat_template.json and
    additional_chat_templates/*.jinja (all optional).

    BOS/EOS come from tokenizer.json's post-processor alone, as in transformers 5, which ignores
    tokenizer_config's add_bos_token/add_eos_token when tokenizer.json exists. Raises
    ModelLoadError on unreadable files.
    """
    folder = Path(folder)
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json (izh needs a fast tokenizer file)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:
        raise ModelLoadError(f"cannot load {tokenizer_file}: {exc}") from exc
    # Some tokenizer.json files (sentence-transformers' BERT ones) carry truncation and padding
    # settings; izh never cuts or pads silently: a too-long prompt is refused where it is validated.
    backend.no_truncation()
    backend.no_padding()
    config = _read_json(folder / "tokenizer_config.json")
    special_tokens = _special_tokens(config, _read_json(folder / "special_tokens_map.json"))
    return Tokenizer(
        backend,
        special_tokens=special_tokens,
        chat_templates=_chat_templates(folder, config),
        generation_config=_read_json(folder / "generation_config.json"),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return value


def _token_content(value: Any) -> str | None:
    # tokenizer_config spells a token as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _special_tokens(config: dict[str, Any], special_tokens_map: dict[str, Any]) -> dict[str, str]:
    special = {}
    for name in SPECIAL_TOKEN_NAMES:
        content = _token_content(config.get(name, special_tokens_map.get(name)))
        if content:
            special[name] = content
    return special


def _chat_templates(folder: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named templates; "default" is the model's. chat_template.jinja wins over tokenizer_config."""
    templates: dict[str, str] = {}
    legacy = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        templates["default"] = legacy
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        for entry in configured:
            if (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                templates[entry["name"]] = entry["template"]
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    return templates
