#!/usr/bin/python3
"""Reading a PyTorch DCP checkpoint that torch 1.13 wrote: tessera against torch's own reader.

    PYTHONPATH=build/python /usr/bin/python3 bench/peers/dcp_read_bench.py --ranks 2 \\
        --size 1GiB [--repeat 3] [--chunks 1000000] --json

Prints one JSON object with two comparisons, measured in the same run:

1. Loads. R gloo processes save the state of `tessera bench io` (bench/peers/dcp_bench.py:
   Megatron-style parameters split over tp=R, F32 Adam moments, a step object) with torch
   1.13's save_state_dict (FileSystemWriter(single_file_per_rank=True)). Then, best of
   --repeat each, after a syncfs (the page cache is kept: both sides read warm files):
     - torch's load_state_dict of the same layout and of the reshard layout tp1,dpR
       (dcp_bench.py's worker, R processes);
     - tessera.load of the same checkpoint, same and resharded layouts, R ranks as threads of
       one process (tessera.run_local), the format detected from the files. Every loaded
       element is checked on the first repeat.
   Reported: seconds, and for the resharded load bytes read over bytes needed (tessera's
   LoadReport, which includes the probes of each item's zip directory; torch's reader reads
   every item it touches whole).
2. The index. A `.metadata` of --chunks chunks (1000 tensors of 2-D row chunks, 1.13 classes,
   pickled by CPython as torch does) over sparse data files: pickle.load (what torch's reader
   does) against tessera.read_metadata (pickle parse, interpretation, the Metadata, and its
   checks: every item inside its file, chunks disjoint and covering), best of --repeat.
"""

import argparse
import json
import math
import os
import pickle
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import dcp_bench as db  # noqa: E402 (installs the torch 1.13 import fixes first)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._shard import checkpoint as dcp  # noqa: E402
from torch.distributed._shard.checkpoint import filesystem as fs113  # noqa: E402
from torch.distributed._shard.checkpoint import metadata as md113  # noqa: E402
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties  # noqa: E402

import tessera  # noqa: E402


# ---- torch: save once, then time its loads ----------------------------------------------------

def torch_worker(rank, o):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(o["run_dir"], "store"),
                            rank=rank, world_size=o["ranks"])
    c = db.model_config(o["size"])
    r = o["ranks"]
    save_entries, _ = db.rank_entries(c, r, 1, rank)
    saved, _ = db.build_state(save_entries, rank, fill=True)
    dcp.save_state_dict(saved, dcp.FileSystemWriter(o["ckpt"], single_file_per_rank=True))
    del saved
    loaded, _ = db.build_state(save_entries, rank, fill=False)
    reshard_entries, _ = db.rank_entries(c, 1, r, rank)
    resharded, _ = db.build_state(reshard_entries, rank, fill=False)
    samples = {"load": [], "reshard_load": []}
    read = 0
    for k in range(o["repeat"]):
        for name, state, entries in (("load", loaded, save_entries),
                                     ("reshard_load", resharded, reshard_entries)):
            if rank == 0:
                db.syncfs(o["run_dir"])
            reader = db.CountingReader(o["ckpt"])
            dist.barrier()
            start = time.perf_counter()
            dcp.load_state_dict(state, reader)
            dist.barrier()
            samples[name].append(time.perf_counter() - start)
            if k == 0:
                db.check_state(state, entries)
                if name == "reshard_load":
                    read = reader.bytes_read
    needed = len(db.STEP_VALUE) + sum(math.prod(e.sizes) * db.ELEMENT_SIZE[e.dtype]
                                      for e in reshard_entries)
    everyone = [None] * r
    dist.all_gather_object(everyone, {"read": read, "needed": needed})
    if rank == 0:
        with open(os.path.join(o["run_dir"], "torch.json"), "w") as f:
            json.dump({"load_seconds": min(samples["load"]),
                       "reshard_load_seconds": min(samples["reshard_load"]),
                       "samples_seconds": samples,
                       "reshard_bytes_read": sum(e["read"] for e in everyone),
                       "reshard_bytes_needed": sum(e["needed"] for e in everyone)}, f)
    dist.barrier()
    dist.destroy_process_group()


# ---- tessera: the same loads, R ranks as threads ----------------------------------------------

def tessera_state(entries):
    state = {"optimizer.step": b""}
    for e in entries:
        local = torch.zeros(e.sizes, dtype=e.dtype)
        state[e.key] = tessera.ShardedTensor(local, global_shape=e.global_shape,
                                             global_offset=e.offsets) if e.sharded else local
    return state


def tessera_load(o, tp, dp, check):
    c = db.model_config(o["size"])
    r = o["ranks"]
    states = [tessera_state(db.rank_entries(c, tp, dp, rank)[0]) for rank in range(r)]

    def fn(comm):
        report = tessera.load(states[comm.rank], o["ckpt"], comm=comm,
                              num_io_threads=o["io_threads"])
        return report.bytes_read, report.bytes_needed

    start = time.perf_counter()
    reports = tessera.run_local(r, fn)
    seconds = time.perf_counter() - start
    if check:
        for rank in range(r):
            for e in db.rank_entries(c, tp, dp, rank)[0]:
                v = states[rank][e.key]
                local = v.data if isinstance(v, tessera.ShardedTensor) else v
                if not torch.equal(local, db.pattern(e.key, e.offsets, e.sizes, e.global_shape,
                                                     e.dtype)):
                    raise RuntimeError(f"tessera load: '{e.key}' differs on rank {rank}")
    return seconds, sum(b for b, _ in reports), sum(n for _, n in reports)


