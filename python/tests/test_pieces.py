"""Several pieces of one tensor on one rank (issue 21): every adapter hands the library each
piece as it is (boxes and flat ranges, each saved from and loaded into its own memory), in any
layout: tessera.ShardedTensor pieces sharing a key, Megatron-Core 0.19's real ShardedTensor
(layers stacked on a prepended axis, a distributed optimizer's flat range of each layer, its
dp_reshardable buckets, ShardedTensorFactory results), torch's ShardedTensor with several local
shards and DTensor (gloo processes). Overlap within a rank is refused naming both pieces."""

import datetime
import importlib.util
import pathlib

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port

LAYERS, ROWS, COLS = 6, 4, 5
LAYER = ROWS * COLS
FULL = torch.arange(LAYERS * LAYER, dtype=torch.float32).reshape(LAYERS, ROWS, COLS)


def layer_ranges(parts):
    """[begin, end) cuts of one layer's LAYER elements into `parts` ranges that cut rows."""
    cuts = [LAYER * p // parts + (p % 2) for p in range(parts)] + [LAYER]
    cuts[0] = 0
    return list(zip(cuts, cuts[1:]))


# ---- tessera.ShardedTensor pieces ------------------------------------------------------------

def stacked_pieces(rank, size, lib, fill=True):
    """Rank `rank` of `size`: the layers rank, rank + size, ... whole (boxes that form no single
    box), and a flat range of every layer (a distributed optimizer's bucket per layer), under
    keys "w" and "m"; views of one buffer per key with a sentinel gap between pieces."""
    def buffer(n):
        data = torch.full((n,), -7.0) if lib == "torch" else np.full(n, -7.0, np.float32)
        return data

    layers = list(range(rank, LAYERS, size))
    w_buffer = buffer(len(layers) * (LAYER + 1))
    pieces = {"w": [], "m": []}
    for i, layer in enumerate(layers):
        view = w_buffer[i * (LAYER + 1):i * (LAYER + 1) + LAYER].reshape(1, ROWS, COLS)
        if fill:
            view[...] = FULL[layer:layer + 1] if lib == "torch" else FULL[layer:layer + 1].numpy()
        pieces["w"].append(tessera.ShardedTensor(view, FULL.shape, (layer, 0, 0), key="w"))
    begin, end = layer_ranges(size)[rank]
    m_buffer = buffer(LAYERS * (end - begin + 1))
    for layer in range(LAYERS):
        at = layer * (end - begin + 1)
        view = m_buffer[at:at + end - begin]
        if fill:
            values = -FULL[layer].reshape(-1)[begin:end]
            view[...] = values if lib == "torch" else values.numpy()
        pieces["m"].append(tessera.ShardedTensor(view, FULL.shape, (layer, 0, 0),
                                                 local_shape=(1, ROWS, COLS),
                                                 flat_range=(begin, end), key="m"))
    return pieces, (w_buffer, m_buffer)


def check_stacked(pieces, buffers, rank, size):
    for piece in pieces["w"]:
        layer = piece.global_offset[0]
        assert np.array_equal(np.asarray(piece.data), FULL[layer:layer + 1].numpy()), layer
    begin, end = layer_ranges(size)[rank]
    for layer, piece in enumerate(pieces["m"]):
        assert np.array_equal(np.asarray(piece.data), -FULL[layer].reshape(-1)[begin:end].numpy())
    for buffer, stride in zip(buffers, (LAYER + 1, end - begin + 1)):
        gaps = np.asarray(buffer)[stride - 1::stride]
        assert (gaps == -7.0).all(), "a load wrote between the pieces"


@pytest.mark.parametrize("lib", ["torch", "numpy"])
@pytest.mark.parametrize("save_size, load_size", [(3, 2), (2, 3), (4, 1), (1, 4)])
def test_tessera_pieces_reshard_between_layouts(ckpt, lib, save_size, load_size):
    tessera.run_local(save_size, lambda comm: tessera.save(
        stacked_pieces(comm.rank, save_size, lib)[0], ckpt, comm=comm))
    tessera.verify(ckpt)
    metadata = tessera.read_metadata(ckpt)
    assert sorted(t.key for t in metadata.tensors) == ["m", "w"]
    whole = tessera.load_all(ckpt, tensor_type="torch")
    assert torch.equal(whole["w"][0], FULL) and torch.equal(whole["m"][0], -FULL)

    def load(comm):
        pieces, buffers = stacked_pieces(comm.rank, load_size, lib, fill=False)
        report = tessera.load(pieces, ckpt, comm=comm)
        assert report.missing_keys == [] and report.unexpected_keys == []
        check_stacked(pieces, buffers, comm.rank, load_size)
        return True

    assert tessera.run_local(load_size, load) == [True] * load_size


def test_pieces_with_async_save_and_torch_dist_format(ckpt):
    """Asynchronous saves (staged piece by piece) and PyTorch DCP's format take pieces too."""
    def save(comm):
        pieces = stacked_pieces(comm.rank, 2, "torch")[0]
        tessera.async_save(pieces, ckpt, comm=comm, staging="deferred").wait()
        tessera.save(pieces, ckpt + "_dcp", comm=comm, format="torch_dist")

    tessera.run_local(2, save)
    for path in (ckpt, ckpt + "_dcp"):
        def load(comm):
            pieces, buffers = stacked_pieces(comm.rank, 3, "torch", fill=False)
            tessera.load(pieces, path, comm=comm)
            check_stacked(pieces, buffers, comm.rank, 3)
            return True

        assert tessera.run_local(3, load) == [True] * 3


def test_one_tensor_at_several_places(ckpt):
    """A tensor tied under two keys is saved under each; one ShardedTensor at two places of one
    key is one piece, not two that overlap."""
    tied = torch.arange(6, dtype=torch.float32)
    piece = tessera.ShardedTensor(tied, key="p")
    tessera.save({"embed": tied, "head": tied, "p": [piece, piece]}, ckpt)
    assert sorted(t.key for t in tessera.read_metadata(ckpt).tensors) == ["embed", "head", "p"]
    back = torch.zeros(6)
    again = tessera.ShardedTensor(torch.zeros(6), key="p")
    tessera.load({"embed": back, "head": back, "p": [again, again]}, ckpt)
    assert torch.equal(back, tied) and torch.equal(again.data, tied)


def test_the_python_merging_of_pieces_is_gone():
    assert importlib.util.find_spec("tessera._merge") is None
    package = pathlib.Path(tessera.__file__).parent
    for source in package.glob("*.py"):
        text = source.read_text()
        assert "one box or flat range per key and rank" not in text, source
        assert "not one contiguous run" not in text, source


# ---- overlap within a rank --------------------------------------------------------------------

def test_overlap_within_a_rank_is_refused_naming_both_pieces(ckpt):
    a = tessera.ShardedTensor(np.zeros((2, 4), np.float32), (4, 4), (0, 0), key="w")
    b = tessera.ShardedTensor(np.zeros((2, 4), np.float32), (4, 4), (1, 0), key="w")
    message = ("tensor 'w': this rank holds pieces of it that overlap: local box [0:2, 0:4] and "
               "local box [1:3, 0:4] share the elements [1:2, 0:4]")
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.save({"p": [a, b]}, ckpt)
    assert message in str(info.value)
    tessera.save({"w": np.arange(16, dtype=np.float32).reshape(4, 4)}, ckpt)
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.load({"p": [a, b]}, ckpt)
    assert message in str(info.value)
    # Flat ranges of one layer that share an element.
    c = tessera.ShardedTensor(np.zeros(5, np.float32), (4, 4), (2, 0), local_shape=(2, 4),
                              flat_range=(0, 5), key="w")
    d = tessera.ShardedTensor(np.zeros(2, np.float32), (4, 4), (2, 0), local_shape=(2, 4),
                              flat_range=(4, 6), key="w")
    with pytest.raises(tessera.InvalidArgumentError, match=r"local box \[2:4, 0:4\] flat range "
                       r"\[0, 5\) and local box \[2:4, 0:4\] flat range \[4, 6\) share the "
                       r"elements \[3:4, 0:1\]"):
        tessera.load({"p": [c, d]}, ckpt)
    # On several ranks, every rank fails, naming the rank that holds them.
    def save(comm):
        pieces = [a, b] if comm.rank == 1 else [tessera.ShardedTensor(
            np.zeros((4, 4), np.float32), (4, 4), key="w", replica_id=1)]
        with pytest.raises(tessera.InvalidArgumentError) as info:
            tessera.save({"p": pieces}, ckpt + "_ranks", comm=comm)
        return str(info.value)

    for text in tessera.run_local(2, save):
        assert "rank 1" in text and "share the elements [1:2, 0:4]" in text, text


def test_pieces_must_agree_on_dtype_and_shape(ckpt):
    a = tessera.ShardedTensor(np.zeros((1, 4), np.float32), (4, 4), (0, 0), key="w")
    b = tessera.ShardedTensor(np.zeros((1, 4), np.float64), (4, 4), (1, 0), key="w")
    with pytest.raises(tessera.InvalidArgumentError,
                       match="tensor 'w': this rank holds pieces of it of dtype F32 and F64"):
        tessera.save({"p": [a, b]}, ckpt)
    c = tessera.ShardedTensor(np.zeros((1, 4), np.float32), (5, 4), (1, 0), key="w")
    with pytest.raises(tessera.InvalidArgumentError, match=r"global shape \[4, 4\] and \[5, 4\]"):
        tessera.save({"p": [a, c]}, ckpt)
    with pytest.raises(ValueError, match="duplicate key 'a.b'"):  # plain tensors are no pieces
        tessera.save({"a.b": np.zeros(1), "a": {"b": np.zeros(1)}}, ckpt)


# ---- Megatron-Core 0.19 (the real package) ----------------------------------------------------

def megatron_mapping():
    from megatron.core.dist_checkpointing import mapping
    return mapping


def megatron_stage(rank, size, fill=True):
    """Megatron-Core's own ShardedTensors of rank `rank` of `size` (interleaved pipeline
    stages: layers rank, rank + size, ...): the layers stacked on a prepended axis, Adam's
    exp_avg as the distributed optimizer holds it with one bucket per layer (a flat range of
    each of the rank's layers: Megatron 0.19 refuses flattened_range in the constructor, so it
    is set on the field, as older releases' from_rank_offsets_flat did), a dp_reshardable
    bucket (several 1-D boxes of one key, one per parameter), and a ShardedTensorFactory whose
    build gives two pieces of one key."""
    mapping = megatron_mapping()
    layers = list(range(rank, LAYERS, size))
    state = {"decoder": {}, "optimizer": {}, "bucket": {}}
    for layer in layers:
        data = FULL[layer].clone() if fill else torch.zeros(ROWS, COLS)
        state["decoder"][str(layer)] = mapping.ShardedTensor.from_rank_offsets(
            "decoder.layers.weight", data, (0, layer, LAYERS), prepend_axis_num=1,
            replica_id=(0, 0, 0))
    begin, end = layer_ranges(size)[rank]
    for layer in range(LAYERS):
        data = (-FULL[layer].reshape(-1)[begin:end]).clone() if fill else torch.zeros(end - begin)
        # Made without data (Megatron's constructor checks data against local_shape), then
        # given its flat data and range, field by field.
        st = mapping.ShardedTensor("optimizer.exp_avg.decoder.layers.weight", None, data.dtype,
                                   (ROWS, COLS), (LAYERS, ROWS, COLS), (layer, 0, 0), None,
                                   replica_id=(0, 0, 0), prepend_axis_num=1)
        st.data = data
        st.flattened_range = slice(begin, end)
        state["optimizer"][str(layer)] = st
    # dp_reshardable: the bucket's elements [rank * 12, rank * 12 + 12) hold three parameters'
    # ranges of 4; each is a 1-D box of the bucket's key.
    bucket = torch.arange(12 * size, dtype=torch.float64)
    for p in range(3):
        at = rank * 12 + 4 * p
        data = bucket[at:at + 4].clone() if fill else torch.zeros(4, dtype=torch.float64)
        state["bucket"][str(p)] = mapping.ShardedTensor(
            "optimizer.distributed.bucket_idx_0.exp_avg_sq", data, data.dtype, (4,),
            (12 * size,), (at,), None, replica_id=(0, 0, 0))

    def build(key, data, replica_id, flattened_range):
        # Rows `rank` and `rank + size` of a (2 * size, COLS) tensor: pieces that form no box.
        return {"a": mapping.ShardedTensor.from_rank_offsets(key, data[0:1], (0, rank, 2 * size),
                                                             replica_id=replica_id),
                "b": mapping.ShardedTensor.from_rank_offsets(key, data[1:2],
                                                             (0, rank + size, 2 * size),
                                                             replica_id=replica_id)}

    def merge(sub):
        return torch.cat([sub["a"], sub["b"]])

    glu = torch.stack([FULL[0, 0] + rank, FULL[0, 0] + rank + size]) if fill else \
        torch.zeros(2, COLS)
    state["glu"] = mapping.ShardedTensorFactory("glu.weight", glu, build, merge,
                                                replica_id=(0, 0, 0))
    state["iteration"] = 11
    return state


def check_megatron(result, rank, size):
    for layer in range(rank, LAYERS, size):
        assert torch.equal(result["decoder"][str(layer)], FULL[layer]), layer
    begin, end = layer_ranges(size)[rank]
    for layer in range(LAYERS):
        assert torch.equal(result["optimizer"][str(layer)], -FULL[layer].reshape(-1)[begin:end])
    for p in range(3):
        at = rank * 12 + 4 * p
        assert torch.equal(result["bucket"][str(p)], torch.arange(at, at + 4,
                                                                  dtype=torch.float64))
    assert torch.equal(result["glu"], torch.stack([FULL[0, 0] + rank, FULL[0, 0] + rank + size]))
    assert result["iteration"] == 11


@pytest.mark.parametrize("save_size, load_size", [(2, 3), (3, 1), (1, 2)])
def test_megatron_distributed_optimizer_with_stacked_layers_reshards(ckpt, save_size,
                                                                     load_size):
    from tessera import megatron as dist_checkpointing
    tessera.run_local(save_size, lambda comm: dist_checkpointing.save(
        megatron_stage(comm.rank, save_size), ckpt, comm=comm))
    tessera.verify(ckpt)
    plain = dist_checkpointing.load_plain_tensors(ckpt)
    assert torch.equal(plain["decoder.layers.weight"], FULL)
    assert torch.equal(plain["optimizer.exp_avg.decoder.layers.weight"], -FULL)
    assert torch.equal(plain["optimizer.distributed.bucket_idx_0.exp_avg_sq"],
                       torch.arange(12 * save_size, dtype=torch.float64))

    def load(comm):
        request = megatron_stage(comm.rank, load_size, fill=False)
        if load_size != save_size:  # the bucket and the factory are sized by the save's layout
            del request["bucket"], request["glu"]
        result = dist_checkpointing.load(request, ckpt, comm=comm)
        for layer in range(comm.rank, LAYERS, load_size):
            assert torch.equal(result["decoder"][str(layer)], FULL[layer]), layer
        begin, end = layer_ranges(load_size)[comm.rank]
        for layer in range(LAYERS):
            assert torch.equal(result["optimizer"][str(layer)],
                               -FULL[layer].reshape(-1)[begin:end])
        if load_size == save_size:
            check_megatron(result, comm.rank, load_size)
        return True

    assert tessera.run_local(load_size, load) == [True] * load_size


def test_megatron_pieces_round_trip_in_the_same_layout(ckpt):
    from tessera import megatron as dist_checkpointing
    tessera.run_local(3, lambda comm: dist_checkpointing.save(
        megatron_stage(comm.rank, 3), ckpt, comm=comm))

    def load(comm):
        result = dist_checkpointing.load(megatron_stage(comm.rank, 3, fill=False), ckpt,
                                         comm=comm)
        check_megatron(result, comm.rank, 3)
        return True

    assert tessera.run_local(3, load) == [True] * 3


def test_megatron_overlapping_pieces_are_refused(ckpt):
    mapping = megatron_mapping()
    state = {str(i): mapping.ShardedTensor.from_rank_offsets(
        "decoder.layers.weight", torch.zeros(ROWS, COLS), (0, 2, LAYERS), prepend_axis_num=1)
        for i in range(2)}  # layer 2 twice
    with pytest.raises(tessera.InvalidArgumentError,
                       match=r"tensor 'decoder.layers.weight': this rank holds pieces of it that "
                             r"overlap: local box \[2:3, 0:4, 0:5\] and local box \[2:3, 0:4, "
                             r"0:5\]"):
        tessera.megatron.save(state, ckpt)


# ---- torch's ShardedTensor with several local shards, and DTensor (gloo) ------------------------

def _enumerable(owners, rows, cols):
    from torch.distributed._shard.sharding_spec import EnumerableShardingSpec, ShardMetadata
    return EnumerableShardingSpec([ShardMetadata([rows * i, 0], [rows, cols], f"rank:{r}/cpu")
                                   for i, r in enumerate(owners)])


def _sharded_like(full, spec):
    from torch.distributed._shard import sharded_tensor
    st = sharded_tensor.empty(spec, *full.shape, dtype=full.dtype)
    for shard in st.local_shards():
        box = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                    shard.metadata.shard_sizes))
        shard.tensor.copy_(full[box])
    return st


