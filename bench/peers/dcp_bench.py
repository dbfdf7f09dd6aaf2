#!/usr/bin/python3
"""PyTorch DCP (torch 1.13, torch.distributed._shard.checkpoint) on tessera's benchmark state.

Runs R processes (torch.multiprocessing.spawn, gloo over a FileStore on this machine) that save
and load the state that `tessera bench io` saves and loads (workload::BuildRankState in
src/workload/model_state.cc), with FileSystemWriter(single_file_per_rank=True,
sync_files=--sync), and prints one JSON object: save_seconds, load_seconds (best of --repeat,
every sample too), bytes, ranks, sync, and a resharded load.

Run it with Debian's interpreter (it has torch 1.13):

    /usr/bin/python3 bench/peers/dcp_bench.py --ranks 2 --size 1GiB [--sync] --json

The state, mirrored from model_state.cc (ModelConfig::ForBytes, Params, BuildRankState):

  hidden h = int(sqrt(size / 10 / (12 L + 4))), ffn = vocab = 4h, L = 4 layers
  embedding.word_embeddings.weight [vocab, h]   BF16, split along dim 0 over TP
  decoder.layers.{l}.input_layernorm.weight [h]                 replicated over TP
  decoder.layers.{l}.self_attention.linear_qkv.weight [3h, h]   dim 0
  decoder.layers.{l}.self_attention.linear_proj.weight [h, h]   dim 1
  decoder.layers.{l}.mlp.linear_fc1.weight [ffn, h]             dim 0
  decoder.layers.{l}.mlp.linear_fc2.weight [h, ffn]             dim 1
  decoder.final_layernorm.weight [h]                            replicated over TP
  optimizer.exp_avg.<key>, optimizer.exp_avg_sq.<key>           F32 Adam moments of each
  optimizer.step                                                a small object ("step=1000")

The save layout is tessera bench io's default, tp=R (dp=1), where DCP expresses every split
exactly: a split parameter is a ShardedTensor built with init_from_local_shards from this rank's
box, which is tessera's Split (the first n % R parts one row or column longer; the same boxes
as a ChunkShardingSpec on dim 0 or 1 when R divides the dimension, but exact for any R and
for column splits too). With dp=1 a moment's flat range covers its whole TP shard, so it is the
same box in F32. Replicated tensors (the norms and their moments) are plain tensors, which DCP
writes from the coordinator only, as tessera writes one replica. The step is a bytes object
(tessera: one per rank, replica id {rank}; DCP: one, written by the coordinator; 9 bytes).

The resharded load uses tessera's default reshard layout for R ranks when DCP can express it:
tp1,dpR. Parameters are then whole on every rank (plain tensors); each moment is this rank's
DP share of the flattened whole tensor, which is a block of rows when R divides the row count
(exact, the case at R=2) and is otherwise cut at the nearest row (same bytes within one row;
"reshard_exact": false). Other reshard layouts (tp>1 with dp>1 needs parameters replicated over
part of the ranks, which one ShardedTensor cannot express) are skipped.

Python 3.11 vs torch 1.13: two modules of torch 1.13 break on Python 3.11. They are fixed at
import time by an import hook (_PatchingFinder below) that compiles the fixed source in memory;
no file of the system is touched and no bytecode is written next to it:
  * torch/distributed/_shard/sharded_tensor/metadata.py: the dataclass field
    `tensor_properties: TensorProperties = field(default=TensorProperties())` is a mutable
    default, rejected by 3.11's dataclasses (ValueError at import) -> default_factory.
  * torch/distributed/elastic/multiprocessing/api.py: Std.from_str iterates `for s in Std`;
    on 3.11 iterating an IntFlag skips NONE and the alias ALL, so "0" and "3" map to None
    -> iterate over the four members explicitly. (Not on this script's path, which does not
    use torchrun, but fixed the same way so any import of it works.)
The hook is installed at the top of this file, so the spawned processes (which import this
file as __mp_main__) install it too.

Method, as in `tessera bench io`: every tensor is allocated and filled before any timing; each
repeat saves into a fresh directory, then loads it under the same layout, then under the
reshard layout; before each phase, outside the timing, syncfs() writes back what earlier phases
left dirty; nothing is dropped from the page cache (with --drop-caches, as root, it is dropped
before every load, so loads read the disk). A phase is timed on rank 0 from a barrier
before it to a barrier after it. --warmup repeats (default 1) run first and are reported apart
(on this VM a process's first writes land on page-cache pages the guest never touched and run
2-4x slower); the figures are the best of the --repeat timed samples. The first repeat checks
every loaded element.
"""

