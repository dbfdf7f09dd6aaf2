"""A tessera Comm over a torch.distributed process group (gloo, CPU tensors).

The C++ library calls these methods (taking the GIL) for its few, small collectives: plans,
write results, the manifest. Variable-size byte buffers travel as uint8 tensors after their
sizes. Split makes a new gloo group over a prefix of the default store, joined by the members
only (dist.new_group would need every rank of the job), so an asynchronous save gets a group
of its own and its collectives never mix with the caller's.
"""

import atexit
import ctypes
import datetime
import threading
import uuid

_OPS = None

# The tensors tessera handed to torch.distributed collectives that gloo's worker thread
# (pt_gloo_runloop) may still hold. Python keeps a reference to each until gloo dropped its own
# (Tensor._use_count() back to 1), so that gloo's thread never holds the last reference to a
# tensor created in Python: dropping that needs the GIL, and a thread that takes the GIL while
# the interpreter exits is ended by pthread_exit, whose unwinding through gloo's noexcept
# frames is "terminate called without an active exception" (issue 22, defect 13: a process
# that saved over gloo aborted at exit, 1 run in 12, when gloo's thread released the last
# collective's tensors after the interpreter began to exit). At exit the tensors gloo may still
# hold are leaked on purpose (see _leak_held_tensors).
_held_lock = threading.Lock()
_held = []
# torch < 2.0 lacks Tensor._use_count(): the tensors of the last collectives are kept instead.
_KEPT_WITHOUT_USE_COUNT = 64


def _hold(tensors):
    """Keeps `tensors` (just handed to a collective) referenced until gloo released them."""
    with _held_lock:
        if _held and hasattr(_held[0], "_use_count"):
            _held[:] = [t for t in _held if t._use_count() > 1]
        else:
            del _held[:-_KEPT_WITHOUT_USE_COUNT]
        _held.extend(tensors)


def _still_held_by_gloo():
    """The held tensors a collective's work may still hold (all of them without _use_count)."""
    with _held_lock:
        return [t for t in _held if not hasattr(t, "_use_count") or t._use_count() > 1]


@atexit.register
def _leak_held_tensors():
    """Before the interpreter tears down (after tessera's wait for asynchronous saves, which
    atexit runs first): each tensor gloo may still hold gets a reference that is never given
    back, so whenever gloo's thread drops its own, no Python object dies on that thread."""
    for t in _still_held_by_gloo():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(t))


def _ops():
    global _OPS
    if _OPS is None:
        import torch.distributed as dist  # noqa: PLC0415
        _OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
    return _OPS


def _to_tensor(data, size):
    import torch  # noqa: PLC0415
    out = torch.zeros(max(size, 1), dtype=torch.uint8)
    if data:
        out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _to_bytes(tensor, size):
    return tensor[:size].numpy().tobytes()


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
        _hold(out + [send])
        self.pg.allgather([out], [send]).wait()
        return [int(t[0]) for t in out]

    # -- the Comm interface --------------------------------------------------------------------
    def barrier(self):
        self.pg.barrier().wait()

    def broadcast(self, data, root):
        from torch.distributed import BroadcastOptions  # noqa: PLC0415
        opts = BroadcastOptions()
        opts.rootRank = root
        size = self._int64([len(data) if self.rank == root else 0])
        _hold([size])
        self.pg.broadcast([size], opts).wait()
        n = int(size[0])
        buf = _to_tensor(data if self.rank == root else b"", n)
        _hold([buf])
        self.pg.broadcast([buf], opts).wait()
        return _to_bytes(buf, n)

    def all_gather(self, data):
        import torch  # noqa: PLC0415
        sizes = self._all_gather_sizes(len(data))
        n = max(sizes)
        out = [torch.zeros(max(n, 1), dtype=torch.uint8) for _ in range(self.size)]
        send = _to_tensor(data, n)
        _hold(out + [send])
        self.pg.allgather([out], [send]).wait()
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
        _hold([t for ts in out for t in ts] + [send])
        self.pg.gather(out, [send], opts).wait()
        if self.rank != root:
            return None
        return [_to_bytes(t, s) for t, s in zip(out[0], sizes)]

    def scatter(self, chunks, root):
        import torch  # noqa: PLC0415
        from torch.distributed import ScatterOptions  # noqa: PLC0415
        opts = ScatterOptions()
        opts.rootRank = root
        sizes = self._int64([len(c) for c in chunks] if self.rank == root else [0] * self.size)
        _hold([sizes])
        self.pg.broadcast([sizes], _broadcast_options(root)).wait()
        n = int(sizes.max())
        inputs = [[_to_tensor(c, n) for c in chunks]] if self.rank == root else []
        out = torch.zeros(max(n, 1), dtype=torch.uint8)
        _hold([t for ts in inputs for t in ts] + [out])
        self.pg.scatter([out], inputs, opts).wait()
        return _to_bytes(out, int(sizes[self.rank]))

    def all_reduce(self, values, op):
        from torch.distributed import AllreduceOptions  # noqa: PLC0415
        if not values:
            return []
        opts = AllreduceOptions()
        opts.reduceOp = _ops()[op]
        tensor = self._int64(list(values))
        _hold([tensor])
        self.pg.allreduce([tensor], opts).wait()
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


def torch_dist_comm(group=None, *, timeout=datetime.timedelta(minutes=30)):
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


def _has_gloo_for_cpu(backend):
    """Whether a group of this backend ("gloo", or "cpu:gloo,cuda:nccl" for a group with a
    backend per device) runs collectives of CPU tensors with gloo."""
    backend = str(backend)
    return backend == "gloo" or "cpu:gloo" in backend.split(",")


_default_cache = {}


def default_comm():
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
