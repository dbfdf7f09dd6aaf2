"""Python state dicts <-> the flat list of entries the C++ library saves and loads.

A state dict is a nested structure of containers (dict, collections.OrderedDict, list, tuple,
namedtuple) whose leaves are:

- torch tensors and NumPy arrays: whole tensors, replicated over the ranks (replica id
  (rank,), so rank 0 writes them);
- ShardedTensor: one rank's piece of a global tensor;
- bytes / bytearray: stored as they are (a ShardedObject of those bytes);
- ShardedObject: an object with an explicit replica id;
- the sharded tensors and objects of torch (ShardedTensor, DTensor) and Megatron-Core
  (ShardedTensor, ShardedObject): see tessera/_adapters.py;
- anything else: pickled, stored as a ShardedObject.

Keys are the dotted paths of the leaves ("model.layers.0.weight"; a list index is a path
element). The container structure is saved as JSON in the user metadata under
STRUCTURE_KEY, so load_all rebuilds the same container types.
"""

from __future__ import annotations

import collections
import importlib
import json
import pickle
import sys
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple, Union

from . import _adapters
from . import _dtypes
from . import _tessera
from ._errors import Error, corrupt_checkpoint, invalid_argument
from ._sharded import ShardedObject, ShardedTensor  # noqa: F401 (re-exported)

if TYPE_CHECKING:
    import numpy
    import torch

    #: What a ShardedTensor holds: a torch tensor or a NumPy array.
    TensorLike = Union[torch.Tensor, numpy.ndarray[Any, Any]]

STRUCTURE_KEY = "tessera.python.structure"
STRUCTURE_VERSION = 1
# Where tessera.remove_keys (C++ RemoveKeys, `tessera rm-keys`) records the prefixes it removed
# (include/tessera/remove_keys.h, kRemovedKeyPrefixesKey): the structure record still names
# those keys, and they are taken out of it when it is read.
REMOVED_PREFIXES_KEY = "tessera.removed_key_prefixes"
# torch_dist (DCP, Megatron) checkpoints: planner_data's path of each key in the nested state dict
# torch saved (src/format/torch_dist/dcp_codec.h, kPlannerPathsKey).
PLANNER_PATHS_KEY = "torch_dist.planner_paths"


# ---- traversal ---------------------------------------------------------------------------

