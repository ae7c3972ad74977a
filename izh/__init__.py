"""izh: an OpenAI-compatible LLM inference server with its own engine."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from izh.llm import LLM
    from izh.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import izh` (the API process, the CLI) never pulls in torch.
    if name == "LLM":
        from izh.llm import LLM

        return LLM
    if name == "SamplingParams":
        from izh.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'izh' has no attribute {name!r}")
