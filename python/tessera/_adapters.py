"""The sharded leaves frameworks produce, as tessera ShardedTensors and ShardedObjects.

tessera.save and tessera.load accept, as leaves of a state dict:

- torch.distributed._shard.sharded_tensor.ShardedTensor (FSDP's SHARDED_STATE_DICT, torch
  1.13 DCP): this rank's local shards are its boxes (shard_offsets, shard_sizes); every holder
  of a box is a main replica, and the lowest rank holding it writes it.
- DTensor (torch.distributed.tensor, torch >= 2.0), by duck typing (to_local(), device_mesh,
  placements): the local tensor is the box that the Shard(dim) placements give this rank's mesh
  coordinate; the coordinates along Replicate() mesh dimensions are its replica id.
- Megatron-Core's ShardedTensor and ShardedObject, by duck typing (Megatron is never
  imported): any object with the fields key, data, dtype, local_shape, global_shape,
  global_offset, axis_fragmentations, replica_id, prepend_axis_num, allow_shape_mismatch,
  flattened_range is a ShardedTensor; one with key, data, global_shape, global_offset,
  replica_id a ShardedObject, saved under Megatron's torch_dist name
  "<key>/shard_<offsets>_<shape>".

None of them is imported here: a torch ShardedTensor is recognised by its class only when its
module is already loaded (whoever made one loaded it), the others by their attributes.
"""

import sys

from . import _dtypes
from ._errors import invalid_argument
from ._sharded import ShardedObject, ShardedTensor

_MEGATRON_TENSOR_FIELDS = ("key", "data", "dtype", "local_shape", "global_shape",
                           "global_offset", "axis_fragmentations", "replica_id",
                           "prepend_axis_num", "allow_shape_mismatch", "flattened_range")
_MEGATRON_OBJECT_FIELDS = ("key", "data", "global_shape", "global_offset", "replica_id")


class Adapted:
    """A framework leaf as tessera sees it.

    value: the tessera ShardedTensor or ShardedObject saved or loaded for it, or a list of
        ShardedTensors: pieces of one tensor (several local shards), each an entry of its own.
    kind: "torch_sharded", "dtensor", "megatron_tensor" or "megatron_object" (for messages).
    replace_on_load: after a load, the leaf is replaced in its container by the loaded value
        (Megatron ShardedObjects, as Megatron's load returns them); tensors are loaded in place.
    """

    __slots__ = ("value", "kind", "replace_on_load")

    def __init__(self, value, kind, replace_on_load=False):
        self.value = value
        self.kind = kind
        self.replace_on_load = replace_on_load


def adapt(leaf, path_key, for_load):
    """The Adapted form of a framework leaf, or None for any other leaf. `path_key` (the
    leaf's dotted path) names the leaf in errors and is the key of leaves without their own."""
    torch_sharded = _torch_sharded_tensor_class()
    if torch_sharded is not None and isinstance(leaf, torch_sharded):
        return Adapted(_from_torch_sharded(leaf, path_key), "torch_sharded")
    if _is_dtensor(leaf):
        return Adapted(_from_dtensor(leaf, path_key), "dtensor")
    if not hasattr(leaf, "global_offset"):  # cheap test first: most leaves are tensors
        return None
    if all(hasattr(leaf, f) for f in _MEGATRON_TENSOR_FIELDS):
        return Adapted(_from_megatron_tensor(leaf, for_load), "megatron_tensor")
    if all(hasattr(leaf, f) for f in _MEGATRON_OBJECT_FIELDS):
        return Adapted(_from_megatron_object(leaf), "megatron_object", replace_on_load=True)
    return None


def is_framework_leaf(leaf):
    """True for the leaves adapt() takes (without converting them)."""
    torch_sharded = _torch_sharded_tensor_class()
    if torch_sharded is not None and isinstance(leaf, torch_sharded):
        return True
    if _is_dtensor(leaf):
        return True
    return hasattr(leaf, "global_offset") and (
        all(hasattr(leaf, f) for f in _MEGATRON_TENSOR_FIELDS)
        or all(hasattr(leaf, f) for f in _MEGATRON_OBJECT_FIELDS))


def megatron_object_key(key, global_offset, global_shape):
    """Megatron's torch_dist name of a ShardedObject (ShardedObject.unique_key)."""
    return (f"{key}/shard_{'.'.join(map(str, global_offset))}_"
            f"{'.'.join(map(str, global_shape))}")