def _check_shards(st, full):
    for shard in st.local_shards():
        box = tuple(slice(o, o + s) for o, s in zip(shard.metadata.shard_offsets,
                                                    shard.metadata.shard_sizes))
        assert torch.equal(shard.tensor, full[box]), shard.metadata


def _gloo_worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        comm = tessera.torch_dist_comm()
        full = FULL.reshape(LAYERS * ROWS, COLS)  # 24 rows
        # Each rank holds 3 blocks of 4 rows, interleaved: no single box.
        st = _sharded_like(full, _enumerable([0, 1, 0, 1, 0, 1], ROWS, COLS))
        assert len(st.local_shards()) == 3
        tessera.save({"w": st}, path, comm=comm)
        # Into a DTensor (rows split in two), and into torch ShardedTensors of other
        # interleavings (two blocks of 6 rows on one rank, blocks of 2 rows).
        mesh = init_device_mesh("cpu", (size,))
        dt = distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)])
        tessera.load({"w": dt}, path, comm=comm)
        assert torch.equal(dt.to_local(), full.chunk(size)[rank])
        for owners, rows in (([1, 1, 0, 0], 6), ([0, 1, 1, 0] * 3, 2)):
            back = _sharded_like(torch.zeros_like(full), _enumerable(owners, rows, COLS))
            tessera.load({"w": back}, path, comm=comm)
            _check_shards(back, full)
        # From a DTensor into several local shards per rank.
        source = distribute_tensor(full.clone(), mesh, [Shard(1)])
        tessera.save({"w": source}, path + "_dt", comm=comm)
        back = _sharded_like(torch.zeros_like(full), _enumerable([1, 0] * 3, ROWS, COLS))
        tessera.load({"w": back}, path + "_dt", comm=comm)
        _check_shards(back, full)
    finally:
        dist.destroy_process_group()


def test_torch_sharded_tensor_with_several_local_shards_and_dtensor(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(_gloo_worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")
    metadata = tessera.read_metadata(path)
    assert [list(c.box.offsets) for c in metadata.find_tensor("w").chunks] == \
        [[4 * i, 0] for i in range(6)]
    assert torch.equal(tessera.load_all(path, tensor_type="torch")["w"],
                       FULL.reshape(LAYERS * ROWS, COLS))
