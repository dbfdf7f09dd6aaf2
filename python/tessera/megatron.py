"""Megatron-Core's dist_checkpointing entry points, over tessera.

Shaped like megatron.core.dist_checkpointing (serialization.py, Megatron-Core 0.19), so that
switching is one line:

    from megatron.core import dist_checkpointing            # before
    from tessera import megatron as dist_checkpointing      # after

    dist_checkpointing.save(model.sharded_state_dict(), checkpoint_dir)
    state_dict = dist_checkpointing.load(model.sharded_state_dict(), checkpoint_dir)
    model.load_state_dict(state_dict)
    tensors = dist_checkpointing.load_plain_tensors(checkpoint_dir)

By default the checkpoint is Megatron's own torch_dist (a PyTorch DCP directory, its
ShardedObjects as one-element lists, the common state as the ShardedObject "common_state",
metadata.json), written by tessera: Megatron's own load and load_plain_tensors read it, and this
module reads what Megatron wrote. format="tessera" writes tessera's own format instead
(docs/FORMAT.md: checksums, remove_sharded_tensors without rewriting), which only tessera reads.

Megatron is not imported by these functions: its ShardedTensor and ShardedObject are
recognised by their fields (tessera/_adapters.py), its ShardedTensorFactory by build()/merge_fn
and its LocalNonpersistentObject by name. The strategies that plug tessera into Megatron's own
dist_checkpointing.save and load (TesseraSaveShardedStrategy, TesseraLoadShardedStrategy,
subclasses of Megatron's torch_dist strategies) import Megatron when first used.

Like Megatron's, the functions are collective over torch.distributed's default group (the
whole job) when it is initialised: `comm=None` means a tessera comm over that group (a gloo
group made once for tessera when the job's backend is another, e.g. NCCL), or one rank when
torch.distributed is not initialised. Pass `comm=` for any other tessera.Comm.
"""

from __future__ import annotations

import enum
import json
import os
import sys
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Literal, Optional, Union

from . import _adapters
from . import _api
from . import _state
from ._errors import Error, invalid_argument, reword_advice, warn_partial_load
from ._handover import AsyncSaveHandle
from ._tessera import Comm
from ._types import StateDict, StrPath

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup
    from typing_extensions import Unpack

    # Imported on first use at run time (they import megatron.core): see __getattr__ below.
    from ._megatron_strategy import TesseraLoadShardedStrategy, TesseraSaveShardedStrategy
    from ._types import LoadOptions, MegatronSaveOptions

__all__ = ["TesseraLoadShardedStrategy", "TesseraSaveShardedStrategy", "load",
           "load_plain_tensors", "remove_sharded_tensors", "save"]

# Megatron's StrictHandling values -> (skip keys asked for but absent from the checkpoint,
# skip keys of the checkpoint no rank asks for, warn, return). Megatron's names are the other
# way round from tessera's: its "unexpected" keys are asked for but absent (tessera's
# missing_keys), its "missing" keys are in the checkpoint but asked for by no rank (tessera's
# unexpected_keys).
_STRICT = {
    "assume_ok_unexpected": (False, True, None, None),
    "raise_unexpected": (False, True, None, None),
    "raise_all": (False, False, None, None),
    "log_unexpected": (True, True, "unexpected", None),
    "log_all": (True, True, "all", None),
    "return_unexpected": (True, True, None, "unexpected"),
    "return_all": (True, True, None, "all"),
    "ignore_all": (True, True, None, None),
}

CONTENT_METADATA_KEY = "content_metadata"  # Megatron's key in the common state dict
# Megatron's torch_dist layout (megatron/core/dist_checkpointing/serialization.py, core.py).
COMMON_STATE_KEY = "common_state/shard_0_1"  # ShardedObject("common_state", ..., (1,), (0,))
LEGACY_COMMON_FILE = "common.pt"            # the common state of Megatron-Core <= 0.15
CONFIG_FILE = "metadata.json"               # CheckpointingConfig: what makes it a checkpoint
TORCH_DIST_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
_FORMATS = ("torch_dist", "tessera")


