"""Shared helpers of the Python tests (run by ctest against the package installed into the
project's virtual environments; python/tests/CMakeLists.txt)."""

import os
import shutil
import socket

import numpy as np
import pytest

# The `tessera` command-line tool of the same build (set by python/CMakeLists.txt).
CLI = os.environ.get("TESSERA_CLI") or shutil.which("tessera")


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