def replica_list(replica_id, what):
    """A replica id (None, an int or a sequence of ints) as a list of ints."""
    if replica_id is None:
        return []
    if isinstance(replica_id, int) or hasattr(replica_id, "__index__"):
        return [int(replica_id)]
    try:
        return [int(r) for r in replica_id]
    except TypeError:
        raise invalid_argument(f"{what}: replica_id must be an int or a tuple of ints, not "
                               f"{type(replica_id).__name__}") from None


# ---- torch.distributed._shard ShardedTensor ------------------------------------------------

def _torch_sharded_tensor_class():
    module = sys.modules.get("torch.distributed._shard.sharded_tensor.api")
    return getattr(module, "ShardedTensor", None) if module is not None else None


def _from_torch_sharded(st, key):
    """Each local shard is a piece at its shard_offsets; several on one rank are pieces of one
    key, each saved from and loaded into its own tensor."""
    metadata = st.metadata()
    global_shape = [int(d) for d in metadata.size]
    shards = st.local_shards()
    if not shards:  # this rank holds none of it: an empty box, so it still names the key
        import torch  # noqa: PLC0415
        data = torch.empty([0] * len(global_shape), dtype=metadata.tensor_properties.dtype)
        return ShardedTensor(data, global_shape, [0] * len(global_shape), key=key)
    pieces = []
    for shard in shards:
        sizes = [int(s) for s in shard.metadata.shard_sizes]
        if list(shard.tensor.shape) != sizes:
            raise invalid_argument(f"tensor '{key}': a local shard's tensor has shape "
                                   f"{list(shard.tensor.shape)} but its metadata says {sizes}")
        pieces.append(ShardedTensor(shard.tensor, global_shape,
                                    [int(o) for o in shard.metadata.shard_offsets], key=key))
    return pieces[0] if len(pieces) == 1 else pieces


# ---- DTensor --------------------------------------------------------------------------------

def _is_dtensor(leaf):
    return (hasattr(leaf, "to_local") and hasattr(leaf, "device_mesh")
            and hasattr(leaf, "placements"))


def _from_dtensor(dt, key):
    global_shape = [int(d) for d in dt.shape]
    mesh = dt.device_mesh
    placements = tuple(dt.placements)
    local = dt.to_local()
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        import torch  # noqa: PLC0415
        data = torch.empty([0] * len(global_shape), dtype=local.dtype)
        return ShardedTensor(data, global_shape, [0] * len(global_shape), key=key)
    replica = []
    for mesh_dim, placement in enumerate(placements):
        if _is_replicate(placement):
            replica.append(int(coordinate[mesh_dim]))
        elif not _is_shard(placement):
            raise invalid_argument(
                f"tensor '{key}': DTensor placement {placement!r} on mesh dimension {mesh_dim} "
                "is neither Shard nor Replicate (redistribute a Partial placement to "
                "Replicate() before saving)")
    sizes, offsets = _dtensor_box(global_shape, mesh, placements, coordinate, key)
    if list(local.shape) != sizes:
        raise invalid_argument(f"tensor '{key}': the DTensor's local tensor has shape "
                               f"{list(local.shape)}, its placements give {sizes}")
    return ShardedTensor(local, global_shape, offsets, replica_id=replica, key=key)


def _is_shard(placement):
    test = getattr(placement, "is_shard", None)
    return bool(test()) if callable(test) else False


def _is_replicate(placement):
    test = getattr(placement, "is_replicate", None)
    return bool(test()) if callable(test) else False


