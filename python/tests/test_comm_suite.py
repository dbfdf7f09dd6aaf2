"""The Comm conformance suite (include/tessera/testing/comm_cases.h) on the torch.distributed
Comm: the one case list that GoogleTest runs on the single-rank Comm, LocalComm and MPI, run
here through the extension's test hook (tessera._tessera._run_comm_case) on
tessera.torch_dist_comm over gloo, in 1, 2 and 3 processes.

Each world size starts its processes once; every rank runs every case its size allows, in the
list's order, each on a fresh gloo group, and logs what it found. Each case is then its own
pytest item, failing with the failures of every rank (or with the rank that never finished it).
A case that needs more ranks than a world size has is not collected for it, as the C++ runners
do not register it: nothing is skipped at run time.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port
from tessera import _tessera

#: Every case of the suite, (name, fewest ranks), in order. A build without the hook fails here,
#: at collection: the file errors out instead of passing with no cases.
CASES: List[Tuple[str, int]] = _tessera._comm_cases()

WORLD_SIZES = (1, 2, 3)

#: The torch.distributed Comm's trait (CommSuiteTraits): it exchanges a header of each call
#: before moving data (python/src/py_comm.cc), as MPI does, so an argument error found by one
#: rank or a mismatch between ranks is an InvalidArgument that every rank agrees on.
AGREED_ARGUMENT_ERRORS = True

#: The gloo timeout of each case's group: a case that fails by hanging fails after it.
CASE_TIMEOUT = datetime.timedelta(seconds=20)
#: The default group's, for the barrier before each case: longer than a case may hang, so that
#: ranks a failed case left apart meet again for the next one.
BETWEEN_CASES_TIMEOUT = datetime.timedelta(seconds=90)
#: How long the processes of one world size may take for the whole list.
RUN_DEADLINE = 180.0


def cases_for(size: int) -> List[str]:
    """The names of the cases a communicator of `size` ranks runs, in order."""
    return [name for name, min_ranks in CASES if size >= min_ranks]


def worker(rank: int, size: int, port: int, out_dir: str, names: List[str]) -> None:
    """One rank: runs every case of `names` on a fresh torch.distributed Comm each, logging
    to out_dir/rank<rank>.jsonl when it starts a case and what it found when it ends it."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=BETWEEN_CASES_TIMEOUT)
    try:
        with open(os.path.join(out_dir, f"rank{rank}.jsonl"), "w", buffering=1) as log:
            for name in names:
                dist.barrier()
                log.write(json.dumps({"case": name, "event": "start"}) + "\n")
                group = dist.new_group(backend="gloo", timeout=CASE_TIMEOUT)
                failure: Optional[str] = None
                try:
                    comm = tessera.torch_dist_comm(group)
                    _tessera._run_comm_case(comm, name,
                                            agreed_argument_errors=AGREED_ARGUMENT_ERRORS)
                except AssertionError as e:
                    failure = str(e)
                except Exception as e:  # noqa: BLE001 - reported as the case's failure
                    failure = f"{type(e).__name__}: {e}"
                finally:
                    comm = None  # the Comm goes before its group
                dist.destroy_process_group(group)
                log.write(json.dumps({"case": name, "event": "end", "failure": failure}) + "\n")
    finally:
        dist.destroy_process_group()


@dataclass
class SuiteRun:
    """What the processes of one world size did."""

    size: int
    started: List[List[str]] = field(default_factory=list)  # per rank, the cases begun
    ended: List[Dict[str, Optional[str]]] = field(default_factory=list)  # per rank: failure
    error: str = ""  # how the processes ended, when not all well


