"""The peer benchmark (bench/peers/harness.py, scripts/bench-peers) runs end to end, small: 8
MiB, one round, 2 processes, every system and every phase. Every system the environment pins
(requirements/dev.txt) must run, and every load it makes (the resharded one where the system
can reshard, and a load of each asynchronous checkpoint) must be verified bit for bit; any
error of any system fails the test (the harness exits nonzero). ByteCheckpoint cannot run with
torch 2.13 and must be listed with its reason."""

import json
import os
import subprocess
import sys

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "bench", "peers", "harness.py")
RUNS = ["raw", "tessera", "tessera_torch_dist", "dcp", "megatron", "torch_checkpointing",
        "safetensors"]
CANNOT_RESHARD = {"raw", "safetensors"}
NO_ASYNC = {"raw", "safetensors"}


def test_every_system_saves_loads_and_is_verified(tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run(
        [sys.executable, HARNESS, "--size", "8MiB", "--rounds", "1", "--procs", "2",
         "--dir", str(tmp_path), "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=300)
    assert done.returncode == 0, f"harness failed ({done.returncode}):\n{done.stderr[-6000:]}"
    result = json.loads(done.stdout)
    assert json.loads(out.read_text()) == result
    assert result["exit_errors"] == []
    for key in ("command", "date", "machine", "versions", "load_average", "config", "state",
                "order", "systems", "fastest_peer"):
        assert key in result, key
    assert result["config"]["procs"] == 2 and result["config"]["rounds"] == 1
    assert result["config"]["phases"] == ["save", "load", "reshard_load", "async_save"]
    assert result["versions"]["torch-checkpointing"] == "0.1.1"
    assert sorted(result["order"][0]) == sorted(RUNS)
    assert 0.8 * 8 * 2**20 < result["config"]["state_bytes"] <= 8 * 2**20

    systems = result["systems"]
    assert sorted(systems) == sorted(RUNS + ["bytecheckpoint"])
    assert not systems["bytecheckpoint"]["available"]
    assert "torch<=2.5.0" in systems["bytecheckpoint"]["reason"]
    for name in RUNS:
        s = systems[name]
        assert s["available"], f"{name}: {s['reason']}"
        assert s["config"], name
        phases = s["phases"]
        for phase in ("save", "load"):
            assert len(phases[phase]["samples"]) == 1 and phases[phase]["median"] > 0, name
        assert phases["load"]["verified"] is True, name
        assert phases["save"]["over_raw"] > 0 and phases["load"]["over_raw"] > 0, name
        if name in CANNOT_RESHARD:
            assert phases["reshard_load"]["median"] is None and phases["reshard_load"]["reason"]
        else:
            assert phases["reshard_load"]["verified"] is True, name
            assert phases["reshard_load"]["over_fastest_peer"] > 0, name
        variants = s["async_save"]
        assert variants, name
        for variant, a in variants.items():
            if name in NO_ASYNC:
                assert a["committed"] is None and a["reason"], (name, variant)
                continue
            assert a["verified"] is True, (name, variant)
            assert a["committed"]["median"] > 0 and a["call"]["median"] > 0, (name, variant)
            assert len(a["call_seconds_per_rank"][0]) == 2, (name, variant)
        assert len(s["peak_rss_bytes_per_rank"]) == 2, name
    assert set(systems["tessera"]["async_save"]) == {"staging=blocking", "staging=deferred"}
    assert any("stubbed" in n for n in systems["megatron"]["notes"])
    for phase in ("save", "load", "reshard_load"):
        assert systems[result["fastest_peer"][phase]["system"]]["role"] == "peer", phase
    # The markdown table on stderr has a row for every system that ran.
    for name in RUNS:
        assert f"| {name} |" in done.stderr, name
