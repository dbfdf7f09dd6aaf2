"""Megatron-Core 0.19's own dist_checkpointing and tessera, both ways, on 4 gloo processes
(TP 2 x DP 2, CPU), with sharded state dicts of Megatron's own classes (test_megatron.py's
model: layers stacked on a prepended axis, a factory, per-rank ShardedObjects, common state,
a non-persistent object):

- Megatron's dist_checkpointing.save with its default strategy (torch_dist) and with its
  FullyParallelSaveStrategyWrapper loads with tessera.megatron.load, in the job under another
  layout and in one process under others (1 x 1, 1 x 3);
- what tessera.megatron.save writes loads with Megatron's dist_checkpointing.load and
  load_plain_tensors;
- tessera as Megatron's strategy: dist_checkpointing.save(..., sharded_strategy=
  TesseraSaveShardedStrategy()), also wrapped by FullyParallelSaveStrategyWrapper and
  asynchronous (async_sharded_save=True, the request run by execute_sync), and
  dist_checkpointing.load(..., sharded_strategy=TesseraLoadShardedStrategy()), with Megatron's
  strict modes, and wrapped by FullyParallelLoadStrategyWrapper (its exchange CPU-patched:
  megatron_load_cpu()); what one strategy saves the other loads.

On a CPU-only torch, Megatron's own torch_dist save calls CUDA twice; see megatron_cpu()."""

import contextlib
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port
from test_megatron import (EMBEDDING, EXP_AVG, FC1, GLU, NORM, check_loaded, layout,
                           model_state)

TP, DP = 2, 2
SIZE = TP * DP


@contextlib.contextmanager
def megatron_cpu():
    """Megatron-Core 0.19's default save strategy (TorchDistSaveShardedStrategy.save, also under
    FullyParallelSaveStrategyWrapper) needs CUDA in exactly two calls, whatever the tensors'
    device: FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize()
    (strategies/filesystem_async.py), and save_state_dict_async_finalize makes a tensor on
    torch.cuda.current_device() (strategies/state_dict_saver.py). On a CPU-only torch both
    raise "Torch not compiled with CUDA enabled"; here the first does nothing and the second
    names the CPU, for Megatron's own saves only. tessera's strategy needs neither."""
    saved = torch.cuda.synchronize, torch.cuda.current_device
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.synchronize, torch.cuda.current_device = saved


