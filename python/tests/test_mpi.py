"""tessera over MPI through mpi4py: two ranks started by mpirun."""

import os
import shutil
import subprocess
import sys

import numpy as np

import tessera

MPIEXEC = os.environ.get("TESSERA_MPIEXEC") or shutil.which("mpiexec")


def test_two_mpi_ranks(tmp_path):
    # The project's environment has Open MPI and mpi4py (scripts/setup): their absence fails.
    assert tessera.HAS_MPI, "this tessera was built without its MPI Comm (no MPI found)"
    assert MPIEXEC, "no mpiexec on PATH (scripts/setup installs Open MPI)"
    path = str(tmp_path / "ckpt")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1")
    worker = os.path.join(os.path.dirname(__file__), "mpi_worker.py")
    result = subprocess.run([MPIEXEC, "-n", "2", sys.executable, worker, path], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 0: ok" in result.stdout and "rank 1: ok" in result.stdout
    for p in (path, path + "_async"):
        loaded = tessera.load_all(p)
        assert np.array_equal(loaded["fc"]["weight"], np.arange(48, dtype=np.float32).reshape(8, 6))
        assert loaded["rng"] == {"0": {"rank": 0}, "1": {"rank": 1}}
        assert tessera.read_metadata(p).num_ranks == 2
