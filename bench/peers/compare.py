#!/usr/bin/python3
"""tessera against PyTorch DCP on the same state, rank count and fsync policy.

Runs `tessera bench io` and bench/peers/dcp_bench.py alternately (tessera, dcp, tessera, dcp,
... for --rounds rounds), each run with --warmup untimed repeats then --repeat timed ones, and
prints one JSON object with both sides' best times over every timed sample of every round and
the ratios:

  dcp_save_over_tessera_save   DCP's best save time / tessera's (3.0: tessera 3x faster)
  dcp_load_over_tessera_load   the same for a load under the save layout
  dcp_reshard_load_over_tessera_reshard_load   for a load under tp1,dp<R> (when both ran it)
  tessera_save_over_raw, tessera_load_over_raw   tessera against raw pwrite/pread of the same
                               bytes, measured inside the same `tessera bench io` runs
  dcp_save_over_best_raw_write, dcp_load_over_raw_read   DCP against those raw baselines (the
                               fastest raw write: with --sync, also the streamed one): the
                               ceiling of any library's ratio to DCP on this machine

    /usr/bin/python3 bench/peers/compare.py --ranks 2 --size 1GiB [--sync]

--format torch_dist: tessera writes a PyTorch DCP checkpoint (the format DCP writes: torch.save
items and a .metadata pickle) instead of its own, so dcp_save_over_tessera_save compares two
writers of the same format. With --save-only (needed for torch_dist until tessera reads DCP)
both sides only save, and the output holds the save figures alone:

    /usr/bin/python3 bench/peers/compare.py --format torch_dist --save-only [--sync]

Only the standard library is needed here; dcp_bench.py runs under /usr/bin/python3 (torch).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def find_tessera():
    for build in ("build", "build-bench"):
        path = os.path.join(ROOT, build, "tessera")
        if os.access(path, os.X_OK):
            return path
    raise SystemExit("compare: no tessera binary in build/ or build-bench/; build tessera_cli "
                     "or pass --tessera")


def run_json(command):
    print("compare: " + " ".join(shlex.quote(c) for c in command), file=sys.stderr)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if done.returncode != 0:
        raise SystemExit(f"compare: command failed with exit code {done.returncode}")
    return json.loads(done.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--sync", action="store_true", help="fdatasync every file (both sides)")
    ap.add_argument("--drop-caches", action="store_true",
                    help="drop the page cache before every load (both sides; root): loads "
                         "read the disk")
    ap.add_argument("--rounds", type=int, default=3, help="tessera, dcp alternations")
    ap.add_argument("--repeat", type=int, default=1, help="timed samples per phase in each run")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first in each run")
    ap.add_argument("--io-threads", type=int, default=2, help="tessera I/O threads per rank")
    ap.add_argument("--dir", default="/tmp", help="where both sides' temporary directories go")
    ap.add_argument("--tessera", default=None,
                    help="the tessera binary (default: build/tessera, else build-bench/tessera)")
    ap.add_argument("--python", default="/usr/bin/python3", help="interpreter with torch 1.13")
    ap.add_argument("--format", choices=("tessera", "torch_dist"), default="tessera",
                    help="what tessera writes: its own format, or PyTorch DCP (torch_dist, the "
                         "format DCP writes too); torch_dist loads need tessera's DCP reader")
    ap.add_argument("--torch-dist-flavor", choices=("2.x", "1.13"), default="2.x",
                    help="class paths of tessera's torch_dist .metadata")
    ap.add_argument("--save-only", action="store_true",
                    help="time the saves only (both sides): no load phases, save ratios only")
    ap.add_argument("--json", action="store_true", help="print JSON (the only output format)")
    args = ap.parse_args()

    common = ["--ranks", str(args.ranks), "--size", args.size, "--repeat", str(args.repeat),
              "--warmup", str(args.warmup), "--dir", args.dir] + (["--sync"] if args.sync else []) + \
        (["--drop-caches"] if args.drop_caches else [])
    only = ["--save-only"] if args.save_only else []
    tessera_cmd = [args.tessera or find_tessera(), "bench", "io", "--io-threads",
                   str(args.io_threads), "--format", args.format, "--torch-dist-flavor",
                   args.torch_dist_flavor, "--json"] + common + only
    dcp_cmd = [args.python, os.path.join(HERE, "dcp_bench.py"), "--json"] + common + only

    tessera_runs, dcp_runs = [], []
    for _ in range(args.rounds):
        tessera_runs.append(run_json(tessera_cmd))
        dcp_runs.append(run_json(dcp_cmd))

    def samples(runs, phase):
        return [s for r in runs for s in r["samples_seconds"].get(phase, [])]

    def best(runs, phase):
        values = samples(runs, phase)
        return min(values) if values else None

    t = {p: best(tessera_runs, p)
         for p in ("save", "load", "reshard_load", "raw_write", "raw_write_streamed", "raw_read")}
    best_raw_write = min(v for v in (t["raw_write"], t["raw_write_streamed"]) if v is not None)
    d = {p: best(dcp_runs, p) for p in ("save", "load", "reshard_load")}
    first_t, first_d = tessera_runs[0], dcp_runs[0]
    if first_t["bytes"] != first_d["bytes"]:
        print(f"compare: warning: tessera saves {first_t['bytes']} bytes, DCP "
              f"{first_d['bytes']}", file=sys.stderr)
    if args.save_only:
        out = save_comparison(args, tessera_runs, dcp_runs, t, d, best_raw_write,
                              tessera_cmd, dcp_cmd)
        print(json.dumps(out, indent=2))
        return
    out = {
        "format": args.format,
        "bytes": first_t["bytes"],
        "ranks": args.ranks,
        "sync": args.sync,
        "drop_caches": args.drop_caches,
        "rounds": args.rounds,
        "repeat_per_run": args.repeat,
        "warmup_per_run": args.warmup,
        "order": "tessera, dcp, alternating, each a fresh process",
        "tessera": {
            "save_seconds": t["save"],
            "load_seconds": t["load"],
            "reshard_load_seconds": t["reshard_load"],
            "raw_write_seconds": t["raw_write"],
            "raw_write_streamed_seconds": t["raw_write_streamed"],
            "raw_read_seconds": t["raw_read"],
            "save_over_raw": t["raw_write"] / t["save"],
            "load_over_raw": t["raw_read"] / t["load"],
            "save_over_raw_per_run": [r["save_over_raw"] for r in tessera_runs],
            "load_over_raw_per_run": [r["load_over_raw"] for r in tessera_runs],
            "reshard_layout": first_t["reshard_layout"],
            "reshard_bytes_read_over_needed": first_t["reshard_bytes_read_over_needed"],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in tessera_runs),
            "state_bytes_held": first_t["state_bytes_held"],
            "samples_seconds": {p: samples(tessera_runs, p) for p in t},
            "command": " ".join(shlex.quote(c) for c in tessera_cmd),
        },
        "dcp": {
            "peer": first_d["peer"],
            "save_seconds": d["save"],
            "load_seconds": d["load"],
            "reshard_load_seconds": d["reshard_load"],
            "reshard_layout": first_d.get("reshard_layout"),
            "reshard_bytes_read_over_needed": first_d.get("reshard_bytes_read_over_needed"),
            "file_bytes": first_d["file_bytes"],
            "peak_rss_bytes_per_rank": max((r["peak_rss_bytes_per_rank"] for r in dcp_runs),
                                           key=max),
            "state_bytes_held": first_d["state_bytes_held"],
            "samples_seconds": {p: samples(dcp_runs, p) for p in d},
            "command": " ".join(shlex.quote(c) for c in dcp_cmd),
        },
        "dcp_save_over_tessera_save": d["save"] / t["save"],
        "dcp_load_over_tessera_load": d["load"] / t["load"],
        "tessera_save_over_raw": t["raw_write"] / t["save"],
        "tessera_load_over_raw": t["raw_read"] / t["load"],
        "dcp_save_over_best_raw_write": d["save"] / best_raw_write,
        "dcp_load_over_raw_read": d["load"] / t["raw_read"],
    }
    if d["reshard_load"] and t["reshard_load"] and \
            first_d.get("reshard_layout") == first_t["reshard_layout"]:
        out["dcp_reshard_load_over_tessera_reshard_load"] = d["reshard_load"] / t["reshard_load"]
    print(json.dumps(out, indent=2))


def save_comparison(args, tessera_runs, dcp_runs, t, d, best_raw_write, tessera_cmd, dcp_cmd):
    """The figures of a --save-only comparison: saves and raw writes only."""
    first_t, first_d = tessera_runs[0], dcp_runs[0]
    return {
        "format": args.format,
        "torch_dist_flavor": args.torch_dist_flavor if args.format == "torch_dist" else None,
        "bytes": first_t["bytes"],
        "ranks": args.ranks,
        "sync": args.sync,
        "rounds": args.rounds,
        "repeat_per_run": args.repeat,
        "warmup_per_run": args.warmup,
        "order": "tessera, dcp, alternating, each a fresh process",
        "tessera": {
            "save_seconds": t["save"],
            "raw_write_seconds": t["raw_write"],
            "raw_write_streamed_seconds": t["raw_write_streamed"],
            "save_over_raw": t["raw_write"] / t["save"],
            "save_over_raw_per_run": [r["save_over_raw"] for r in tessera_runs],
            "peak_rss_bytes": max(r["peak_rss_bytes"] for r in tessera_runs),
            "samples_seconds": {p: [s for r in tessera_runs for s in
                                    r["samples_seconds"].get(p, [])]
                                for p in ("save", "raw_write", "raw_write_streamed")},
            "command": " ".join(shlex.quote(c) for c in tessera_cmd),
        },
        "dcp": {
            "peer": first_d["peer"],
            "writer": first_d["writer"],
            "save_seconds": d["save"],
            "file_bytes": first_d["file_bytes"],
            "samples_seconds": [s for r in dcp_runs for s in r["samples_seconds"]["save"]],
            "command": " ".join(shlex.quote(c) for c in dcp_cmd),
        },
        "dcp_save_over_tessera_save": d["save"] / t["save"],
        "tessera_save_over_raw": t["raw_write"] / t["save"],
        "dcp_save_over_best_raw_write": d["save"] / best_raw_write,
    }


if __name__ == "__main__":
    main()
