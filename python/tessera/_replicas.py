"""The replica check of a save: tensors held by several ranks as replicas must be equal.

A save writes each replicated tensor (a plain tensor: every rank's copy; a ShardedTensor box
that several ranks hold under other replica ids) from one rank only (the main replica), so
replicas that differ across ranks lose every other rank's values without a word, e.g. an
optimizer's state taken for replicated when it was not (issue 22, defect 12). With the check,
the ranks first learn which boxes some rank holds under a non-main replica id (one small
all-gather), then each rank hashes the replicas it holds (BLAKE2b of their bytes, from their
memory: no copy; a sharded piece nobody else holds is not hashed), rank 0 compares the hashes
of each box (they travel with the structure gather a save makes anyway), and every rank learns
the verdict (one small collective); a mismatch fails the save on every rank before a byte is
written, naming the key, the box and the ranks on each side.

What is checked: plain tensors (every rank holds one, rank 0's is written) and the pieces of
sharded tensors that several ranks hold under replica ids (DTensor's Replicate() dimensions,
Megatron's replica ids, ShardedTensor(replica_id=...)). check_replicas="small" (tessera.save's
default): those of at most SMALL_BYTES bytes each (cheap: scalars, biases, norms, Adam's step);
"all" (True; save_state's default): all of them; "none" (False): nothing. Objects are not
compared (equal values may pickle differently). A one-rank save and a rank-local save
(collective=False) check nothing. The comparison is bit for bit.
"""

import ctypes
import hashlib
import json
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple, Type, Union

from . import _dtypes
from . import _tessera
from ._errors import _INVALID_ARGUMENT

SMALL_BYTES = 1 << 20
MODES = {"small": SMALL_BYTES, "all": None, True: None, "none": 0, False: 0}


def limit_of(mode: Union[str, bool]) -> Optional[int]:
    """The largest replica checked (None: all, 0: none) for a check_replicas value."""
    if isinstance(mode, bool) or mode in ("small", "all", "none"):
        return MODES[mode]
    raise ValueError(f"check_replicas must be 'small', 'all' (True) or 'none' (False), not "
                     f"{mode!r}")


def _raw(data: Any) -> Any:
    """A zero-copy byte view of a contiguous CPU tensor or array, or None."""
    if _dtypes.is_torch_tensor(data):
        if data.device.type != "cpu" or not data.is_contiguous():
            return None  # the save itself refuses it, naming why
        from ._state import lazy_view_bit, resolve_lazy_view  # noqa: PLC0415
        if lazy_view_bit(data) is not None:
            # A conj/neg view: hash its values (a copy: the resolved tensor dies on return).
            data = resolve_lazy_view(data)
            n = data.numel() * data.element_size()
            return bytes((ctypes.c_char * n).from_address(data.data_ptr())) if n else b""
        n = data.numel() * data.element_size()
        return (ctypes.c_char * n).from_address(data.data_ptr()) if n else b""
    if _dtypes.is_numpy_array(data):
        if not data.flags.c_contiguous:
            return None
        return memoryview(data).cast("B") if data.nbytes else b""
    return None


def _nbytes(data: Any) -> int:
    if _dtypes.is_torch_tensor(data):
        return data.numel() * data.element_size()
    return int(getattr(data, "nbytes", 0))


def _is_main(replica_id: list) -> bool:
    """Whether a replica id names the main replica (all zeros: the one a save writes)."""
    return not any(replica_id)


def _pieces(leaves: Iterable[Any], sharded_type: Type[Any],
            limit: Optional[int]) -> Iterator[tuple]:
    """(key, box, data, main) of this rank's tensors of at most `limit` bytes (all when None)
    that may be replicas: plain tensors (box ["whole", shape, dtype]: every rank holds one;
    the shape and dtype are part of what is compared, so that ranks that disagree on them get
    the save's own error about it) and ShardedTensor pieces (box: offsets, shape, flat range).
    `main`: a piece with the main replica id (all zeros) -- a replica only if another rank
    holds its box under another id."""
    for leaf in leaves:
        if not leaf.is_tensor:
            continue
        value = leaf.value
        data, main = value, False
        box: List[Any] = ["whole", list(getattr(value, "shape", [])),
                          str(getattr(value, "dtype", ""))]
        if isinstance(value, sharded_type):
            data, main = value.data, _is_main(value.replica_id)
            shape = list(value.local_shape or getattr(data, "shape", []))
            box = [value.global_offset or [0] * len(shape), shape,
                   list(value.flat_range) if value.flat_range else None]
        if limit is not None and _nbytes(data) > limit:
            continue
        yield leaf.key, box, data, main


