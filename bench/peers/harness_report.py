"""Statistics, ratios and the markdown table of bench/peers/harness.py.

summarize() turns the samples the ranks gathered into, per system and phase: samples, median,
min, max; the median over raw's median ("over_raw") and over the fastest peer's median
("over_fastest_peer", a peer being any system but raw and tessera's two). Asynchronous saves:
per variant the call (how long the caller is blocked; per sample the slowest rank's) and the
time to committed (barrier to barrier on rank 0, until the checkpoint is complete and, with
--sync, durable), each against raw's synchronous save and against the fastest peer's.
"""

from __future__ import annotations

import statistics
from typing import Any, Optional

PHASES = ("save", "load", "reshard_load")


def spread(samples: list[float]) -> dict[str, Any]:
    """samples, median, min, max of a list of seconds."""
    return {"samples": samples, "median": statistics.median(samples), "min": min(samples),
            "max": max(samples)}


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return None if a is None or b is None or b == 0 else a / b


def _median(entry: Any) -> Optional[float]:
    return entry.get("median") if isinstance(entry, dict) else None


def summarize(raw_result: dict[str, Any]) -> dict[str, Any]:
    """The "systems" and "fastest_peer" parts of the output from the ranks' result."""
    systems: dict[str, Any] = {}
    for name, r in raw_result["systems"].items():
        out: dict[str, Any] = {"available": r["reason"] is None, "reason": r["reason"],
                               "role": r["role"], "config": r["config"], "notes": r["notes"]}
        if r["reason"] is None:
            out["phases"] = {}
            for phase in PHASES:
                p = r["phases"].get(phase)
                if p is None:
                    continue
                if p.get("reason"):
                    out["phases"][phase] = {"median": None, "reason": p["reason"]}
                else:
                    out["phases"][phase] = {**spread(p["samples"]), "verified": p["verified"]}
                    if p.get("breakdown_samples"):  # seconds per phase of the call, medians
                        parts = p["breakdown_samples"]
                        out["phases"][phase]["breakdown_medians"] = {
                            k: statistics.median(s[k] for s in parts) for k in parts[0]}
            out["async_save"] = {}
            for variant, a in r.get("async_save", {}).items():
                if a.get("reason"):
                    out["async_save"][variant] = {"committed": None, "reason": a["reason"]}
                    continue
                calls = [max(per_rank) for per_rank in a["call_seconds_per_rank"]]
                out["async_save"][variant] = {
                    "call": spread(calls), "committed": spread(a["committed_samples"]),
                    "call_seconds_per_rank": a["call_seconds_per_rank"],
                    "verified": a["verified"]}
            out["peak_rss_bytes_per_rank"] = r["peak_rss_bytes_per_rank"]
            out["rss_at_block_start_bytes_per_rank"] = r["rss_at_block_start_bytes_per_rank"]
        systems[name] = out

    def is_peer(name: str) -> bool:
        return systems[name]["role"] == "peer" and systems[name]["available"]

    fastest: dict[str, Any] = {}
    for phase in PHASES:
        best: Optional[dict[str, Any]] = None
        for name in systems:
            m = _median(systems[name].get("phases", {}).get(phase))
            if is_peer(name) and m is not None and (best is None or m < best["median"]):
                best = {"system": name, "median": m}
        fastest[phase] = best
    for what in ("call", "committed"):
        best = None
        for name in systems:
            for variant, a in systems[name].get("async_save", {}).items():
                m = _median(a.get(what))
                if is_peer(name) and m is not None and (best is None or m < best["median"]):
                    best = {"system": name, "variant": variant, "median": m}
        fastest[f"async_{what}"] = best

    raw = systems.get("raw", {}).get("phases", {})
    for name, s in systems.items():
        for phase, p in s.get("phases", {}).items():
            p["over_raw"] = _ratio(p.get("median"), _median(raw.get(phase)))
            p["over_fastest_peer"] = _ratio(p.get("median"), (fastest[phase] or {}).get("median"))
        for a in s.get("async_save", {}).values():
            if a.get("committed") is None:
                continue
            a["committed_over_raw_save"] = _ratio(a["committed"]["median"],
                                                  _median(raw.get("save")))
            for what in ("call", "committed"):
                a[f"{what}_over_fastest_peer"] = _ratio(
                    a[what]["median"], (fastest[f"async_{what}"] or {}).get("median"))
    return {"systems": systems, "fastest_peer": fastest}


