"""Exceptions, and the one place where script status replies become exceptions."""

from __future__ import annotations

from redis.exceptions import NoPermissionError, OutOfMemoryError, ReadOnlyError, ResponseError


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


class RedisRefusedError(CoordinationUnavailableError):
    """Redis answers but refuses the call for a reason of its own, not the call's:
    degrade, as when it cannot be reached (`refusal` tells the kinds apart)."""


class WriteRefusedError(RedisRefusedError):
    """Redis answers but refuses writes (OOM, READONLY, MISCONF, NOREPLICAS): degrade."""


class ServerBusyError(RedisRefusedError):
    """Redis answers BUSY: a script (any client's) has run past busy-reply-threshold,
    and every other call is refused until it ends or SCRIPT KILL stops it: degrade."""


class AccessRefusedError(RedisRefusedError):
    """Redis refuses this user a command or key the node needs (NOPERM: its ACL rule
    changed while the node ran, say): degrade, as when it refuses the login."""


SCRIPT_ERROR_PREFIX = "LCERR "
# Error codes of a server that is up but cannot take writes now: maxmemory with
# noeviction, a replica after a failover, a failed RDB save, too few replicas.
WRITE_REFUSED_CODES = ("OOM", "READONLY", "MISCONF", "NOREPLICAS")
# How a refusal reads from inside a script: Redis 7.0 drops the NOPERM code.
SCRIPT_ACCESS_REFUSED = "The user executing the script can't"


def _words(exc: ResponseError) -> list[str]:
    """The first words of an error reply, where an error code may stand after a
    script wrapper ("ERR Error running script ...: @user_script:12: MISCONF ...")."""
    return str(exc).replace(":", " ").split()[:64]


def is_write_refused(exc: ResponseError) -> bool:
    """Whether a Redis error reply means "cannot write now" rather than a bad call.

    redis-py turns OOM and READONLY into their own classes (and strips the code);
    other codes stay in the text, possibly after a script wrapper, so each word is
    checked.
    """
    if isinstance(exc, OutOfMemoryError | ReadOnlyError):
        return True
    return any(word in WRITE_REFUSED_CODES for word in _words(exc))


def is_server_busy(exc: ResponseError) -> bool:
    """Whether a Redis error reply is BUSY (a long script or function is running),
    alone or as redis-py reports it from a MULTI/EXEC ("Command # 1 (...) of pipeline
    caused error: BUSY ...")."""
    text = str(exc)
    return text.startswith("BUSY ") or " of pipeline caused error: BUSY " in text


def is_access_refused(exc: ResponseError) -> bool:
    """Whether a Redis error reply is an ACL refusal: of the call itself (redis-py's
    NoPermissionError), or of a command or key inside a script."""
    if isinstance(exc, NoPermissionError):
        return True
    return SCRIPT_ACCESS_REFUSED in str(exc) or "NOPERM" in _words(exc)


def refusal(exc: ResponseError) -> RedisRefusedError | None:
    """The refusal a Redis error reply is (writes, BUSY, an ACL); None if it is none."""
    if is_write_refused(exc):
        return WriteRefusedError(f"redis refuses writes: {exc}")
    if is_server_busy(exc):
        return ServerBusyError(f"redis is busy: {exc}")
    if is_access_refused(exc):
        return AccessRefusedError(f"redis refuses this user: {exc}")
    return None


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
