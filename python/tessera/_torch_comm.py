"""A tessera Comm over a torch.distributed process group (gloo, CPU tensors).

The C++ library calls these methods (taking the GIL) for its few, small collectives: plans,
write results, the manifest. Variable-size byte buffers travel as uint8 tensors after their
sizes. Split makes a new gloo group over a prefix of the default store, joined by the members
only (dist.new_group would need every rank of the job), so an asynchronous save gets a group
of its own and its collectives never mix with the caller's.
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import threading
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from ._tessera import Comm

_OPS = None

# Why tessera waits after each collective until gloo's worker thread has let go of its tensors
# (issue 22, defect 13: a process that saved over gloo sometimes aborted at exit with
# "terminate called without an active exception").
#
# A collective's work holds the tensors tessera created in Python for it. gloo's worker thread
# (ProcessGroupGloo::runLoop) destroys the work a moment AFTER marking it complete, so after
# work.wait() returned. Dropping its reference to a tensor that has a Python object takes the
# GIL on that thread: torch 2.13 (c10/util/intrusive_ptr.h, "PyObject preservation") decrefs the
# PyObject whenever a tensor's C++ refcount goes from 2 to 1, even while Python still holds the
# tensor; older torch did so when the C++ side held the last reference. If the interpreter
# began to exit meanwhile (the save was the process's last act), the thread blocked on the GIL is
# ended by pthread_exit, whose forced unwinding reaches the noexcept decref_pyobject frame:
# std::terminate (core dump: pt_gloo_runloop in ~AsyncWork -> TensorImpl::decref_pyobject ->
# gil_scoped_acquire -> take_gil -> PyThread_exit_thread -> __gxx_personality_v0 -> terminate).
# Keeping the tensors referenced from Python cannot help with torch 2.13; what does is that
# a collective returns only once gloo released them (Tensor._use_count() back to 1, waited for
# with the GIL released so gloo's thread can take it): after that, gloo's thread has nothing of
# tessera's left to drop, whenever the process exits.
#
# A collective that failed, or whose tensors gloo still holds after _RELEASE_WAIT seconds, leaves
# them in _held; the exit waits (bounded) for those too. torch < 2.0 lacks Tensor._use_count():
# there the tensors of the last collectives are kept referenced instead (the C++ side then never
# holds the last reference), and leaked at exit.
_held_lock = threading.Lock()
_held: list = []
_KEPT_WITHOUT_USE_COUNT = 64
_RELEASE_WAIT = 10.0  # seconds; gloo releases a completed work's tensors within microseconds
_EXIT_WAIT = 10.0  # seconds the exit waits for tensors of collectives that did not complete


def _held_by_others(tensors: list) -> list:
    """The tensors of `tensors` that something besides their Python object references."""
    return [t for t in tensors if t._use_count() > 1]


def _wait_released(tensors: list, seconds: float) -> list:
    """Waits up to `seconds`, with the GIL released, until no tensor of `tensors` is referenced
    by anything but its Python object; returns those still referenced."""
    deadline = time.monotonic() + seconds
    pause = 2e-5
    pending = _held_by_others(tensors)
    while pending and time.monotonic() < deadline:
        time.sleep(pause)  # releases the GIL: gloo's thread may need it to let go
        pause = min(pause * 2, 1e-2)
        pending = _held_by_others(pending)
    return pending


def _run(tensors: list, start: Callable[[], Any]) -> None:
    """Runs the collective `start()` returns (a c10d Work) over `tensors` (every tensor made in
    Python that it uses), waits for it and then until gloo's worker thread released `tensors`
    (see above)."""
    if tensors and not hasattr(tensors[0], "_use_count"):
        _keep(tensors)
        start().wait()
        return
    try:
        start().wait()  # the temporary Work is dropped here, before the wait for its tensors
    except BaseException:
        _keep(tensors)
        raise
    pending = _wait_released(tensors, _RELEASE_WAIT)
    if pending:
        _keep(pending)


def _keep(tensors: list) -> None:
    """Keeps `tensors` referenced until the exit (see above)."""
    with _held_lock:
        if _held and hasattr(_held[0], "_use_count"):
            _held[:] = _held_by_others(_held)
        else:
            del _held[:-_KEPT_WITHOUT_USE_COUNT]
        _held.extend(tensors)


@atexit.register
def _release_at_exit() -> None:
    """Before the interpreter tears down (after tessera's wait for asynchronous saves, which
    atexit runs first): waits a while for gloo to release the tensors of collectives that failed
    or hung; without Tensor._use_count() (torch < 2.0), each kept tensor gets a reference that is
    never given back, so gloo's thread never holds the last one."""
    with _held_lock:
        held = list(_held)
    if held and hasattr(held[0], "_use_count"):
        _wait_released(held, _EXIT_WAIT)
        return
    for t in held:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))


