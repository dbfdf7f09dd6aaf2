#!/usr/bin/env python3
"""What a background save costs the training loop: the step time of a compute loop while an
asynchronous save runs behind it, against the same loop with no save, in the same processes.

    .venv/bin/python bench/peers/async_overlap.py --procs 2 --size 512MiB --rounds 5 \\
        [--systems tessera,tessera_nice0,tessera_blocking,dcp] [--sync] [--json out.json]

Each of --procs gloo processes holds its shard (Shard(0) DTensors) of the Megatron-style state
of bench/peers/dcp_bench.py (BF16 parameters, F32 Adam moments) and runs a loop of steps; a
step is --matmuls products of two 512 x 512 F32 matrices on one intra-op thread per process
(so that the processes' compute fills the cores, as training does), then, in the step that
started a save, the wait a training loop makes before its optimizer step (wait_staged() for
tessera's deferred staging; nothing more for the others, whose call returns once staged).

Per system and round, after --warmup steps: --steps steps with no save (the baseline), then a
save started at the top of a step, and steps until it is committed (rank 0 polls; every rank
agrees at each step boundary by an all-reduce, which the baseline steps make too). Reported per
system, medians over the rounds and their spread: the call (seconds the caller's thread was
blocked), the time to committed, the median step time during the save over the baseline's
(slowdown: 0.10 is 10% slower steps), and the extra seconds the loop lost over the save
(sum of step times during the save minus as many baseline steps).

Systems:
  tessera           tessera.async_save(staging="deferred"), background_nice=10 (the default)
  tessera_nice0     the same at the caller's priority (background_nice=0)
  tessera_nice19    the same at the lowest priority (background_nice=19)
  tessera_blocking  tessera.async_save(staging="blocking")
  dcp               torch.distributed.checkpoint.async_save (torch 2.13, its default stager
                    and thread executor; FileSystemWriter(sync_files=--sync)) over a gloo
                    group of its own (its background collectives would otherwise meet the
                    loop's all-reduces on the default group and hang)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
SYSTEMS = ("tessera", "tessera_nice0", "tessera_nice19", "tessera_blocking", "dcp")


def parse_size(text: str) -> int:
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    for unit, factor in units.items():
        if text.endswith(unit):
            return int(float(text[:-len(unit)]) * factor)
    return int(text)


def megatron_shapes(size: int) -> Dict[str, Tuple[int, ...]]:
    """The parameter shapes of dcp_bench.py's state for `size` bytes (ModelConfig::ForBytes)."""
    h = int((size / 10 / (12 * 4 + 4)) ** 0.5)
    h -= h % 4
    shapes: Dict[str, Tuple[int, ...]] = {"embedding.word_embeddings.weight": (4 * h, h)}
    for layer in range(4):
        p = f"decoder.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attention.linear_qkv.weight"] = (3 * h, h)
        shapes[p + "self_attention.linear_proj.weight"] = (h, h)
        shapes[p + "mlp.linear_fc1.weight"] = (4 * h, h)
        shapes[p + "mlp.linear_fc2.weight"] = (h, 4 * h)
    return shapes


def build_state(size: int, mesh: Any) -> Dict[str, Any]:
    """This rank's DTensors: rows split over the mesh (Shard(0)); 1-D norms replicated."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    world, rank = mesh.size(), mesh.get_local_rank()

    def dtensor(shape: Tuple[int, ...], dtype: torch.dtype, fill: float) -> Any:
        if len(shape) == 1:
            return DTensor.from_local(torch.full(shape, fill, dtype=dtype), mesh, [Replicate()],
                                      run_check=False)
        rows = shape[0] // world
        local = torch.full((rows,) + shape[1:], fill + rank, dtype=dtype)
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    state: Dict[str, Any] = {"model": {}, "optimizer": {"exp_avg": {}, "exp_avg_sq": {}}}
    for i, (key, shape) in enumerate(megatron_shapes(size).items()):
        state["model"][key] = dtensor(shape, torch.bfloat16, i)
        state["optimizer"]["exp_avg"][key] = dtensor(shape, torch.float32, i + 0.5)
        state["optimizer"]["exp_avg_sq"][key] = dtensor(shape, torch.float32, i + 0.25)
    state["step"] = 1000
    return state


class Loop:
    """The compute of one step, and a step-boundary all-reduce every rank makes."""

    def __init__(self, matmuls: int) -> None:
        self.a = torch.randn(512, 512)
        self.b = torch.randn(512, 512)
        self.matmuls = matmuls
        self.flag = torch.zeros(1)

    def compute(self) -> None:
        c = self.a
        for _ in range(self.matmuls):
            c = torch.mm(c, self.b)
            c.mul_(1e-3)

    def all_done(self, done: bool) -> bool:
        self.flag[0] = 1.0 if done else 0.0
        dist.all_reduce(self.flag, op=dist.ReduceOp.MIN)
        return bool(self.flag[0] > 0)


_dcp_group: List[Any] = []


def dcp_group() -> Any:
    """A gloo group for DCP's asynchronous saves, made once (collectively, on first use)."""
    if not _dcp_group:
        _dcp_group.append(dist.new_group(backend="gloo"))
    return _dcp_group[0]


