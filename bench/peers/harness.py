"""The peer benchmark: tessera and every current peer on the same state, in the same processes.

Every row of the peer comparison table (docs/PERFORMANCE.md) comes from here.

    scripts/bench-peers [--size 512MiB|2GiB|8GiB] [--procs 2|4] [--sync] [--rounds 5]
                        [--state megatron|transformers] [--systems raw,tessera,...]
                        [--phases save,load,reshard_load,async_save] [--dir /tmp]
                        [--launcher spawn|mpi] [--json PATH] [--table]

The state (harness_state.py): the Megatron-style workload of `tessera bench io` (BF16
parameters, F32 Adam moments, a small step object) or a transformers Llama model with its AdamW
state (FSDP2), as torch DTensors placed Shard(0) on a 1-D CPU DeviceMesh of --procs processes
(gloo over a FileStore in the run's directory). The systems (harness_systems.py, harness_patched.py): raw (os.pwrite
/ os.preadv of the bytes each rank holds, the baseline), tessera in its own format and in
format="torch_dist", PyTorch DCP, Megatron-Core dist_checkpointing, torch-checkpointing,
safetensors, and ByteCheckpoint (listed with the reason it cannot run).

Method. Every system runs in the same processes, on the same tensors. Each round runs every
system once, one block each, the order rotated by one system per round. A block: an untimed
write and delete of the bytes the rank holds (this VM returns freed memory to its host, and
the first write after runs several times slower), then the phases, each into or from a fresh
directory under the run's directory: save; load into the same layout; load into the
resharded layout (Shard(1) columns, or whole for 1-D tensors); each asynchronous save variant.
The block's directories are deleted after it. Before each phase, outside the timing, rank 0
calls syncfs() on the file system (what earlier phases left dirty is written back; --no-flush
leaves it, page-cache mode only); a phase is timed on rank 0 from a barrier before it to a
barrier after it. An asynchronous save's "call" is the time the call blocks each rank (the
slowest rank's per sample), its "committed" from the barrier before the call to the barrier
after the wait for the commit. In the first round every load is checked bit for bit against
what was saved (targets zeroed before), and each asynchronous checkpoint is loaded back
(untimed) and checked the same way; later rounds are not checked. The peak RSS of each rank
(VmHWM, reset through /proc/self/clear_refs at the start of each block; the largest over the
rounds) is reported per system with the RSS at the block's start: the processes are shared,
so it includes memory the allocator kept from earlier blocks, and a system may reuse it
without raising its peak; processes a system starts are not included. --rss-jobs adds, after
the run, one job per system (with raw, one round) whose whole-process peak (ru_maxrss, and that
of the writer processes it waited for) is that system's alone.

Modes: page cache (default: no fsync by any system that lets one choose) and --sync (each
system's own fsync option; the harness fdatasyncs the files, inside the timing, for a system
without one; see each system's notes).

Output: one JSON object on stdout (and in --json PATH), a markdown table on stderr (--table:
the table on stdout and the JSON only in --json). Any error of any system stops the run with a
nonzero exit status; a system or phase that cannot run here is listed with its reason.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import harness_report  # noqa: E402
from harness_state import BenchState, Layout, build_state, local_of, parse_size  # noqa: E402
from harness_patched import Megatron, TorchCheckpointing  # noqa: E402
from harness_systems import (ByteCheckpoint, Dcp, Raw, Safetensors, System, Tessera,  # noqa: E402
                             buffer_of, write_all)

# Every system the harness knows, by the name --systems takes.
SYSTEMS: dict[str, Callable[[bool], System]] = {
    "raw": Raw,
    "tessera": lambda sync: Tessera(sync, "tessera"),
    "tessera_torch_dist": lambda sync: Tessera(sync, "torch_dist"),
    "dcp": Dcp,
    "megatron": Megatron,
    "torch_checkpointing": TorchCheckpointing,
    "safetensors": Safetensors,
    "bytecheckpoint": ByteCheckpoint,
}

ALL_PHASES = ("save", "load", "reshard_load", "async_save")
# Their INFO/WARNING chatter (deprecations, O_DIRECT fall-backs, replicated plain tensors) is
# what each system's notes() already says; --verbose keeps it.
QUIET_LOGGERS = ("megatron", "torch_checkpointing")
VERSIONS = ("torch", "tessera", "megatron-core", "torch-checkpointing", "safetensors",
            "transformers", "numpy", "bytecheckpoint")


# ---- small helpers -----------------------------------------------------------------------------

def syncfs(path: str) -> None:
    """syncfs(2) of the file system holding `path`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            raise OSError(ctypes.get_errno(), "syncfs failed")
    finally:
        os.close(fd)