def save(sharded_state_dict: StateDict, checkpoint_dir: StrPath,
         sharded_strategy: Optional[object] = None, validate_access_integrity: bool = True,
         async_sharded_save: bool = False,
         preprocess_common_before_consistancy_check: Optional[Callable[..., Any]] = None,
         content_metadata: Optional[Dict[str, Any]] = None, async_strategy: Optional[str] = None,
         verify_integrity: bool = False, *, common_strategy: Optional[object] = None,
         comm: Optional[Comm] = None, format: Literal["torch_dist", "tessera"] = "torch_dist",
         **options: Unpack[MegatronSaveOptions]) -> Optional[AsyncSaveHandle]:
    """Saves a Megatron sharded state dict at `checkpoint_dir`. COLLECTIVE. Megatron's steps:
    ShardedTensorFactory leaves are built, LocalNonpersistentObject leaves left out,
    ShardedTensors and ShardedObjects saved by their main replicas (replica id all zeros),
    every other leaf (the "common" state: iteration, args, ...) from rank 0; `content_metadata`
    goes into the common state under "content_metadata".

    format="torch_dist" (default): Megatron's torch_dist checkpoint, as Megatron-Core 0.19
        writes it: a PyTorch DCP directory, each ShardedObject's data as a one-element list,
        the common state dict as the ShardedObject "common_state" (rank 0's), and
        metadata.json (written by rank 0 before the data: a directory without .metadata is no
        checkpoint). Megatron's load and load_plain_tensors read it.
    format="tessera": tessera's own format (checksums; remove_sharded_tensors frees bytes
        without rewriting), the common state as tessera saves any leaf.
    sharded_strategy: a TesseraSaveShardedStrategy is used as it is meant (its options apply);
        any other Megatron strategy object is ignored with a warning: tessera is the strategy.
    validate_access_integrity: tessera always checks that the main replicas cover every tensor
        exactly once (the error names the key, the boxes and the ranks).
    preprocess_common_before_consistancy_check: not called: the common state is rank 0's; it
        is not compared across ranks.
    async_sharded_save=True: returns a tessera.AsyncSaveHandle whose save already runs in the
        background (wait() it), where Megatron returns a request for the caller to schedule.
    async_strategy, verify_integrity: accepted for Megatron's signature (tessera checksums
        every chunk of its own format; a DCP checkpoint has no checksums).
    common_strategy: Megatron-Core <= 0.13's argument; ignored with a warning unless None.
    comm, **options: as tessera.save (num_io_threads, sync, ...).

    Returns None, or the AsyncSaveHandle.
    """
    del validate_access_integrity, preprocess_common_before_consistancy_check, async_strategy
    del verify_integrity
    save_options: Dict[str, Any] = dict(options)
    if isinstance(sharded_strategy, _strategy_classes()["save"] or ()):
        save_options = {**sharded_strategy.options, **save_options}
        sharded_strategy = None
    _warn_strategies("save", sharded_strategy, common_strategy)
    if format not in _FORMATS:
        raise ValueError(f"format must be one of {list(_FORMATS)}, not {format!r}")
    comm = _api._comm_handle(comm)
    state = _copy_for_save(sharded_state_dict)
    if content_metadata is not None:
        if not isinstance(state, dict):
            raise TypeError("content_metadata needs a sharded state dict that is a dict")
        state[CONTENT_METADATA_KEY] = content_metadata
    path = os.fspath(checkpoint_dir)
    if format == "torch_dist":
        state = _torch_dist_layout(state, comm.rank if comm is not None else 0)
        save_options["format"] = "torch_dist"
        if comm is None or comm.rank == 0:
            write_config(path)
    if async_sharded_save:
        return _api.async_save(state, path, comm=comm, **save_options)
    _api.save(state, path, comm=comm, **save_options)
    return None


def write_config(path: StrPath) -> None:
    """Writes Megatron's metadata.json (CheckpointingConfig of the torch_dist backend) into the
    directory `path`, creating it: Megatron's load requires it to call a directory a
    checkpoint."""
    os.makedirs(path, exist_ok=True)
    temporary = os.path.join(path, CONFIG_FILE + ".tmp")
    with open(temporary, "w") as f:
        json.dump(TORCH_DIST_CONFIG, f)
    os.replace(temporary, os.path.join(path, CONFIG_FILE))