def start_save(system: str, state: Dict[str, Any], path: str, sync: bool,
               comm: Any) -> Tuple[Callable[[], None], Callable[[], bool], Callable[[], None]]:
    """Starts a save; returns (before_optimizer_step, done, wait)."""
    if system.startswith("tessera"):
        import tessera
        staging = "blocking" if system == "tessera_blocking" else "deferred"
        nice = {"tessera_nice0": 0, "tessera_nice19": 19}.get(system, 10)
        h = tessera.async_save(state, path, comm=comm, staging=staging, sync=sync,
                               background_nice=nice)
        return h.wait_staged, h.done, lambda: (h.wait(), None)[1]
    import torch.distributed.checkpoint as dcp
    # A group of its own, as torch's documentation advises: DCP's background thread runs
    # collectives, which must not meet the training loop's on the default group.
    future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, sync_files=sync),
                            process_group=dcp_group())
    return (lambda: None), future.done, lambda: (future.result(), None)[1]


def one_round(system: str, state: Dict[str, Any], loop: Loop, args: argparse.Namespace,
              root: str, index: int, comm: Any) -> Dict[str, float]:
    rank = dist.get_rank()
    baseline: List[float] = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loop.compute()
        loop.all_done(True)
        baseline.append(time.perf_counter() - t)
    path = os.path.join(root, f"{system}-{index}")
    during: List[float] = []
    t0 = time.perf_counter()
    before_step, done, wait = start_save(system, state, path, args.sync, comm)
    call = time.perf_counter() - t0
    loop.compute()
    before_step()
    finished = loop.all_done(done())
    during.append(time.perf_counter() - t0)
    while not finished:
        t = time.perf_counter()
        loop.compute()
        finished = loop.all_done(done())
        during.append(time.perf_counter() - t)
    wait()
    committed = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    base = statistics.median(baseline)
    return {"call_seconds": call, "committed_seconds": committed,
            "baseline_step_seconds": base, "save_step_seconds": statistics.median(during),
            "slowdown": statistics.median(during) / base - 1.0,
            "lost_seconds": sum(during) - base * len(during), "steps_during_save": len(during)}


def worker(rank: int, args: argparse.Namespace, root: str, port: int,
           out: "mp.SimpleQueue[Any]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.procs)
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (args.procs,))
    state = build_state(parse_size(args.size), mesh)
    loop = Loop(args.matmuls)
    import tessera
    comm = tessera.torch_dist_comm()
    systems = args.systems.split(",")
    for _ in range(args.warmup):  # first writes on this VM are slow; the comms get split
        for system in systems:
            one_round(system, state, loop, args, root, -1, comm)
    results: Dict[str, List[Dict[str, float]]] = {s: [] for s in systems}
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[:r % len(systems)]
        for system in order:
            results[system].append(one_round(system, state, loop, args, root, r, comm))
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def summarize(rounds: List[Dict[str, float]]) -> Dict[str, Any]:
    summary: Dict[str, Any] = {}
    for field in rounds[0]:
        values = [r[field] for r in rounds]
        summary[field] = {"median": statistics.median(values), "min": min(values),
                          "max": max(values), "samples": values}
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--size", default="512MiB", help="the whole state, e.g. 512MiB, 2GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds of every system")
    ap.add_argument("--steps", type=int, default=10, help="baseline steps before each save")
    ap.add_argument("--matmuls", type=int, default=20, help="512x512 products per step")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--sync", action="store_true", help="fdatasync every file (both sides)")
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--json", default=None, help="also write the JSON here")
    args = ap.parse_args()
    for system in args.systems.split(","):
        if system not in SYSTEMS:
            raise SystemExit(f"async_overlap: unknown system {system!r}: one of {SYSTEMS}")
    root = tempfile.mkdtemp(prefix="tessera-overlap-", dir=args.dir)
    load_before = os.getloadavg()
    try:
        ctx = mp.get_context("spawn")
        out = ctx.SimpleQueue()
        port = 29000 + os.getpid() % 1000
        mp.spawn(worker, args=(args, root, port, out), nprocs=args.procs)
        results = out.get()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {
        "command": " ".join([sys.executable] + sys.argv),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(), "procs": args.procs, "size": args.size, "sync": args.sync,
        "matmuls_per_step": args.matmuls, "rounds": args.rounds,
        "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
        "torch": torch.__version__,
        "systems": {s: summarize(r) for s, r in results.items()},
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