def run_suite(size: int, out_dir: Path) -> SuiteRun:
    """Starts `size` gloo processes that run every case for `size` ranks; returns their logs."""
    out_dir.mkdir(parents=True, exist_ok=True)
    context = mp.start_processes(worker, args=(size, free_port(), str(out_dir), cases_for(size)),
                                 nprocs=size, join=False, start_method="spawn")
    run = SuiteRun(size)
    deadline = time.monotonic() + RUN_DEADLINE
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                run.error = f"the processes did not finish within {RUN_DEADLINE:.0f} s"
                break
    except Exception as e:  # noqa: BLE001 - a rank died or raised: reported per case
        run.error = f"{type(e).__name__}: {e}"
        for process in context.processes:
            process.kill()
    for rank in range(size):
        started: List[str] = []
        ended: Dict[str, Optional[str]] = {}
        log = out_dir / f"rank{rank}.jsonl"
        for line in log.read_text().splitlines() if log.exists() else []:
            entry = json.loads(line)
            if entry["event"] == "start":
                started.append(entry["case"])
            else:
                ended[entry["case"]] = entry["failure"]
        run.started.append(started)
        run.ended.append(ended)
    return run


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], SuiteRun]:
    """The run of a world size, made on first use and shared by its cases."""
    runs: Dict[int, SuiteRun] = {}

    def get(size: int) -> SuiteRun:
        if size not in runs:
            runs[size] = run_suite(size, tmp_path_factory.mktemp(f"comm_suite_{size}"))
        return runs[size]

    return get


PARAMS = [(size, name) for size in WORLD_SIZES for name in cases_for(size)]


@pytest.mark.parametrize("size,name", PARAMS, ids=[f"{s}ranks-{n}" for s, n in PARAMS])
def test_case_on_torch_dist_comm(size: int, name: str,
                                 suite: Callable[[int], SuiteRun]) -> None:
    """One case of the suite on the torch.distributed Comm of `size` gloo processes."""
    run = suite(size)
    failures = []
    for rank in range(size):
        if name in run.ended[rank]:
            if run.ended[rank][name] is not None:
                failures.append(f"rank {rank}: {run.ended[rank][name]}")
        elif name in run.started[rank]:
            failures.append(f"rank {rank} began {name} and never finished it ({run.error})")
        else:
            failures.append(f"rank {rank} never began {name} ({run.error or 'no log'})")
    assert not failures, f"{name} on {size} torch.distributed ranks:\n" + "\n".join(failures)


@pytest.mark.parametrize("size", WORLD_SIZES)
def test_every_rank_ran_the_whole_list(size: int, suite: Callable[[int], SuiteRun]) -> None:
    """Every rank began every case for its size, in the list's order, and its processes ended
    well (a case that crashed or hung a process fails here too)."""
    run = suite(size)
    for rank in range(size):
        assert run.started[rank] == cases_for(size), f"rank {rank}: {run.error}"
    assert not run.error


def test_case_counts() -> None:
    """The list has cases for one, two and three ranks or more, and the world sizes above
    cover every case: none is left out of every size."""
    assert {min_ranks for _, min_ranks in CASES} == {1, 2, 3}
    assert cases_for(max(WORLD_SIZES)) == [name for name, _ in CASES]
    assert len(cases_for(1)) < len(cases_for(2)) < len(cases_for(3))


def test_hook_passes_on_local_comm() -> None:
    """The hook itself: every case for two ranks passes on LocalComm (the C++ runners' target,
    whose argument errors are reported by the rank that found them)."""
    # A fresh communicator per case, as the C++ runners make.
    for name in cases_for(2):
        tessera.run_local(2, lambda comm, n=name: _tessera._run_comm_case(
            comm, n, agreed_argument_errors=False), timeout=30)


def test_hook_reports_a_failing_case() -> None:
    """A case that fails raises AssertionError naming the case, the rank and the check:
    LocalComm declared with the wrong trait (only the rank that found an op mismatch returns
    InvalidArgument there, the others kAborted)."""
    with pytest.raises(AssertionError, match=r"AllReduceOpMismatchFailsEverywhere failed on "
                                             r"rank \d:\n  .*comm_cases\.h:\d+: invalid"):
        tessera.run_local(2, lambda comm: _tessera._run_comm_case(
            comm, "AllReduceOpMismatchFailsEverywhere", agreed_argument_errors=True), timeout=30)


def test_hook_refuses_unknown_cases_and_too_few_ranks() -> None:
    comm = tessera.single_rank_comm()
    with pytest.raises(ValueError, match="no Comm suite case named 'NoSuchCase'"):
        _tessera._run_comm_case(comm, "NoSuchCase", agreed_argument_errors=False)
    with pytest.raises(ValueError, match="needs 2 ranks or more, not 1"):
        _tessera._run_comm_case(comm, "DifferentRootsFailEverywhere",
                                agreed_argument_errors=False)
