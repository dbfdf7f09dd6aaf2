#!/usr/bin/python3
"""Writes PyTorch DCP checkpoints with the real torch 1.13 of this machine, for tessera's reader
tests (src/checkpoint/dcp_load_test.cc, python/tests/test_torch_dist_load.py).

    make_dcp_read_fixtures.py OUT_DIR

OUT_DIR/single/   save_state_dict(no_dist=True), FileSystemWriter's default (one file per item):
                  tensors of several dtypes and shapes, a transposed view (stride (1, 4)), a
                  permuted 3-D view, a scalar, an empty tensor, a 1 MiB tensor, and objects
                  (bytes and a dict), saved by torch as torch.save'd byte items.
OUT_DIR/sharded2/ save_state_dict by 2 gloo processes, single_file_per_rank=True: ShardedTensors
                  split by rows and by columns, a replicated tensor, an object.
OUT_DIR/megatron/ Megatron-Core's torch_dist as core <= 0.14 writes it (see megatron()).
OUT_DIR/<name>.expected.json:
  {"tensors": {fqn: {"dtype": "float32", "shape": [...], "hex": row-major bytes}},
   "objects": {fqn: {"item_hex": the item's bytes in its data file, "repr": repr(value)}}}
Object items are located through torch's own .metadata (what torch's reader would read).
Prints "OK" and exits 0 on success.
"""
import io
import json
import os
import pickle
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "format", "torch_dist", "testdata"))
import torch113_compat  # noqa: E402,F401 (before torch.distributed._shard)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._shard import checkpoint as dcp  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards  # noqa: E402


def values(shape, dtype, seed):
    """Deterministic values every dtype holds exactly."""
    n = 1
    for d in shape:
        n *= d
    t = (torch.arange(n, dtype=torch.int64) * 7 + seed) % 251 - 100
    return t.reshape(shape).to(dtype)


def raw_hex(t):
    t = t.detach().contiguous().reshape(-1)
    return "" if t.numel() == 0 else t.view(torch.uint8).numpy().tobytes().hex()


def describe_tensors(tensors):
    return {k: {"dtype": str(v.dtype).replace("torch.", ""), "shape": list(v.shape),
                "hex": raw_hex(v)} for k, v in tensors.items()}