def check_text(text, what):
    """Keys and user metadata are UTF-8 text: a str holding lone surrogates (how Python spells
    bytes that are not UTF-8, e.g. os.fsdecode) cannot be saved."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise invalid_argument(f"{what} {text!r} is not valid UTF-8 text ({e.reason} at "
                               f"position {e.start})") from None


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def _is_tensor_like(value):
    """What torch DCP keeps traversing a list for: torch tensors (DTensor, torch ShardedTensor),
    and tessera's and the frameworks' sharded leaves."""
    return (_dtypes.is_torch_tensor(value) or isinstance(value, (ShardedTensor, ShardedObject))
            or _adapters.is_framework_leaf(value))


def dcp_terminal(value):
    """Whether torch.distributed.checkpoint's flattening (torch's _traverse.traverse_state_dict)
    stores `value` as one leaf: anything but a dict or a list, and a list holding no tensor
    and no dict or list that is not itself terminal. A tuple is one leaf (one pickled object)."""
    t = type(value)
    if t is dict or t is collections.OrderedDict:
        return False
    if t is not list:
        return True
    for entry in value:
        if type(entry) in (dict, collections.OrderedDict, list) and not dcp_terminal(entry):
            return False
        if _is_tensor_like(entry):
            return False
    return True


def dcp_differs(value):
    """Whether flattening `value` as torch DCP does gives other keys than tessera's own
    flattening: it holds a tuple, or a list DCP stores whole (dcp_terminal)."""
    t = type(value)
    if t is dict or t is collections.OrderedDict:
        return any(dcp_differs(v) for v in value.values())
    if t is list:
        return dcp_terminal(value) or any(dcp_differs(v) for v in value)
    return t is tuple or _is_namedtuple(value)


def _items(value, dcp=False):
    """(kind, [(key, child)]) of a container, or (None, None) for a leaf. With `dcp`, the
    containers torch DCP stores as one leaf (dcp_terminal) are leaves."""
    t = type(value)
    if dcp and t is not dict and t is not collections.OrderedDict and dcp_terminal(value):
        return None, None
    if t is dict or t is collections.OrderedDict:
        return ("dict" if t is dict else "odict"), list(value.items())
    if t is list:
        return "list", list(enumerate(value))
    if t is tuple:
        return "tuple", list(enumerate(value))
    if _is_namedtuple(value):
        return "namedtuple", list(enumerate(value))
    return None, None


# A leaf_fn of copy_containers returns it for an entry to leave out.
DROP = object()


def copy_containers(value: Any, leaf_fn: Any, path: Tuple[Any, ...] = ()) -> Any:
    """A copy of the containers of `value` whose leaves are leaf_fn(path, leaf); entries for
    which it returns DROP are left out. (Megatron's adapters copy a sharded state dict so.)"""
    kind, items = _items(value)
    if kind is None:
        return leaf_fn(path, value)
    copied = [(k, copy_containers(child, leaf_fn, path + (k,))) for k, child in items]
    copied = [(k, v) for k, v in copied if v is not DROP]
    if kind in ("dict", "odict"):
        return type(value)(copied)
    values = [v for _, v in copied]
    if kind == "list":
        return values
    return type(value)._make(values) if kind == "namedtuple" else tuple(values)


def _path_text(path):
    return ".".join(map(str, path)) if path else "the state dict"


def _walk(value, path, visit, dcp=False):
    """Visits the leaves in depth-first order (visit(path, leaf) returns the leaf's structure
    node) and returns the structure node of `value`. A path holds str dict keys (an int key as
    its str) and int list and tuple indices, as torch DCP's paths. `dcp`: see _items."""
    kind, items = _items(value, dcp)
    if kind is None:
        return visit(path, value)
    node: Dict[str, Any] = {kind: []}
    for k, child in items:
        if kind in ("dict", "odict"):
            if type(k) not in (str, int):
                raise invalid_argument(
                    f"{_path_text(path)}: dict key {k!r} of type {type(k).__name__}: "
                    "tessera state dicts take str and int keys")
            node[kind].append([k, _walk(child, path + (str(k),), visit, dcp)])
        else:
            node[kind].append(_walk(child, path + (k,), visit, dcp))
    if kind == "namedtuple":
        t = type(value)
        node["type"] = f"{t.__module__}:{t.__qualname__}"
        node["fields"] = list(t._fields)
    return node


def map_leaves(value, fn, counter=None, dcp=False):
    """Replaces each leaf by fn(index, leaf) (indices in _walk's order, with the same `dcp`).
    Dicts and lists are updated in place; a tuple holding a replaced leaf is rebuilt. Returns
    the new value."""
    if counter is None:
        counter = [0]
    kind, items = _items(value, dcp)
    if kind is None:
        index = counter[0]
        counter[0] += 1
        return fn(index, value)
    if kind in ("dict", "odict", "list"):
        for k, child in items:
            new = map_leaves(child, fn, counter, dcp)
            if new is not child:
                value[k] = new
        return value
    children = [child for _, child in items]
    new = [map_leaves(child, fn, counter, dcp) for child in children]
    if all(a is b for a, b in zip(new, children)):
        return value
    return type(value)._make(new) if kind == "namedtuple" else tuple(new)


# ---- flattening ----------------------------------------------------------------------------

class Leaf:
    """One leaf of a flattened state dict."""

    __slots__ = ("key", "value", "is_tensor", "encoding", "replace_on_load", "index",
                 "megatron_list")

    def __init__(self, key, value, is_tensor, encoding=None, replace_on_load=False,
                 megatron_list=False):
        self.index = None  # of the state dict's leaf, in map_leaves order (set by Flat)
        self.key = key
        self.value = value          # the leaf (tensor, array, ShardedTensor, object), or the
        #                             tessera ShardedTensor/ShardedObject of a framework leaf
        self.is_tensor = is_tensor
        self.encoding = encoding    # objects: "bytes", "bytearray" or "pickle"
        # After a load, the leaf is replaced by the loaded value even though it is a sharded
        # object (a Megatron ShardedObject, as Megatron's load returns it).
        self.replace_on_load = replace_on_load
        # A Megatron ShardedObject in a DCP (torch_dist) checkpoint: Megatron stores its data as
        # a one-element list (torch.save([data]), strategies/torch.py), and so does tessera.
        self.megatron_list = megatron_list


def _encoding(value):
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, bytearray):
        return "bytearray"
    return "pickle"


def _lib(data):
    if _dtypes.is_torch_tensor(data):
        return "torch"
    if _dtypes.is_numpy_array(data):
        return "numpy"
    raise invalid_argument(
        f"ShardedTensor data must be a torch tensor or a NumPy array, not {type(data).__name__}")