import argparse
import ctypes
import importlib.abc
import importlib.machinery
import json
import math
import os
import resource
import shutil
import sys
import tempfile
import time
import zlib

# ---- torch 1.13 on Python 3.11: fix two modules at import time ----------------------------------

_FIXES = {
    "torch.distributed._shard.sharded_tensor.metadata": [
        (
            "tensor_properties: TensorProperties = field(default=TensorProperties())",
            "tensor_properties: TensorProperties = field(default_factory=TensorProperties)",
        )
    ],
    "torch.distributed.elastic.multiprocessing.api": [
        ("for s in Std:", "for s in (Std.NONE, Std.OUT, Std.ERR, Std.ALL):")
    ],
}


class _PatchedSourceLoader(importlib.machinery.SourceFileLoader):
    """Compiles the module's source with the fixes applied; never reads or writes bytecode."""

    def get_code(self, fullname):
        source = self.get_data(self.path).decode("utf-8")
        for old, new in _FIXES[fullname]:
            source = source.replace(old, new)  # a no-op where torch is already fixed
        return compile(source, self.path, "exec", dont_inherit=True)


class _PatchingFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _FIXES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or not isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            return spec
        spec.loader = _PatchedSourceLoader(fullname, spec.origin)
        return spec


if sys.version_info >= (3, 11):
    sys.meta_path.insert(0, _PatchingFinder())

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed._shard import checkpoint as dcp  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor  # noqa: E402
from torch.distributed._shard.sharded_tensor import init_from_local_shards  # noqa: E402

# ---- the state: a mirror of src/workload/model_state.cc -------------------------------------

STEP_VALUE = b"step=1000"
ELEMENT_SIZE = {torch.bfloat16: 2, torch.float32: 4}