def _dtensor_box(global_shape, mesh, placements, coordinate, key):
    """(local sizes, global offsets) of this rank's box: torch's own computation when the
    installed torch has it (it knows every placement kind), else Shard(dim) placements applied
    in mesh-dimension order, each splitting the current extent as torch.chunk does."""
    for name in ("torch.distributed.tensor._utils", "torch.distributed._tensor._utils"):
        module = sys.modules.get(name)
        compute = getattr(module, "compute_local_shape_and_global_offset", None)
        if compute is not None and type(mesh).__name__ == "DeviceMesh":
            sizes, offsets = compute(global_shape, mesh, placements)
            return [int(s) for s in sizes], [int(o) for o in offsets]
    sizes, offsets = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        if not _is_shard(placement):
            continue
        if type(placement).__name__ != "Shard":
            raise invalid_argument(f"tensor '{key}': DTensor placement {placement!r} is not "
                                   "supported by this torch; use Shard(dim) or Replicate()")
        dim = placement.dim % len(global_shape)
        parts = int(mesh.size(mesh_dim))
        chunk = -(-sizes[dim] // parts)  # torch.chunk: ceil-sized pieces, the last ones short
        start = min(int(coordinate[mesh_dim]) * chunk, sizes[dim])
        offsets[dim] += start
        sizes[dim] = min(chunk, sizes[dim] - start)
    return sizes, offsets


# ---- Megatron-Core ----------------------------------------------------------------------------

def _from_megatron_tensor(st, for_load):
    """Megatron's ShardedTensor: local data viewed as (1,) * prepend_axis_num + local_shape at
    global_offset (which includes the prepended axes) of global_shape; with flattened_range, the
    data is that slice of the flattened local shard."""
    key = st.key
    what = f"Megatron ShardedTensor '{key}'"
    prepend = int(st.prepend_axis_num or 0)
    local_shape = [int(d) for d in st.local_shape]
    global_shape = [int(d) for d in st.global_shape]
    global_offset = [int(o) for o in st.global_offset]
    if len(global_offset) != len(global_shape) or len(local_shape) + prepend != len(global_shape):
        raise invalid_argument(
            f"{what}: global_shape {global_shape}, global_offset {global_offset}, local_shape "
            f"{local_shape} and prepend_axis_num {prepend} do not agree (global_shape and "
            "global_offset need len(local_shape) + prepend_axis_num dimensions)")
    flat = st.flattened_range
    if flat is not None:
        if not isinstance(flat, slice) or flat.stop is None or flat.step not in (None, 1):
            raise invalid_argument(f"{what}: flattened_range must be a slice(start, stop) with "
                                   f"step 1, not {flat!r}")
        begin, end = int(flat.start or 0), int(flat.stop)
    data = st.data
    if data is None:
        if not for_load:
            raise invalid_argument(f"{what}: data is None (nothing to save)")
        data = _allocate_like_megatron(st, local_shape, None if flat is None else end - begin)
        st.data = data  # as Megatron's ShardedTensor.init_data: the loaded tensor is its data
    if _dtypes.is_torch_tensor(data) and st.dtype is not None and data.dtype != st.dtype:
        raise invalid_argument(f"{what}: data has dtype {data.dtype} but the ShardedTensor "
                               f"says {st.dtype}")
    replica = replica_list(st.replica_id, what)
    if flat is not None:
        if len(data.shape) != 1 or data.shape[0] != end - begin:
            raise invalid_argument(
                f"{what}: flattened_range {begin}:{end} needs 1-D data of {end - begin} "
                f"elements, not shape {list(data.shape)}")
        return ShardedTensor(data, global_shape, global_offset, replica_id=replica,
                             flat_range=(begin, end), local_shape=[1] * prepend + local_shape,
                             allow_shape_mismatch=st.allow_shape_mismatch, key=key)
    if list(data.shape) != local_shape:
        raise invalid_argument(f"{what}: data has shape {list(data.shape)} but local_shape is "
                               f"{local_shape}")
    if prepend:
        data = _view(data, [1] * prepend + local_shape, what)
    return ShardedTensor(data, global_shape, global_offset, replica_id=replica,
                         allow_shape_mismatch=st.allow_shape_mismatch, key=key)


def _allocate_like_megatron(st, local_shape, flat_length):
    import torch  # noqa: PLC0415
    shape = local_shape if flat_length is None else [flat_length]
    return torch.empty(shape, dtype=st.dtype)


def _view(data, shape, what):
    """`data` reshaped to `shape` without a copy (a load must write into the caller's memory)."""
    if _dtypes.is_torch_tensor(data):
        if not data.is_contiguous():
            raise invalid_argument(f"{what}: the tensor is not contiguous (tessera reads and "
                                   "writes row-major memory in place)")
        return data.view(shape)
    if _dtypes.is_numpy_array(data):
        if not data.flags.c_contiguous:
            raise invalid_argument(f"{what}: the array is not contiguous (tessera reads and "
                                   "writes row-major memory in place)")
        return data.reshape(shape)
    raise invalid_argument(f"{what}: data must be a torch tensor or a NumPy array, not "
                           f"{type(data).__name__}")


def _from_megatron_object(so):
    offset = [int(o) for o in so.global_offset]
    shape = [int(s) for s in so.global_shape]
    key = megatron_object_key(so.key, offset, shape)
    if len(offset) != len(shape):
        raise invalid_argument(f"Megatron ShardedObject '{so.key}': global_offset {offset} and "
                               f"global_shape {shape} differ in length")
    return ShardedObject(so.data, replica_list(so.replica_id, f"ShardedObject '{so.key}'"),
                         key=key)