def _ops():
    global _OPS
    if _OPS is None:
        import torch.distributed as dist  # noqa: PLC0415
        _OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    return _OPS


def _uint8_view(data: Any) -> "torch.Tensor":
    """A uint8 tensor over `data`'s buffer, without a copy. Read-only buffers (bytes) are fine
    for what gloo only reads; torch warns that writing would be undefined, and nothing writes."""
    import torch  # noqa: PLC0415
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(data, dtype=torch.uint8)


def _to_tensor(data: Any, size: int) -> "torch.Tensor":
    """`data` as a uint8 tensor of max(size, 1) elements, zero-padded: a view of its buffer when it
    fills the tensor exactly (an input gloo sends from, never writes), else a copy."""
    import torch  # noqa: PLC0415
    n = len(data) if data else 0
    if n and n == size:
        return _uint8_view(data)
    out = torch.empty(max(size, 1), dtype=torch.uint8)
    if n:
        out[:n] = _uint8_view(data)
    out[n:].zero_()
    return out


def _to_bytes(tensor: "torch.Tensor", size: int) -> memoryview:
    """The first `size` bytes of a received tensor, as a view (the C++ side copies it once)."""
    return tensor[:size].numpy().data  # ndarray.data: a memoryview of the array


class TorchDistImpl:
    """The Python side of tessera.torch_dist_comm(): methods over a c10d ProcessGroup."""

    def __init__(self, pg, rank, size, store, timeout):
        self.pg = pg
        self.rank = rank
        self.size = size
        self._store = store
        self._timeout = timeout

    # -- helpers --------------------------------------------------------------------------
    def _int64(self, values):
        import torch  # noqa: PLC0415
        return torch.tensor(values, dtype=torch.int64)

    def _all_gather_sizes(self, n):
        import torch  # noqa: PLC0415
        out = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        send = self._int64([n])
        _run(out + [send], lambda: self.pg.allgather([out], [send]))
        return [int(t[0]) for t in out]

    # -- the Comm interface --------------------------------------------------------------------
    def broadcast(self, data, root):
        from torch.distributed import BroadcastOptions  # noqa: PLC0415
        opts = BroadcastOptions()
        opts.rootRank = root
        size = self._int64([len(data) if self.rank == root else 0])
        _run([size], lambda: self.pg.broadcast([size], opts))
        n = int(size[0])
        buf = _to_tensor(data if self.rank == root else b"", n)
        _run([buf], lambda: self.pg.broadcast([buf], opts))
        return _to_bytes(buf, n)

    def all_gather(self, data):
        import torch  # noqa: PLC0415
        sizes = self._all_gather_sizes(len(data))
        n = max(sizes)
        out = [torch.zeros(max(n, 1), dtype=torch.uint8) for _ in range(self.size)]
        send = _to_tensor(data, n)
        _run(out + [send], lambda: self.pg.allgather([out], [send]))
        return [_to_bytes(t, s) for t, s in zip(out, sizes)]

    def gather(self, data, root):
        import torch  # noqa: PLC0415
        from torch.distributed import GatherOptions  # noqa: PLC0415
        sizes = self._all_gather_sizes(len(data))
        n = max(sizes)
        opts = GatherOptions()
        opts.rootRank = root
        out = ([[torch.zeros(max(n, 1), dtype=torch.uint8) for _ in range(self.size)]]
               if self.rank == root else [])
        send = _to_tensor(data, n)
        _run([t for ts in out for t in ts] + [send], lambda: self.pg.gather(out, [send], opts))
        if self.rank != root:
            return None
        return [_to_bytes(t, s) for t, s in zip(out[0], sizes)]

    def scatter(self, chunks, root):
        import torch  # noqa: PLC0415
        from torch.distributed import ScatterOptions  # noqa: PLC0415
        opts = ScatterOptions()
        opts.rootRank = root
        sizes = self._int64([len(c) for c in chunks] if self.rank == root else [0] * self.size)
        _run([sizes], lambda: self.pg.broadcast([sizes], _broadcast_options(root)))
        n = int(sizes.max())
        inputs = [[_to_tensor(c, n) for c in chunks]] if self.rank == root else []
        out = torch.zeros(max(n, 1), dtype=torch.uint8)
        _run([t for ts in inputs for t in ts] + [out], lambda: self.pg.scatter([out], inputs, opts))
        return _to_bytes(out, int(sizes[self.rank]))

    def all_reduce(self, values, op):
        from torch.distributed import AllreduceOptions  # noqa: PLC0415
        if not values:
            return []
        opts = AllreduceOptions()
        opts.reduceOp = _ops()[op]
        tensor = self._int64(list(values))
        _run([tensor], lambda: self.pg.allreduce([tensor], opts))
        return tensor.tolist()

    def split(self, color, key):
        import pickle  # noqa: PLC0415
        from torch.distributed import PrefixStore, ProcessGroupGloo  # noqa: PLC0415
        token = uuid.uuid4().hex if self.rank == 0 else ""
        entries = [pickle.loads(b) for b in self.all_gather(pickle.dumps((color, key, token)))]
        token = entries[0][2]
        members = sorted((r for r in range(self.size) if entries[r][0] == color),
                         key=lambda r: (entries[r][1], r))
        rank = members.index(self.rank)
        store = PrefixStore(f"tessera/split/{token}/{color}/", self._store)
        pg = ProcessGroupGloo(store, rank, len(members), self._timeout)
        return TorchDistImpl(pg, rank, len(members), self._store, self._timeout)


