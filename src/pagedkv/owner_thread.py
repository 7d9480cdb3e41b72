"""Leaf: the single-owner thread rule of pagedkv's stateful structures (the manager and its block
pool, the reference scheduler).

Those structures are not thread-safe (the free queue is a linked list two threads would tear
apart), and a lock on every call would tax the engine's decode step. Instead each is owned by
one thread, the first that changes it; a change from any other thread raises
`ThreadOwnershipError` naming both threads, before anything is changed. The owner hands it over
with `release()`. Imports nothing of pagedkv but its errors.
"""

from __future__ import annotations

import threading
from _thread import get_ident

from pagedkv.errors import ThreadOwnershipError


class OwnerThread:
    """Which thread may change one structure (or a group of structures sharing this object).

    Invariants: `thread_id` is None (unowned) or the `threading.get_ident()` of `thread`, the
    owner. The first `check` from an unowned state, or after the owner thread has ended, makes
    the caller the owner; `release()` returns to unowned. Reads are not checked (they change
    nothing, but a read from another thread may see a change half made: don't).
    """

    __slots__ = ("what", "hand_over", "thread_id", "thread", "_lock")

    def __init__(self, what: str, hand_over: str) -> None:
        """Args:
        what: the structure in messages (`"this KVCacheManager and its BlockPool"`).
        hand_over: how its owner hands it over (`"manager.release_owner_thread()"`).
        """
        self.what = what
        self.hand_over = hand_over
        self.thread_id: int | None = None
        self.thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def check(self, operation: str) -> None:
        """Raise `ThreadOwnershipError` unless the calling thread owns the structure (or can
        become its owner: nobody owns it, or its owner has ended)."""
        # Hot path: the owner pays one C call and one comparison.
        if get_ident() != self.thread_id:
            self._claim(operation)

    def _claim(self, operation: str) -> None:
        current = threading.current_thread()
        with self._lock:  # two threads claiming an unowned structure at once: one wins
            owner = self.thread
            if owner is None or owner is current or not owner.is_alive():
                self.thread = current
                self.thread_id = get_ident()
                return
        raise ThreadOwnershipError(
            f"{operation} called from thread {current.name!r} (id {get_ident()}), but thread "
            f"{owner.name!r} (id {self.thread_id}) owns {self.what}: it is not thread-safe. "
            f"Call it from one thread, or have the owner hand it over with {self.hand_over}",
            owner_thread=owner.name,
            calling_thread=current.name,
        )

    def release(self) -> None:
        """Leave the structure unowned: the next thread that changes it becomes its owner.

        Only the owner may release (or any thread once the owner has ended); from another
        thread this raises `ThreadOwnershipError`, since that thread could not know the owner
        is done with it.
        """
        self.check(f"release ({self.hand_over})")
        with self._lock:
            self.thread = None
            self.thread_id = None

    def owner_name(self) -> str | None:
        """The owner thread's name, None while unowned."""
        owner = self.thread
        return None if owner is None else owner.name
