#!/usr/bin/python3
"""Loads a PyTorch DCP checkpoint that tessera wrote with torch 1.13's own DCP and compares it
with expectations.

    load_dcp_with_torch.py CKPT EXPECTED.json [--ranks N]

EXPECTED.json:
  {"flavor": "1.13" or "2",
   "tensors": {fqn: {"dtype": "float32", "shape": [...], "hex": raw little-endian bytes}},
   "objects": {fqn: {"bytes_hex": "..."} or {"value": a JSON value}},
   "save_id": the save's id (checked in the 2.x storage_meta)}

With --ranks 1 (default) the state dict is plain tensors, loaded with no_dist=True. With
--ranks N > 1, N processes (gloo over a FileStore) each load the checkpoint twice, into torch
ShardedTensors split along the first dimension ("rows") and then along the last ("cols") (a
tensor too small to split, or 0-d, is a plain tensor on every rank), and check their shard.
Objects come back through torch.load and are compared with the expected bytes or value.

flavor "2": the .metadata names torch 2.x's classes (torch.distributed.checkpoint.*), which
torch 1.13 lacks; it is unpickled with the stand-ins of src/format/torch_dist/testdata/
dcp2_standins.py, its 2.x-only content is checked (version, storage_meta, planner_data), and it
is turned into torch 1.13's classes for the load, which then runs torch's own reader and planner.

Prints "OK ..." and exits 0 when everything matches; prints MISMATCH lines and exits 1 otherwise.
Used by src/checkpoint/dcp_save_test.cc.
"""
import argparse
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
from torch.distributed._shard.checkpoint import filesystem as fs113  # noqa: E402
from torch.distributed._shard.checkpoint import metadata as md113  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # noqa: E402
from torch.distributed._shard.sharded_tensor import init_from_local_shards  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402


def expected_tensor(e):
    dtype = getattr(torch, e["dtype"])
    raw = bytearray(bytes.fromhex(e["hex"]))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
    return flat.view(dtype).reshape(e["shape"])


def raw(t):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def to_113(meta, problems, expected):
    """A torch 2.x Metadata (stand-in classes) as torch 1.13's, after checking its 2.x parts."""
    if meta.version != "1.0.0":
        problems.append(f"version {meta.version!r}, expected '1.0.0'")
    sm = meta.storage_meta
    if sm is None or sm.save_id != expected["save_id"]:
        problems.append(f"storage_meta {sm!r}: save_id should be {expected['save_id']}")
    fqns = list(meta.state_dict_metadata)
    if meta.planner_data != {f: (f,) for f in fqns}:
        problems.append(f"planner_data {meta.planner_data!r}")
    sdm = {}
    for fqn, v in meta.state_dict_metadata.items():
        if type(v).__name__ == "BytesStorageMetadata":
            sdm[fqn] = md113.BytesStorageMetadata()
            continue
        p = v.properties
        props = TensorProperties(dtype=p.dtype, layout=p.layout, requires_grad=p.requires_grad,
                                 memory_format=p.memory_format, pin_memory=p.pin_memory)
        chunks = [md113.ChunkStorageMetadata(offsets=c.offsets, sizes=c.sizes) for c in v.chunks]
        sdm[fqn] = md113.TensorStorageMetadata(properties=props, size=v.size, chunks=chunks)
    storage = {}
    for index, info in meta.storage_data.items():
        if getattr(info, "transform_descriptors", None):
            problems.append(f"{index.fqn}: transform_descriptors {info.transform_descriptors}")
        storage[md113.MetadataIndex(index.fqn, index.offset, index.index)] = fs113._StorageInfo(
            info.relative_path, info.offset, info.length)
    return md113.Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage)