def _torch_dist_layout(state, rank):
    """The state dict a torch_dist save writes: the sharded leaves where they are, and the
    common (non-sharded) leaves in one ShardedObject "common_state" of rank 0, as Megatron's
    save_preprocess and save do."""
    if not isinstance(state, dict):
        raise TypeError("a torch_dist save needs a sharded state dict that is a dict")
    sharded, common = _extract(state, _is_sharded_leaf)
    if "common_state" in sharded:
        raise invalid_argument("the sharded state dict has an entry 'common_state', the name "
                               "Megatron's torch_dist gives the common state")
    sharded["common_state"] = _state.ShardedObject([common], replica_id=rank,
                                                   key=COMMON_STATE_KEY)
    return sharded


def load(sharded_state_dict: StateDict, checkpoint_dir: StrPath,
         sharded_strategy: Optional[object] = None, validate_access_integrity: bool = True,
         strict: Union[str, bool, enum.Enum] = "assume_ok_unexpected",
         verify_integrity: bool = False, process_group: Optional[ProcessGroup] = None, *,
         common_strategy: Optional[object] = None, comm: Optional[Comm] = None,
         **options: Unpack[LoadOptions]) -> Any:
    """Loads the checkpoint at `checkpoint_dir` (Megatron's torch_dist, written by Megatron or
    by tessera, or tessera's own format) into the tensors of a Megatron sharded state dict (in
    place: each ShardedTensor's data) and returns the loaded state dict, as Megatron's load
    does: the same nesting with each ShardedTensor replaced by its data tensor, each
    ShardedObject by its loaded value, each ShardedTensorFactory by its merge_fn of what was
    loaded, each LocalNonpersistentObject by its unwrapped object; plus the checkpoint's common
    (non-sharded) state, whatever the request holds. `sharded_state_dict` itself keeps its
    leaves. A ShardedTensor whose data is None gets a new tensor (Megatron's init_data).
    COLLECTIVE, over `process_group` (a gloo torch.distributed group) or `comm`.

    strict: Megatron's StrictHandling (or its value as a string; True means its default
        "assume_ok_unexpected", False "log_unexpected"). In Megatron's words, "unexpected" keys
        are asked for but absent from the checkpoint, "missing" keys are in the checkpoint but
        asked for by no rank:
        - "assume_ok_unexpected" (default), "raise_unexpected": an unexpected key is an error;
          missing keys are ignored.
        - "raise_all": either is an error.
        - "log_unexpected", "log_all": they are skipped with a warning (tessera.PartialLoadWarning).
        - "return_unexpected", "return_all": skipped; load returns (state_dict, missing_keys,
          unexpected_keys), sets of keys ("return_unexpected" leaves missing_keys empty).
        - "ignore_all": skipped silently.
    sharded_strategy: a TesseraLoadShardedStrategy's options apply; any other Megatron strategy
        is ignored with a warning. common_strategy (Megatron <= 0.13): ignored with a warning.
    validate_access_integrity, verify_integrity: accepted for Megatron's signature; a tessera
        load reads any box of any saved tensor, whoever else reads it, and checks the
        checksums of tessera's format.
    comm, **options: as tessera.load.
    """
    del validate_access_integrity, verify_integrity
    if isinstance(sharded_strategy, _strategy_classes()["load"] or ()):
        options = {**sharded_strategy.options, **options}
        sharded_strategy = None
    _warn_strategies("load", sharded_strategy, common_strategy)
    skip_absent, skip_unasked, log, returned = _parse_strict(strict)
    if comm is None and process_group is not None:
        from ._torch_comm import torch_dist_comm  # noqa: PLC0415
        comm = torch_dist_comm(process_group)
    comm = _api._comm_handle(comm)
    path = os.fspath(checkpoint_dir)

    def prepare():
        request = _Request(sharded_state_dict)
        metadata = _api.read_metadata(path)
        if metadata.format == "torch_dist":
            request.use_torch_dist_common(metadata)
        else:
            request.match_common_entries(metadata)
        flat = _state.Flat(request.state, for_load=True)
        builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=True)
        opts = _api._load_options(True, options)
        policy = _api._tessera.KeyPolicy
        opts.missing_keys = policy.SKIP if skip_absent else policy.ERROR
        opts.unexpected_keys = policy.SKIP if skip_unasked else policy.ERROR
        return request, flat, builder, opts

    request, flat, builder, opts = _api._prepare(comm, prepare)
    try:
        report = _api._load_prepared(request.state, flat, builder, path, comm, opts,
                                     function=None)
    except Error as e:
        raise _megatron_wording(e, strict) from None
    absent = {_base_key(k) for k in report.missing_keys}      # Megatron's "unexpected"
    unasked = {_base_key(k) for k in report.unexpected_keys} - request.internal_keys
    if log is not None:
        warn_partial_load(f"tessera.megatron.load(strict={_strict_name(strict)!r})",
                          sorted(absent), sorted(unasked) if log == "all" else [])
    result = request.result(report.state_dict, flat, set(report.missing_keys))
    if returned is None:
        return result
    return result, (unasked if returned == "all" else set()), absent