class Flat:
    """A state dict flattened: its leaves in depth-first order and its structure."""

    def __init__(self, state_dict, for_load=False, dcp=False):
        """`dcp`: flatten as torch.distributed.checkpoint does (dcp_terminal containers, such as
        tuples and lists of numbers, are one object each), for checkpoints in its format."""
        if _items(state_dict)[0] is None:
            raise TypeError("a state dict must be a dict, list or tuple, not "
                            f"{type(state_dict).__name__}")
        self.for_load = for_load  # a Megatron ShardedTensor without data gets a tensor to load
        self.dcp = dcp
        self.leaves = []
        self.entries = []  # by build(): the StateBuilder index of each leaf
        # The path of each key in the state dict (str dict keys, int list indices), as torch
        # DCP's planner_data records it; a key of its own (ShardedTensor(key=...), Megatron's)
        # is its own path.
        self.paths = {}
        self._num_leaves = 0
        self._root = _walk(state_dict, (), self._visit_leaf, dcp)
        self._extra = {}

    @property
    def root(self):
        """The structure node of the state dict (as saved under STRUCTURE_KEY)."""
        return self._root

    @property
    def structure(self):
        """The JSON text saved under STRUCTURE_KEY."""
        structure = {"version": STRUCTURE_VERSION, "root": self._root}
        if self._extra:
            structure["extra"] = self._extra
        return json.dumps(structure, separators=(",", ":"))

    def rank_summary(self, replicas=()):
        """What rank 0 needs to know of this rank's leaves that rank 0 may not hold (see
        merge_rank_summaries): the encodings of its ShardedObjects, the libraries of its
        tensors; and `replicas`, the digests of its replicas (tessera/_replicas.py). Small: one
        entry per ShardedObject and checked replica."""
        objects = [[leaf.key, leaf.encoding] for leaf in self.leaves
                   if isinstance(leaf.value, ShardedObject)]
        libs = sorted({_lib(leaf.value.data if isinstance(leaf.value, ShardedTensor)
                            else leaf.value) for leaf in self.leaves if leaf.is_tensor})
        return json.dumps({"objects": objects, "libs": libs,
                           "replicas": list(replicas)}).encode()

    def merge_rank_summaries(self, summaries):
        """On rank 0, with every rank's rank_summary(): records the encodings of objects only
        other ranks hold, and the tensor library all ranks use (if one), so load_all decodes
        and types the leaves rank 0's structure lacks."""
        own = {leaf.key for leaf in self.leaves}
        objects: Dict[str, str] = {}
        libs: Set[str] = set()
        for summary in summaries:
            summary = json.loads(summary)
            libs.update(summary["libs"])
            for key, encoding in summary["objects"]:
                if key not in own:
                    objects.setdefault(key, encoding)
        if objects:
            self._extra["objects"] = objects
        if len(libs) == 1:
            self._extra["lib"] = libs.pop()

    def _visit_leaf(self, path, value):
        first = len(self.leaves)
        node = self._visit(path, value)
        for leaf in self.leaves[first:]:  # one leaf of the state dict, maybe several pieces
            leaf.index = self._num_leaves
            self.paths.setdefault(leaf.key, list(path) if leaf.key == _path_text(path)
                                  else [leaf.key])
        self._num_leaves += 1
        return node

    def _visit(self, path, value):
        key = ".".join(map(str, path))
        custom = value.key if isinstance(value, (ShardedTensor, ShardedObject)) else None
        check_text(custom or key, "key")
        if not isinstance(value, (ShardedTensor, ShardedObject)):
            adapted = _adapters.adapt(value, key, self.for_load)
            if adapted is not None:
                return self._visit_adapted(key, adapted)
        if isinstance(value, ShardedTensor):
            key = value.key or key
            self.leaves.append(Leaf(key, value, True))
            return {"tensor": key, "lib": _lib(value.data), "sharded": True}
        if _dtypes.is_torch_tensor(value) or _dtypes.is_numpy_array(value):
            self.leaves.append(Leaf(key, value, True))
            return {"tensor": key, "lib": "torch" if _dtypes.is_torch_tensor(value) else "numpy"}
        if isinstance(value, ShardedObject):
            key = value.key or key
            encoding = _encoding(value.value)
            self.leaves.append(Leaf(key, value, False, encoding))
            return {"object": key, "encoding": encoding, "sharded": True}
        encoding = _encoding(value)
        self.leaves.append(Leaf(key, value, False, encoding))
        return {"object": key, "encoding": encoding}

    def _visit_adapted(self, key, adapted):
        value = adapted.value
        if isinstance(value, list):  # pieces of one tensor (entries of their own, see build())
            for piece in value:
                self.leaves.append(Leaf(piece.key or key, piece, True))
            return {"tensor": value[0].key or key, "lib": _lib(value[0].data), "sharded": True}
        key = value.key or key
        if isinstance(value, ShardedTensor):
            self.leaves.append(Leaf(key, value, True))
            return {"tensor": key, "lib": _lib(value.data), "sharded": True}
        megatron_list = adapted.kind == "megatron_object"
        if megatron_list and self.dcp and not self.for_load:
            # Megatron's torch_dist layout of a ShardedObject: its data in a one-element list.
            value = ShardedObject([value.value], value.replica_id, key=value.key)
        encoding = _encoding(value.value)
        self.leaves.append(Leaf(key, value, False, encoding, adapted.replace_on_load,
                                megatron_list))
        return {"object": key, "encoding": encoding, "sharded": True}

    def build(self, rank, for_load):
        """The StateBuilder of the leaves; plain tensors and objects get replica id (rank,).
        Tensor leaves sharing a key are pieces of one tensor (Megatron's layers stacked on a
        prepended axis, a distributed optimizer's flat range of each layer, several local
        shards): each is an entry of its own, saved from and loaded into its own memory (the
        library checks that they agree and do not overlap). One object at several places of
        the state dict is one entry."""
        builder = _tessera.StateBuilder()
        self.entries = []
        # (key, id of the leaf's value) -> its entry: one object at several places under one
        # key is one entry (a tensor tied under two keys is saved under each).
        entry_of_value: Dict[Tuple[str, int], int] = {}
        # tensor key -> whether every leaf of it so far is a ShardedTensor
        sharded_only: Dict[str, bool] = {}
        for leaf in self.leaves:
            if leaf.is_tensor:
                value = leaf.value
                entry = entry_of_value.get((leaf.key, id(value)))
                if entry is None:
                    _check_shared_key(sharded_only, leaf.key, value)
                    entry = _add_tensor(builder, leaf.key, value, rank, for_load)
                    entry_of_value[(leaf.key, id(value))] = entry
                self.entries.append(entry)
                continue
            value = leaf.value
            replica = [rank]
            if isinstance(value, ShardedObject):
                replica = value.replica_id
                value = value.value
            if for_load:
                data = b""
            elif leaf.encoding == "pickle":
                try:
                    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as e:
                    raise invalid_argument(
                        f"object '{leaf.key}': cannot be pickled: {type(e).__name__}: {e}"
                    ) from e
            else:
                data = bytes(value)
            self.entries.append(builder.add_object(leaf.key, data, replica,
                                                   pickled=leaf.encoding == "pickle"))
        return builder