@contextlib.contextmanager
def megatron_load_cpu():
    """Megatron-Core 0.19's FullyParallelLoadStrategyWrapper exchanges the loaded shards on
    CUDA whatever the tensors' device (dist_checkpointing/exchange_utils.py: init_data("cuda"),
    torch.empty(..., device="cuda"), torch.empty_like(..., device="cuda"), Tensor.cuda()) and
    calls torch.cuda.synchronize() (strategies/fully_parallel.py). On a CPU-only torch those
    raise; here they name the CPU and do nothing, so that its exchange runs over gloo."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    def cpu(device):
        return "cpu" if device is not None and torch.device(device).type == "cuda" else device

    empty, empty_like, init_data = torch.empty, torch.empty_like, ShardedTensor.init_data
    saved = (torch.cuda.synchronize, torch.Tensor.cuda, empty, empty_like, init_data)
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self
    torch.empty = lambda *args, device=None, **kwargs: empty(*args, device=cpu(device), **kwargs)
    torch.empty_like = lambda t, *args, device=None, **kwargs: empty_like(
        t, *args, device=cpu(device), **kwargs)
    ShardedTensor.init_data = lambda self, device, init_fn=empty: init_data(self, cpu(device),
                                                                            init_fn)
    try:
        yield
    finally:
        (torch.cuda.synchronize, torch.Tensor.cuda, torch.empty, torch.empty_like,
         ShardedTensor.init_data) = saved


def state(rank, fill=True, swapped=False):
    """This rank's Megatron sharded state dict; `swapped` lays the ranks out the other way
    (tp = rank // DP), so each rank asks for other pieces than it saved."""
    tp, dp = (rank // DP, rank % DP) if swapped else layout(rank, TP)
    return model_state(tp, TP, dp, DP, fill=fill, legacy_flat=False), tp, dp


def one_piece_state(rank, fill=True, swapped=False):
    """A state with one piece of each key per rank (no layers stacked on a prepended axis):
    FullyParallelSaveStrategyWrapper makes some of a rank's pieces of one key main replicas and
    others not, and several pieces of one key with different replica ids on one rank need the
    library to take several boxes per key and rank (issue 21; until then tessera refuses them,
    naming the key)."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor
    tp, dp = (rank // DP, rank % DP) if swapped else layout(rank, TP)
    rows = FC1.shape[1] // TP

    def value(full):
        return full.clone() if fill else torch.zeros_like(full)

    return {"fc1": ShardedTensor.from_rank_offsets("fc1", value(FC1[0, tp * rows:(tp + 1) * rows]),
                                                   (0, tp, TP), replica_id=(0, 0, dp)),
            "norm": ShardedTensor.from_rank_offsets("norm", value(NORM), replica_id=(0, tp, dp)),
            "rng": ShardedObject("rng", {"rank": rank} if fill else None, (SIZE,), (rank,)),
            "iteration": 5}, tp, dp


def check_one_piece(result, tp):
    rows = FC1.shape[1] // TP
    assert torch.equal(result["fc1"], FC1[0, tp * rows:(tp + 1) * rows])
    assert torch.equal(result["norm"], NORM) and result["iteration"] == 5


def request(rank):
    sd, tp, dp = state(rank, fill=False, swapped=True)
    del sd["rng_state"]  # per rank: the swapped layout asks for other ranks' objects
    return sd, tp, dp


def worker(rank, size, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=180))
    try:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelSaveStrategyWrapper
        from megatron.core.dist_checkpointing.strategies.torch import \
            TorchDistSaveShardedStrategy
        from tessera.megatron import TesseraLoadShardedStrategy, TesseraSaveShardedStrategy

        def path(name):
            p = os.path.join(out, name)
            if rank == 0:
                os.makedirs(p, exist_ok=True)  # Megatron's save wants the directory
            dist.barrier()
            return p

        # Saves: Megatron's own, tessera as its strategy, tessera.megatron.
        with megatron_cpu():
            dist_checkpointing.save(state(rank)[0], path("megatron"))
            dist_checkpointing.save(state(rank)[0], path("megatron_fp"),
                                    FullyParallelSaveStrategyWrapper(
                                        TorchDistSaveShardedStrategy()))
        dist_checkpointing.save(state(rank)[0], path("strategy"), TesseraSaveShardedStrategy())
        dist_checkpointing.save(one_piece_state(rank)[0], path("strategy_fp"),
                                FullyParallelSaveStrategyWrapper(TesseraSaveShardedStrategy()))
        pending = dist_checkpointing.save(state(rank)[0], path("strategy_async"),
                                          TesseraSaveShardedStrategy(num_io_threads=1),
                                          async_sharded_save=True)
        pending.execute_sync()  # what Megatron's async queue does once the save is done
        tessera.megatron.save(state(rank)[0], path("tessera"))

        # Loads under another layout.
        for name, load in [
                ("strategy", lambda r, p: dist_checkpointing.load(
                    r, p, TesseraLoadShardedStrategy())),
                ("strategy_async", lambda r, p: dist_checkpointing.load(r, p)),
                ("megatron", lambda r, p: dist_checkpointing.load(
                    r, p, TesseraLoadShardedStrategy())),
                ("megatron", tessera.megatron.load),
                ("megatron_fp", tessera.megatron.load),
                ("tessera", lambda r, p: dist_checkpointing.load(r, p)),
                ("tessera", tessera.megatron.load)]:
            sd, tp, dp = request(rank)
            result = load(sd, os.path.join(out, name))
            try:
                check_loaded(result, tp, TP, dp, DP, legacy_flat=False)
            except AssertionError as e:
                raise AssertionError(f"{name} loaded by {load}: {e}") from e

        # Saved with the main replicas spread over the ranks by Megatron's wrapper: loaded by
        # tessera's strategy, ranks that need the same bytes sharing one read.
        sd, tp, dp = one_piece_state(rank, fill=False, swapped=True)
        del sd["rng"]
        check_one_piece(dist_checkpointing.load(sd, os.path.join(out, "strategy_fp"),
                                                TesseraLoadShardedStrategy(
                                                    read_sharing="broadcast")), tp)
        # ... and read once in the job, tessera exchanging the blocks itself.
        sd, tp, dp = one_piece_state(rank, fill=False, swapped=True)
        del sd["rng"]
        check_one_piece(dist_checkpointing.load(sd, os.path.join(out, "strategy_fp"),
                                                TesseraLoadShardedStrategy(
                                                    read_sharing="read_once")), tp)

        # Megatron's FullyParallelLoadStrategyWrapper around tessera's strategy: Megatron gives
        # each rank the main-replica shards to load (disjoint needs: tessera's plan shares
        # nothing, whatever its read_sharing), then exchanges them itself (CPU-patched).
        # Its "gather_rounds" exchange all-gathers tensors of different sizes, which gloo
        # refuses ("invalid tensor size"): that one needs NCCL.
        from megatron.core.dist_checkpointing.strategies.fully_parallel import \
            FullyParallelLoadStrategyWrapper
        for name, algo, sharing in [("megatron", "broadcast", "auto"),
                                    ("strategy", "gather_object", "read_once"),
                                    ("tessera", "broadcast", "none")]:
            sd, tp, dp = request(rank)
            with megatron_load_cpu():
                result = dist_checkpointing.load(sd, os.path.join(out, name),
                                                 FullyParallelLoadStrategyWrapper(
                                                     TesseraLoadShardedStrategy(
                                                         read_sharing=sharing),
                                                     exchange_algo=algo))
            try:
                check_loaded(result, tp, TP, dp, DP, legacy_flat=False)
            except AssertionError as e:
                raise AssertionError(f"{name} under the wrapper ({algo}, {sharing}): {e}") from e

        # Megatron's strict modes through tessera's strategy (its load_sharded_metadata).
        sd, tp, dp = request(rank)
        sd["absent"] = sd["model"]["decoder.final_layernorm.weight"].without_data()
        sd["absent"].key = "absent.w"
        result, missing, unexpected = dist_checkpointing.load(
            sd, os.path.join(out, "strategy"), TesseraLoadShardedStrategy(), strict="return_all")
        assert unexpected == {"absent.w"} and "rng_state" in {k.split("/")[0] for k in missing}
        assert "absent" not in result
        check_loaded(result, tp, TP, dp, DP, legacy_flat=False)

        # Megatron's whole tensors, of checkpoints written by tessera both ways.
        for name in ("tessera", "strategy"):
            plain = dist_checkpointing.load_plain_tensors(os.path.join(out, name))
            assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"], FC1)
            assert torch.equal(plain["optimizer.exp_avg.decoder.layers.mlp.linear_fc1.weight"],
                               EXP_AVG)
            assert torch.equal(plain["embedding.word_embeddings.weight"], EMBEDDING)
        assert dist_checkpointing.load_common_state_dict(os.path.join(out, "tessera"))[
            "iteration"] == 7
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("megatron"))
    mp.start_processes(worker, args=(SIZE, free_port(), out), nprocs=SIZE, join=True,
                       start_method="spawn")
    return out


@pytest.mark.parametrize("name", ["megatron", "megatron_fp", "strategy", "tessera"])
def test_one_process_and_three_ranks_load_them(job, name):
    path = os.path.join(job, name)
    assert sorted(os.listdir(path))[:1] == [".metadata"]
    assert "metadata.json" in os.listdir(path)
    tessera.verify(path)
    for tp_size, dp_size in ((1, 1), (1, 3)):
        def load(comm):
            tp, dp = layout(comm.rank, tp_size)
            sd = model_state(tp, tp_size, dp, dp_size, fill=False, legacy_flat=False)
            del sd["rng_state"]
            check_loaded(tessera.megatron.load(sd, path, comm=comm), tp, tp_size, dp, dp_size,
                         legacy_flat=False)

        tessera.run_local(tp_size * dp_size, load)
    plain = tessera.megatron.load_plain_tensors(path)
    assert torch.equal(plain["decoder.layers.mlp.linear_fc1.weight"], FC1)
    assert torch.equal(plain["decoder.final_layernorm.weight"], NORM)
    w, v = torch.chunk(GLU, 2)
    assert torch.equal(plain["mlp.glu_w"], w) and torch.equal(plain["mlp.glu_v"], v)
    loaded = tessera.load_all(path)
    assert loaded["rng_state/shard_0.1.0_1.2.2"] == [{"tp": 1, "dp": 0}]  # Megatron's layout
    assert loaded["common_state/shard_0_1"][0]["iteration"] == 7


def test_megatrons_files_and_tesseras_hold_the_same_keys(job):
    keys = {}
    for name in ("megatron", "strategy", "tessera"):
        metadata = tessera.read_metadata(os.path.join(job, name))
        keys[name] = ({t.key: list(t.shape) for t in metadata.tensors},
                      sorted(o.key for o in metadata.objects))
    assert keys["megatron"] == keys["strategy"] == keys["tessera"]


def test_fully_parallel_wrapper_around_tesseras_strategy(job):
    path = os.path.join(job, "strategy_fp")
    tessera.verify(path)
    metadata = tessera.read_metadata(path)
    assert len(metadata.find_tensor("norm").chunks) == 1  # one main replica, wherever it was
    loaded = tessera.load_all(path, tensor_type="torch")
    assert torch.equal(loaded["fc1"], FC1[0]) and torch.equal(loaded["norm"], NORM)
    assert loaded["common_state/shard_0_1"] == [{"iteration": 5}]