def proc_status(field: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M)
    return int(match.group(1)) * 1024 if match else 0


def reset_peak_rss() -> bool:
    """Resets this process's VmHWM to its current RSS (Linux 4.0+); False if it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def machine(directory: str) -> dict[str, Any]:
    """What the figures ran on."""
    out: dict[str, Any] = {"nproc": os.cpu_count(), "kernel": os.uname().release,
                           "cpu_model": "unknown", "mem_total_bytes": 0,
                           "dir_filesystem": "unknown"}
    with contextlib.suppress(OSError, AttributeError):
        out["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
            out["cpu_model"] = match.group(1).strip() if match else "unknown"
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            match = re.search(r"^MemTotal:\s+(\d+) kB", f.read(), re.M)
            out["mem_total_bytes"] = int(match.group(1)) * 1024 if match else 0
    with contextlib.suppress(OSError):
        real, best = os.path.realpath(directory), ""
        with open("/proc/mounts") as f:
            for line in f:
                device, mount, fstype = line.split()[:3]
                if (real == mount or real.startswith(mount.rstrip("/") + "/")) and \
                        len(mount) > len(best):
                    best, out["dir_filesystem"] = mount, f"{fstype} ({device} on {mount})"
    return out


def versions() -> dict[str, Any]:
    """Installed versions of the packages measured, and where tessera comes from."""
    out: dict[str, Any] = {"python": sys.version.split()[0]}
    for name in VERSIONS:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    spec = importlib.util.find_spec("tessera")
    out["tessera_location"] = os.path.dirname(spec.origin) if spec and spec.origin else None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "src",
                                "include", "python/tessera", "python/src"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        out["repository_commit"] = head + (" (library sources modified)" if dirty else "")
    return out


# ---- one rank --------------------------------------------------------------------------------

class Rank:
    """What one rank does: the rounds of blocks, timed; the results gathered to rank 0."""

    def __init__(self, cfg: dict[str, Any], state: BenchState, systems: list[System]) -> None:
        self.cfg, self.state, self.systems = cfg, state, systems
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.run_dir: str = cfg["run_dir"]
        self.results: dict[str, Any] = {}

    def fresh_dir(self, path: str) -> str:
        """An empty directory at `path` (made by rank 0; a barrier after)."""
        if self.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(path)
        dist.barrier()
        return path

    def timed(self, fn: Callable[[], Any]) -> float:
        """Seconds of fn() on rank 0 from a barrier to a barrier (syncfs before, untimed)."""
        if self.cfg["flush"] and self.rank == 0:
            syncfs(self.run_dir)
        dist.barrier()
        start = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - start

    def warm(self) -> None:
        """The untimed write and delete of the bytes this rank holds."""
        name = os.path.join(self.run_dir, f"warm-{self.rank}.bin")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            for leaf in self.state.leaves:
                data = buffer_of(local_of(leaf.saved))
                write_all(fd, data, offset)
                offset += len(data)
            if self.cfg["sync"]:
                os.fdatasync(fd)
        finally:
            os.close(fd)
        os.unlink(name)
        dist.barrier()

    def block(self, system: System, round_index: int) -> None:
        """One system's phases in one round."""
        r = self.results[system.name]
        phases, check = self.cfg["phases"], round_index == 0
        can_reset = reset_peak_rss()
        rss_start = proc_status("VmRSS")
        block_dir = os.path.join(self.run_dir, f"r{round_index}-{system.name}")
        self.warm()
        ckpt = self.fresh_dir(os.path.join(block_dir, "ckpt"))
        if {"save", "load", "reshard_load"} & set(phases):
            system.prepare("save", self.state)
            seconds = self.timed(lambda: system.save(self.state, ckpt))
            system.finish("save")
            if "save" in phases:
                r["phases"]["save"]["samples"].append(seconds)
                breakdown = getattr(system, "last_save_breakdown", None)
                if breakdown is not None:  # rank 0's phases (tessera's SaveReport)
                    r["phases"]["save"].setdefault("breakdown_samples", []).append(breakdown)
        loads: tuple[tuple[str, Layout], ...] = (("load", "load"), ("reshard_load", "reshard"))
        for phase, layout in loads:
            if phase not in phases or r["phases"][phase].get("reason"):
                continue
            loaded: list[dict[str, Any]] = []
            if check:
                self.state.zero(layout)
            system.prepare(phase, self.state)
            seconds = self.timed(lambda: loaded.append(system.load(self.state, ckpt, layout)))
            system.finish(phase)
            r["phases"][phase]["samples"].append(seconds)
            if check:
                self.state.check(loaded[0], layout, system.name)
                r["phases"][phase]["verified"] = True
        for variant, a in r["async_save"].items():
            if a.get("reason"):
                continue
            path = self.fresh_dir(os.path.join(block_dir, "async-" + variant.replace("=", "-")))
            system.prepare("async_save", self.state, variant)
            if self.cfg["flush"] and self.rank == 0:
                syncfs(self.run_dir)
            dist.barrier()
            start = time.perf_counter()
            wait = system.async_save(self.state, path, variant)
            call = time.perf_counter() - start
            wait()
            dist.barrier()
            committed = time.perf_counter() - start
            system.finish("async_save", variant)
            calls: list[Any] = [None] * self.world
            dist.all_gather_object(calls, call)
            a["call_seconds_per_rank"].append(calls)
            a["committed_samples"].append(committed)
            if check:  # the checkpoint it committed loads back, bit for bit
                self.state.zero("load")
                system.prepare("check", self.state)
                loaded_back = system.load(self.state, path, "load")
                system.finish("check")
                self.state.check(loaded_back, "load", f"{system.name} async {variant}")
                a["verified"] = True
        system.end_block()
        dist.barrier()
        if self.rank == 0:
            shutil.rmtree(block_dir, ignore_errors=True)
        r["rss_start"] = max(r["rss_start"], rss_start)
        if not can_reset or r["peak_rss"] is None:
            r["peak_rss"] = None  # a peak since the block's start cannot be told
        else:
            r["peak_rss"] = max(r["peak_rss"], proc_status("VmHWM"))

    def run(self) -> Optional[dict[str, Any]]:
        """Every round; returns the result on rank 0 (None elsewhere)."""
        available = []
        for system in self.systems:
            reasons: list[Any] = [None] * self.world
            dist.all_gather_object(reasons, system.unavailable())
            reason = next((x for x in reasons if x), None)
            entry: dict[str, Any] = {"role": system.role, "reason": reason,
                                     "config": {}, "notes": []}
            self.results[system.name] = entry
            if reason is not None:
                continue
            available.append(system)
            entry.update(config=system.config(), notes=system.notes(), rss_start=0, peak_rss=0)
            reshard = system.reshard_unavailable()
            entry["phases"] = {
                "save": {"samples": [], "verified": None},
                "load": {"samples": [], "verified": False},
                "reshard_load": ({"reason": reshard} if reshard else
                                 {"samples": [], "verified": False})}
            entry["phases"] = {k: v for k, v in entry["phases"].items()
                               if k in self.cfg["phases"]}
            entry["async_save"] = {}
            if "async_save" in self.cfg["phases"]:
                for variant, why in system.async_variants().items():
                    entry["async_save"][variant] = ({"reason": why} if why else {
                        "call_seconds_per_rank": [], "committed_samples": [],
                        "verified": False})
        order = []
        for round_index in range(self.cfg["rounds"]):
            shift = round_index % max(1, len(available))
            names = []
            for system in available[shift:] + available[:shift]:
                try:
                    self.block(system, round_index)
                except BaseException:
                    with open(os.path.join(self.run_dir, f"error-{self.rank}.txt"), "w") as f:
                        f.write(f"rank {self.rank}: {system.name}, round {round_index}:\n"
                                f"{traceback.format_exc()}")
                    raise
                names.append(system.name)
            order.append(names)
        for system in available:
            entry = self.results[system.name]
            for field, out in (("peak_rss", "peak_rss_bytes_per_rank"),
                               ("rss_start", "rss_at_block_start_bytes_per_rank")):
                values: list[Any] = [None] * self.world
                dist.all_gather_object(values, entry.pop(field))
                entry[out] = values if all(v is not None for v in values) else None
        sizes: list[Any] = [None] * self.world
        dist.all_gather_object(sizes, self.state.local_bytes())
        if self.rank != 0:
            return None
        return {"systems": self.results, "order": order, "state": self.state.description,
                "state_bytes": self.state.global_bytes(), "bytes_per_rank": sizes,
                "torch_num_threads": torch.get_num_threads()}


