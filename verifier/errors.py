"""Typed errors of the serving path.

One mapping turns these into HTTP and gRPC status codes at the edge (`cluster/`):
`InvalidRequestError` -> 400 / INVALID_ARGUMENT, `OverloadedError` -> 429 or 503 /
RESOURCE_EXHAUSTED. Domain code raises them; it never formats a status code itself.
"""

from __future__ import annotations


class SplitspecError(Exception):
    """Base class of every error splitspec raises on purpose."""


class InvalidRequestError(SplitspecError, ValueError):
    """A request parameter is invalid; `param` names it as the API spells it.

    >>> str(InvalidRequestError("max_tokens", "must be >= 1, got 0"))
    'max_tokens: must be >= 1, got 0'
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.message = message


class OverloadedError(SplitspecError):
    """The engine cannot take more work now; retry after `retry_after_s` seconds."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(SplitspecError):
    """A model or tokenizer file is missing, unsupported or inconsistent."""
