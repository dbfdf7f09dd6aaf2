"""The peers of bench/peers/harness.py that need patches to run on a CPU-only torch over gloo:
Megatron-Core's dist_checkpointing and torch-checkpointing. Each patch is applied around the
system's own calls, checked against the source it replaces (the run fails if that source
changes), and listed in the adapter's notes(); the interface is harness_systems.System's."""

from __future__ import annotations

import contextlib
import inspect
import textwrap
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from harness_state import BenchState, Layout, local_of
from harness_systems import System, Waiter, copy_into_targets, sync_checkpoint_dir, version_of


# ---- Megatron-Core dist_checkpointing ----------------------------------------------------------

_MEGATRON_EXCHANGE_PATCHES = {
    # function of megatron.core.dist_checkpointing.exchange_utils: (old, new, count)
    "_get_empty_tensor_for_exchange": ('"cuda"', '"cpu"', 4),
    "exchange_loaded_tensors_broadcast": (".cuda()", ".cpu()", 1),
}


class Megatron(System):
    """Megatron-Core dist_checkpointing: the torch_dist save strategy under
    FullyParallelSaveStrategyWrapper, TorchDistLoadShardedStrategy under
    FullyParallelLoadStrategyWrapper, ShardedTensors over the same local shards."""

    name = "megatron"
    module = "megatron.core.dist_checkpointing"

    def __init__(self, sync: bool) -> None:
        super().__init__(sync)
        self._queue: Any = None
        self._patched = False

    def config(self) -> dict[str, Any]:
        return {"megatron-core": version_of("megatron-core"),
                "save": "dist_checkpointing.save(sharded_state_dict, path, "
                        "FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("
                        "'torch_dist', 1)))  (thread_count=1, the default)",
                "load": "dist_checkpointing.load(sharded_state_dict, path, "
                        "FullyParallelLoadStrategyWrapper(TorchDistLoadShardedStrategy()))  "
                        "(exchange_algo='broadcast', the default)",
                "async": {"async_calls_queue": "dist_checkpointing.save(..., "
                          "async_sharded_save=True, async_strategy='mcore') then "
                          "AsyncCallsQueue().schedule_async_request(request); committed = "
                          "maybe_finalize_async_calls(blocking=True) returned"},
                "sharded_tensors": "ShardedTensor.from_rank_offsets(key, local, (dim, rank, "
                                   "world)) for Shard(dim); replica_id=rank for a replicated "
                                   "tensor; ShardedObject(key, bytes, (1,), (0,), "
                                   "replica_id=rank) for each object"}

    def notes(self) -> list[str]:
        return [
            "CPU state over gloo: torch.cuda.synchronize is stubbed to do nothing and "
            "torch.cuda.current_device to return 'cpu' around Megatron's saves and loads "
            "(FileSystemWriterAsync.preload_tensors, save_state_dict_async_finalize and "
            "FullyParallelLoadStrategyWrapper.load call them whatever the tensors' device, and "
            "on a CPU-only torch they raise; python/tests/test_megatron_interop.py stubs them "
            "the same way for saves)",
            "CPU state over gloo: FullyParallelLoadStrategyWrapper's broadcast exchange makes "
            "CUDA tensors; the harness recompiles megatron.core.dist_checkpointing."
            "exchange_utils._get_empty_tensor_for_exchange with \"cuda\" replaced by \"cpu\" "
            "and exchange_loaded_tensors_broadcast with .cuda() replaced by .cpu() (the same "
            "broadcasts, of CPU tensors over gloo)",
            "FileSystemWriterAsync fsyncs every data file whatever the mode (use_fsync=True is "
            "hard-coded in write_preloaded_data) and the metadata file: there is no option to "
            "leave them in the page cache, so its page-cache figures include the fsyncs",
            "tensors its load returns in other memory than the target (the replicated ones "
            "exchanged by the FullyParallel broadcast) are copied into the target inside the "
            "timing",
            "async: AsyncCallsQueue(persistent=False) forks a process per save; its memory is "
            "not in the per-block peak RSS (the parent's only; --rss-jobs reports it)"]

    @contextlib.contextmanager
    def _cpu(self) -> Iterator[None]:
        """The CUDA stubs of notes(), around Megatron's own calls only."""
        saved = torch.cuda.synchronize, torch.cuda.current_device
        torch.cuda.synchronize = lambda *args, **kwargs: None  # type: ignore[assignment]
        torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
        try:
            yield
        finally:
            torch.cuda.synchronize, torch.cuda.current_device = saved

    def _patch_exchange(self) -> None:
        """The exchange patches of notes()."""
        if self._patched:
            return
        from megatron.core.dist_checkpointing import exchange_utils
        for function, (old, new, count) in _MEGATRON_EXCHANGE_PATCHES.items():
            source = textwrap.dedent(inspect.getsource(getattr(exchange_utils, function)))
            if source.count(old) != count:
                raise RuntimeError(f"megatron-core {version_of('megatron-core')}: "
                                   f"exchange_utils.{function} has {source.count(old)} of {old}, "
                                   f"expected {count}: update _MEGATRON_EXCHANGE_PATCHES")
            code = compile(source.replace(old, new), exchange_utils.__file__, "exec")
            exec(code, exchange_utils.__dict__)  # noqa: S102 (redefines the function there)
        self._patched = True

    def _sharded(self, state: BenchState, layout: Layout) -> dict[str, Any]:
        from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
        out: dict[str, Any] = {}
        for leaf in state.leaves:
            value = leaf.target(layout)
            local = local_of(value)
            placement = value.placements[0] if isinstance(value, DTensor) else None
            if isinstance(placement, Shard):
                out[leaf.key] = ShardedTensor.from_rank_offsets(
                    leaf.key, local, (placement.dim, self.rank, self.world), replica_id=0)
            else:
                out[leaf.key] = ShardedTensor.from_rank_offsets(leaf.key, local,
                                                                replica_id=self.rank)
        for key, data in state.objects.items():
            out[key] = ShardedObject(key, data if layout == "save" else None, (1,), (0,),
                                     replica_id=self.rank)
        return out

    def prepare(self, phase: str, state: BenchState, variant: Optional[str] = None) -> None:
        if phase in ("load", "reshard_load", "check"):
            self._patch_exchange()
        if phase == "async_save" and self._queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import \
                AsyncCallsQueue
            self._queue = AsyncCallsQueue()  # persistent=False: a fork per save

    def _save_strategy(self) -> Any:
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import \
            TorchDistSaveShardedStrategy
        return FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1))

    def save(self, state: BenchState, path: str) -> None:
        from megatron.core import dist_checkpointing
        with self._cpu():
            dist_checkpointing.save(self._sharded(state, "save"), path, self._save_strategy())

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelLoadStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import \
            TorchDistLoadShardedStrategy
        self._patch_exchange()
        with self._cpu():
            loaded = dist_checkpointing.load(self._sharded(state, layout), path,
                                             FullyParallelLoadStrategyWrapper(
                                                 TorchDistLoadShardedStrategy()))
        loaded = dict(loaded)
        copy_into_targets(state, loaded, layout)
        return loaded

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"async_calls_queue": None}

    def async_save(self, state: BenchState, path: str, variant: str) -> Waiter:
        from megatron.core import dist_checkpointing
        queue = self._queue
        with self._cpu():
            request = dist_checkpointing.save(self._sharded(state, "save"), path,
                                              self._save_strategy(), async_sharded_save=True,
                                              async_strategy="mcore")
            queue.schedule_async_request(request)

        def wait() -> None:
            with self._cpu():
                queue.maybe_finalize_async_calls(blocking=True, no_dist=False)
        return wait

    def close(self) -> None:
        if self._queue is not None:
            self._queue.close()
            self._queue = None