def remove_sharded_tensors(checkpoint_dir: StrPath, key_prefix: str) -> None:
    """Removes every tensor and object whose key starts with `key_prefix` from the checkpoint
    at `checkpoint_dir` and frees their bytes, as Megatron's remove_sharded_tensors does (e.g.
    key_prefix="optimizer." to keep only the model). Crash-safe (tessera.remove_keys); saving
    with separate_prefixes=[key_prefix] (Megatron's separation_hint) makes it delete whole
    files without copying. Not collective, like Megatron's: call it from one process. Warns,
    as Megatron does, when no key has the prefix.
    """
    report = _api.remove_keys(os.fspath(checkpoint_dir), [key_prefix])
    if not report.removed_tensors and not report.removed_objects:
        warnings.warn(f'There are no keys in {os.fspath(checkpoint_dir)} that begin with '
                      f'"{key_prefix}".', stacklevel=2)


def load_plain_tensors(checkpoint_dir: StrPath, *, comm: Optional[Comm] = None,
                       **options: Unpack[LoadOptions]) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at `checkpoint_dir`, whole, as torch tensors in a flat
    dict by key; common state not included (as Megatron's load_plain_tensors). COLLECTIVE
    like Megatron's (every rank reads everything): over torch.distributed's default group when
    it is initialised, else this process alone; or over `comm`.
    """
    import torch  # noqa: PLC0415
    from . import _dtypes  # noqa: PLC0415
    path = os.fspath(checkpoint_dir)
    comm = _api._comm_handle(comm)

    def prepare():
        state = {}
        for info in _api.read_metadata(path).tensors:
            dtype, raw = _dtypes.torch_dtype(info.dtype)
            data = torch.empty(tuple(info.shape), dtype=dtype)
            state[info.key] = _state.ShardedTensor(data, dtype=info.dtype if raw else None,
                                                   key=info.key)
        flat = _state.Flat(state, for_load=True)
        builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=True)
        opts = _api._load_options(True, options)
        opts.unexpected_keys = _api._tessera.KeyPolicy.SKIP  # the objects: not asked for
        return state, flat, builder, opts

    state, flat, builder, opts = _api._prepare(comm, prepare)
    _api._load_prepared(state, flat, builder, path, comm, opts, function=None)
    return {key: leaf.data for key, leaf in state.items()}


# ---- the request of a load, and its result ---------------------------------------------------



def _is_factory(value):
    return (hasattr(value, "build_fn") and hasattr(value, "merge_fn")
            and callable(getattr(value, "build", None)))


def _is_nonpersistent(value):
    return type(value).__name__ == "LocalNonpersistentObject" and callable(
        getattr(value, "unwrap", None))


def _copy_for_save(sharded_state_dict):
    def leaf(path, value):
        if _is_nonpersistent(value):
            return _state.DROP
        if _is_factory(value):
            return value.build()
        return value
    return _state.copy_containers(sharded_state_dict, leaf)


class _Request:
    """What one rank asks a load for: the sharded state dict with factories built and
    non-persistent objects set aside, plus placeholders for the checkpoint's common entries
    it does not name."""

    def __init__(self, sharded_state_dict):
        self.factories: List[Any] = []      # (path, factory)
        self.nonpersistent: List[Any] = []  # (path, object)

        def leaf(path, value):
            if _is_nonpersistent(value):
                self.nonpersistent.append((path, value))
                return _state.DROP
            if _is_factory(value):
                self.factories.append((path, value))
                return value.build()
            return value

        self.state = _state.copy_containers(sharded_state_dict, leaf)
        self.common = []  # (path, leaf) of common entries the request lacks
        # torch_dist: the checkpoint's common state dict, loaded whole and merged (Megatron's
        # load_common_state_dict); keys of the layout no caller asks for.
        self.torch_dist_common = False
        self.internal_keys = set()

    def use_torch_dist_common(self, metadata):
        """A torch_dist checkpoint (Megatron's or tessera's): the request's common leaves go;
        the result's common part is the checkpoint's common state dict (the ShardedObject
        "common_state", or the common.pt of Megatron-Core <= 0.15), loaded whole."""
        objects = {o.key for o in metadata.objects}
        self.state = _state.copy_containers(
            self.state, lambda path, value: value if _is_sharded_leaf(value) else _state.DROP)
        if not isinstance(self.state, dict):
            raise TypeError("a sharded state dict must be a dict")
        placeholders = []
        for key in (COMMON_STATE_KEY, LEGACY_COMMON_FILE, CONFIG_FILE):
            if key in objects:
                placeholders.append(_state.ShardedObject(b"" if key == CONFIG_FILE else None,
                                                         key=key))
                self.internal_keys.add(_base_key(key))
        self.state = dict(self.state)
        self.state["\0common"] = placeholders
        self.torch_dist_common = True

    def match_common_entries(self, metadata):
        """As Megatron's load, whose common part is the checkpoint's common state whatever the
        request holds: drops the request's common (non-sharded) leaves the checkpoint lacks,
        and adds placeholders for the saved common leaves the request does not name (found in
        the saved structure; each is loaded and put at its saved path, through dicts only)."""
        saved = {t.key for t in metadata.tensors} | {o.key for o in metadata.objects}
        self.state = _state.copy_containers(
            self.state, lambda path, value: value if _is_sharded_leaf(value)
            or _leaf_key(path, value) in saved else _state.DROP)
        root = _state.saved_structure(metadata)  # without what remove_keys removed
        if root is None or not isinstance(self.state, dict):
            return
        asked = set()
        _state._walk(self.state, (), lambda path, value: asked.add(_leaf_key(path, value)))
        tensors = {t.key: t for t in metadata.tensors}
        for path, node in _common_nodes(root, ()):
            key = node.get("tensor", node.get("object"))
            if key in asked or not all(isinstance(p, str) for p in path):
                continue
            if "tensor" in node:
                if key not in tensors:
                    continue
                placeholder = _state._allocate(tensors[key], "torch", key)
            else:
                placeholder = _state.ShardedObject(b"" if node.get("encoding") == "bytes"
                                                   else None, key=key)
            self.common.append((path, placeholder))
        if self.common:
            self.state = dict(self.state)
            self.state["\0common"] = [placeholder for _, placeholder in self.common]

    def result(self, loaded, flat, skipped):
        """The state dict Megatron's load returns. `loaded` is the request after the load,
        whose object leaves were replaced by their values (which may be containers): its
        leaves are found through the structure the request had before (flat.root)."""
        keys: Dict[int, str] = {}
        for leaf in flat.leaves:
            keys.setdefault(leaf.index, leaf.key)

        def unwrap(index, value):
            return _state.DROP if keys.get(index) in skipped else _unwrap_leaf(value)

        result = _rebuild(flat.root, loaded, unwrap, [0])
        common = result.pop("\0common", None) if isinstance(result, dict) else None
        for path, obj in self.nonpersistent:  # in path order: list positions come back
            _put(result, path, obj.unwrap(), insert=True)
        for path, factory in self.factories:
            _put(result, path, factory.merge_fn(_get(result, path)))
        if self.torch_dist_common:
            # Megatron: merge(common_state_dict, loaded_state_dict): the common state is the
            # base, what was loaded goes into it.
            base = {}
            for value in common or []:
                if type(value) is list and len(value) == 1:
                    value = value[0]  # "common_state": [state dict], as Megatron stores it
                if isinstance(value, dict):  # the common state dict (not metadata.json's bytes)
                    base = value
            return _merge(base, result)
        if common is not None:
            for (path, _), value in zip(self.common, common):
                if _get_or_none(result, path) is None:
                    _put(result, path, value, create=True)
        return result


def _extract(value, predicate):
    """(matching, rest) of a nested dict: Megatron's dict_utils.extract_matching_values, so the
    common state holds the containers Megatron's holds (one that only held sharded leaves is
    left out; an empty one stays)."""
    matching: Any
    rest: Any
    if isinstance(value, dict):
        matching, rest = {}, {}
        for k, v in value.items():
            if isinstance(v, (dict, list)):
                m, r = _extract(v, predicate)
                if m:
                    matching[k] = m
                if r or not v:
                    rest[k] = r
            elif predicate(v):
                matching[k] = v
            else:
                rest[k] = v
        return matching, rest
    if isinstance(value, list):
        matching, rest = [], []
        for v in value:
            if isinstance(v, (dict, list)) and v:
                m, r = _extract(v, predicate)
                if m:
                    matching.append(m)
                if r:
                    rest.append(r)
            elif predicate(v):
                matching.append(v)
            else:
                rest.append(v)
        return matching, rest
    return (value, None) if predicate(value) else (None, value)


def _merge(base, other):
    """Megatron's dict_utils.merge: `other` merged into `base` (dicts key by key, lists item by
    item, anything else replaced). Returns base."""
    if isinstance(base, dict) and isinstance(other, dict):
        for k, v in other.items():
            base[k] = _merge(base[k], v) if k in base else v
        return base
    if isinstance(base, list) and isinstance(other, list):
        if len(base) != len(other):
            raise invalid_argument(f"the checkpoint's common state has a list of {len(base)} "
                                   f"items where the loaded state has {len(other)}")
        return [_merge(a, b) for a, b in zip(base, other)]
    return other


def _rebuild(node, value, leaf_fn, counter):
    """A copy of `value` following the structure `node` (tessera._state's JSON nodes): each
    leaf node's value becomes leaf_fn(leaf index, value); _state.DROP leaves it out."""
    if "tensor" in node or "object" in node:
        counter[0] += 1
        return leaf_fn(counter[0] - 1, value)
    for kind in ("dict", "odict"):
        if kind in node:
            items = [(k, _rebuild(child, value[k], leaf_fn, counter)) for k, child in node[kind]]
            return type(value)((k, v) for k, v in items if v is not _state.DROP)
    for kind in ("list", "tuple", "namedtuple"):
        if kind in node:
            items = [_rebuild(child, v, leaf_fn, counter) for child, v in zip(node[kind], value)]
            items = [v for v in items if v is not _state.DROP]
            if kind == "list":
                return items
            return type(value)._make(items) if kind == "namedtuple" else tuple(items)
    raise AssertionError(f"unknown structure node {sorted(node)}")


def _unwrap_leaf(value):
    if isinstance(value, _state.ShardedTensor):
        return value.data
    if isinstance(value, _state.ShardedObject):
        return value.value
    if hasattr(value, "flattened_range") and hasattr(value, "prepend_axis_num"):
        return value.data  # a Megatron ShardedTensor, loaded in place
    return value


def _leaf_key(path, value):
    """The key a leaf is saved under (as _state.Flat names it)."""
    if isinstance(value, (_state.ShardedTensor, _state.ShardedObject)) and value.key:
        return value.key
    if _adapters.is_framework_leaf(value) and hasattr(value, "global_offset"):
        if hasattr(value, "flattened_range"):
            return value.key  # a Megatron ShardedTensor
        return _adapters.megatron_object_key(value.key, value.global_offset, value.global_shape)
    return ".".join(str(p) for p in path)


def _is_sharded_leaf(value):
    return (isinstance(value, (_state.ShardedTensor, _state.ShardedObject))
            or _adapters.is_framework_leaf(value))


def _common_nodes(node, path):
    """(path, node) of every leaf of a saved structure that is not sharded."""
    for kind in ("dict", "odict"):
        if kind in node:
            for k, child in node[kind]:
                yield from _common_nodes(child, path + (k,))
            return
    for kind in ("list", "tuple", "namedtuple"):
        if kind in node:
            for i, child in enumerate(node[kind]):
                yield from _common_nodes(child, path + (i,))
            return
    if not node.get("sharded"):
        yield path, node


def _get(container, path):
    for p in path:
        container = container[p]
    return container


def _get_or_none(container, path):
    try:
        return _get(container, path)
    except (KeyError, IndexError, TypeError):
        return None


def _put(container, path, value, create=False, insert=False):
    for p in path[:-1]:
        if create and isinstance(container, dict) and p not in container:
            container[p] = {}
        container = container[p]
    if isinstance(container, tuple):
        raise invalid_argument(f"cannot put a value at {'.'.join(map(str, path))}: a tuple "
                               "holds it")
    if insert and isinstance(container, list):
        container.insert(path[-1], value)
    else:
        container[path[-1]] = value


def _base_key(key):
    """A ShardedObject's Megatron key from its saved name ("<key>/shard_<offsets>_<shape>")."""
    base, sep, shard = key.rpartition("/shard_")
    return base if sep and shard.count("_") == 1 else key


# ---- options ---------------------------------------------------------------------------------

def _strict_name(strict):
    if isinstance(strict, bool):
        return "assume_ok_unexpected" if strict else "log_unexpected"
    return getattr(strict, "value", strict)  # a StrictHandling member


def _parse_strict(strict):
    name = _strict_name(strict)
    if name not in _STRICT:
        raise ValueError(f"strict must be one of {sorted(_STRICT)} (or a StrictHandling), not "
                         f"{strict!r}")
    return _STRICT[name]


def _megatron_wording(error, strict):
    """A load error with tessera.load's advice ("pass strict=False") in Megatron's terms,
    chosen by the error's detail (its kind), never by its text."""
    kind = error.detail.kind if getattr(error, "detail", None) is not None else "none"
    if kind == "missing_keys":
        return reword_advice(
            error, "pass strict='log_unexpected' or 'return_unexpected' to load the rest")
    if kind == "unexpected_keys":
        return reword_advice(
            error, f"strict={_strict_name(strict)!r}; the default 'assume_ok_unexpected' loads "
            "only the keys asked for")
    return error


def _warn_strategies(function, sharded_strategy, common_strategy):
    for name, value in (("sharded_strategy", sharded_strategy),
                        ("common_strategy", common_strategy)):
        if value is not None:
            warnings.warn(f"tessera.megatron.{function}: {name}={type(value).__name__} is "
                          "ignored: tessera is the strategy", stacklevel=3)


def _strategy_classes():
    """{"save": TesseraSaveShardedStrategy, "load": TesseraLoadShardedStrategy}, or Nones when
    they were never made (then no caller can hold one)."""
    module = sys.modules.get("tessera._megatron_strategy")
    if module is None:
        return {"save": None, "load": None}
    return {"save": module.TesseraSaveShardedStrategy, "load": module.TesseraLoadShardedStrategy}


# Hidden from type checkers, which see the imports under TYPE_CHECKING above instead (a module
# __getattr__ would make every attribute of this module valid to them).
if not TYPE_CHECKING:
    def __getattr__(name):
        """TesseraSaveShardedStrategy and TesseraLoadShardedStrategy subclass Megatron's own
        strategies, so Megatron is imported on first use of these names only."""
        if name in ("TesseraSaveShardedStrategy", "TesseraLoadShardedStrategy"):
            from . import _megatron_strategy  # noqa: PLC0415 (imports megatron.core)
            return getattr(_megatron_strategy, name)
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