def parse_size(text):
    """tools/inspect.cc ParseSize: 256MiB, 1GiB, 1000000, 1.5GB."""
    units = {"": 1, "B": 1, "K": 1 << 10, "KiB": 1 << 10, "M": 1 << 20, "MiB": 1 << 20,
             "G": 1 << 30, "GiB": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    number = text.rstrip("KMGiB")
    unit = text[len(number):]
    if unit not in units:
        raise SystemExit(f"dcp_bench: bad size '{text}': expected e.g. 256MiB, 1GiB, 1000000")
    return int(round(float(number) * units[unit]))


def model_config(size, layers=4):
    """ModelConfig::ForBytes."""
    h = max(8, int(math.sqrt(size / 10.0 / (12.0 * layers + 4.0))))
    return {"hidden": h, "ffn": 4 * h, "vocab": 4 * h, "layers": layers}


def params(c):
    """Params(config, pp=1): (key, global shape, split dim or -1 for replicated)."""
    h = c["hidden"]
    out = [("embedding.word_embeddings.weight", (c["vocab"], h), 0)]
    for layer in range(c["layers"]):
        p = f"decoder.layers.{layer}."
        out += [
            (p + "input_layernorm.weight", (h,), -1),
            (p + "self_attention.linear_qkv.weight", (3 * h, h), 0),
            (p + "self_attention.linear_proj.weight", (h, h), 1),
            (p + "mlp.linear_fc1.weight", (c["ffn"], h), 0),
            (p + "mlp.linear_fc2.weight", (h, c["ffn"]), 1),
        ]
    out.append(("decoder.final_layernorm.weight", (h,), -1))
    return out


def split(n, parts, i):
    """Split(): [begin, begin + size) of part i of n cut into `parts` as evenly as possible."""
    base, rem = divmod(n, parts)
    return i * base + min(i, rem), base + (1 if i < rem else 0)


def state_bytes(c):
    """ModelConfig::StateBytes: every unique element once, plus the step object."""
    return sum(math.prod(s) for _, s, _ in params(c)) * 10 + len(STEP_VALUE)


def pattern(key, offsets, sizes, global_shape, dtype):
    """Element values: (crc32(key) + global linear index) % 251, exact in BF16 and F32.
    Built from a per-row and a per-column term (every tensor here is 1-D or 2-D), so it costs
    a few passes over 2-byte values."""
    base = zlib.crc32(key.encode()) % 251
    if len(sizes) == 1:
        index = torch.arange(offsets[0], offsets[0] + sizes[0], dtype=torch.int64) + base
        return (index % 251).to(dtype)
    assert len(sizes) == 2
    rows = torch.arange(offsets[0], offsets[0] + sizes[0], dtype=torch.int64)
    row_term = ((rows * global_shape[1] + base) % 251).to(torch.int16).view(-1, 1)
    col_term = (torch.arange(offsets[1], offsets[1] + sizes[1], dtype=torch.int64) % 251)
    values = row_term + col_term.to(torch.int16).view(1, -1)  # in [0, 500]
    values -= (values >= 251).to(torch.int16) * 251
    return values.to(dtype)


class Entry:
    """One tensor a rank holds: its box of the global tensor, sharded or replicated."""

    def __init__(self, key, global_shape, offsets, sizes, dtype, sharded):
        self.key, self.global_shape, self.offsets, self.sizes = key, global_shape, offsets, sizes
        self.dtype, self.sharded = dtype, sharded


def rank_entries(c, tp, dp, rank):
    """What rank `rank` holds under tp x dp (pp=1), as DCP can hold it; (entries, exact)."""
    t, d = rank % tp, rank // tp
    entries, exact = [], True
    for key, shape, split_dim in params(c):
        offsets, sizes = [0] * len(shape), list(shape)
        if split_dim >= 0:
            offsets[split_dim], sizes[split_dim] = split(shape[split_dim], tp, t)
        # The parameter: a TP shard (ShardedTensor), or whole on every rank (plain tensor).
        entries.append(Entry(key, shape, offsets, sizes, torch.bfloat16, tp > 1 and split_dim >= 0))
        # The moments: this DP rank's flat share of the TP shard. A block of leading-dim rows
        # of the TP box when the flat split falls on row boundaries.
        m_offsets, m_sizes = list(offsets), list(sizes)
        if dp > 1:
            row_elements = math.prod(sizes[1:])
            flat_begin, flat_size = split(math.prod(sizes), dp, d)
            row_begin, row_count = split(sizes[0], dp, d)
            exact &= (flat_begin, flat_size) == (row_begin * row_elements,
                                                 row_count * row_elements)
            m_offsets[0], m_sizes[0] = offsets[0] + row_begin, row_count
        moment_sharded = (tp > 1 and split_dim >= 0) or dp > 1
        for moment in ("exp_avg", "exp_avg_sq"):
            entries.append(Entry(f"optimizer.{moment}.{key}", shape, m_offsets, m_sizes,
                                 torch.float32, moment_sharded))
    return entries, exact


def build_state(entries, rank, fill):
    """The state dict of DCP: ShardedTensors for sharded entries, tensors for replicated ones."""
    state, held = {}, 0
    for e in entries:
        if fill:
            local = pattern(e.key, e.offsets, e.sizes, e.global_shape, e.dtype)
        else:
            local = torch.zeros(e.sizes, dtype=e.dtype)  # zeros: every page touched
        held += local.numel() * local.element_size()
        if e.sharded:
            shard = Shard.from_tensor_and_offsets(local, list(e.offsets), rank)
            state[e.key] = init_from_local_shards([shard], *e.global_shape)
        else:
            state[e.key] = local
    state["optimizer.step"] = STEP_VALUE if fill else b""
    return state, held


def check_state(state, entries):
    for e in entries:
        value = state[e.key]
        local = value.local_shards()[0].tensor if isinstance(value, ShardedTensor) else value
        if not torch.equal(local, pattern(e.key, e.offsets, e.sizes, e.global_shape, e.dtype)):
            raise RuntimeError(f"DCP load: '{e.key}' differs from the saved values")
    if state["optimizer.step"] != STEP_VALUE:
        raise RuntimeError("DCP load: 'optimizer.step' differs from the saved value")


class CountingReader(dcp.FileSystemReader):
    """FileSystemReader that counts what it reads: every read item torch.loads the whole saved
    item (header and all) and then narrows it, so it reads each item's full stored length."""

    bytes_read = 0

    def read_data(self, plan, planner):
        for item in plan.items:
            self.bytes_read += self.storage_data[item.storage_index].length
        return super().read_data(plan, planner)


# ---- one rank ---------------------------------------------------------------------------------

def syncfs(path):
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        libc.syncfs(fd)
    finally:
        os.close(fd)


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache():
    """Drops this machine's clean page-cache pages (root only); callers write back first."""
    with open(DROP_CACHES, "w") as f:
        f.write("1")


def worker(rank, o):
    dist.init_process_group("gloo", init_method="file://" + os.path.join(o["run_dir"], "store"),
                            rank=rank, world_size=o["ranks"])
    lead = rank == 0
    c = model_config(o["size"])
    r = o["ranks"]
    save_entries, _ = rank_entries(c, r, 1, rank)
    saved, save_held = build_state(save_entries, rank, fill=True)
    loaded, load_held = build_state(save_entries, rank, fill=False)
    reshard = None
    if o["reshard"]:
        reshard_entries, reshard_exact = rank_entries(c, 1, r, rank)
        resharded, reshard_held = build_state(reshard_entries, rank, fill=False)
        reshard_needed = len(STEP_VALUE) + sum(
            math.prod(e.sizes) * ELEMENT_SIZE[e.dtype] for e in reshard_entries)
        reshard = {"exact": reshard_exact, "held": reshard_held, "needed": reshard_needed}
    samples = {"save": [], "load": [], "reshard_load": []}
    reshard_read = 0

    def timed(name, fn):
        if lead and (o["flush"] or o["drop_caches"]):
            syncfs(o["run_dir"])
        if lead and o["drop_caches"] and name != "save":
            drop_page_cache()
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        if lead:
            samples[name].append(time.perf_counter() - start)

    file_bytes = 0
    for k in range(o["warmup"] + o["repeat"]):
        ckpt = os.path.join(o["run_dir"], f"ckpt-{k}")
        writer = dcp.FileSystemWriter(ckpt, single_file_per_rank=True, sync_files=o["sync"])
        timed("save", lambda: dcp.save_state_dict(saved, writer))
        if k == 0 and lead:
            file_bytes = sum(os.path.getsize(os.path.join(ckpt, n)) for n in os.listdir(ckpt))
        if not o["save_only"]:
            timed("load", lambda: dcp.load_state_dict(loaded, dcp.FileSystemReader(ckpt)))
            if k == 0 and o["check"]:
                check_state(loaded, save_entries)
        if reshard:
            reader = CountingReader(ckpt)
            timed("reshard_load", lambda: dcp.load_state_dict(resharded, reader))
            if k == 0:
                reshard_read = reader.bytes_read
                if o["check"]:
                    check_state(resharded, reshard_entries)
        dist.barrier()
        if lead:
            shutil.rmtree(ckpt, ignore_errors=True)

    # Per-rank figures, gathered to rank 0.
    mine = {
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "held": save_held + load_held + (reshard["held"] if reshard else 0),
        "save_held": save_held,
        "reshard_read": reshard_read,
        "reshard_needed": reshard["needed"] if reshard else 0,
        "reshard_exact": reshard["exact"] if reshard else True,
    }
    everyone = [None] * r
    dist.all_gather_object(everyone, mine)
    if lead:
        warmup = {name: v[:o["warmup"]] for name, v in samples.items()}
        samples = {name: v[o["warmup"]:] for name, v in samples.items()}
        best = {name: min(v) for name, v in samples.items() if v}
        out = {
            "peer": f"pytorch-dcp {torch.__version__}",
            "bytes": state_bytes(c),
            "file_bytes": file_bytes,
            "ranks": r,
            "sync": o["sync"],
            "repeat": o["repeat"],
            "save_layout": f"tp{r},dp1",
            "model": c,
            "save_seconds": best["save"],
            "load_seconds": best.get("load"),
            "save_gb_per_s": state_bytes(c) / best["save"] / 1e9,
            "load_gb_per_s": (sum(e["save_held"] for e in everyone) / best["load"] / 1e9
                              if "load" in best else None),
            "save_only": o["save_only"],
            "samples_seconds": samples,
            "warmup": o["warmup"],
            "warmup_samples_seconds": warmup,
            "peak_rss_bytes_per_rank": [e["peak_rss_bytes"] for e in everyone],
            "state_bytes_held": sum(e["held"] for e in everyone),
            "writer": f"FileSystemWriter(single_file_per_rank=True, sync_files={o['sync']})",
            "flush_between_phases": o["flush"],
            "checked": o["check"],
        }
        if reshard:
            read = sum(e["reshard_read"] for e in everyone)
            needed = sum(e["reshard_needed"] for e in everyone)
            out.update({
                "reshard_layout": f"tp1,dp{r}",
                "reshard_exact": all(e["reshard_exact"] for e in everyone),
                "reshard_load_seconds": best["reshard_load"],
                "reshard_bytes_read": read,
                "reshard_bytes_needed": needed,
                "reshard_bytes_read_over_needed": read / needed,
            })
        with open(os.path.join(o["run_dir"], "result.json"), "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="1GiB", help="state size, e.g. 256MiB, 1GiB")
    ap.add_argument("--sync", action="store_true", help="FileSystemWriter(sync_files=True)")
    ap.add_argument("--repeat", type=int, default=3, help="samples of each phase; best reported")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    ap.add_argument("--dir", default="/tmp", help="where the run's temporary directory goes")
    ap.add_argument("--no-reshard", action="store_true", help="skip the resharded load")
    ap.add_argument("--save-only", action="store_true", help="only the save (no loads)")
    ap.add_argument("--no-flush", action="store_true", help="no syncfs between phases")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every load, so loads read the disk (root)")
    ap.add_argument("--no-check", action="store_true", help="do not check loaded elements")
    ap.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = ap.parse_args()
    if args.ranks < 1 or args.repeat < 1 or args.warmup < 0:
        raise SystemExit("dcp_bench: --ranks and --repeat must be >= 1, --warmup >= 0")
    if args.drop_caches and not os.access(DROP_CACHES, os.W_OK):
        raise SystemExit(f"dcp_bench: --drop-caches: cannot write {DROP_CACHES} (it needs root)")
    run_dir = tempfile.mkdtemp(prefix="dcp-bench-", dir=args.dir)
    try:
        o = {"ranks": args.ranks, "size": parse_size(args.size), "sync": args.sync,
             "repeat": args.repeat, "warmup": args.warmup, "run_dir": run_dir,
             "reshard": not args.no_reshard and not args.save_only and args.ranks > 1,
             "save_only": args.save_only, "flush": not args.no_flush,
             "check": not args.no_check, "drop_caches": args.drop_caches}
        mp.spawn(worker, args=(o,), nprocs=args.ranks, join=True)
        with open(os.path.join(run_dir, "result.json")) as f:
            out = json.load(f)
        out["dir"] = run_dir + " (removed)"
        print(json.dumps(out, indent=2, sort_keys=True))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