class Reader(fs113.FileSystemReader):
    """torch 1.13's FileSystemReader; for the 2.x flavour, the .metadata read as described."""

    def __init__(self, path, expected, problems):
        super().__init__(path)
        self.expected, self.problems = expected, problems

    def read_metadata(self):
        if self.expected["flavor"] == "1.13":
            meta = super().read_metadata()
            if type(meta) is not md113.Metadata:
                self.problems.append(f"the .metadata holds a {type(meta)}")
            return meta
        sys.path.insert(0, os.path.join(HERE, "..", "..", "format", "torch_dist", "testdata"))
        import dcp2_standins
        ns = dcp2_standins.install()
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            meta = pickle.load(f)
        if type(meta) is not ns.Metadata:
            self.problems.append(f"the .metadata holds a {type(meta)}, not torch 2.x's Metadata")
            return super().read_metadata()
        return to_113(meta, self.problems, self.expected)


def split(n, parts, i):
    base, rem = divmod(n, parts)
    return i * base + min(i, rem), base + (1 if i < rem else 0)


def build_state(expected, rank, ranks, layout):
    """The state dict to load into, and what each local tensor must hold afterwards."""
    state, want = {}, {}
    for fqn, e in expected["tensors"].items():
        full = expected_tensor(e)
        shape = list(e["shape"])
        dim = 0 if layout == "rows" else len(shape) - 1
        if ranks == 1 or not shape or shape[dim] < ranks:
            state[fqn] = torch.zeros(shape, dtype=full.dtype)
            want[fqn] = full
            continue
        begin, size = split(shape[dim], ranks, rank)
        local_shape, offsets = list(shape), [0] * len(shape)
        local_shape[dim], offsets[dim] = size, begin
        local = torch.zeros(local_shape, dtype=full.dtype)
        shard = Shard.from_tensor_and_offsets(local, offsets, rank)
        state[fqn] = init_from_local_shards([shard], *shape)
        want[fqn] = full.narrow(dim, begin, size)
    for fqn in expected["objects"]:
        state[fqn] = b""
    return state, want


def check(state, want, expected, problems, where):
    for fqn, w in want.items():
        v = state[fqn]
        local = v.local_shards()[0].tensor if isinstance(v, ShardedTensor) else v
        if local.dtype != w.dtype or list(local.shape) != list(w.shape) or raw(local) != raw(w):
            problems.append(f"{where} {fqn}: loaded {local.dtype} {list(local.shape)} "
                            f"{raw(local)[:16].hex()}..., expected {w.dtype} {list(w.shape)} "
                            f"{raw(w)[:16].hex()}...")
    for fqn, e in expected["objects"].items():
        v = state[fqn]
        if "bytes_hex" in e:
            ok = isinstance(v, bytes) and v.hex() == e["bytes_hex"]
        else:
            ok = v == e["value"]
        if not ok:
            problems.append(f"{where} object {fqn}: loaded {v!r}, expected {e}")


def load(ckpt, expected, rank, ranks, layout, problems):
    state, want = build_state(expected, rank, ranks, layout)
    dcp.load_state_dict(state, Reader(ckpt, expected, problems), no_dist=ranks == 1)
    check(state, want, expected, problems, f"rank {rank} {layout}:")


def worker(rank, ranks, ckpt, expected, run_dir):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(run_dir, "store"),
                            rank=rank, world_size=ranks)
    problems = []
    try:
        for layout in ("rows", "cols"):
            load(ckpt, expected, rank, ranks, layout, problems)
    except Exception as e:  # noqa: BLE001 (reported as a mismatch)
        problems.append(f"rank {rank}: {type(e).__name__}: {e}")
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(problems, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("expected")
    ap.add_argument("--ranks", type=int, default=1)
    args = ap.parse_args()
    with open(args.expected) as f:
        expected = json.load(f)
    problems = []
    if args.ranks == 1:
        load(args.ckpt, expected, 0, 1, "rows", problems)
    else:
        with tempfile.TemporaryDirectory(prefix="dcp-load-") as run_dir:
            mp.spawn(worker, args=(args.ranks, args.ckpt, expected, run_dir), nprocs=args.ranks,
                     join=True)
            for r in range(args.ranks):
                with open(os.path.join(run_dir, f"rank{r}.json")) as f:
                    problems += json.load(f)
    for p in problems:
        print("MISMATCH", p)
    if problems:
        sys.exit(1)
    print(f"OK {args.ranks} rank(s): {len(expected['tensors'])} tensors, "
          f"{len(expected['objects'])} objects")


if __name__ == "__main__":
    main()