def _broadcast_options(root):
    from torch.distributed import BroadcastOptions  # noqa: PLC0415
    opts = BroadcastOptions()
    opts.rootRank = root
    return opts


def torch_dist_comm(group: Optional[ProcessGroup] = None, *,
                    timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> Comm:
    """A tessera.Comm over a torch.distributed process group (default: the whole job), which
    must be a gloo group (CPU tensors). torch.distributed must be initialised. `timeout` is
    that of the groups made for asynchronous saves. COLLECTIVE: every rank of the group calls
    it."""
    import torch.distributed as dist  # noqa: PLC0415
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415
    from . import _tessera  # noqa: PLC0415
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group('gloo', ...) first")
    pg = group if group is not None else c10d._get_default_group()
    backend = dist.get_backend(pg)
    if not _has_gloo_for_cpu(backend):
        raise ValueError(f"tessera.torch_dist_comm needs a gloo group, not {backend} "
                         "(make one with torch.distributed.new_group(backend='gloo'))")
    impl = TorchDistImpl(pg, dist.get_rank(pg), dist.get_world_size(pg),
                         c10d._get_default_store(), timeout)
    return _tessera.python_comm(impl)


def _has_gloo_for_cpu(backend: object) -> bool:
    """Whether a group of this backend ("gloo", or "cpu:gloo,cuda:nccl" for a group with a
    backend per device) runs collectives of CPU tensors with gloo."""
    backend = str(backend)
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


_default_cache: Dict[str, Tuple[Any, Comm]] = {}


def default_comm() -> Optional[Comm]:
    """The tessera Comm of a call without `comm=`: when torch.distributed is initialised with
    several ranks, a Comm over its default group (the whole job, as torch.distributed.checkpoint
    uses), made once per default group (over a gloo group made for tessera, once, when the
    default group does not run CPU collectives with gloo, e.g. NCCL); else None, one rank.
    torch is not imported here: a job that uses torch.distributed has imported it.

    Making it is COLLECTIVE the first time (and with NCCL, dist.new_group): every rank calls
    the same tessera function, as they must anyway."""
    import sys  # noqa: PLC0415
    dist = sys.modules.get("torch.distributed")
    if (dist is None or not dist.is_available() or not dist.is_initialized()
            or dist.get_world_size() == 1):
        return None
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415
    default = c10d._get_default_group()
    cached = _default_cache.get("default")
    if cached is not None and cached[0] is default:
        return cached[1]
    group = None if _has_gloo_for_cpu(dist.get_backend()) else dist.new_group(backend="gloo")
    comm = torch_dist_comm(group)
    _default_cache["default"] = (default, comm)
    return comm
