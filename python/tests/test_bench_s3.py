"""The whole-checkpoint S3 benchmark (bench/peers/s3_harness.py, scripts/bench-s3) runs end to
end, small: 4 MiB, one round, 2 processes, every system and every phase, against moto through
its counting proxy. Every system the environment pins must run, every load must be verified bit
for bit, and the counters must add up: requests were counted, every save moved at least the
state's bytes to the server and every load at least the state's bytes back."""

import json
import os
import subprocess
import sys

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir,
                       "bench", "peers", "s3_harness.py")
SYSTEMS = ["tessera", "dcp_s3torchconnector", "dcp_msc", "raw"]


def test_every_system_saves_and_loads_on_moto_and_is_counted(tmp_path):
    out = tmp_path / "out.json"
    env = dict(os.environ)
    assert env.get("TESSERA_MOTO_SERVER"), "ctest sets TESSERA_MOTO_SERVER"
    done = subprocess.run(
        [sys.executable, HARNESS, "--size", "4MiB", "--rounds", "1", "--procs", "2",
         "--json", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"harness failed ({done.returncode}):\n{done.stderr[-6000:]}"
    result = json.loads(done.stdout)
    assert json.loads(out.read_text()) == result
    assert sorted(result["systems"]) == sorted(SYSTEMS)
    assert result["config"]["procs"] == 2 and result["config"]["rounds"] == 1
    assert 0.8 * 4 * 2**20 < result["config"]["state_bytes"] <= 4 * 2**20
    for name in SYSTEMS:
        system = result["systems"][name]
        assert system["available"], (name, system.get("reason"))
        phases = system["phases"]
        expected = ["save", "load"] + ([] if name == "raw" else ["reshard_load"])
        for phase in expected:
            p = phases[phase]
            assert p["best_seconds"] > 0, (name, phase)
            assert p["requests_per_gb"] > 0, (name, phase)
            assert p["server_bytes_per_state_byte"] >= 0.999, (name, phase, p)
            assert p["cpu_seconds_per_gb"] > 0, (name, phase)
            if phase != "save":
                assert p["verified"] is True, (name, phase)