def run_rank(rank: int, world: int, cfg: dict[str, Any]) -> None:
    """The body of each process of the job."""
    if not cfg["verbose"]:
        warnings.simplefilter("ignore")
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
    dist.init_process_group("gloo", init_method="file://" + os.path.join(cfg["run_dir"], "store"),
                            rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    state = build_state(cfg["state"], cfg["size"], mesh)
    systems = [SYSTEMS[name](cfg["sync"]) for name in cfg["systems"]]
    try:
        result = Rank(cfg, state, systems).run()
    finally:
        for system in systems:
            system.close()
    # The whole process's peak (this job's), and that of its children waited for (writer
    # processes a system started and joined), after every system closed.
    peaks: list[Any] = [None] * world
    dist.all_gather_object(peaks, {
        "self": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "children": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024})
    if result is not None:
        result["process_peak_rss_bytes_per_rank"] = [p["self"] for p in peaks]
        result["children_peak_rss_bytes_per_rank"] = [p["children"] for p in peaks]
        with open(os.path.join(cfg["run_dir"], "result.json"), "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(cfg["run_dir"], f"done-{rank}"), "w"):
        pass


def spawned(rank: int, cfg: dict[str, Any]) -> None:
    """torch.multiprocessing's entry point."""
    run_rank(rank, cfg["procs"], cfg)


def mpi_worker(config_path: str) -> None:
    """The entry point of each process under mpirun: the rank from Open MPI's environment."""
    with open(config_path) as f:
        cfg = json.load(f)
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "-1")))
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "-1")))
    if rank < 0 or world != cfg["procs"]:
        raise SystemExit(f"harness: under mpirun, expected {cfg['procs']} ranks in "
                         "OMPI_COMM_WORLD_RANK/SIZE")
    run_rank(rank, world, cfg)


