"""The engine's exception types (torch-free). app/errors.py maps each one to an HTTP status.

Every error the engine raises on purpose derives from KVShareError, so a caller can tell
"the engine refused this" from a bug by type, never by a built-in class. Some also derive
from the built-in they replace (ValueError, PermissionError, RuntimeError) so that older
callers keep working; new code catches the engine type.

KVShareError is not app/errors.py's EngineError: that one is the HTTP 500 the front end sends
when the engine fails a request while running it.
"""

from __future__ import annotations


class KVShareError(Exception):
    """Base of every error the engine raises on purpose."""


class ParamError(KVShareError, ValueError):
    """A bad request or config field; `param` names it so the caller can report it.

    A ValueError too: pydantic turns a ValueError from EngineConfig.__post_init__ into a
    settings error that names the key.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class DuplicateRequest(ParamError):
    """A request id that is already running."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"request id {request_id!r} is already running")


class UnknownFaultKind(ParamError):
    """A fault drill of a kind that does not exist."""

    def __init__(self, kind: str, kinds: tuple[str, ...]) -> None:
        super().__init__("kind", f"unknown fault kind {kind!r}; use one of {', '.join(kinds)}")


class FaultInjectionDisabled(KVShareError, PermissionError):
    """A fault drill on an engine started without enable_fault_injection."""


class InvalidFaultTarget(KVShareError, ValueError):
    """A fault drill whose target block is not in the prefix cache (or there is none)."""


class EngineNotReady(KVShareError, RuntimeError):
    """The engine is not loaded or not running, so it cannot take this command."""


class KVEventsDisabled(KVShareError):
    """A KV event query (the block-hash listing) on an engine without KV events."""


class ChoiceNotForked(KVShareError):
    """An abort of one choice of an n-choice request whose choices have not forked yet (the
    caller aborts the whole request instead)."""


class ModelLoadError(KVShareError):
    """The configured model cannot be loaded; the message says why and what to do."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The configured model names nothing loadable (a path, a packaged model's packages, the
    offline hub cache); the message says what was looked for and how to get it."""