def _check_shared_key(sharded_only, key, value):
    """Only ShardedTensors (pieces of one tensor) may share a key: two plain tensors under one
    dotted path are a mistake in the state dict, not pieces."""
    sharded = isinstance(value, ShardedTensor)
    if key in sharded_only and not (sharded and sharded_only[key]):
        raise invalid_argument(
            f"duplicate key '{key}': several leaves have it (a key is the dotted path of a "
            "leaf, or the key of its sharded tensor); only pieces of one sharded tensor may "
            "share a key")
    sharded_only[key] = sharded and sharded_only.get(key, True)


def _add_tensor(builder, key, value, rank, for_load):
    spec = {}
    dtype = None
    data = value
    if isinstance(value, ShardedTensor):
        data = value.data
        dtype = value.dtype
        spec = dict(global_shape=value.global_shape, global_offset=value.global_offset or [],
                    local_shape=value.local_shape or [], replica_id=value.replica_id,
                    flat_range=value.flat_range,
                    allow_shape_mismatch=value.allow_shape_mismatch, partial=value.partial)
    else:
        spec = dict(replica_id=[rank])
    if _dtypes.is_torch_tensor(data):
        return _add_torch(builder, key, data, dtype, spec, for_load)
    if _dtypes.is_numpy_array(data):
        name = dtype or _dtypes.numpy_dtype_name(data.dtype)
        if name is None:
            raise invalid_argument(
                f"tensor '{key}': NumPy dtype {data.dtype} has no tessera dtype (supported: "
                "float16/32/64, int8..64, uint8..64, bool, in native byte order)")
        return builder.add_buffer(key, data, name, writable=for_load, **spec)
    raise invalid_argument(
        f"tensor '{key}': data must be a torch tensor or a NumPy array, not "
        f"{type(data).__name__}")


def lazy_view_bit(tensor):
    """'conjugate' or 'negative' when a torch tensor is a lazy view whose memory holds other
    values than the tensor (its conjugate or negative bit: `z.conj()`, `z.conj().imag`,
    `torch._neg_view(t)`), else None. data_ptr() of such a tensor points at the unresolved
    values: saving from it would store the wrong sign, loading into it would write it."""
    if getattr(tensor, "is_conj", None) is not None and tensor.is_conj():
        return "conjugate"
    if getattr(tensor, "is_neg", None) is not None and tensor.is_neg():
        return "negative"
    return None


def resolve_lazy_view(tensor):
    """`tensor` itself, or for a conjugate/negative view a new tensor of its values."""
    if lazy_view_bit(tensor) is None:
        return tensor
    return tensor.resolve_conj().resolve_neg()


def refuse_lazy_view_target(tensor, what):
    """A load target must be memory that holds its own values: refuse a conj/neg view."""
    bit = lazy_view_bit(tensor)
    if bit is not None:
        raise invalid_argument(
            f"{what}: the load target is a view with torch's {bit} bit set (e.g. z.conj(), "
            "z.conj().imag, torch._neg_view(t)): its memory holds other values than the "
            "tensor, so a load would store wrong-signed data; load into a tensor of its own "
            "(e.g. t.resolve_conj().resolve_neg() or t.clone()) and copy")


