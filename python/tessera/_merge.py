"""Several pieces of one tensor on one rank, as the one entry the library takes per key.

The C++ StateDict holds one entry per key and rank. Frameworks hand a rank several pieces of
one global tensor under one key: Megatron-Core stacks the layers of a pipeline stage along a
prepended axis (one ShardedTensor per layer, all with the key "decoder.layers.<...>"), and
its distributed optimizer holds a flat range of each; a torch ShardedTensor may place several
shards on one rank. When the pieces form one box (or one flat range of one box), they are saved
and loaded as that box through a staging buffer: copied into it before a save, copied out of it
after a load. That costs one copy of the pieces, which the library would spare if it took
several boxes per key and rank.

- Dense pieces merge when their boxes tile their bounding box exactly.
- Pieces with flat ranges merge when they differ only along the first axis and their elements,
  in the row-major order of the bounding box, are one contiguous run (consecutive layers: the
  tail of one, whole ones, the head of the next).
"""

import math

from . import _dtypes
from ._errors import invalid_argument


class Merged:
    """The merged entry (`tensor`, a ShardedTensor over a staging buffer) and how to move data
    between it and the pieces."""

    def __init__(self, tensor, copies):
        self.tensor = tensor
        self._copies = copies  # (staging view, piece data) pairs

    def copy_in(self):
        """Pieces -> staging (before a save)."""
        for staging, piece in self._copies:
            _assign(staging, piece)

    def copy_out(self):
        """Staging -> pieces (after a load)."""
        for staging, piece in self._copies:
            _assign(piece, staging)


def merge(key, pieces):
    """One ShardedTensor for `pieces` (ShardedTensors of `key` held by one rank), or an
    InvalidArgumentError naming the key and the boxes when they form no single box."""
    from ._state import ShardedTensor  # noqa: PLC0415 (_state imports this module)
    first = pieces[0]
    for p in pieces[1:]:
        for field in ("global_shape", "replica_id", "allow_shape_mismatch", "partial"):
            if getattr(p, field) != getattr(first, field):
                raise invalid_argument(
                    f"tensor '{key}': this rank holds {len(pieces)} pieces of it with different "
                    f"{field} ({getattr(first, field)} and {getattr(p, field)})")
    libs = {_lib_and_dtype(p.data) for p in pieces}
    if len(libs) != 1:
        raise invalid_argument(f"tensor '{key}': this rank holds {len(pieces)} pieces of it of "
                               f"different dtypes or array types ({sorted(map(str, libs))})")
    boxes = [_box(p) for p in pieces]
    nonempty = [i for i, (_, sizes) in enumerate(boxes) if math.prod(sizes) > 0]
    if not nonempty:
        return None  # nothing but empty boxes: any one of them says it all
    pieces = [pieces[i] for i in nonempty]
    boxes = [boxes[i] for i in nonempty]
    low = [min(o[d] for o, _ in boxes) for d in range(len(first.global_shape))]
    high = [max(o[d] + s[d] for o, s in boxes) for d in range(len(first.global_shape))]
    shape = [h - lo for h, lo in zip(high, low)]
    if any(p.flat_range is not None for p in pieces):
        return _merge_flat(key, pieces, boxes, low, shape, ShardedTensor)
    _check_tiling(key, boxes, low, shape)
    staging = _empty_like(pieces[0].data, shape)
    copies = []
    for p, (offsets, sizes) in zip(pieces, boxes):
        region = tuple(slice(o - lo, o - lo + s) for o, lo, s in zip(offsets, low, sizes))
        copies.append((staging[region], p.data))
    tensor = ShardedTensor(staging, first.global_shape, low, replica_id=first.replica_id,
                           allow_shape_mismatch=first.allow_shape_mismatch,
                           partial=first.partial, dtype=first.dtype, key=key)
    return Merged(tensor, copies)


