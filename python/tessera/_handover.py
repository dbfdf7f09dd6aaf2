"""The hand-over of tessera.async_save: the caller's thread only queues the save.

A save needs, before its bytes can be copied, the state flattened in Python (DTensors and
optimizer state adapted, replicas compared) and a few small collectives (every rank agrees the
state is good, rank 0 learns the structure). On a 2-process DTensor state of 64 tensors that is
10-35 ms on the caller's thread; torch-checkpointing's async save() returns in about 1 ms. So
each Comm gets one submitting thread (a _Submitter) with a communicator of its own, split from
the caller's once (on the first asynchronous save over that Comm, a collective like the C++
saver's own split): the caller's call snapshots the containers of its state dict and queues;
the thread flattens, agrees and starts the C++ save (its staging and writing run on the C++
threads, src/checkpoint/async_save.cc). Saves are handed over in the order they were queued,
the same on every rank (the collective contract), so the private communicator stays in step.

The handle (AsyncSaveHandle) is returned before the save exists: each method first waits for
the hand-over, then asks the C++ handle. An error of the hand-over (bad input on any rank)
is raised by wait_staged(), wait() and exception(), on every rank.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Callable, Deque, Dict, List, Optional, Tuple

from . import _tessera
from ._errors import Error, as_error
from ._tessera import Comm, SaveReport

# What the submitting thread runs for one save: given the private communicator (None for
# rank-local saves, which use the caller's, captured by the work), starts the C++ save and
# returns its handle (or raises).
Work = Callable[[Optional[Comm]], "_tessera.AsyncSaveHandle"]


class AsyncSaveHandle:
    """An asynchronous save in flight (tessera.async_save): wait_staged(), staged(), wait(),
    done(), exception(), report. Thread-safe."""

    def __init__(self) -> None:
        self._handed_over = threading.Event()
        self._inner: Optional[_tessera.AsyncSaveHandle] = None
        self._error: Optional[Error] = None  # the hand-over's, on this rank
        self._error_seen = False

    @classmethod
    def _of(cls, inner: _tessera.AsyncSaveHandle) -> AsyncSaveHandle:
        """The handle of a save started without a hand-over (CheckpointManager's)."""
        handle = cls()
        handle._hand_over(inner, None)
        return handle

    # ---- set by the submitting thread --------------------------------------------------------

    def _hand_over(self, inner: Optional[_tessera.AsyncSaveHandle],
                   error: Optional[Error]) -> None:
        self._inner, self._error = inner, error
        self._handed_over.set()

    def _wait_handed_over(self) -> Optional[_tessera.AsyncSaveHandle]:
        """The C++ handle once handed over; raises the hand-over's error instead."""
        self._handed_over.wait()
        if self._error is not None:
            self._error_seen = True
            raise self._error
        return self._inner

    # ---- the public interface (as the C++ handle's, python/src/py_checkpoint.cc) ---------------

    def wait_staged(self) -> None:
        """Blocks until the state is copied into the staging buffers: from then on the caller
        may change its tensors (with staging="deferred", call it before the optimizer step).
        Raises this rank's error: of the hand-over (a bad state on any rank) or of staging."""
        inner = self._wait_handed_over()
        assert inner is not None
        inner.wait_staged()

    def staged(self) -> bool:
        """True once the copy into the staging buffers is done, or the save failed before it
        (non-blocking)."""
        if not self._handed_over.is_set():
            return False
        return self._inner is None or self._inner.staged()

    def wait(self) -> SaveReport:
        """Blocks until the save is committed and returns its SaveReport, or raises its error
        (the same on every rank). Starts with wait_staged()."""
        inner = self._wait_handed_over()
        assert inner is not None
        return inner.wait()

    def done(self) -> bool:
        """True once the save is committed or failed (non-blocking)."""
        if not self._handed_over.is_set():
            return False
        return self._inner is None or self._inner.done()

    def exception(self) -> Optional[Error]:
        """The exception the save failed with; None while in flight or after success."""
        if not self._handed_over.is_set():
            return None
        if self._error is not None:
            self._error_seen = True
            return self._error
        assert self._inner is not None
        return self._inner.exception()

    @property
    def report(self) -> Optional[SaveReport]:
        """The SaveReport once committed, else None."""
        return self._inner.report if self._inner is not None else None

    def _unseen_failure(self) -> Optional[Error]:
        """Waits; the exception of a failed save that nothing has shown yet (then marked shown),
        else None. For the exit hook."""
        self._handed_over.wait()
        if self._error is not None:
            if self._error_seen:
                return None
            self._error_seen = True
            return self._error
        assert self._inner is not None
        return self._inner._unseen_failure()

    def __repr__(self) -> str:
        if not self._handed_over.is_set():
            return "<tessera.AsyncSaveHandle in flight, handing over>"
        if self._error is not None:
            return f"<tessera.AsyncSaveHandle failed: {self._error}>"
        return repr(self._inner)


class _Submitter:
    """One thread that hands the asynchronous saves of one Comm over, in queue order."""

    def __init__(self, comm: Optional[Comm]) -> None:
        """`comm`: the communicator the thread's collectives run over (private to it), or None
        (rank-local saves: no collective, and no reference that would keep the caller's Comm,
        the key of _submitters, alive)."""
        self._comm: Optional[Comm] = comm
        self._queue: Deque[Tuple[Work, AsyncSaveHandle]] = collections.deque()
        self._cv = threading.Condition()
        self._closing = False
        # Daemon: the interpreter's exit joins non-daemon threads before atexit hooks, and
        # tessera's exit hook (_api._wait_for_async_saves) is what waits for the saves.
        self.finalizer: Optional[weakref.finalize] = None  # closes it when its Comm goes
        self._thread = threading.Thread(target=self._run, name="tessera-async-handover",
                                        daemon=True)
        self._thread.start()

    def submit(self, work: Work) -> AsyncSaveHandle:
        handle = AsyncSaveHandle()
        with self._cv:
            self._queue.append((work, handle))
            self._cv.notify()
        return handle

    def close(self) -> None:
        """The thread hands over what is queued and ends; then the private communicator is
        destroyed here (which waits for its saves in flight, as destroying any Comm does): on
        the caller's thread, never on the daemon thread, which the interpreter's exit may stop
        in the middle of a C++ destructor."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join()
            self._comm = None

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._closing or bool(self._queue))
                if not self._queue:
                    return  # closing (the communicator is close()'s to destroy)
                work, handle = self._queue.popleft()
            try:
                inner = work(self._comm)
            except Exception as e:  # noqa: BLE001 (handed to the caller through the handle)
                handle._hand_over(None, as_error(e))
            else:
                handle._hand_over(inner, None)
            # The work holds the caller's state (its tensors): released now, not when the
            # next save arrives (a deferred save's state is the C++ handle's until staged).
            del work, handle


# The submitters of each live Comm: {comm: {collective: submitter}}. Weak keys: a Comm the
# caller drops closes its submitters (weakref.finalize below).
_submitters: "weakref.WeakKeyDictionary[Comm, Dict[bool, _Submitter]]" = weakref.WeakKeyDictionary()
_submitters_lock = threading.Lock()


def submitter(comm: Comm, collective: bool) -> _Submitter:
    """The submitter of `comm` for collective (or rank-local) saves. The first call for a
    collective one is COLLECTIVE over `comm` (the split of its private communicator, no message
    with one rank); a rank-local one never communicates: its work uses `comm` itself (only the
    C++ rank-local saver, which sends nothing, is attached to it)."""
    with _submitters_lock:
        found = _submitters.get(comm, {}).get(collective)
    if found is not None:
        return found
    made = _Submitter(_tessera._split_comm(comm) if collective else None)
    with _submitters_lock:
        per_comm = _submitters.setdefault(comm, {})
        if collective not in per_comm:
            per_comm[collective] = made
            made.finalizer = weakref.finalize(comm, made.close)
            # Not at exit: closing would destroy the private communicator on the daemon thread
            # while the interpreter ends, which kills that thread inside C++ destructors.
            made.finalizer.atexit = False
            return made
        found = per_comm[collective]
    made.close()  # another thread of this process made one first (not a collective race:
    return found  # a Comm is used by one thread at a time)


def forget_after_fork() -> List[_Submitter]:
    """In a forked child: the parent's submitting threads do not exist there. Forgets every
    submitter and returns them, for the caller to keep forever: destroying one would destroy
    its communicator, and closing one could wait on a lock the parent's thread held."""
    global _submitters_lock
    _submitters_lock = threading.Lock()
    forgotten = [s for per_comm in _submitters.values() for s in per_comm.values()]
    for s in forgotten:
        if s.finalizer is not None:
            s.finalizer.detach()
    _submitters.clear()
    return forgotten