def _add_torch(builder, key, tensor, dtype, spec, for_load=False):
    if for_load:
        refuse_lazy_view_target(tensor, f"tensor '{key}'")
    else:
        # A new tensor of the values (the builder keeps it alive as the pointer's owner).
        tensor = resolve_lazy_view(tensor)
    device = tensor.device
    if device.type not in ("cpu", "cuda"):
        raise invalid_argument(
            f"tensor '{key}': on device {device}; tessera reads and writes host and CUDA "
            "memory (move it with .cpu(), and back after a load)")
    if tensor.layout != _torch_strided():
        raise invalid_argument(f"tensor '{key}': layout {tensor.layout} is not supported "
                               "(dense tensors only)")
    name = _dtypes.torch_dtype_name(tensor.dtype)
    if dtype is not None:
        if tensor.element_size() != _dtypes.itemsize(dtype):
            raise invalid_argument(
                f"tensor '{key}': items of {tensor.element_size()} bytes cannot hold dtype "
                f"{dtype}")
        name = dtype
    if name is None:
        raise invalid_argument(f"tensor '{key}': torch dtype {tensor.dtype} has no tessera dtype")
    if not tensor.is_contiguous():
        raise invalid_argument(
            f"tensor '{key}': the tensor is not contiguous (tessera reads and writes row-major "
            "memory in place; pass t.contiguous() to save, or load into a contiguous tensor)")
    if device.type == "cuda":
        # Copied through pinned buffers on tessera's own stream, ordered after the work queued
        # so far on torch's current stream of the tensor's device (and, on load, before the
        # work queued on it afterwards).
        return builder.add_pointer(key, tensor.data_ptr(), name, list(tensor.shape), tensor,
                                   cuda_device=_device_index(device),
                                   stream=_current_cuda_stream(device), **spec)
    return builder.add_pointer(key, tensor.data_ptr(), name, list(tensor.shape), tensor, **spec)


def _device_index(device):
    import torch  # noqa: PLC0415
    return device.index if device.index is not None else torch.cuda.current_device()


def _current_cuda_stream(device):
    """torch's current stream of `device` as a cudaStream_t integer (0: the legacy default)."""
    import torch  # noqa: PLC0415
    return int(torch.cuda.current_stream(device).cuda_stream)


def _torch_strided():
    import torch  # noqa: PLC0415
    return torch.strided


def decode_objects(flat, builder, skipped, unpickle=True):
    """After a load: the new value of each object leaf, by leaf index (ShardedObject leaves
    are updated in place instead). Keys in `skipped` (not loaded) are left alone. With
    unpickle=False nothing is unpickled: a leaf whose placeholder is not bytes or bytearray
    receives the stored bytes as they are. Otherwise such a leaf gets the value its stored
    encoding gives: torch.load of a torch.save archive (PyTorch DCP byte items), json.loads of
    JSON, pickle.loads of anything else."""
    new_values = {}
    for leaf, entry in zip(flat.leaves, flat.entries):
        index = leaf.index
        if leaf.is_tensor or leaf.key in skipped:
            continue
        data = builder.object_data(entry)
        current = leaf.value.value if isinstance(leaf.value, ShardedObject) else leaf.value
        if isinstance(current, bytes):
            value = data
        elif isinstance(current, bytearray):
            value = bytearray(data)
        elif not unpickle:
            value = data
        elif isinstance(current, _Json) or builder.object_encoding(entry) == "json":
            value = _json_value(leaf.key, data)
        elif isinstance(current, _TorchSaved) or builder.object_encoding(entry) == "torch_save":
            # A torch.save archive (a PyTorch DCP byte item): what torch's own loader returns.
            value = _torch_load(leaf.key, data)
        else:
            try:
                value = pickle.loads(data)
            except Exception as e:
                raise invalid_argument(
                    f"object '{leaf.key}': the stored bytes are not a pickle ({type(e).__name__}: "
                    f"{e}); load into a bytes placeholder to get the raw bytes") from e
        if (leaf.megatron_list and builder.object_encoding(entry) == "torch_save"
                and type(value) is list and len(value) == 1):
            value = value[0]  # Megatron's [data] in a DCP checkpoint (Leaf.megatron_list)
        if isinstance(leaf.value, ShardedObject):
            leaf.value.value = value
        if leaf.replace_on_load or not isinstance(leaf.value, ShardedObject):
            new_values[index] = value
    return new_values


# ---- state dicts from metadata ---------------------------------------------------------------

class _Pickled:
    """Placeholder of an object leaf stored pickled (load_all)."""


class _TorchSaved:
    """Placeholder of an object leaf stored as a torch.save archive (load_all of a PyTorch DCP
    checkpoint: its byte items, Megatron's common.pt); torch.load gives the value back."""


