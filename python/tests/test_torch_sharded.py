"""torch's own ShardedTensor (torch.distributed._shard, what FSDP1's SHARDED_STATE_DICT and
torch 1.13 DCP use) as a state dict leaf, under gloo, in torch 1.13 (legacy run) and torch 2.13.
DTensor: test_dcp.py and test_fsdp2.py."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_compat  # noqa: F401 (torch 1.13 on Python 3.11: makes _shard importable)
import tessera
from conftest import free_port

ROWS, COLS = 10, 6  # 10 rows over 4 ranks: chunks of 3, 3, 3, 1 (uneven)
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)
BIAS = torch.arange(7, dtype=torch.bfloat16)  # 7 over 4 ranks: 2, 2, 2, 1


def chunk_spec(dim, ranks):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    return ChunkShardingSpec(dim=dim, placements=[f"rank:{r}/cpu" for r in ranks])


def sharded_like(full, spec):
    """A torch ShardedTensor of `full`'s shape and dtype under `spec`, this rank's shard
    filled from `full`."""
    from torch.distributed._shard import sharded_tensor
    st = sharded_tensor.empty(spec, *full.shape, dtype=full.dtype)
    for shard in st.local_shards():
        box = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                    shard.metadata.shard_sizes))
        shard.tensor.copy_(full[box])
    return st


def zeros_like_sharded(full, spec):
    return sharded_like(torch.zeros_like(full), spec)


def check_local_shards(st, full):
    for shard in st.local_shards():
        box = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                    shard.metadata.shard_sizes))
        assert torch.equal(shard.tensor, full[box]), (shard.metadata, shard.tensor)


def worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        comm = tessera.torch_dist_comm()
        ranks = list(range(size))
        # Save from every rank: rows of the weight, pieces of the bias, and a tensor of
        # 3 rows over 4 ranks (rank 3 holds no shard of it).
        state = {"fc": {"weight": sharded_like(FULL, chunk_spec(0, ranks)),
                        "bias": sharded_like(BIAS, chunk_spec(0, ranks))},
                 "small": sharded_like(FULL[:3], chunk_spec(0, ranks)),
                 "step": 3}
        # Rank 3 holds no row of it: no shard (torch 1.13) or an empty one (torch 2.x).
        assert sum(sh.tensor.numel() for sh in state["small"].local_shards()) == (
            0 if rank == 3 else COLS)
        tessera.save(state, path, comm=comm)

        # Load into another layout: columns over ranks 2, 0, 1 (rank 3 holds nothing), the
        # bias over two ranks in reverse order.
        target = {"fc": {"weight": zeros_like_sharded(FULL, chunk_spec(1, [2, 0, 1])),
                         "bias": zeros_like_sharded(BIAS, chunk_spec(0, [1, 0]))},
                  "small": zeros_like_sharded(FULL[:3], chunk_spec(1, ranks)),
                  "step": None}
        report = tessera.load(target, path, comm=comm)
        assert report.missing_keys == [] and report.unexpected_keys == []
        check_local_shards(target["fc"]["weight"], FULL)
        check_local_shards(target["fc"]["bias"], BIAS)
        check_local_shards(target["small"], FULL[:3])
        assert target["step"] == 3
        # In place: the loaded values are the ShardedTensors' own shards.
        assert isinstance(target["fc"]["weight"], type(state["fc"]["weight"]))

        # Several local shards on one rank: each a piece of its own, saved from and loaded into
        # its own tensor (ranks 0 and 1 hold two adjacent row blocks each).
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata

        def enumerable(owners):
            return EnumerableShardingSpec([ShardMetadata([2 * i, 0], [2, COLS], f"rank:{r}/cpu")
                                           for i, r in enumerate(owners)])

        two = sharded_like(FULL[:8], enumerable([0, 0, 1, 1]))
        tessera.save({"two": two}, path + "_two", comm=comm)
        back = zeros_like_sharded(FULL[:8], enumerable([3, 2, 1, 0]))  # one block per rank
        tessera.load({"two": back}, path + "_two", comm=comm)
        check_local_shards(back, FULL[:8])
        back = zeros_like_sharded(FULL[:8], enumerable([1, 1, 0, 0]))
        tessera.load({"two": back}, path + "_two", comm=comm)
        check_local_shards(back, FULL[:8])
        # Shards that form no single box (rows 0:2 and 4:6 on rank 0) as well.
        gaps = sharded_like(FULL[:8], enumerable([0, 1, 0, 1]))
        tessera.save({"two": gaps}, path + "_gaps", comm=comm)
        back = zeros_like_sharded(FULL[:8], enumerable([1, 0, 1, 0]))
        tessera.load({"two": back}, path + "_gaps", comm=comm)
        check_local_shards(back, FULL[:8])

        # Without comm=: the default process group, as torch.distributed.checkpoint.
        tessera.save({"two": two}, path + "_default")
        back = zeros_like_sharded(FULL[:8], enumerable([2, 3, 0, 1]))
        tessera.load({"two": back}, path + "_default")
        check_local_shards(back, FULL[:8])
    finally:
        dist.destroy_process_group()


def test_sharded_tensors_of_4_gloo_ranks_load_in_other_layouts(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(worker, args=(4, free_port(), path), nprocs=4, join=True,
                       start_method="spawn")
    tessera.verify(path)
    metadata = tessera.read_metadata(path)
    assert metadata.num_ranks == 4
    weight = metadata.find_tensor("fc.weight")
    assert [list(c.box.sizes) for c in weight.chunks] == [[3, COLS]] * 3 + [[1, COLS]]
    assert weight.dtype == "F32" and list(weight.shape) == [ROWS, COLS]
    assert metadata.find_tensor("fc.bias").dtype == "BF16"

    # One process, plain tensors: the whole global tensors.
    plain = {"fc": {"weight": torch.zeros(ROWS, COLS), "bias": torch.zeros(7, dtype=BIAS.dtype)},
             "small": torch.zeros(3, COLS), "step": None}
    tessera.load(plain, path)
    assert torch.equal(plain["fc"]["weight"], FULL) and torch.equal(plain["fc"]["bias"], BIAS)
    assert torch.equal(plain["small"], FULL[:3]) and plain["step"] == 3
    loaded = tessera.load_all(path)
    assert torch.equal(loaded["fc"]["weight"], FULL) and loaded["step"] == 3
