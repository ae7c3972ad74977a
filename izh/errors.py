"""The error tree. Each error knows its HTTP status and OpenAI error type; one handler maps them."""

from __future__ import annotations

import signal


class IzhError(Exception):
    """Base of every error izh reports to a user or a client."""

    status_code: int = 500
    error_type: str = "internal_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def to_dict(self) -> dict[str, dict[str, str | None]]:
        """OpenAI's error envelope."""
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }


class InvalidRequest(IzhError):
    """The request is malformed or asks for something impossible (HTTP 400)."""

    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus max_tokens) does not fit the model's context."""

    default_code = "context_length_exceeded"


class LimitExceeded(InvalidRequest):
    """A request asks for more than a `[limits]` setting allows (HTTP 400)."""

    default_code = "limit_exceeded"


class LoraAdapterError(InvalidRequest):
    """A LoRA adapter cannot be served: a bad folder, an unsupported option, a rank above max_lora_rank,
    a duplicate name (HTTP 400)."""

    default_code = "invalid_lora_adapter"


class Unauthorized(IzhError):
    status_code = 401
    error_type = "authentication_error"
    default_code = "invalid_api_key"


class NotFound(IzhError):
    status_code = 404
    error_type = "not_found_error"


class ModelNotFound(NotFound):
    default_code = "model_not_found"


class RequestTimeout(IzhError):
    """The client did not send its request body in time (HTTP 408)."""

    status_code = 408
    error_type = "invalid_request_error"
    default_code = "request_timeout"


class PayloadTooLarge(IzhError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "payload_too_large"


class RateLimited(IzhError):
    status_code = 429
    error_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"


class RateLimitExceeded(RateLimited):
    """429: the key's bucket or concurrency is exhausted; retry after `retry_after_s`."""

    def __init__(self, message: str, *, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Overloaded(IzhError):
    """Admission refused: too many requests in flight, or draining (HTTP 503)."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "overloaded"


class EngineDead(IzhError):
    """The engine core died or hung; every in-flight request fails with this."""

    status_code = 503
    error_type = "service_unavailable_error"
    default_code = "engine_dead"


class ModelLoadError(IzhError):
    """Weights, config or tokenizer could not be loaded; the message names what and why."""

    status_code = 500
    error_type = "internal_error"
    default_code = "model_load_error"


class UnsupportedModel(ModelLoadError):
    """The model reads fine, but izh does not serve its architecture, tokenizer or one of its features."""

    default_code = "unsupported_model"


class ModelSettingsError(ModelLoadError):
    """The model reads fine, but a setting does not fit it or this machine (a max_model_len past its
    context, a dtype or KV cache format the device cannot run); the message names the setting."""

    default_code = "model_settings_error"


class ModelDownloadError(ModelLoadError):
    """Fetching a model failed: the network, the source (status, checksum) or the free disk space."""

    default_code = "model_download_failed"


def model_load_error(message: str, code: str | None) -> ModelLoadError:
    """The ModelLoadError (sub)class whose code is `code`: a load error that crossed the process
    boundary as text keeps its kind (and so its CLI hint)."""
    for cls in (UnsupportedModel, ModelSettingsError, ModelDownloadError):
        if code == cls.default_code:
            return cls(message)
    return ModelLoadError(message, code=code)


class HTTPStatusError(IzhError):
    """A plain HTTP error raised by the framework (405, ...) that has no class of its own here."""

    error_type = "invalid_request_error"

    def __init__(self, message: str, status_code: int) -> None:
        super().__init__(message)
        self.status_code = status_code


def describe_exit(exit_code: int | None) -> str:
    """How a child process ended, for messages: "killed by SIGKILL", "exit code 1" (None: unknown)."""
    if exit_code is None:
        return "exit code unknown"
    if exit_code < 0:
        try:
            return f"killed by {signal.Signals(-exit_code).name}"
        except ValueError:
            return f"killed by signal {-exit_code}"
    return f"exit code {exit_code}"
