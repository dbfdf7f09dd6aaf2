"""torch's own sharded tensors as state dict leaves: torch.distributed._shard ShardedTensor
(what FSDP's SHARDED_STATE_DICT and torch 1.13 DCP use) under gloo, and DTensor (the real one
where the installed torch has it; a duck-typed stand-in everywhere)."""

import dataclasses
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
        assert len(state["small"].local_shards()) == (0 if rank == 3 else 1)
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

        # tessera.megatron without comm=: collective over the default group, as Megatron's.
        from megatron_standins import ShardedTensor as MegatronTensor
        piece = MegatronTensor.from_rank_offsets("m", FULL[rank:rank + 1].clone(),
                                                 (0, rank, size))
        tessera.megatron.save({"m": piece, "step": 5}, path + "_megatron")
        other = size - 1 - rank
        back = MegatronTensor.from_rank_offsets("m", torch.zeros(1, COLS), (0, other, size))
        loaded = tessera.megatron.load({"m": back}, path + "_megatron")
        assert torch.equal(loaded["m"], FULL[other:other + 1]) and loaded["step"] == 5
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


# ---- DTensor ----------------------------------------------------------------------------------

def _real_dtensor():
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        try:
            module = __import__(name, fromlist=["DTensor"])
        except ImportError:
            continue
        if hasattr(module, "DTensor"):
            return module
    return None


@pytest.mark.skipif(_real_dtensor() is None,
                    reason=f"torch {torch.__version__} has no DTensor (torch.distributed.tensor "
                           "or torch.distributed._tensor, torch >= 2.0)")
def test_real_dtensor_over_gloo(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(dtensor_worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")
    loaded = tessera.load_all(path)
    assert torch.equal(loaded["w"], FULL) and torch.equal(loaded["r"], FULL[0])


def dtensor_worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        module = _real_dtensor()
        mesh = module.DeviceMesh("cpu", list(range(size)))
        w = module.distribute_tensor(FULL, mesh, [module.Shard(0)])
        r = module.distribute_tensor(FULL[0], mesh, [module.Replicate()])
        comm = tessera.torch_dist_comm()
        tessera.save({"w": w, "r": r}, path, comm=comm)
        target = {"w": module.distribute_tensor(torch.zeros(ROWS, COLS), mesh,
                                                [module.Shard(1)]),
                  "r": module.distribute_tensor(torch.zeros(COLS), mesh, [module.Replicate()])}
        tessera.load(target, path, comm=comm)
        assert torch.equal(target["w"].full_tensor(), FULL)
        assert torch.equal(target["r"].to_local(), FULL[0])
    finally:
        dist.destroy_process_group()


# A stand-in with DTensor's interface (to_local(), device_mesh, placements, shape), so the
# placement arithmetic is tested under any torch.
@dataclasses.dataclass(frozen=True)
class Shard:
    dim: int

    def is_shard(self):
        return True

    def is_replicate(self):
        return False


@dataclasses.dataclass(frozen=True)
class Replicate:
    def is_shard(self):
        return False

    def is_replicate(self):
        return True


@dataclasses.dataclass(frozen=True)
class Partial:
    def is_shard(self):
        return False

    def is_replicate(self):
        return False


class Mesh:
    def __init__(self, shape, rank):
        self.shape = shape
        self.coordinate = list(torch.arange(torch.Size(shape).numel()).reshape(shape)
                               .eq(rank).nonzero()[0].tolist())

    def size(self, dim):
        return self.shape[dim]

    def get_coordinate(self):
        return self.coordinate


class FakeDTensor:
    def __init__(self, full, mesh, placements, fill=True):
        self.shape = full.shape
        self.device_mesh, self.placements = mesh, placements
        box = [slice(0, n) for n in full.shape]
        for mesh_dim, p in enumerate(placements):
            if p.is_shard():
                current = box[p.dim]
                pieces = torch.arange(current.start, current.stop).chunk(mesh.size(mesh_dim))
                i = mesh.coordinate[mesh_dim]
                piece = pieces[i] if i < len(pieces) else torch.arange(0)
                start = int(piece[0]) if len(piece) else current.stop
                box[p.dim] = slice(start, start + len(piece))
        self.local = full[tuple(box)].clone() if fill else torch.zeros_like(full[tuple(box)])

    def to_local(self):
        return self.local


def test_dtensor_stand_in_2d_mesh(ckpt):
    """A 2 x 2 mesh: rows over mesh dimension 0, replicated over 1; then columns over both
    mesh dimensions (nested, uneven: 6 columns into 2 then 2), rows replicated."""
    def save(comm):
        mesh = Mesh((2, 2), comm.rank)
        tessera.save({"w": FakeDTensor(FULL, mesh, (Shard(0), Replicate())),
                      "c": FakeDTensor(FULL, mesh, (Shard(1), Shard(1)))}, ckpt, comm=comm)

    tessera.run_local(4, save)
    metadata = tessera.read_metadata(ckpt)
    # Replicas are written once: 2 row blocks of w; 4 column blocks of c (3 -> 2 + 1).
    assert sorted(list(c.box.offsets) for c in metadata.find_tensor("w").chunks) == [[0, 0],
                                                                                     [5, 0]]
    assert sorted((list(c.box.offsets), list(c.box.sizes))
                  for c in metadata.find_tensor("c").chunks) == [
        ([0, 0], [ROWS, 2]), ([0, 2], [ROWS, 1]), ([0, 3], [ROWS, 2]), ([0, 5], [ROWS, 1])]

    def load(comm):
        mesh = Mesh((2, 2), comm.rank)
        target = {"w": FakeDTensor(FULL, mesh, (Replicate(), Shard(1)), fill=False),
                  "c": FakeDTensor(FULL, mesh, (Shard(0), Shard(0)), fill=False)}
        tessera.load(target, ckpt, comm=comm)
        return target["w"].local, target["c"].local

    for rank, (w, c) in enumerate(tessera.run_local(4, load)):
        assert torch.equal(w, FakeDTensor(FULL, Mesh((2, 2), rank), (Replicate(), Shard(1))).local)
        assert torch.equal(c, FakeDTensor(FULL, Mesh((2, 2), rank), (Shard(0), Shard(0))).local)


def test_dtensor_stand_in_partial_is_refused(ckpt):
    with pytest.raises(ValueError, match="'p': DTensor placement Partial.*Replicate"):
        tessera.save({"p": FakeDTensor(FULL, Mesh((1,), 0), (Partial(),))}, ckpt)