class _Json:
    """Placeholder of an object leaf stored as JSON text (Megatron's metadata.json)."""


def _placeholder(encoding):
    """The placeholder load_all puts where an object of `encoding` goes: the saved Python
    encoding ("bytes", "bytearray", "pickle") or the stored one (ObjectInfo.encoding)."""
    if encoding == "bytes":
        return b""
    if encoding == "bytearray":
        return bytearray()
    if encoding == "torch_save":
        return _TorchSaved()
    if encoding == "json":
        return _Json()
    return _Pickled()


def _torch_load(key, data):
    try:
        import torch  # noqa: PLC0415
    except ImportError as e:
        raise invalid_argument(
            f"object '{key}' is a torch.save archive and torch is not importable; pass "
            "objects='bytes' to get its bytes") from e
    import io  # noqa: PLC0415
    try:
        return torch.load(io.BytesIO(data), weights_only=False)
    except Exception as e:
        raise invalid_argument(
            f"object '{key}': torch.load of its stored bytes failed ({type(e).__name__}: {e})"
        ) from e


def json_from_checkpoint(text, what):
    """`text`, JSON that a checkpoint holds, parsed. A CorruptCheckpointError naming `what` (the
    object, the file) when it is not JSON, or nests deeper than Python's parser can go (its
    RecursionError, e.g. a metadata.json nested 100,000 deep, is never let out)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise corrupt_checkpoint(f"{what}: the stored JSON is nested too deeply to parse "
                                 f"(deeper than Python's recursion limit)") from None
    except ValueError as e:
        raise corrupt_checkpoint(f"{what}: the stored bytes are not JSON ({e})") from None


def _json_value(key, data):
    return json_from_checkpoint(data, f"object '{key}'")


def _allocate(info, lib, key=None):
    """An uninitialised tensor for `info` (a TensorInfo), as a ShardedTensor naming its key
    (the saved one, whatever its place in the structure) and its dtype (the array may hold raw
    bits)."""
    shape = tuple(info.shape)
    if lib == "torch":
        import torch  # noqa: PLC0415
        dtype, _ = _dtypes.torch_dtype(info.dtype)
        data = torch.empty(shape, dtype=dtype)
    else:
        np = _dtypes._numpy()
        dtype, _ = _dtypes.numpy_dtype(info.dtype)
        data = np.empty(shape, dtype=dtype)
    return ShardedTensor(data, dtype=info.dtype, key=key)


def _namedtuple_type(node, import_modules):
    """The namedtuple class the structure names, when it can be found (imported by name only
    with import_modules: importing runs a module's code), else an equivalent new one."""
    module, _, qualname = node["type"].partition(":")
    try:
        t = importlib.import_module(module) if import_modules else sys.modules[module]
        for part in qualname.split("."):
            t = getattr(t, part)
        if isinstance(t, type) and issubclass(t, tuple) and list(t._fields) == node["fields"]:
            return t
    except Exception:  # noqa: BLE001 (any failure: fall back to an equivalent type)
        pass
    name = qualname.rpartition(".")[2] or "namedtuple"
    return collections.namedtuple(name, node["fields"])


def _malformed(source, detail):
    return corrupt_checkpoint(f"{source}: the saved structure (user metadata "
                              f"'{STRUCTURE_KEY}') is malformed: {detail}")


def template_from_node(node, tensors, tensor_type, used=None, allocated=None,
                       import_modules=True, source="the checkpoint"):
    """The template of one saved structure node: a freshly allocated tensor for each tensor
    leaf (a ShardedTensor naming its key), a placeholder ShardedObject for each object leaf, in
    the saved containers. `tensors`: the checkpoint's TensorInfo by key; `used` collects the
    keys named; `allocated` (key -> ShardedTensor) makes leaves naming one key (pieces of one
    tensor, e.g. Megatron's layers) share one whole tensor. A node that does not parse is a
    CorruptCheckpointError naming `source`; namedtuple types are imported only with
    import_modules."""
    used = set() if used is None else used
    allocated = {} if allocated is None else allocated

    def build(node):
        if "tensor" in node:
            key = node["tensor"]
            if key not in tensors:
                raise _malformed(source, f"it names tensor {key!r} but the checkpoint has no "
                                 "such tensor")
            used.add(key)
            if key not in allocated:
                allocated[key] = _allocate(tensors[key], tensor_type or node.get("lib", "numpy"),
                                           key)
            return allocated[key]
        if "object" in node:
            key = node["object"]
            used.add(key)
            encoding = node.get("encoding")
            placeholder = b"" if encoding == "bytes" else bytearray() if encoding == "bytearray" \
                else _Pickled()
            return ShardedObject(placeholder, key=key)
        if "dict" in node:
            return {k: build(v) for k, v in node["dict"]}
        if "odict" in node:
            return collections.OrderedDict((k, build(v)) for k, v in node["odict"])
        if "list" in node:
            return [build(v) for v in node["list"]]
        if "tuple" in node:
            return tuple(build(v) for v in node["tuple"])
        if "namedtuple" in node:
            return _namedtuple_type(node, import_modules)._make(
                build(v) for v in node["namedtuple"])
        raise _malformed(source, f"unknown node {sorted(node)}")

    try:
        return build(node)
    except Error:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, RecursionError) as e:
        raise _malformed(source, f"{type(e).__name__}: {e}") from None


