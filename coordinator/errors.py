"""Exceptions, and the one place where script status replies become exceptions."""

from __future__ import annotations

from redis.exceptions import ResponseError


class CoordinatorError(Exception):
    """Base class of every error the coordinator raises."""


class InvalidArgumentError(CoordinatorError, ValueError):
    """A caller passed a value that fails validation; nothing was written."""


class ScriptArgumentError(InvalidArgumentError):
    """A Lua script rejected its arguments; nothing was written."""


class UnknownInstanceError(CoordinatorError, LookupError):
    """The instance is not registered in the pool (re-register it)."""


class EpochFencedError(CoordinatorError):
    """A registration carried an epoch older than the one Redis holds."""


class NoInstanceError(CoordinatorError):
    """No alive instance can take the request."""


class PoolFullError(CoordinatorError):
    """Every alive instance is at max_slots; retry after `retry_after_ms`."""

    def __init__(self, retry_after_ms: int) -> None:
        super().__init__(f"every instance is full; retry after {retry_after_ms} ms")
        self.retry_after_ms = retry_after_ms


class CoordinationUnavailableError(CoordinatorError):
    """Redis could not be reached; the caller should use degraded mode."""


SCRIPT_ERROR_PREFIX = "LCERR "


def from_response_error(exc: ResponseError) -> CoordinatorError | None:
    """Map a script's error reply to a narrow exception; None if it is not ours."""
    text = str(exc)
    marker = text.find(SCRIPT_ERROR_PREFIX)
    if marker < 0:
        return None
    detail = text[marker + len(SCRIPT_ERROR_PREFIX) :]
    kind, _, rest = detail.partition(" ")
    if kind == "bad_arg":
        return ScriptArgumentError(f"invalid script argument: {rest}")
    if kind == "unknown_instance":
        return UnknownInstanceError(f"unknown instance {rest!r}")
    if kind == "epoch_fenced":
        return EpochFencedError(f"stale registration epoch: {rest}")
    return CoordinatorError(detail)
