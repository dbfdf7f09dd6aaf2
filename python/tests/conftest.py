"""Shared helpers of the Python tests (run by ctest against the package installed into the
project's virtual environments; python/tests/CMakeLists.txt)."""

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time

import numpy as np
import pytest

# The `tessera` command-line tool of the same build (set by python/CMakeLists.txt).
CLI = os.environ.get("TESSERA_CLI") or shutil.which("tessera")


@contextlib.contextmanager
def moto_server():
    """Starts moto on loopback through tessera_moto_server (signing enforced, an IAM user and
    a bucket provisioned) and yields the variables that reach it: AWS_ACCESS_KEY_ID,
    AWS_SECRET_ACCESS_KEY, AWS_REGION, AWS_ENDPOINT_URL, TESSERA_TEST_BUCKET. A server that
    cannot start fails the test (never a skip)."""
    starter = os.environ.get("TESSERA_MOTO_SERVER")
    assert starter and os.path.exists(starter), (
        "TESSERA_MOTO_SERVER must name the tessera_moto_server program (ctest sets it; build "
        f"the target tessera_moto_server); got {starter!r}")
    work = tempfile.mkdtemp(prefix="tessera-s3-py-")
    env_file = os.path.join(work, "env")
    with open(os.path.join(work, "moto.log"), "w+") as log:
        server = subprocess.Popen([starter, env_file], stderr=log)
        try:
            deadline = time.monotonic() + 120
            while (not os.path.exists(env_file) and server.poll() is None
                   and time.monotonic() < deadline):
                time.sleep(0.1)
            if not os.path.exists(env_file):
                log.seek(0)
                pytest.fail(f"the S3 test server (moto) did not start: {log.read()}")
            with open(env_file) as f:
                yield dict(line.split("=", 1) for line in f.read().splitlines() if line)
        finally:
            server.terminate()
            server.wait(timeout=30)
            shutil.rmtree(work, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_bytes(value):
    """The bytes of a tensor or array, for bit-exact comparisons (NaNs included)."""
    if isinstance(value, np.ndarray):
        return value.tobytes()
    import torch
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return value.contiguous().view(ints[value.element_size()]).numpy().tobytes()


def rank_box(shape, rank, ranks, dim):
    """(offsets, sizes) of rank's slice of a tensor of `shape` split as evenly as possible
    along `dim` over `ranks` ranks (the whole tensor when it has no such dimension)."""
    offsets, sizes = [0] * len(shape), list(shape)
    if dim < len(shape):
        offsets[dim] = shape[dim] * rank // ranks
        sizes[dim] = shape[dim] * (rank + 1) // ranks - offsets[dim]
    return offsets, sizes


@pytest.fixture
def ckpt(tmp_path):
    """A path for a checkpoint directory (not created)."""
    return str(tmp_path / "ckpt")


@pytest.fixture
def cli():
    # Not a skip: python/tests/CMakeLists.txt sets TESSERA_CLI to the tool of the same build.
    assert CLI and os.path.exists(CLI), (
        f"the tessera command-line tool is not there (TESSERA_CLI={CLI!r}): build it "
        "(scripts/build) and run the tests through ctest, or set TESSERA_CLI")
    return CLI
