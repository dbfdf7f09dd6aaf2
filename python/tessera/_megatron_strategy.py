"""tessera as a Megatron-Core save and load strategy.

Megatron-Core's dist_checkpointing.save(sharded_state_dict, checkpoint_dir, sharded_strategy)
uses the strategy it is given only when it is a TorchDistSaveShardedStrategy (or a
FullyParallelSaveStrategyWrapper around one; anything else is replaced by its default), and
dist_checkpointing.load calls load, load_sharded_metadata and load_tensors_metadata of any
strategy object. So the two classes here subclass Megatron's torch_dist strategies and write
and read the very same checkpoint format (torch_dist: PyTorch DCP plus Megatron's
metadata.json, which Megatron writes itself with the strategy's backend "torch_dist" and version
1): a checkpoint saved through tessera loads with Megatron's default strategy, and one Megatron
saved loads through tessera's. What changes is who writes and reads: tessera's planner, I/O
threads, crash-safe commit and resharding reads, over torch.distributed's default group.

    from megatron.core import dist_checkpointing
    from tessera.megatron import TesseraLoadShardedStrategy, TesseraSaveShardedStrategy

    dist_checkpointing.save(sharded_state_dict, ckpt_dir,
                            sharded_strategy=TesseraSaveShardedStrategy())
    state_dict = dist_checkpointing.load(sharded_state_dict, ckpt_dir,
                                         sharded_strategy=TesseraLoadShardedStrategy())

Importing this module imports megatron.core (tessera.megatron imports it on first use of the
class names).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.torch import (TorchDistLoadShardedStrategy,
                                                               TorchDistSaveShardedStrategy)

from . import _api
from . import _state
from ._tessera import Comm
from ._types import StateDict, StrPath

__all__ = ["TesseraLoadShardedStrategy", "TesseraSaveShardedStrategy"]


class TesseraSaveShardedStrategy(TorchDistSaveShardedStrategy):
    """Megatron's torch_dist save strategy, with tessera writing: dist_checkpointing.save calls
    save (or async_save) with the sharded state dict it prepared (factories built, the common
    state as the ShardedObject "common_state" of rank 0), then writes metadata.json.

    comm: the tessera Comm to save over (default: torch.distributed's default group).
    **options: tessera.save options (num_io_threads, sync, balance_writes, ...). The format is
    always torch_dist.
    """

    def __init__(self, *, comm: Optional[Comm] = None, **options: Any) -> None:
        super().__init__(backend="torch_dist", version=1)
        if "format" in options:
            raise TypeError("TesseraSaveShardedStrategy writes Megatron's torch_dist format; "
                            "use tessera.megatron.save(..., format='tessera') for tessera's own")
        self.comm = comm
        self.options = dict(options)
        # Megatron's separation_hint: tessera's separate_prefixes.
        hint = self.options.pop("separation_hint", None)
        if hint is not None:
            self.options.setdefault("separate_prefixes", [hint])

    def save(self, sharded_state_dict: StateDict, checkpoint_dir: StrPath) -> None:
        """Saves the sharded state dict (COLLECTIVE), committed when it returns."""
        _api.save(sharded_state_dict, os.fspath(checkpoint_dir), comm=self.comm,
                  format="torch_dist", **self.options)

    def async_save(self, sharded_state_dict: StateDict, checkpoint_dir: StrPath,
                   async_strategy: str = "nvrx") -> AsyncRequest:
        """Starts the save in the background now (tessera.async_save: returns once the state is
        staged) and returns Megatron's AsyncRequest with no function to run and the wait for
        the save as its first finalize function, so Megatron's async queue (or the request's
        execute_sync) finishes it and then runs the finalize functions Megatron adds
        (metadata.json)."""
        del async_strategy  # tessera's own background save, whatever Megatron would use
        handle = _api.async_save(sharded_state_dict, os.fspath(checkpoint_dir), comm=self.comm,
                                 format="torch_dist", **self.options)
        return AsyncRequest(None, (), [handle.wait])

    def can_handle_sharded_objects(self) -> bool:
        return True


class TesseraLoadShardedStrategy(TorchDistLoadShardedStrategy):
    """Megatron's torch_dist load strategy, with tessera reading: any layout from any saved
    layout, each rank reading only the bytes it needs, in parallel threads. Megatron's load has
    already checked the request against its strict mode and loaded the common state; load
    fills each ShardedTensor's data in place and returns the state dict with tensors and
    ShardedObjects' values, as Megatron's own strategy does. load_sharded_metadata and
    load_tensors_metadata (used by Megatron's strict modes and load_plain_tensors) are
    Megatron's: they read the .metadata, as tessera does.

    comm: the tessera Comm to load over (default: torch.distributed's default group).
    **options: tessera.load options (num_io_threads, read_sharing, cast_dtypes, ...).
    """

    def __init__(self, *, comm: Optional[Comm] = None, **options: Any) -> None:
        super().__init__()
        self.comm = comm
        self.options = dict(options)

    def load(self, sharded_state_dict: StateDict, checkpoint_dir: StrPath,
             async_strategy: str = "mcore") -> Any:
        del async_strategy
        comm = _api._comm_handle(self.comm)
        path = os.fspath(checkpoint_dir)
        # A load replaces the ShardedObject leaves of the dict it is given by their values: give
        # it a copy of the containers (Megatron's own strategy leaves the request as it is).
        sharded_state_dict = _state.copy_containers(sharded_state_dict, lambda path, value: value)
        # Megatron's FullyParallelLoadStrategyWrapper passes flat dicts keyed by shard ids
        # (tuples), which a tessera state dict cannot hold: they get names for the load and
        # their keys back in the result (the checkpoint keys are the ShardedTensors' own).
        shard_ids: Optional[list[Any]] = None
        if isinstance(sharded_state_dict, dict) and not all(
                isinstance(k, str) for k in sharded_state_dict):
            shard_ids = list(sharded_state_dict)
            sharded_state_dict = {f"shard_{i}": v
                                  for i, v in enumerate(sharded_state_dict.values())}

        def prepare():
            flat = _state.Flat(sharded_state_dict, for_load=True)
            builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=True)
            opts = _api._load_options(True, self.options)
            # Megatron asks for the keys it checked against its strict mode; the checkpoint also
            # holds the common state (loaded by Megatron itself) and what other ranks asked for.
            opts.unexpected_keys = _api._tessera.KeyPolicy.SKIP
            return flat, builder, opts

        flat, builder, opts = _api._prepare(comm, prepare)
        report = _api._load_prepared(sharded_state_dict, flat, builder, path, comm, opts,
                                     function=None)
        values = _values(report.state_dict)
        if shard_ids is not None:
            return {key: values[f"shard_{i}"] for i, key in enumerate(shard_ids)}
        return values


def _values(state):
    """The state dict Megatron's strategy returns: ShardedTensors as their data, ShardedObjects
    as their values (a load already replaced those), containers kept."""
    if isinstance(state, dict):
        return type(state)((k, _values(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_values(v) for v in state]
    if isinstance(state, ShardedTensor):
        return state.data
    if isinstance(state, ShardedObject):
        return state.data
    return state