# ---- the job -----------------------------------------------------------------------------------

def launch(cfg: dict[str, Any]) -> list[str]:
    """Runs the job; returns the errors of processes that failed (empty when none did)."""
    if cfg["launcher"] == "spawn":
        import torch.multiprocessing as mp
        try:
            mp.start_processes(spawned, args=(cfg,), nprocs=cfg["procs"], join=True,
                               start_method="spawn")
        except Exception as e:  # ProcessRaisedException, ProcessExitedException
            return [f"{type(e).__name__}: {e}".strip()]
        return []
    config_path = os.path.join(cfg["run_dir"], "config.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        return ["--launcher mpi: no mpirun on PATH"]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [mpirun, "-np", str(cfg["procs"]), "--oversubscribe", "--bind-to", "none",
               sys.executable, os.path.abspath(__file__), "--mpi-worker", config_path]
    done = subprocess.run(command, env=env)
    return [] if done.returncode == 0 else [f"mpirun exited with status {done.returncode}"]


def run_job(cfg: dict[str, Any]) -> tuple[Optional[dict[str, Any]], list[str]]:
    """Runs one job in a new directory under cfg["dir"] (removed after); returns rank 0's
    result (None if the job failed) and the errors of processes that failed."""
    run_dir = tempfile.mkdtemp(prefix="tessera-peers-", dir=cfg["dir"])
    try:
        errors = launch(dict(cfg, run_dir=run_dir))
        result = None
        result_path = os.path.join(run_dir, "result.json")
        if os.path.exists(result_path):
            with open(result_path) as f:
                result = json.load(f)
        if not all(os.path.exists(os.path.join(run_dir, f"done-{r}"))
                   for r in range(cfg["procs"])):
            result = None  # a rank did not finish its work
        for name in sorted(os.listdir(run_dir)):
            if name.startswith("error-"):
                with open(os.path.join(run_dir, name)) as f:
                    errors.append(f.read())
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    return result, errors


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="512MiB", help="state size: 512MiB (default), 2GiB, 8GiB")
    ap.add_argument("--procs", type=int, default=2, choices=(2, 4, 8),
                    help="processes (ranks), 2 by default")
    ap.add_argument("--state", default="megatron", choices=("megatron", "transformers"))
    ap.add_argument("--sync", action="store_true",
                    help="durable saves: each system's fsync option (fdatasync by the harness "
                         "where a system has none)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (5 by default)")
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated subset of {','.join(SYSTEMS)} (raw is always added)")
    ap.add_argument("--phases", default=",".join(ALL_PHASES),
                    help=f"comma-separated subset of {','.join(ALL_PHASES)}")
    ap.add_argument("--dir", default="/tmp", help="where the run's directory is made (/tmp)")
    ap.add_argument("--launcher", default="spawn", choices=("spawn", "mpi"),
                    help="torch.multiprocessing spawn (default) or mpirun (env ranks)")
    ap.add_argument("--json", metavar="PATH", help="also write the JSON to PATH")
    ap.add_argument("--table", action="store_true",
                    help="print the markdown table on stdout (the JSON then only to --json)")
    ap.add_argument("--rss-jobs", action="store_true",
                    help="after the run, one more job per system (with raw, one round) whose "
                         "whole-process peak RSS is that system's alone")
    ap.add_argument("--no-flush", action="store_true",
                    help="no syncfs before each phase (page-cache mode only)")
    ap.add_argument("--timeout", type=int, default=1800, help="gloo timeout in seconds")
    ap.add_argument("--verbose", action="store_true",
                    help="keep the systems' Python warnings and log messages")
    ap.add_argument("--mpi-worker", metavar="CONFIG", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    systems = [s for s in args.systems.split(",") if s]
    phases = [p for p in args.phases.split(",") if p]
    unknown = [s for s in systems if s not in SYSTEMS] + [p for p in phases if p not in ALL_PHASES]
    if unknown:
        ap.error(f"unknown system or phase: {', '.join(unknown)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    try:
        args.size_bytes = parse_size(args.size)
    except ValueError as e:
        ap.error(str(e))
    if args.sync and args.no_flush:
        ap.error("--no-flush is for page-cache mode (with --sync every phase starts clean)")
    args.systems = ["raw"] + [s for s in SYSTEMS if s in systems and s != "raw"]
    args.phases = [p for p in ALL_PHASES if p in phases]
    return args


def main(argv: list[str]) -> int:
    """Runs the benchmark; returns the exit status."""
    args = parse_args(argv)
    if args.mpi_worker:
        mpi_worker(args.mpi_worker)
        return 0
    size = args.size_bytes
    cfg = {"size": size, "procs": args.procs, "state": args.state, "sync": args.sync,
           "rounds": args.rounds, "systems": args.systems, "phases": args.phases,
           "launcher": args.launcher, "flush": not args.no_flush, "dir": args.dir,
           "timeout": args.timeout, "verbose": args.verbose}
    # glibc serves blocks under its adaptive mmap threshold (up to 32 MiB) from the heap and
    # keeps them when freed: the copies a system makes per save (a stager's, a load's) would
    # stay resident for the rest of the run, and the machine's page cache would shrink block
    # after block (at 2 GiB, 9.5 GiB a rank and saves 2x slower for every system). A fixed
    # threshold of 1 MiB returns them to the kernel when freed. The same for every system.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before = [round(x, 2) for x in os.getloadavg()]
    info = machine(args.dir)
    begin = time.perf_counter()
    result, errors = run_job(cfg)
    if result is None:
        print("bench-peers: the run failed:\n" + "\n".join(errors), file=sys.stderr)
        return 1
    isolated: dict[str, Any] = {}
    if args.rss_jobs:
        ran = [n for n, s in result["systems"].items() if s["reason"] is None]
        for name in ran:
            job = dict(cfg, rounds=1, systems=["raw"] if name == "raw" else ["raw", name])
            job_result, job_errors = run_job(job)
            errors += job_errors
            if job_result is None:
                print(f"bench-peers: the --rss-jobs run of {name} failed:\n" +
                      "\n".join(job_errors), file=sys.stderr)
                return 1
            isolated[name] = {k: job_result[k] for k in ("process_peak_rss_bytes_per_rank",
                                                         "children_peak_rss_bytes_per_rank")}
    load_after = [round(x, 2) for x in os.getloadavg()]
    output: dict[str, Any] = {
        "harness": "bench/peers/harness.py",
        "command": shlex.join(["scripts/bench-peers"] + argv),
        "date": started, "wall_seconds": round(time.perf_counter() - begin, 1),
        "machine": info, "versions": versions(),
        "load_average": {"before": load_before, "after": load_after},
        "environment": {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                   "MALLOC_MMAP_THRESHOLD_")
                        if k in os.environ},
        "config": {"state": args.state, "size_requested": args.size, "size_bytes": size,
                   "state_bytes": result["state_bytes"], "bytes_per_rank": result["bytes_per_rank"],
                   "procs": args.procs, "launcher": args.launcher, "sync": args.sync,
                   "rounds": args.rounds, "phases": args.phases, "flush_between_phases":
                   cfg["flush"], "dir": args.dir, "torch_num_threads": result["torch_num_threads"],
                   "placement": "save Shard(0); load Shard(0); reshard_load Shard(1) (Replicate "
                                "for 1-D tensors); 1-D CPU DeviceMesh, gloo"},
        "state": result["state"], "order": result["order"],
        **harness_report.summarize(result),
        "process_peak_rss_bytes_per_rank": result["process_peak_rss_bytes_per_rank"],
        "children_peak_rss_bytes_per_rank": result["children_peak_rss_bytes_per_rank"],
        "isolated_peak_rss": isolated or None,
        # Errors after every rank finished its work (at interpreter exit): the figures stand,
        # but the run fails.
        "exit_errors": errors,
    }
    text = json.dumps(output, indent=2)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    table = harness_report.table(output)
    if args.table:
        print(table, end="")
    else:
        print(text)
        print(table, end="", file=sys.stderr)
    if errors:
        print("bench-peers: processes failed after the run finished:\n" + "\n".join(errors),
              file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
