"""One exception hierarchy for rftstream.

Every error a user can see derives from :class:`RftError` and says *what* failed
(config key path, message subject, actor name, registry name) and *why*. NATS
client errors are translated into :class:`BusError` subclasses at the bus adapter.
"""

from __future__ import annotations

import re
import sys
from typing import Any

if sys.version_info < (3, 11):  # pragma: no cover - anyio depends on the backport there
    from exceptiongroup import BaseExceptionGroup


class RftError(Exception):
    """Base of every rftstream error."""


class ConfigError(RftError):
    """A config value is missing, unknown or invalid.

    ``key_path`` is the dotted path (``buffer.explorer_input.taskset.path``),
    ``value`` the offending value and ``source`` the file it came from, if any.
    """

    def __init__(
        self,
        key_path: str,
        message: str,
        *,
        value: Any = None,
        source: str | None = None,
        has_value: bool = False,
    ) -> None:
        self.key_path = key_path
        self.message = message
        self.value = value
        self.source = source
        self.has_value = has_value
        where = f"{source}: " if source else ""
        shown = f" (got {value!r})" if has_value or value is not None else ""
        super().__init__(f"{where}config key `{key_path}`: {message}{shown}")

    def at(self, key_path: str) -> ConfigError:
        """The same error naming ``key_path`` instead (a caller that knows the key better:
        a list item that is itself the path, where the callee named ``<item>.path``)."""
        return ConfigError(
            key_path, self.message, value=self.value, source=self.source, has_value=self.has_value
        )


class WeightSyncError(RftError):
    """Weights could not be published, fetched or loaded; names the version (and the
    tensor or chunk at fault)."""


class RegistryError(RftError):
    """A name is not registered (or registered twice) in a registry."""


class PluginError(RftError):
    """A plugin module failed to import; names the file or entry point."""


class SchemaError(RftError):
    """A message body does not decode as the expected wire schema."""


class BusError(RftError):
    """A NATS operation failed; the message names subject/stream/consumer."""


class RunNotFoundError(BusError):
    """A read-only command found no state of the named run on the server (no KV bucket)."""


class PayloadTooLargeError(BusError):
    """A message (payload + headers) exceeds the server's ``max_payload``."""


# -- what a transport (rftstream.bus.transport) raises: neutral, whatever carries the bus


class BusTimeout(BusError):
    """A bus request got no answer in time; it may or may not have taken effect
    (a publish retried with the same message id is stored once)."""


class BusUnavailable(BusError):
    """The bus answered "not now" (overloaded, no leader, no stream for the subject yet):
    the same request may succeed a moment later."""


class StreamFullError(BusUnavailable):
    """A publish was refused because the stream reached ``max_bytes`` / ``max_msgs`` (discard new)."""


class NotFound(BusError):
    """A named stream, consumer, bucket, key or message does not exist."""


class StreamNotFound(NotFound):
    """No stream of that name."""


class ConsumerNotFound(NotFound):
    """No consumer of that name on the stream."""


class BucketNotFound(NotFound):
    """No key-value bucket of that name."""


class KeyNotFound(NotFound):
    """The key has no value (never written, deleted or purged)."""


class MessageNotFound(NotFound):
    """No stored message at that sequence, or none on that subject."""


class CasConflict(BusError):
    """A conditional key-value write lost: the key was not at the expected revision."""


class ActorError(RftError):
    """An actor failed; the message names the actor."""


class WorkflowError(RftError):
    """A workflow raised or timed out on a task."""


class OperatorError(RftError):
    """An experience operator raised on a batch."""


class CredentialsError(OperatorError):
    """An operator (or a task pipeline op) cannot work without credentials it lacks (see
    :func:`lacks_credentials`): retrying or restarting cannot mend it."""


class ReportError(RftError):
    """A run directory lacks what a report needs (``metrics.jsonl``); names the path."""


def first_leaf(exc: BaseException) -> BaseException:
    """The first exception inside ``exc``'s (nested) exception groups; ``exc`` itself when
    it is not a group."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _leaves(exc: BaseException) -> int:
    if isinstance(exc, BaseExceptionGroup):
        return sum(_leaves(e) for e in exc.exceptions)
    return 1


def error_text(exc: BaseException) -> str:
    """``Type: message`` of what went wrong, for dead-letter reasons and console lines. An
    exception group (anyio's ``unhandled errors in a TaskGroup``, which names nothing) is
    unwrapped to its first exception, with how many others it held."""
    leaf = first_leaf(exc)
    more = _leaves(exc) - 1
    return f"{type(leaf).__name__}: {leaf}" + (f" (and {more} more)" if more else "")


_CREDENTIALS_RE = re.compile(
    r"api[ _-]?key|credential|unauthori[sz]ed|authenticat|permission denied|access denied"
    r"|\b(status|http|code)\W{0,3}40[13]\b",
    re.IGNORECASE,
)


def lacks_credentials(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception it wraps (cause, context, group), says credentials
    are missing or refused: an API key not set, a 401/403, an ``AuthenticationError`` or
    ``PermissionDeniedError`` of an API client. Such an error fails every batch alike, so
    retrying and dead-lettering batch after batch only hides it."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        name = type(e).__name__
        if "Authentication" in name or "PermissionDenied" in name:
            return True
        if _CREDENTIALS_RE.search(str(e)):
            return True
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
    return False


def mendable_by_restart(exc: BaseException) -> bool:
    """Whether a process that failed with ``exc`` may recover when started again: not for a
    config error or missing credentials (a restart meets them again), yes for anything
    else (a lost connection, a crash)."""
    return not isinstance(first_leaf(exc), ConfigError | CredentialsError)