# ---- torch-checkpointing -----------------------------------------------------------------------

def _gather_pickled_on_cpu(self: Any, data: Any, process_group: Any = None) -> dict[int, Any]:
    """DefaultMetadataManager._all_gather_pickled_data for a CPU (gloo) group: the same
    result ({rank: data}) through all_gather_object."""
    out: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(out, data, group=process_group)
    return dict(enumerate(out))


class TorchCheckpointing(System):
    """torch-checkpointing (module torch_checkpointing): CheckpointManager with every tensor in
    one item "state" declaring DefaultResharder (so the checkpoint can be resharded) and the
    objects in an item "objects"; LocalFileSystemStorageConfig(use_direct_io=False)."""

    name = "torch_checkpointing"
    module = "torch_checkpointing"

    def __init__(self, sync: bool) -> None:
        super().__init__(sync)
        self._manager: Any = None        # the synchronous save's or the load's, one per phase
        self._async_manager: Any = None  # kept for the whole run
        self._patched = False

    def config(self) -> dict[str, Any]:
        return {"torch-checkpointing": version_of("torch-checkpointing"),
                "items": "{'state': ItemSpec(resharder=DefaultResharder()), 'objects': "
                         "ItemSpec()}: every tensor in item 'state' (state_<rank>.pt), the "
                         "objects in item 'objects'",
                "storage": "LocalFileSystemStorageConfig(use_direct_io=False)",
                "save": "CheckpointManager(Config(save=SyncCheckpointSaverConfig())), a new "
                        "manager per save (built outside the timing)",
                "load": "a new CheckpointManager per load (built outside the timing), "
                        "manager.load(path, into={...})",
                "async": {"async_manager": "CheckpointManager(Config(save="
                          "AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig("
                          "use_pinned_memory=False, use_non_blocking_copy=False)))), one per "
                          "block, made before the timing: its writer subprocess started and "
                          "waited for, its staging pool allocated by manager.prewarm_staging("
                          "payload) and waited for; closed after the block; committed = the "
                          "write future's result"}}

    def notes(self) -> list[str]:
        out = [
            "use_direct_io=False: the default O_DIRECT writes fail on ext4 with EINVAL "
            "(unaligned buffers); loads still try O_DIRECT reads first (the default "
            "ReadArgs) and fall back to buffered reads after the first EINVAL",
            "a synchronous manager writes metadata.pkl only on its first save, so each save "
            "gets a new manager",
            "with a resharder declared, DefaultMetadataManager._all_gather_pickled_data "
            "all-gathers through tensors made with device='cuda'; the harness replaces it (on "
            "the class) by the same exchange through dist.all_gather_object, which gloo runs "
            "on CPU; without it no save with a resharder can run on CPU",
            "async: the writes run in a subprocess per rank (one per block, started before "
            "the timing); its memory is not in the per-block peak RSS (--rss-jobs reports it); the "
            "harness waits for its start-up and for prewarm_staging through two private "
            "attributes (_saver._checkpoint_process.wait_for_init, _prewarm_staging_future), "
            "so that neither is timed"]
        if self.sync:
            out.append("--sync: the library has no fsync option; the harness fdatasyncs every "
                       "file of the checkpoint after the save returns (each rank its own "
                       "state_<r>/objects_<r> files, rank 0 the others and the directories), "
                       "inside the timing")
        else:
            out.append("it never fsyncs: page-cache figures are its only mode")
        return out

    def _patch(self) -> None:
        if self._patched:
            return
        from torch_checkpointing import metadata_manager
        source = inspect.getsource(metadata_manager.DefaultMetadataManager.
                                   _all_gather_pickled_data)
        if 'device="cuda"' not in source:
            raise RuntimeError("torch_checkpointing: _all_gather_pickled_data no longer names "
                               "device='cuda': review the patch")
        metadata_manager.DefaultMetadataManager._all_gather_pickled_data = (  # type: ignore
            _gather_pickled_on_cpu)
        self._patched = True

    def _new_manager(self, asynchronous: bool) -> Any:
        from torch_checkpointing import CheckpointManager, ItemSpec
        from torch_checkpointing.config import (AsyncCheckpointSaverConfig,
                                                SyncCheckpointSaverConfig)
        from torch_checkpointing.default_resharder import DefaultResharder
        from torch_checkpointing.staging import CheckpointStagerConfig
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        self._patch()
        save = (AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(
            use_pinned_memory=False, use_non_blocking_copy=False))
            if asynchronous else SyncCheckpointSaverConfig())
        return CheckpointManager(CheckpointManager.Config(
            items={"state": ItemSpec(resharder=DefaultResharder()), "objects": ItemSpec()},
            save=save, storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))

    def prepare(self, phase: str, state: BenchState, variant: Optional[str] = None) -> None:
        if phase in ("save", "load", "reshard_load", "check"):
            self._manager = self._new_manager(False)
        elif phase == "async_save" and self._async_manager is None:
            self._async_manager = self._new_manager(True)
            process = getattr(getattr(self._async_manager, "_saver", None),
                              "_checkpoint_process", None)
            if process is not None:
                process.wait_for_init()  # the writer subprocess is up before any timing
            self._async_manager.prewarm_staging(self._payload(state.flat("save")))
            prewarm = getattr(self._async_manager, "_prewarm_staging_future", None)
            if prewarm is not None:
                prewarm.result()  # else the first save waits for it, inside the timing

    def finish(self, phase: str, variant: Optional[str] = None) -> None:
        if self._manager is not None:
            self._manager.close()
            self._manager = None

    @staticmethod
    def _payload(flat: dict[str, Any]) -> dict[str, Any]:
        return {"state": {k: v for k, v in flat.items() if isinstance(v, torch.Tensor)},
                "objects": {k: v for k, v in flat.items() if not isinstance(v, torch.Tensor)}}

    def save(self, state: BenchState, path: str) -> None:
        self._manager.save(path, self._payload(state.flat("save")))
        if self.sync:
            sync_checkpoint_dir(path, self.rank, self.world)

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        result = self._manager.load(path, into=self._payload(state.flat(layout)))
        loaded = dict(result["state"])
        loaded.update(result["objects"])
        return loaded

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"async_manager": None}

    def async_save(self, state: BenchState, path: str, variant: str) -> Waiter:
        future = self._async_manager.save(path, self._payload(state.flat("save")))

        def wait() -> None:
            future.result()
            if self.sync:
                sync_checkpoint_dir(path, self.rank, self.world)
        return wait

    def end_block(self) -> None:
        if self._async_manager is not None:
            self._async_manager.close()
            self._async_manager = None

    def close(self) -> None:
        self.finish("close")
        self.end_block()