def compare_loads(o):
    mp.spawn(torch_worker, args=(o,), nprocs=o["ranks"], join=True)
    with open(os.path.join(o["run_dir"], "torch.json")) as f:
        t = json.load(f)
    samples = {"load": [], "reshard_load": []}
    read = needed = 0
    for k in range(o["repeat"]):
        for name, tp, dp in (("load", o["ranks"], 1), ("reshard_load", 1, o["ranks"])):
            db.syncfs(o["run_dir"])
            seconds, r, n = tessera_load(o, tp, dp, check=k == 0)
            samples[name].append(seconds)
            if name == "reshard_load":
                read, needed = r, n
    best = {name: min(v) for name, v in samples.items()}
    return {
        "ranks": o["ranks"],
        "bytes": db.state_bytes(db.model_config(o["size"])),
        "checkpoint_file_bytes": sum(os.path.getsize(os.path.join(o["ckpt"], n))
                                     for n in os.listdir(o["ckpt"])),
        "save_layout": f"tp{o['ranks']},dp1 (torch 1.13 save_state_dict)",
        "reshard_layout": f"tp1,dp{o['ranks']}",
        "torch": t,
        "tessera": {"load_seconds": best["load"], "reshard_load_seconds": best["reshard_load"],
                    "samples_seconds": samples, "reshard_bytes_read": read,
                    "reshard_bytes_needed": needed, "io_threads": o["io_threads"]},
        "load_speedup": t["load_seconds"] / best["load"],
        "reshard_load_speedup": t["reshard_load_seconds"] / best["reshard_load"],
        "tessera_reshard_bytes_read_over_needed": read / needed,
        "torch_reshard_bytes_read_over_needed":
            t["reshard_bytes_read"] / t["reshard_bytes_needed"],
    }


# ---- the index --------------------------------------------------------------------------------

def write_big_metadata(ckpt, chunks):
    """A .metadata of `chunks` chunks: 1000 tensors (rows, 64) float32 of one-row chunks, items
    of 512 bytes in 100 sparse files, pickled as torch's writer does."""
    os.makedirs(ckpt)
    tensors = 1000
    rows = max(1, chunks // tensors)
    files = 100
    item = 512
    props = TensorProperties(dtype=torch.float32)
    sdm, storage = {}, {}
    position = [0] * files
    n = 0
    for t in range(tensors):
        fqn = f"decoder.layers.{t}.weight"
        chunk_list = []
        for r in range(rows):
            chunk_list.append(md113.ChunkStorageMetadata(offsets=torch.Size([r, 0]),
                                                         sizes=torch.Size([1, 64])))
            f = n % files
            storage[md113.MetadataIndex(fqn, torch.Size([r, 0]), r)] = fs113._StorageInfo(
                f"__{f}_0.distcp", position[f], item)
            position[f] += item
            n += 1
        sdm[fqn] = md113.TensorStorageMetadata(properties=props, size=torch.Size([rows, 64]),
                                               chunks=chunk_list)
    meta = md113.Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage)
    with open(os.path.join(ckpt, ".metadata"), "wb") as f:
        pickle.dump(meta, f)
    for f in range(files):
        with open(os.path.join(ckpt, f"__{f}_0.distcp"), "wb") as out:
            out.truncate(position[f])
    return n


def compare_index(o):
    ckpt = os.path.join(o["run_dir"], "index")
    n = write_big_metadata(ckpt, o["chunks"])
    path = os.path.join(ckpt, ".metadata")
    py, ts = [], []
    for _ in range(o["repeat"]):
        start = time.perf_counter()
        with open(path, "rb") as f:
            pickle.load(f)
        py.append(time.perf_counter() - start)
        start = time.perf_counter()
        meta = tessera.read_metadata(ckpt)
        ts.append(time.perf_counter() - start)
        assert sum(len(t.chunks) for t in meta.tensors) == n
        del meta
    return {"chunks": n, "metadata_bytes": os.path.getsize(path),
            "python_pickle_load_seconds": min(py), "tessera_read_metadata_seconds": min(ts),
            "samples_seconds": {"pickle_load": py, "tessera": ts},
            "speedup": min(py) / min(ts)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--chunks", type=int, default=1000000, help="0: skip the index comparison")
    ap.add_argument("--no-loads", action="store_true", help="only the index comparison")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = ap.parse_args()
    run_dir = tempfile.mkdtemp(prefix="dcp-read-bench-", dir=args.dir)
    o = {"ranks": args.ranks, "size": db.parse_size(args.size), "repeat": args.repeat,
         "io_threads": args.io_threads, "chunks": args.chunks, "run_dir": run_dir,
         "ckpt": os.path.join(run_dir, "ckpt")}
    out = {"peer": f"pytorch-dcp {torch.__version__}", "page_cache": "warm (syncfs, no drop)"}
    try:
        if not args.no_loads:
            out["load"] = compare_loads(o)
        if args.chunks > 0:
            out["index"] = compare_index(o)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
