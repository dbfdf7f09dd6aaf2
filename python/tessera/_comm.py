"""tessera.single_rank_comm, run_local and python_comm: the extension module's communicators
(python/src/py_comm.cc) behind Python functions, so that help() and inspect.signature show
their parameters, and a type checker their types."""

from __future__ import annotations

from typing import Callable, List, Optional, Protocol, Sequence, TypeVar, Union

from . import _tessera
from ._tessera import Comm

_T = TypeVar("_T")

#: What a collective of a CommImpl may return for bytes: any bytes-like object.
BytesLike = Union[bytes, bytearray, memoryview]


class CommImpl(Protocol):
    """What tessera.python_comm(impl) calls: a communicator written in Python.

    rank and size are read once, when the Comm is made. Each method is called with the GIL,
    from whichever thread runs the collective; what it raises fails the collective (a
    tessera.Error keeps its status, anything else becomes a CommError) and aborts the
    communicator. An optional abort(message) method, if present, is called when tessera aborts
    the communicator.

    With several ranks, every collective begins with all_reduce(header, "max") over a few
    int64 values that describe the call (which collective, its root, its length, its op,
    whether this rank failed or was aborted); a Barrier is that alone. So the methods below are
    only called once every rank has entered the same collective with the same arguments: ranks
    that disagree, pass a bad argument or were aborted all fail with the same error, and the
    failed rank's status reaches the others through broadcast(). A barrier() method, if the
    object has one, is not called.
    """

    @property
    def rank(self) -> int:
        """This process's rank, 0 <= rank < size."""

    @property
    def size(self) -> int:
        """The number of ranks."""

    def broadcast(self, data: Optional[bytes], root: int, /) -> BytesLike:
        """Root's bytes on every rank (`data` is None on the others)."""

    def gather(self, data: bytes, root: int, /) -> Optional[Sequence[BytesLike]]:
        """On `root`, every rank's bytes indexed by rank; anything (None) elsewhere."""

    def all_gather(self, data: bytes, /) -> Sequence[BytesLike]:
        """Every rank's bytes, indexed by rank."""

    def scatter(self, chunks: Optional[List[bytes]], root: int, /) -> BytesLike:
        """This rank's item of root's `chunks` (one per rank; None on the others)."""

    def all_reduce(self, values: List[int], op: str, /) -> Sequence[int]:
        """Element-wise "sum", "min" or "max" of int64 values over the ranks."""

    def split(self, color: int, key: int, /) -> CommImpl:
        """COLLECTIVE. A communicator of the ranks of the same `color`, ordered by `key`."""


def single_rank_comm() -> Comm:
    """A communicator of one rank: this process alone.

    Returns:
        A new tessera.Comm of size 1.
    """
    return _tessera.single_rank_comm()


def run_local(num_ranks: int, fn: Callable[[Comm], _T], timeout: float = 600.0) -> List[_T]:
    """Runs fn(comm) for `num_ranks` ranks on as many threads, over an in-process communicator.

    A way to try or test collective code in one process: each rank is a thread, and tessera
    releases the GIL inside its calls, so the ranks really run in parallel. The Comm a rank
    function gets is valid until it returns.

    Args:
        num_ranks: how many ranks (threads), at least 1.
        fn: the rank function, called with that rank's tessera.Comm.
        timeout: seconds a collective waits at most for its peers.

    Returns:
        What each rank's fn returned, indexed by rank.

    Raises:
        ValueError: num_ranks < 1 or timeout <= 0.
        Exception: if any rank raises, the exception of the first failing rank (ranks whose
            collectives only gave up because of it are passed over), with a note naming it.
    """
    return _tessera.run_local(num_ranks, fn, timeout)


def python_comm(impl: CommImpl) -> Comm:
    """A communicator whose collectives call methods of a Python object (see docs/PYTHON.md).

    Args:
        impl: the communicator's Python side (see CommImpl): rank and size attributes, and
            broadcast, gather, all_gather, scatter, all_reduce and split methods.

    Returns:
        A tessera.Comm over `impl`.

    Raises:
        ValueError: impl's rank is not in [0, size).
    """
    return _tessera.python_comm(impl)