def _identity(key: str, box: list) -> str:
    """The text that names one box of one key alike on every rank."""
    return json.dumps([key, box])


def claims(leaves: Iterable[Any], sharded_type: Type[Any], limit: Optional[int]) -> list:
    """The boxes this rank holds under a replica id other than the main one ([key, box]):
    another rank holds the main replica of each. Small: one entry per such piece."""
    if limit == 0:
        return []
    return [[key, box] for key, box, _, main in _pieces(leaves, sharded_type, limit)
            if not main and box[0] != "whole"]


def digests(leaves: Iterable[Any], sharded_type: Type[Any], limit: Optional[int],
            claimed: set) -> list:
    """[key, box, hash] of this rank's replicas of at most `limit` bytes (all when None),
    hashed from their memory: plain tensors, ShardedTensor pieces with a replica id other than
    the main one, and main pieces whose box another rank claimed (`claimed`: the _identity of
    every rank's claims). A main piece nobody else holds is not hashed (no cost for the
    shards of a sharded model)."""
    if limit == 0:
        return []
    out = []
    for key, box, data, main in _pieces(leaves, sharded_type, limit):
        if main and _identity(key, box) not in claimed:
            continue
        raw = _raw(data)
        if raw is None:
            continue  # the save itself refuses it, naming why
        out.append([key, box, hashlib.blake2b(raw, digest_size=8).hexdigest()])
    return out


def exchange_claims(comm: Any, leaves: Iterable[Any], sharded_type: Type[Any],
                    limit: Optional[int]) -> set:
    """COLLECTIVE over `comm` (several ranks; skip it when `limit` is 0 on every rank): every
    rank learns which boxes some rank holds as a non-main replica (one small all-gather)."""
    mine = json.dumps(claims(leaves, sharded_type, limit)).encode()
    claimed: Set[str] = set()
    for payload in comm.all_gather(mine):
        claimed.update(_identity(key, box) for key, box in json.loads(payload))
    return claimed


def _box_text(box: list) -> str:
    if box[0] == "whole":
        return ""
    offsets, shape, flat = box
    dims = ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) if offsets else ""
    text = f" box [{dims}]" if offsets else f" shape {shape}"
    return text + (f" elements {flat[0]}:{flat[1]}" if flat else "")


def mismatch(per_rank: list) -> Optional[str]:
    """The message of the first box whose replicas differ, from every rank's digests (a list
    indexed by rank), or None."""
    holders: Dict[Tuple[str, str], Tuple[Any, Dict[str, List[int]]]] = {}
    for rank, entries in enumerate(per_rank):
        for key, box, digest in entries:
            holders.setdefault((key, repr(box)), (box, {}))[1].setdefault(digest, []).append(rank)
    for (key, _), (box, by_digest) in sorted(holders.items()):
        if len(by_digest) > 1:
            groups = sorted(by_digest.values())
            sides = "; ".join(f"ranks {', '.join(map(str, g))} hold one value" if len(g) > 1
                              else f"rank {g[0]} holds one value" for g in groups)
            return (f"the replicas of tensor '{key}'{_box_text(box)} differ across ranks "
                    f"({sides}): a save writes one of them, so the others' values would be "
                    "lost (make them equal, give each rank its own piece with a ShardedTensor, "
                    "or pass check_replicas=False to save the main replica's values anyway)")
    return None


def check(comm: Any, per_rank: Optional[list]) -> None:
    """COLLECTIVE over `comm` (several ranks): raises InvalidArgumentError on every rank when
    replicas differ. `per_rank`: on rank 0, every rank's digests (gathered by the caller);
    None elsewhere."""
    message = (mismatch(per_rank) or "") if per_rank is not None else ""
    _tessera._agree_on_status(comm, _INVALID_ARGUMENT if message else 0, message)