def describe_objects(ckpt, objects):
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    out = {}
    for index, info in meta.storage_data.items():
        if index.fqn not in objects:
            continue
        with open(os.path.join(ckpt, info.relative_path), "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        value = torch.load(io.BytesIO(item))
        assert value == objects[index.fqn], (value, objects[index.fqn])
        out[index.fqn] = {"item_hex": item.hex(), "repr": repr(value)}
    assert set(out) == set(objects), (set(out), set(objects))
    return out


def write_expected(out, name, tensors, objects):
    ckpt = os.path.join(out, name)
    with open(ckpt + ".expected.json", "w") as f:
        json.dump({"tensors": describe_tensors(tensors),
                   "objects": describe_objects(ckpt, objects)}, f, indent=1)


def single(out):
    transposed = values((6, 4), torch.int64, 3).t()           # size (4, 6), stride (1, 4)
    permuted = values((5, 7, 3), torch.float16, 5).permute(2, 0, 1)  # (3, 5, 7)
    assert transposed.stride() == (1, 4) and not permuted.is_contiguous()
    tensors = {
        "layer.weight": values((8, 6), torch.float32, 1),
        "layer.bias": values((10,), torch.bfloat16, 2),
        "transposed": transposed,
        "permuted": permuted,
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros((0, 3)),
        "mask": values((2, 3, 4), torch.int64, 9) > 0,
        "big": values((512, 512), torch.float32, 11),
    }
    objects = {"obj_bytes": b"hello\x00world", "obj_dict": {"step": 7, "lr": [0.5, 1]}}
    ckpt = os.path.join(out, "single")
    dcp.save_state_dict({**tensors, **objects}, dcp.FileSystemWriter(ckpt), no_dist=True)
    write_expected(out, "single", tensors, objects)


SHARDED = {
    "emb": ((10, 6), torch.float32, 0),    # rows split 5 + 5
    "proj": ((4, 9), torch.float16, 1),    # columns split 4 + 5
}


def sharded_full():
    return {k: values(shape, dtype, seed + 20) for k, (shape, dtype, seed) in SHARDED.items()}


def sharded_worker(rank, ckpt, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    full = sharded_full()
    state = {}
    for k, t in full.items():
        dim = SHARDED[k][2]
        size = t.shape[dim]
        begin = 0 if rank == 0 else size // 2
        length = size // 2 if rank == 0 else size - size // 2
        offsets = [0, 0]
        offsets[dim] = begin
        local = t.narrow(dim, begin, length).contiguous()
        state[k] = init_from_local_shards([Shard.from_tensor_and_offsets(local, offsets, rank)],
                                          *t.shape)
    state["rep"] = values((3,), torch.float32, 30)
    state["obj"] = {"epoch": 3}
    dcp.save_state_dict(state, dcp.FileSystemWriter(ckpt, single_file_per_rank=True))
    dist.barrier()
    dist.destroy_process_group()


def sharded2(out):
    ckpt = os.path.join(out, "sharded2")
    with tempfile.TemporaryDirectory(prefix="dcp-fixture-") as run_dir:
        mp.spawn(sharded_worker, args=(ckpt, os.path.join(run_dir, "store")), nprocs=2,
                 join=True)
    tensors = sharded_full()
    tensors["rep"] = values((3,), torch.float32, 30)
    write_expected(out, "sharded2", tensors, {"obj": {"epoch": 3}})


# Megatron-Core torch_dist (as core <= 0.14 writes it): an N-D reformulated flattened tensor
# of original shape (4, 6) in fragments of (2, 3), each fragment's 6 elements split into flat
# ranges [0, 4) and [4, 6) (a distributed optimizer over 2 data-parallel ranks); mcore_data as
# an attribute of torch's Metadata; a ShardedObject; metadata.json and common.pt.
ND_ORIGINAL = (4, 6)
ND_FRAGMENTS = (2, 2)
ND_RANGES = ((0, 4), (4, 6))


def megatron_worker(ckpt, store):
    dist.init_process_group("gloo", init_method="file://" + store, rank=0, world_size=1)
    w = values(ND_ORIGINAL, torch.float32, 40)
    local = (ND_ORIGINAL[0] // ND_FRAGMENTS[0], ND_ORIGINAL[1] // ND_FRAGMENTS[1])
    shards = []
    for i in range(ND_FRAGMENTS[0]):
        for j in range(ND_FRAGMENTS[1]):
            flat = w[i * local[0]:(i + 1) * local[0], j * local[1]:(j + 1) * local[1]].reshape(-1)
            for begin, end in ND_RANGES:
                shards.append(Shard.from_tensor_and_offsets(
                    flat[begin:end].clone().reshape(1, 1, end - begin), [i, j, begin], 0))
    numel = local[0] * local[1]
    state = {
        "optimizer.state.exp_avg.decoder.weight":
            init_from_local_shards(shards, ND_FRAGMENTS[0], ND_FRAGMENTS[1], numel),
        "decoder.bias": values((5,), torch.bfloat16, 41),
        "optimizer.param_groups/shard_0_1": [{"lr": 0.1}],
    }
    dcp.save_state_dict(state, dcp.FileSystemWriter(ckpt, single_file_per_rank=True))
    dist.destroy_process_group()
    return w


def megatron(out):
    ckpt = os.path.join(out, "megatron")
    with tempfile.TemporaryDirectory(prefix="dcp-fixture-") as run_dir:
        w = megatron_worker(ckpt, os.path.join(run_dir, "store"))
    path = os.path.join(ckpt, ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)
    meta.mcore_data = {"optimizer.state.exp_avg.decoder.weight":
                       {"nd_reformulated_orig_global_shape": ND_ORIGINAL}}
    with open(path, "wb") as f:
        pickle.dump(meta, f, protocol=4)
    with open(os.path.join(ckpt, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                   "common_backend": "torch"}, f)
    torch.save({"iteration": 100, "args": {"tp": 2}}, os.path.join(ckpt, "common.pt"))
    tensors = {"optimizer.state.exp_avg.decoder.weight": w,
               "decoder.bias": values((5,), torch.bfloat16, 41)}
    write_expected(out, "megatron", tensors, {"optimizer.param_groups/shard_0_1": [{"lr": 0.1}]})


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    single(out)
    sharded2(out)
    megatron(out)
    print("OK")


if __name__ == "__main__":
    main()
