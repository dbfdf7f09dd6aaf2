"""Resume a torch training run in one call.

    tessera.torch.save_state(path, model=model, optimizer=optimizer, comm=comm,
                             step=step, scheduler=scheduler.state_dict(),
                             rng=tessera.torch.per_rank(torch.get_rng_state()))
    extra = tessera.torch.load_state(path, model=model, optimizer=optimizer, comm=comm)
    scheduler.load_state_dict(extra["scheduler"]); torch.set_rng_state(extra["rng"])

load_state takes a fresh model and a fresh optimizer (no state yet): the optimizer's state is
built from the checkpoint's metadata, loaded, and handed to optimizer.load_state_dict. The
training then continues exactly as if it had not stopped.

Through a tessera.CheckpointManager (save every N steps, keep the newest, resume from the
latest that is whole):

    manager = tessera.CheckpointManager("ckpt/run", comm=comm, keep_last=2)
    extra = tessera.torch.load_state(manager, model=model, optimizer=optimizer)  # None: fresh
    ...
    tessera.torch.save_state(manager, model=model, optimizer=optimizer, step=step)  # background

What is saved (one tessera checkpoint; `tessera inspect` shows it):

- model: model.state_dict() under "model" (a dict or list of models: under "model.<name>").
  Its leaves may be sharded (torch ShardedTensor, DTensor, tessera.ShardedTensor): then each
  rank saves and loads its piece, in any layout.
- optimizer: its state keyed by parameter name (the model's named_parameters(); without a
  model, by the optimizer's parameter index): "optimizer.state.<name>.<state>", and its
  param_groups (hyperparameters) as one object. A state tensor shaped like its parameter is
  sharded like the parameter's state-dict entry (Adam's moments of a tensor-parallel weight
  are saved as pieces of one global tensor, and reshard with it); a scalar (Adam's step) is
  taken from rank 0. Several optimizers: a dict or list, under "optimizer.<name>".
- extra: each keyword value (anything picklable, tensors, nested containers) under
  "extra.<name>", rank 0's copy; per_rank(value) saves every rank's own copy (e.g. its RNG
  state), and each rank gets its own back.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Sequence, Union, overload

from . import _adapters
from . import _api
from . import _manager
from . import _dtypes
from . import _state
from . import _tessera
from ._errors import invalid_argument
from ._handover import AsyncSaveHandle
from ._types import StrPath

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer

    #: The model argument: a torch module, or a dict (by name) or list of them.
    Models = Union[Module, Mapping[str, Module], Sequence[Module]]
    #: The optimizer argument: a torch optimizer, or a dict (by name) or list of them.
    Optimizers = Union[Optimizer, Mapping[str, Optimizer], Sequence[Optimizer]]

__all__ = ["async_save_state", "load_state", "per_rank", "save_state"]

# The user-metadata entry describing a save_state checkpoint: which parts it has.
RESUME_KEY = "tessera.torch.state"
_VERSION = 1


class per_rank:  # noqa: N801 (used like a function)
    """An extra value of save_state saved from every rank under its own key; load_state gives
    each rank the value that rank saved (with strict=True, a rank the save did not have is an
    error; with strict=False its value is left out)."""

    __slots__ = ("value",)

    value: Any

    def __init__(self, value: Any) -> None:
        self.value = value


def _save_parts(model, optimizer, rank, size, extra):
    """The state dict save_state saves and the description of its parts."""
    models = _Parts(model, "model")
    optimizers = _Parts(optimizer, "optimizer")
    state, names, holdings = {}, _param_names(models), None
    if models.kind is not None:
        model_states = {name: m.state_dict() for name, m in models.items}
        state["model"] = models.pack(model_states)
        holdings = _Holdings(models, model_states)
    if optimizers.kind is not None:
        state["optimizer"] = optimizers.pack({
            name: _optimizer_state(o, name, names, holdings)
            for name, o in optimizers.items})
    per_rank_names = sorted(k for k, v in extra.items() if isinstance(v, per_rank))
    if extra:
        state["extra"] = {k: _state.ShardedObject(v.value, key=f"extra.{k}/rank_{rank}")
                          if isinstance(v, per_rank) else v for k, v in extra.items()}
    description = {"version": _VERSION, "model": models.describe(),
                   "optimizer": optimizers.describe(), "extra": sorted(extra),
                   "per_rank": per_rank_names, "num_ranks": size}
    return state, description


def _recorded_step(extra):
    """The `step` extra as the user metadata "step" (what `tessera ls` shows), if an int."""
    step = extra.get("step")
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    if _dtypes.is_torch_tensor(step) and step.numel() == 1 and not step.is_floating_point():
        return int(step.item())
    return None


def _prepare_state(model, optimizer, comm, save_options, extra):
    """(comm, state, save options with the description and the step in the user metadata)."""
    comm = _api._comm_handle(comm)
    rank = comm.rank if comm is not None else 0
    size = comm.size if comm is not None else 1
    state, description = _api._prepare(
        comm, lambda: _save_parts(model, optimizer, rank, size, extra))
    options = dict(save_options or {})
    # Every replica is compared across the ranks by default (_replicas.py): an optimizer state
    # taken for replicated that is not fails the save instead of keeping rank 0's.
    options.setdefault("check_replicas", "all")
    metadata = dict(options.get("user_metadata") or {})
    metadata[RESUME_KEY] = json.dumps(description)
    step = _recorded_step(extra)
    if step is not None:
        metadata.setdefault("step", str(step))
    options["user_metadata"] = metadata
    return comm, state, options


@overload
def save_state(path: _manager.CheckpointManager, *, model: Optional[Models] = None,
               optimizer: Optional[Optimizers] = None, comm: None = None,
               save_options: None = None, **extra: Any) -> _manager.ManagedSave: ...
@overload
def save_state(path: StrPath, *, model: Optional[Models] = None,
               optimizer: Optional[Optimizers] = None, comm: Optional[_tessera.Comm] = None,
               save_options: Optional[Mapping[str, Any]] = None,
               **extra: Any) -> _tessera.SaveReport: ...
def save_state(path: Union[StrPath, _manager.CheckpointManager], *,
               model: Optional[Models] = None, optimizer: Optional[Optimizers] = None,
               comm: Optional[_tessera.Comm] = None,
               save_options: Optional[Mapping[str, Any]] = None,
               **extra: Any) -> Union[_tessera.SaveReport, _manager.ManagedSave]:
    """Saves a training run's state at `path`: the model's state dict, the optimizer's state
    and hyperparameters, and every other keyword argument (step, scheduler state, RNG state,
    anything picklable). COLLECTIVE over `comm`, like tessera.save. `save_options`: a dict of
    tessera.save options (num_io_threads, sync, user_metadata, ...); check_replicas defaults
    to "all" here: every replicated tensor (the model's plain entries, the state of their
    parameters) is compared across the ranks, and replicas that differ fail the save naming
    the key and the ranks. An int `step` is also recorded in the user metadata ("step":
    `tessera ls` and `inspect` show it). Returns the SaveReport.

    `path` may be a tessera.CheckpointManager: then `step` (an int) is required, the state is
    saved as that step's checkpoint under the manager's root, through the manager (in the
    background when the manager saves asynchronously, with its options and comm: pass neither
    comm nor save_options), and the ManagedSave is returned.
    """
    if isinstance(path, _manager.CheckpointManager):
        return _save_through(path, model, optimizer, comm, save_options, extra)
    comm, state, options = _prepare_state(model, optimizer, comm, save_options, extra)
    return _api.save(state, os.fspath(path), comm=comm, **options)


def async_save_state(path: StrPath, *, model: Optional[Models] = None,
                     optimizer: Optional[Optimizers] = None,
                     comm: Optional[_tessera.Comm] = None,
                     save_options: Optional[Mapping[str, Any]] = None,
                     **extra: Any) -> AsyncSaveHandle:
    """save_state in the background: returns a tessera.AsyncSaveHandle once the state is
    staged (wait() it; its failure is raised there, and a failure nobody waited for makes the
    interpreter exit with status 1). `save_options` also takes tessera.async_save's (staging,
    when_busy, staging_threads, ...); with staging="deferred", call handle.wait_staged() before
    the optimizer changes the tensors. COLLECTIVE over `comm`."""
    comm, state, options = _prepare_state(model, optimizer, comm, save_options, extra)
    return _api.async_save(state, os.fspath(path), comm=comm, **options)


def _save_through(manager, model, optimizer, comm, save_options, extra):
    step = _recorded_step(extra)
    if step is None:
        raise invalid_argument("save_state through a CheckpointManager needs step=<int>: the "
                               "checkpoint's step")
    if comm is not None or save_options:
        raise TypeError("save_state through a CheckpointManager takes the manager's comm and "
                        "options: pass neither comm nor save_options")
    comm = manager._comm
    state, description = _api._prepare(
        comm, lambda: _save_parts(model, optimizer, comm.rank, comm.size, extra))
    return manager.save(step, state, user_metadata={RESUME_KEY: json.dumps(description)})


@overload
def load_state(path: _manager.CheckpointManager, *, model: Optional[Models] = None,
               optimizer: Optional[Optimizers] = None, comm: None = None, strict: bool = True,
               load_options: Optional[Mapping[str, Any]] = None,
               per_rank_map: Optional[_manager.PerRankMap] = None) -> Optional[Dict[str, Any]]:
    ...
@overload
def load_state(path: StrPath, *, model: Optional[Models] = None,
               optimizer: Optional[Optimizers] = None, comm: Optional[_tessera.Comm] = None,
               strict: bool = True, load_options: Optional[Mapping[str, Any]] = None,
               per_rank_map: Optional[_manager.PerRankMap] = None) -> Dict[str, Any]: ...
def load_state(path: Union[StrPath, _manager.CheckpointManager], *,
               model: Optional[Models] = None, optimizer: Optional[Optimizers] = None,
               comm: Optional[_tessera.Comm] = None, strict: bool = True,
               load_options: Optional[Mapping[str, Any]] = None,
               per_rank_map: Optional[_manager.PerRankMap] = None
               ) -> Optional[Dict[str, Any]]:
    """Loads a checkpoint of save_state into `model` (in place) and `optimizer` (fresh or not:
    its state is built from the checkpoint, then optimizer.load_state_dict), under any layout
    of the model's sharded state. Returns the extra values as a dict. COLLECTIVE over `comm`.

    strict=True: everything saved must be loaded and everything asked for must be in the
    checkpoint (pass the model and the optimizer that were saved). strict=False: the parts
    present on both sides are loaded; a tessera.PartialLoadWarning says what was left out.
    `load_options`: a dict of tessera.load options (num_io_threads, read_sharing, ...).

    Extras saved with per_rank() belong to the world size of the save: restored into another
    one, they are an error naming them, unless `per_rank_map(rank, world_size,
    saved_world_size)` says which saved rank's value (an int) or values (a list: the extra is
    then the list of them) each rank takes; with strict=False and no map they are left out.

    `path` may be a tessera.CheckpointManager: then the newest committed checkpoint under its
    root is loaded (with the manager's comm: pass none), falling back past checkpoints that
    fail their checks with a tessera.CheckpointWarning; None is returned when the root holds
    none (a fresh run).
    """
    if isinstance(path, _manager.CheckpointManager):
        return _load_through(path, model, optimizer, comm, strict, load_options, per_rank_map)
    comm = _api._comm_handle(comm)
    plan, report = _load_at(os.fspath(path), model, optimizer, comm, strict, load_options,
                            per_rank_map, [])
    return plan.finish(report)


def _load_at(path, model, optimizer, comm, strict, load_options, per_rank_map, keys):
    """Loads the save_state checkpoint at `path` (and the objects `keys`: their builder
    indices are plan.key_indices); returns (plan, LoadReport)."""
    rank = comm.rank if comm is not None else 0
    size = comm.size if comm is not None else 1

    def prepare():
        metadata = _api.read_metadata(path)
        plan = _LoadPlan(metadata, path, model, optimizer, rank, size, strict, per_rank_map)
        flat = _state.Flat(plan.template, for_load=True)
        builder = flat.build(rank=rank, for_load=True)
        plan.key_indices = [builder.add_object(k, b"") for k in keys]
        return plan, flat, builder, _api._load_options(strict, dict(load_options or {}))

    plan, flat, builder, opts = _api._prepare(comm, prepare)
    report = _api._load_prepared(plan.template, flat, builder, path, comm, opts,
                                 function="tessera.torch.load_state")
    plan.builder = builder
    return plan, report


def _load_through(manager, model, optimizer, comm, strict, load_options, per_rank_map):
    if comm is not None:
        raise TypeError("load_state through a CheckpointManager takes the manager's comm: "
                        "pass none")
    manager.wait()
    result = {}

    def load(step, path, keys):
        plan, report = _load_at(path, model, optimizer, manager._comm, strict, load_options,
                                per_rank_map, keys)
        result["extra"] = plan.finish(report)
        return [plan.builder.object_data(i) for i in plan.key_indices]

    if manager._restore_with(load, None, None) is None:
        return None
    return result["extra"]


# ---- models and optimizers -------------------------------------------------------------------

class _Parts:
    """A model or optimizer argument: None, one object, or a dict or list of them."""

    def __init__(self, value, what):
        self.what = what
        if value is None:
            self.kind, self.items = None, []
        elif isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise TypeError(f"{what}: a dict of them needs str keys")
            self.kind, self.items = "dict", list(value.items())
        elif isinstance(value, (list, tuple)):
            self.kind, self.items = "list", [(str(i), v) for i, v in enumerate(value)]
        else:
            self.kind, self.items = "single", [("", value)]

    def describe(self):
        return None if self.kind is None else {"kind": self.kind,
                                               "names": [n for n, _ in self.items]}

    def pack(self, by_name):
        """The state dict entry: the one state, or a dict of them by name."""
        if self.kind == "single":
            return by_name[""]
        return {name: by_name[name] for name, _ in self.items}

    def check_against(self, saved):
        """Errors when the saved description of this part differs from the argument."""
        if saved is None or self.kind is None:
            return
        names = [n for n, _ in self.items]
        if saved["kind"] != self.kind or saved["names"] != names:
            raise invalid_argument(
                f"the checkpoint holds {self.what} {_describe(saved)}, not {_describe(self.describe())}")


def _describe(description):
    if description["kind"] == "single":
        return "one"
    return f"a {description['kind']} of {description['names']}"


def _param_names(models):
    """{id(parameter): name}: the model's named_parameters(), prefixed "<name>." for a dict or
    list of models."""
    names: Dict[int, str] = {}
    for prefix, m in models.items:
        for fqn, p in m.named_parameters():
            names.setdefault(id(p), f"{prefix}.{fqn}" if prefix else fqn)
    return names


def _memory_key(tensor):
    """Where a tensor's elements are: (address of the first, count). A parameter and its
    state-dict entry (a view of it, whatever the entry's key or wrapper) have the same."""
    return (tensor.data_ptr(), tensor.numel())


class _Holdings:
    """How each parameter appears in the model's state dict, found by identity (the memory the
    entry's local tensor views), not by name: a module may register a parameter under one name
    and expose it under another (or wrap it in a DTensor, a torch or tessera ShardedTensor).
    A parameter's optimizer state is sharded like its entry."""

    def __init__(self, models, model_states):
        # memory key -> (state-dict key, tessera ShardedTensor or None)
        self.by_memory: Dict[Any, Any] = {}
        self.any_sharded = False
        for prefix, _ in models.items:
            for key, leaf in model_states[prefix].items():
                name = f"{prefix}.{key}" if prefix else key
                shard, local = None, leaf
                if isinstance(leaf, _state.ShardedTensor):
                    shard, local = leaf, leaf.data
                elif _adapters.is_framework_leaf(leaf):
                    adapted = _adapters.adapt(leaf, name, for_load=False)
                    if isinstance(adapted.value, _state.ShardedTensor):
                        shard, local = adapted.value, adapted.value.data
                    else:  # several pieces (or an object): no single box to shard state like
                        self.any_sharded = True
                        continue
                if not _dtypes.is_torch_tensor(local) or local.numel() == 0:
                    continue
                self.any_sharded = self.any_sharded or shard is not None
                self.by_memory.setdefault(_memory_key(local), (name, shard))

    def find(self, param):
        """(state-dict key, shard or None), or None when no entry holds the parameter."""
        local = param.to_local() if _adapters.is_framework_leaf(param) else param  # DTensor
        if not _dtypes.is_torch_tensor(local) or local.numel() == 0:
            return None
        return self.by_memory.get(_memory_key(local))


def _flat_params(optimizer):
    return [p for group in optimizer.param_groups for p in group["params"]]


def _names_of(optimizer, opt_name, names):
    """The name of each of the optimizer's parameters, in its state-dict index order."""
    out = []
    for i, p in enumerate(_flat_params(optimizer)):
        if names:
            if id(p) not in names:
                raise invalid_argument(
                    f"optimizer{'.' + opt_name if opt_name else ''}: parameter {i} (shape "
                    f"{list(p.shape)}) is not a parameter of the model")
            out.append(names[id(p)])
        else:
            out.append(str(i))
    if len(set(out)) != len(out):
        raise invalid_argument(f"optimizer{'.' + opt_name if opt_name else ''}: a parameter "
                               "appears twice")
    return out


def _optimizer_state(optimizer, opt_name, names, holdings):
    state_dict = optimizer.state_dict()
    params = _flat_params(optimizer)
    param_names = _names_of(optimizer, opt_name, names)
    state = {}
    for index, values in state_dict["state"].items():
        name = param_names[index]
        state[name] = {k: _state_value(v, params[index], holdings, name, k)
                       for k, v in values.items()}
    groups = [dict(g, params=[param_names[i] for i in g["params"]])
              for g in state_dict["param_groups"]]
    # One object, the same on every rank (main replica everywhere: rank 0 writes it).
    return {"state": state, "param_groups": _state.ShardedObject(groups)}


def _state_value(value, param, holdings, name, key):
    """An optimizer state value as saved: shaped like a parameter whose state-dict entry is
    sharded -> sharded like that entry; a scalar (Adam's step) or the state of a parameter whose
    entry is a plain tensor -> as it is, a replica (rank 0's is written; the replica check of
    save_state compares the ranks' copies). A tensor of a parameter that no state-dict entry
    holds, in a model with sharded entries, is refused: it might be a shard."""
    if not _dtypes.is_torch_tensor(value) or _adapters.is_framework_leaf(value):
        return value
    if value.numel() <= 1:
        return value  # a scalar such as Adam's step: the same on every rank
    found = holdings.find(param) if holdings is not None else None
    if found is None:
        if holdings is not None and holdings.any_sharded:
            raise invalid_argument(
                f"optimizer state '{key}' of parameter '{name}': no entry of the model's state "
                "dict holds this parameter (found by the memory it views, not by name), and the "
                "model's state dict has sharded entries, so tessera cannot tell whether this "
                "state is a shard; expose the parameter itself (or a view of it) in the state "
                "dict")
        return value
    entry, shard = found
    if shard is None:
        return value
    if list(value.shape) == list(param.shape) and value.numel() == shard.data.numel():
        return _like(shard, value)
    raise invalid_argument(
        f"optimizer state '{key}' of parameter '{name}' (state-dict entry '{entry}') has shape "
        f"{list(value.shape)} but the parameter {list(param.shape)}: tessera cannot tell how it "
        "is sharded")


def _like(shard, tensor, key=None):
    """`tensor` (shaped like the parameter) as a piece sharded like `shard`: a view of it."""
    return _state.ShardedTensor(tensor.view(shard.data.shape), shard.global_shape,
                                shard.global_offset, replica_id=shard.replica_id,
                                flat_range=shard.flat_range, local_shape=shard.local_shape,
                                key=key)


# ---- loading ------------------------------------------------------------------------------------

class _LoadPlan:
    """The template a load_state asks for, and how to hand the loaded state to the model and
    the optimizer."""

    # Set by _load_at: the builder indices of the objects it asked for, and the builder.
    key_indices: List[int]
    builder: _tessera.StateBuilder

    def __init__(self, metadata, path, model, optimizer, rank, size, strict, per_rank_map=None):
        text = metadata.user_metadata.get(RESUME_KEY)
        if text is None:
            raise invalid_argument(f"the checkpoint at {path} was not saved by "
                                   "tessera.torch.save_state (use tessera.load)")
        self.description = description = _state.json_from_checkpoint(
            text, f"the checkpoint at {path}: user metadata '{RESUME_KEY}'")
        if description.get("version") != _VERSION:
            raise invalid_argument(f"the checkpoint at {path} holds a tessera.torch state of "
                                   f"version {description.get('version')}; this tessera reads "
                                   f"version {_VERSION}")
        # The saved structure without what tessera.remove_keys removed since.
        root = dict(_state.saved_structure(metadata)["dict"])
        self.tensors = {t.key: t for t in metadata.tensors}
        self.rank, self.size, self.strict = rank, size, strict
        self.per_rank_map = per_rank_map
        self.left_out = set()    # per-rank extras of another world size, strict=False
        self.models = _Parts(model, "model")
        self.optimizers = _Parts(optimizer, "optimizer")
        removed = _state.removed_prefixes(metadata)
        for part in (self.models, self.optimizers):
            saved = description[part.what]
            why = ""
            if saved is not None and part.what not in root:
                description[part.what] = saved = None  # every key of it was removed
                why = f" any more (tessera.remove_keys removed prefixes {removed})"
            if strict and (part.kind is None) != (saved is None):
                raise invalid_argument(
                    f"the checkpoint at {path} {'holds' if saved else 'has no'} {part.what} "
                    f"state{why}; pass {part.what}={'...' if saved else 'None'} (or "
                    "strict=False)")
            part.check_against(saved)
        self.template = {}
        self.state_keys = {}     # (id(optimizer), parameter name) -> the keys of its state
        self.param_shaped = {}   # id(template piece) -> the parameter-shaped tensor it views
        self.extra_keys = {}     # extra name -> the keys of its value
        names, holdings = _param_names(self.models), None
        if self.models.kind is not None:
            self.model_states = {name: m.state_dict() for name, m in self.models.items}
            self.template["model"] = self.models.pack(self.model_states)
            holdings = _Holdings(self.models, self.model_states)
        if self.optimizers.kind is not None and description["optimizer"] is not None:
            saved_node = root["optimizer"]
            by_name = {}
            self.param_names = {}
            for name, o in self.optimizers.items:
                node = saved_node if self.optimizers.kind == "single" \
                    else dict(saved_node["dict"])[name]
                self.param_names[name] = _names_of(o, name, names)
                by_name[name] = self._optimizer_template(o, self.param_names[name], node,
                                                         holdings)
            self.template["optimizer"] = self.optimizers.pack(by_name)
        if "extra" in root:
            self.template["extra"] = self._extra_template(dict(root["extra"]["dict"]))

    def _optimizer_template(self, optimizer, param_names, node, holdings):
        params = dict(zip(param_names, _flat_params(optimizer)))
        state = {}
        for name, values in _state_items(node):
            param = params.get(name)
            if param is None:
                if self.strict:
                    raise invalid_argument(f"the checkpoint holds optimizer state of parameter "
                                           f"'{name}', which this optimizer lacks")
                continue
            found = holdings.find(param) if holdings is not None else None
            shard = found[1] if found is not None else None
            state[name] = {k: self._state_template(leaf, param, shard)
                           for k, leaf in values["dict"]}
            self.state_keys[id(optimizer), name] = _node_keys(values)
        return {"state": state,
                "param_groups": _state.ShardedObject(None, key=dict(node["dict"])[
                    "param_groups"]["object"])}

    def _state_template(self, node, param, shard):
        if "tensor" not in node:
            return _state.template_from_node(node, self.tensors, "torch")
        info = self.tensors[node["tensor"]]
        import torch  # noqa: PLC0415
        dtype, raw = _dtypes.torch_dtype(info.dtype)
        if node.get("sharded") and shard is not None and list(info.shape) == list(
                shard.global_shape) and param.numel() == shard.data.numel():
            tensor = torch.empty(param.shape, dtype=dtype)
            piece = _like(shard, tensor, key=node["tensor"])
            piece.dtype = info.dtype if raw else None
            self.param_shaped[id(piece)] = tensor
            return piece
        if node.get("sharded") and _adapters.is_framework_leaf(param):  # e.g. a DTensor
            return torch.empty_like(param, dtype=dtype)
        return _state.template_from_node(node, self.tensors, "torch")

    def _extra_template(self, nodes):
        per_rank_names = set(self.description["per_rank"])
        saved_ranks = self.description["num_ranks"]
        extra = {}
        for name, node in nodes.items():
            if name not in per_rank_names:
                extra[name] = _state.template_from_node(node, self.tensors, None)
                self.extra_keys[name] = _node_keys(node)
                continue
            taken = self._saved_ranks_of(name, self.rank, saved_ranks)
            if taken is None:  # another world size, strict=False: left out
                self.left_out.add(name)
                self.extra_keys[name] = set()
                continue
            keys = [f"extra.{name}/rank_{r}" for r in (taken if isinstance(taken, list)
                                                         else [taken])]
            objects = [_state.ShardedObject(None, key=k) for k in keys]
            extra[name] = objects if isinstance(taken, list) else objects[0]
            self.extra_keys[name] = set(keys)
            if self.rank == 0:  # the values no rank of this run takes: read, dropped
                wanted = set()
                for r in range(self.size):
                    got = self._saved_ranks_of(name, r, saved_ranks)
                    wanted |= set(got if isinstance(got, list) else [got])
                extra[f"\0{name}"] = [_state.ShardedObject(None, key=f"extra.{name}/rank_{r}")
                                      for r in range(saved_ranks) if r not in wanted]
        return extra

    def _saved_ranks_of(self, name, rank, saved_ranks):
        """Which saved rank's value (an int) or values (a list) `rank` takes of the per-rank
        extra `name`; None when it is left out."""
        if saved_ranks == self.size:
            return rank
        if self.per_rank_map is None:
            if not self.strict:
                return None
            raise invalid_argument(
                f"extra '{name}' was saved per rank by {saved_ranks} ranks; this run has "
                f"{self.size}: pass per_rank_map=lambda rank, world_size, saved_world_size: ... "
                "(the saved rank, or list of ranks, whose value each rank takes), or "
                "strict=False to leave it out")
        taken = self.per_rank_map(rank, self.size, saved_ranks)
        ranks = list(taken) if isinstance(taken, (list, tuple)) else [taken]
        for r in ranks:
            if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < saved_ranks:
                raise invalid_argument(f"per_rank_map gave rank {rank} the saved rank {r!r} for "
                                       f"extra '{name}', saved by {saved_ranks} ranks")
        if len(set(ranks)) != len(ranks):
            raise invalid_argument(f"per_rank_map gave rank {rank} a saved rank twice")
        return ranks if isinstance(taken, (list, tuple)) else ranks[0]

    def finish(self, report):
        """Hands the loaded state to the model and the optimizer; returns the extra values."""
        loaded = report.state_dict
        skipped = set(report.missing_keys)
        if self.models.kind is not None:
            for name, m in self.models.items:
                state = self.model_states[name]
                if not any(_is_sharded(v) for v in state.values()):
                    m.load_state_dict(state)  # a no-op copy for views; runs set_extra_state
        if "optimizer" in self.template:
            packed = loaded["optimizer"]
            for name, o in self.optimizers.items:
                part = packed if self.optimizers.kind == "single" else packed[name]
                self._load_optimizer(o, self.param_names[name], part, skipped)
        extra = _state.unwrap(loaded.get("extra", {}))
        return {k: v for k, v in extra.items()
                if not k.startswith("\0") and not self.extra_keys[k] & skipped}

    def _load_optimizer(self, optimizer, param_names, part, skipped):
        groups = part["param_groups"].value
        if groups is None:  # not loaded (strict=False, absent)
            return
        current = optimizer.state_dict()["param_groups"]
        if len(groups) != len(current):
            raise invalid_argument(f"the checkpoint's optimizer has {len(groups)} parameter "
                                   f"groups, this one {len(current)}")
        new_groups = []
        for i, (saved, now) in enumerate(zip(groups, current)):
            mine = [param_names[j] for j in now["params"]]
            if sorted(saved["params"]) != sorted(mine):
                raise invalid_argument(
                    f"parameter group {i}: the checkpoint's has parameters "
                    f"{sorted(saved['params'])}, this optimizer's {sorted(mine)}")
            new_groups.append(dict(saved, params=now["params"]))
        index = {n: i for i, n in enumerate(param_names)}
        state = {}
        for name, values in part["state"].items():
            if self.state_keys[id(optimizer), name] & skipped:
                continue  # not (wholly) in the checkpoint: the optimizer starts it afresh
            state[index[name]] = {k: self.param_shaped.get(id(v)) if id(v) in self.param_shaped
                                  else _state.unwrap(v) for k, v in values.items()}
        optimizer.load_state_dict({"state": state, "param_groups": new_groups})


def _state_items(node):
    """(parameter name, its state's node) of an optimizer's saved "state" dict."""
    return [(k, v) for k, v in dict(node["dict"])["state"]["dict"]]


def _is_sharded(value):
    return isinstance(value, (_state.ShardedTensor, _state.ShardedObject)) or \
        _adapters.is_framework_leaf(value)


def _node_keys(node):
    """The keys of the leaves below a saved structure node."""
    if "tensor" in node:
        return {node["tensor"]}
    if "object" in node:
        return {node["object"]}
    keys = set()
    for kind in ("dict", "odict"):
        for _, child in node.get(kind, ()):
            keys |= _node_keys(child)
    for kind in ("list", "tuple", "namedtuple"):
        for child in node.get(kind, ()):
            keys |= _node_keys(child)
    return keys