def _structure(metadata, source):
    """The saved structure record (a dict), or None (a checkpoint not saved from Python)."""
    text = metadata.user_metadata.get(STRUCTURE_KEY)
    if text is None:
        return None
    try:
        structure = json.loads(text)
    except RecursionError:
        raise _malformed(source, "JSON nested too deeply to parse") from None
    except ValueError as e:
        raise _malformed(source, f"not JSON ({e})") from None
    if not isinstance(structure, dict):
        raise _malformed(source, f"a JSON {type(structure).__name__}, not an object")
    if structure.get("version") != STRUCTURE_VERSION:
        raise invalid_argument(
            f"the saved structure has version {structure.get('version')}; this tessera "
            f"reads version {STRUCTURE_VERSION}")
    if "root" not in structure:
        raise _malformed(source, "it has no 'root'")
    extra = structure.get("extra", {})
    if not isinstance(extra, dict) or not isinstance(extra.get("objects", {}), dict):
        raise _malformed(source, f"'extra' must be an object of objects, not {extra!r}")
    removed = removed_prefixes(metadata)
    if removed:  # keys tessera.remove_keys took out: out of the structure too
        present = {t.key for t in metadata.tensors} | {o.key for o in metadata.objects}
        root = _without_removed(structure["root"], present, removed)
        structure["root"] = {"dict": []} if root is None else root
    return structure


def removed_prefixes(metadata):
    """The key prefixes tessera.remove_keys removed from the checkpoint (none: [])."""
    try:
        prefixes = json.loads(metadata.user_metadata.get(REMOVED_PREFIXES_KEY, "[]"))
    except ValueError:
        return []
    return [p for p in prefixes if isinstance(p, str) and p] if isinstance(prefixes, list) else []


def _without_removed(node, present, removed):
    """`node` without the leaves remove_keys took out of the checkpoint (absent, and under a
    removed prefix) and without the containers that held only such leaves; None when the node
    itself goes. A namedtuple that lost a field becomes a tuple of the rest."""
    if not isinstance(node, dict):
        return node  # malformed: left for the template's checks to name
    if "tensor" in node or "object" in node:
        key = node.get("tensor", node.get("object"))
        gone = (isinstance(key, str) and key not in present
                and any(key.startswith(p) for p in removed))
        return None if gone else node
    for kind in ("dict", "odict", "list", "tuple", "namedtuple"):
        children = node.get(kind)
        if not isinstance(children, list):
            continue
        if kind in ("dict", "odict"):
            items = [item for item in children if isinstance(item, list) and len(item) == 2]
            new = [[k, _without_removed(child, present, removed)] for k, child in items]
            changed = len(items) != len(children) or any(
                a[1] is not b[1] for a, b in zip(items, new))
            kept = [item for item in new if item[1] is not None]
        else:
            new = [_without_removed(child, present, removed) for child in children]
            changed = any(a is not b for a, b in zip(children, new))
            kept = [child for child in new if child is not None]
        if not changed:
            return node
        if children and not kept:
            return None
        if kind == "namedtuple":
            return {"tuple": kept}
        return dict(node, **{kind: kept})
    return node


def saved_structure(metadata, source="the checkpoint"):
    """The saved structure's root node, or None (a checkpoint not saved from Python)."""
    structure = _structure(metadata, source)
    return None if structure is None else structure["root"]


