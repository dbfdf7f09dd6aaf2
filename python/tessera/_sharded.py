"""tessera.ShardedTensor and tessera.ShardedObject: the leaves a state dict gives to say how a
value is sharded or replicated. Their own module, below _state and _adapters (which both build
them), so that neither imports the other."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple, Union

from . import _dtypes

if TYPE_CHECKING:
    import numpy
    import torch

    #: What a ShardedTensor holds: a torch tensor or a NumPy array.
    TensorLike = Union[torch.Tensor, numpy.ndarray[Any, Any]]


def _as_ints(value, what):
    if value is None:
        return None
    try:
        return [int(v) for v in value]
    except TypeError:
        raise TypeError(f"{what} must be a sequence of ints, not {type(value).__name__}") from None


def _replica(value):
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return _as_ints(value, "replica_id")


class ShardedTensor:
    """One rank's piece of a global tensor (see include/tessera/sharded_tensor.h).

    data: a contiguous torch tensor (in CPU or CUDA memory) or NumPy array: the local box
        [global_offset, global_offset + local_shape), or, with flat_range=(begin, end), the
        elements begin..end-1 of the row-major flattening of that box (how a distributed
        optimizer shards).
    global_shape: the shape of the whole tensor; default data's shape (a whole tensor).
    global_offset: where the local box starts; default all zeros.
    replica_id: an int or a tuple of ints; all zeros (the default) is the main replica, the
        one that is written. Holders of the same box with other ids are deduplicated.
    local_shape: the shape of the local box; required with flat_range.
    allow_shape_mismatch: load only: load the part of the box that lies inside the saved tensor
        when the saved global shape differs.
    partial: save only: the ranks together may hold only part of the tensor.
    dtype: a tessera dtype name ("BF16", "F8_E4M3", ...) for data holding raw bits in an
        integer array of the same width (e.g. bfloat16 in a NumPy uint16 array).
    key: the key to save under instead of the leaf's dotted path.
    """

    __slots__ = ("data", "global_shape", "global_offset", "replica_id", "flat_range",
                 "local_shape", "allow_shape_mismatch", "partial", "dtype", "key")

    data: Any  # TensorLike (a template's may be any tensor a framework leaf wraps)
    global_shape: Optional[List[int]]
    global_offset: Optional[List[int]]
    replica_id: List[int]
    flat_range: Optional[Tuple[int, ...]]
    local_shape: Optional[List[int]]
    allow_shape_mismatch: bool
    partial: bool
    dtype: Optional[str]
    key: Optional[str]

    def __init__(self, data: TensorLike, global_shape: Optional[Sequence[int]] = None,
                 global_offset: Optional[Sequence[int]] = None, *,
                 replica_id: Union[int, Sequence[int]] = (),
                 flat_range: Union[Tuple[int, int], slice, None] = None,
                 local_shape: Optional[Sequence[int]] = None, allow_shape_mismatch: bool = False,
                 partial: bool = False, dtype: Optional[str] = None,
                 key: Optional[str] = None) -> None:
        self.data = data
        self.global_shape = _as_ints(global_shape, "global_shape")
        self.global_offset = _as_ints(global_offset, "global_offset")
        self.replica_id = _replica(replica_id)
        if flat_range is not None:
            if isinstance(flat_range, slice):
                flat_range = (flat_range.start or 0, flat_range.stop)
            flat_range = tuple(_as_ints(flat_range, "flat_range"))
            if len(flat_range) != 2:
                raise ValueError("flat_range must be (begin, end)")
        self.flat_range = flat_range
        self.local_shape = _as_ints(local_shape, "local_shape")
        self.allow_shape_mismatch = bool(allow_shape_mismatch)
        self.partial = bool(partial)
        if dtype is not None and dtype not in _dtypes.DTYPE_NAMES:
            raise ValueError(f"unknown tessera dtype {dtype!r}; one of {_dtypes.DTYPE_NAMES}")
        self.dtype = dtype
        self.key = key

    def __repr__(self) -> str:
        shape = tuple(getattr(self.data, "shape", ()))
        return (f"ShardedTensor(data shape {shape}, global_shape={self.global_shape}, "
                f"global_offset={self.global_offset}, replica_id={self.replica_id}, "
                f"flat_range={self.flat_range})")


class ShardedObject:
    """An object with an explicit replica id: bytes/bytearray are stored as they are, any
    other value pickled. Only the main replica (all zeros, the default) is written, so a value
    held by one rank only (e.g. that rank's RNG state under its own key) is saved from it.
    After a load, `value` holds what was loaded."""

    __slots__ = ("value", "replica_id", "key")

    value: Any
    replica_id: List[int]
    key: Optional[str]

    def __init__(self, value: Any, replica_id: Union[int, Sequence[int]] = (), *,
                 key: Optional[str] = None) -> None:
        self.value = value
        self.replica_id = _replica(replica_id)
        self.key = key

    def __repr__(self) -> str:
        return f"ShardedObject({self.value!r}, replica_id={self.replica_id})"