def _merge_flat(key, pieces, boxes, low, shape, sharded_tensor):
    inner = math.prod(shape[1:])
    runs = []
    for p, (offsets, sizes) in zip(pieces, boxes):
        if list(offsets[1:]) != low[1:] or list(sizes[1:]) != shape[1:]:
            raise invalid_argument(
                f"tensor '{key}': this rank holds {len(pieces)} pieces of it with flat ranges "
                f"whose boxes differ in more than the first axis ({_describe(boxes)}); tessera "
                "takes one box or flat range per key and rank")
        begin, end = p.flat_range if p.flat_range is not None else (0, math.prod(sizes))
        start = (offsets[0] - low[0]) * inner
        runs.append((start + begin, start + end, p))
    runs.sort(key=lambda r: r[0])
    for (_, end, _), (begin, _, _) in zip(runs, runs[1:]):
        if begin != end:
            raise invalid_argument(
                f"tensor '{key}': this rank holds {len(pieces)} pieces of it whose flat ranges "
                f"are not one contiguous run of their bounding box ({_describe(boxes)}); tessera "
                "takes one box or flat range per key and rank")
    total_begin, total_end = runs[0][0], runs[-1][1]
    staging = _empty_like(pieces[0].data, [total_end - total_begin])
    copies = [(staging[b - total_begin:e - total_begin], _flat_view(p.data, key))
              for b, e, p in runs]
    first = pieces[0]
    tensor = sharded_tensor(staging, first.global_shape, low, replica_id=first.replica_id,
                            flat_range=(total_begin, total_end), local_shape=shape,
                            allow_shape_mismatch=first.allow_shape_mismatch,
                            partial=first.partial, dtype=first.dtype, key=key)
    return Merged(tensor, copies)


def _box(p):
    """(offsets, sizes) of a ShardedTensor's local box, defaults applied."""
    sizes = list(p.local_shape) if p.local_shape else list(p.data.shape)
    offsets = list(p.global_offset) if p.global_offset else [0] * len(p.global_shape)
    return offsets, sizes


def _check_tiling(key, boxes, low, shape):
    volume = sum(math.prod(s) for _, s in boxes)
    overlap = None
    for i in range(len(boxes)):
        for j in range(i + 1, len(boxes)):
            if _intersects(boxes[i], boxes[j]):
                overlap = (i, j)
                break
        if overlap:
            break
    if overlap is not None or volume != math.prod(shape):
        why = (f"boxes {_describe([boxes[overlap[0]], boxes[overlap[1]]])} overlap"
               if overlap else f"they cover {volume} of the {math.prod(shape)} elements of "
                               f"their bounding box")
        raise invalid_argument(
            f"tensor '{key}': this rank holds {len(boxes)} pieces of it that do not form one "
            f"box: {why} ({_describe(boxes)}); tessera takes one box per key and rank")


def _intersects(a, b):
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def _describe(boxes, limit=4):
    text = ", ".join("[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, sizes)) + "]"
                     for offsets, sizes in boxes[:limit])
    return text + (f", ... ({len(boxes)} boxes)" if len(boxes) > limit else "")


def _lib_and_dtype(data):
    return (type(data).__module__.split(".")[0], str(data.dtype))


def _empty_like(data, shape):
    if _dtypes.is_torch_tensor(data):
        import torch  # noqa: PLC0415
        return torch.empty(shape, dtype=data.dtype)
    return _dtypes._numpy().empty(shape, dtype=data.dtype)


def _flat_view(data, key):
    if _dtypes.is_torch_tensor(data):
        if not data.is_contiguous():
            raise invalid_argument(f"tensor '{key}': the tensor is not contiguous")
        return data.view(-1)
    if not data.flags.c_contiguous:
        raise invalid_argument(f"tensor '{key}': the array is not contiguous")
    return data.reshape(-1)


def _assign(destination, source):
    if _dtypes.is_torch_tensor(destination):
        destination.copy_(source)
    else:
        destination[...] = source