def _seconds(entry: Optional[dict[str, Any]]) -> str:
    if not entry:
        return "-"
    if entry.get("median") is None:
        return "n/a"
    return f"{entry['median']:.3f} [{entry['min']:.3f}-{entry['max']:.3f}]"


def _x(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(output: dict[str, Any]) -> str:
    """The markdown tables of an output: synchronous phases, then asynchronous saves, then the
    systems that did not run and the phases they could not, with the reasons."""
    c = output["config"]
    lines = [f"State {c['state']} {c['state_bytes'] / 2**20:.1f} MiB, {c['procs']} processes "
             f"({c['launcher']}), {'--sync (fdatasync)' if c['sync'] else 'page cache'}, "
             f"{c['rounds']} rounds; seconds: median [min-max]; x raw and x fastest peer are "
             "median / median.", ""]
    lines += ["| system | save | x raw | x peer | load | x raw | x peer | reshard load | "
              "x peer | peak RSS/rank MiB (at start) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    reasons: list[str] = []
    for name, s in output["systems"].items():
        if not s["available"]:
            reasons.append(f"- {name}: not run: {s['reason']}")
            continue
        ph = s["phases"]
        cells = [name]
        for phase in PHASES:
            p = ph.get(phase)
            cells.append(_seconds(p))
            if phase != "reshard_load":
                cells.append(_x(p.get("over_raw")) if p else "-")
            cells.append(_x(p.get("over_fastest_peer")) if p else "-")
            if p and p.get("reason"):
                reasons.append(f"- {name} {phase}: {p['reason']}")
        rss = s.get("peak_rss_bytes_per_rank") or []
        start = s.get("rss_at_block_start_bytes_per_rank") or []
        cells.append(f"{max(rss) / 2**20:.0f} ({max(start) / 2**20:.0f})" if rss and start
                     else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| system | async variant | call (blocked) | committed | committed x raw save "
              "| committed x fastest peer |", "|---|---|---|---|---|---|"]
    for name, s in output["systems"].items():
        for variant, a in (s.get("async_save") or {}).items():
            if a.get("committed") is None:
                reasons.append(f"- {name} async {variant}: {a['reason']}")
                continue
            lines.append(f"| {name} | {variant} | {_seconds(a['call'])} | "
                         f"{_seconds(a['committed'])} | {_x(a.get('committed_over_raw_save'))} "
                         f"| {_x(a.get('committed_over_fastest_peer'))} |")
    isolated = output.get("isolated_peak_rss")
    if isolated:
        lines += ["", "Peak RSS per rank of a job running the system alone (with raw, one "
                  "round; --rss-jobs), MiB, the largest rank; children: the largest writer "
                  "process it waited for (a forked one counts the pages it shares with its "
                  "parent):"]
        for name, r in isolated.items():
            lines.append(f"- {name}: {max(r['process_peak_rss_bytes_per_rank']) / 2**20:.0f}"
                         f" (children {max(r['children_peak_rss_bytes_per_rank']) / 2**20:.0f})")
    fp = output.get("fastest_peer") or {}
    lines += ["", "Fastest peer: " + ", ".join(
        f"{k} {v['system']}{'/' + v['variant'] if 'variant' in v else ''}"
        for k, v in fp.items() if v)]
    if reasons:
        lines += ["", "Not measured:"] + reasons
    m = output["machine"]
    lines += ["", f"Machine: {m['cpu_model']}, {m['nproc']} CPUs, "
              f"{m['mem_total_bytes'] / 2**30:.1f} GiB, kernel {m['kernel']}, --dir on "
              f"{m['dir_filesystem']}; load average before {output['load_average']['before']} "
              f"after {output['load_average']['after']}"]
    return "\n".join(lines) + "\n"