def template_from_metadata(metadata, tensor_type, source="the checkpoint", import_modules=True):
    """A state dict with a freshly allocated tensor for every tensor of the checkpoint and a
    placeholder for every object, in the saved container structure when the checkpoint has one
    (saved from Python), else a flat dict by key. A structure record that does not parse is a
    CorruptCheckpointError naming `source`."""
    tensors = {t.key: t for t in metadata.tensors}
    objects = {o.key: o.encoding for o in metadata.objects}
    used: Set[str] = set()
    allocated: Dict[str, ShardedTensor] = {}
    structure = _structure(metadata, source)
    root = {}
    extra = {}
    if structure is not None:
        root = template_from_node(structure["root"], tensors, tensor_type, used, allocated,
                                  import_modules, source)
        extra = structure.get("extra", {})
    # Keys the structure does not name (saved from C++, or only by ranks other than rank 0):
    # placed by their dotted path under the containers they share with the structure.
    rest = sorted((set(tensors) | set(objects)) - used)
    if rest and not isinstance(root, dict):
        raise invalid_argument(
            f"the checkpoint has keys outside its saved structure ({rest[0]!r}, ...) and the "
            f"structure's root is a {type(root).__name__}, not a dict")
    lib = tensor_type or extra.get("lib", "numpy")
    encodings = extra.get("objects", {})
    # A DCP / Megatron torch_dist checkpoint saved by torch from a nested state dict: each
    # key's path in it (planner_data), to rebuild the nesting as torch does.
    paths = _planner_paths(metadata, source, len(tensors) + len(objects)) \
        if structure is None else {}
    for key in rest:
        if key in tensors:
            value = _allocate(tensors[key], lib, key)
        else:
            # The encoding Python saved, else the stored one (other formats, C++ saves).
            value = ShardedObject(_placeholder(encodings.get(key, objects[key])), key=key)
        if key in paths:
            _set_element(root, paths[key], value, key, source)
        else:
            _place(root, key, value)
    return root


def _planner_paths(metadata, source, num_keys):
    """{key: path} from a torch_dist checkpoint's planner_data (user_metadata
    PLANNER_PATHS_KEY, written by the C++ reader), or {}. A path is a non-empty list of str
    keys and int list indices; an index is below the number of keys (each list element holds
    at least one leaf), so a crafted one cannot make a huge list."""
    if metadata.format != "torch_dist":
        return {}
    text = metadata.user_metadata.get(PLANNER_PATHS_KEY)
    if text is None:
        return {}
    try:
        paths = json.loads(text)
    except (ValueError, RecursionError):
        raise _malformed(source, "its planner_data paths are not JSON") from None
    if not isinstance(paths, dict):
        raise _malformed(source, "its planner_data paths are not a mapping")
    for key, path in paths.items():
        if not isinstance(path, list) or not path or not all(
                isinstance(e, str) or (type(e) is int and 0 <= e < num_keys) for e in path):
            raise _malformed(source, f"planner_data gives key {key!r} the path {path!r} (a "
                             "path is str keys and int list indices below the number of keys)")
    return paths


def _set_element(root, path, value, key, source):
    """torch.distributed.checkpoint._traverse.set_element: `value` at `path` below `root`,
    making a dict for a str path element and a list (holes None) for an int one."""
    try:
        node = root
        for i in range(1, len(path)):
            prev = path[i - 1]
            default: Any = {} if type(path[i]) is str else []
            if isinstance(node, dict):
                node = node.setdefault(prev, default)
            else:
                node.extend([None] * (prev + 1 - len(node)))
                if node[prev] is None:
                    node[prev] = default
                node = node[prev]
        last = path[-1]
        if type(last) is int:
            node.extend([None] * (last + 1 - len(node)))
        if not isinstance(node, (dict, list)) or (isinstance(node, dict) and last in node) or (
                isinstance(node, list) and node[last] is not None):
            raise TypeError("another key's value is there")
        node[last] = value
    except (TypeError, AttributeError, IndexError, KeyError) as e:
        raise _malformed(source, f"planner_data's path {path!r} of key {key!r} collides with "
                         f"another key's ({e})") from None


def _child(container, name):
    """The child of a dict or list named by the path element `name`, or None."""
    if isinstance(container, dict):
        if name in container:
            return container[name]
        if name.lstrip("-").isdigit() and int(name) in container:
            return container[int(name)]
        return None
    if isinstance(container, list) and name.isdigit() and int(name) < len(container):
        return container[int(name)]
    return None


def _place(root, key, value):
    """Puts `value` at its dotted `key` below `root` (a dict): down the longest existing path
    of dicts and lists; then, in the deepest dict reached, under nested new dicts (one per
    path element) when that dict holds only dicts, else as one entry keyed by the rest of the
    path (dict keys may hold dots, as in a torch module's state_dict)."""
    node, parts = root, key.split(".")
    while True:
        for n in range(len(parts) - 1, 0, -1):
            child = _child(node, ".".join(parts[:n]))
            if isinstance(child, (dict, list)):
                node, parts = child, parts[n:]
                break
        else:
            break
    if isinstance(node, dict) and node and all(type(v) is dict for v in node.values()):
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        parts = parts[-1:]
    rest = ".".join(parts)
    if not isinstance(node, dict) or rest in node:
        node, rest = root, key
    if rest in node:
        raise invalid_argument(f"key '{key}' collides with the saved structure")
    node[rest] = value


def _unwrap_leaf(_, leaf):
    if isinstance(leaf, ShardedTensor):
        return leaf.data
    if isinstance(leaf, ShardedObject):
        return leaf.value
    return leaf


def unwrap(value):
    """load_all: the ShardedTensor and ShardedObject wrappers of the template -> their
    contents."""
    return map_leaves(value, _unwrap_leaf)
