"""Leaf: the exception hierarchy. Every misuse of pagedkv raises a `PagedKVError` subclass.

Each class also derives from the builtin a caller would naturally catch (`ValueError`,
`TypeError`, `KeyError`), so code written against vLLM's assertions and `ValueError`s keeps working.
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument has the right type but an impossible value (names the value)."""


class InvalidTypeError(PagedKVError, TypeError):
    """An argument has the wrong type (for example a float token id)."""


class ConfigError(PagedKVError, ValueError):
    """A spec, group or manager configuration cannot work (checked at construction)."""


class UnknownHashAlgorithmError(ConfigError):
    """The prefix-cache hash algorithm name is not one pagedkv knows."""


class MissingDependencyError(PagedKVError, ImportError):
    """An optional extra is needed for the feature asked for."""


def install_hint(extra: str) -> str:
    """How to install an extra: from a package index, and from a clone of the repository."""
    return f"pip install 'pagedkv[{extra}]' (in a clone: pip install -e '.[{extra}]')"


class RequestStateError(PagedKVError, ValueError):
    """The request is in a state that forbids the call (finished, reused id, stale hit)."""


class ForeignBlockError(PagedKVError, ValueError):
    """A block passed in does not belong to this pool, or is not the one the pool holds."""


class GroupIndexError(PagedKVError, IndexError):
    """A KV-cache group index is out of range."""


class ThreadOwnershipError(PagedKVError, RuntimeError):
    """A thread changed a single-owner structure (a manager, its pool, a scheduler) that
    another, live thread owns; nothing was changed. Names both threads."""

    def __init__(self, message: str, *, owner_thread: str, calling_thread: str) -> None:
        super().__init__(message)
        self.owner_thread = owner_thread
        self.calling_thread = calling_thread


class InvariantViolation(PagedKVError, AssertionError):
    """`check_invariants()` found a broken internal invariant (a bug, never user error)."""


class NotEnoughMemoryError(PagedKVError, ValueError):
    """Memory sizing: the budget cannot hold even one request of `max_model_len` tokens.

    Carries the numbers where the raiser knows them (None where it does not).
    """

    def __init__(
        self,
        message: str,
        *,
        needed_bytes: int | None = None,
        available_bytes: int | None = None,
        max_model_len: int | None = None,
        max_model_len_that_fits: int | None = None,
    ) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.available_bytes = available_bytes
        self.max_model_len = max_model_len
        self.max_model_len_that_fits = max_model_len_that_fits


class HostMemoryError(NotEnoughMemoryError):
    """This machine's available memory cannot hold the structure asked for (estimated first,
    so nothing was built); names the estimate and the limit."""

    def __init__(self, message: str, needed_bytes: int, available_bytes: int) -> None:
        super().__init__(message, needed_bytes=needed_bytes, available_bytes=available_bytes)
