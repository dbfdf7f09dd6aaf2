"""Processes that saved over gloo exit cleanly (issue 22, defect 13).

A process that saved over gloo sometimes aborted at exit with "terminate called without an
active exception" (torch then reported the job as failed). The core dump: gloo's worker thread
(pt_gloo_runloop) destroyed a completed collective's work after work.wait() had returned;
dropping its reference to a tensor tessera had made in Python took the GIL (torch 2.13 decrefs
the Python object whenever such a tensor's C++ refcount goes from 2 to 1); the interpreter had
begun to exit meanwhile, so the thread was ended by pthread_exit, whose unwinding reached a
noexcept frame: std::terminate. tessera now returns from a collective only once gloo released
its tensors (tessera/_torch_comm.py).

It is a race (the last collective of a save right before the exit): before the fix about 1 run
in 5 of test_resume's gloo worker aborted, and 1 process in 21 of a worker that trains a model
and calls tessera.torch.save_state. So each scenario runs 12 times, 3 at a time (the contention
widens the window), and any non-zero exit fails the test."""

import os
import subprocess
import sys
import textwrap

from conftest import free_port

RUNS = 12
AT_ONCE = 3

START = """
    import sys, datetime, threading
    import torch, torch.distributed as dist
    rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=datetime.timedelta(seconds=120))
    import tessera, tessera.torch
"""

# Collectives over 8 gloo groups from 8 threads, then an asynchronous save through
# tessera.megatron; the process exits without waiting (the interpreter waits for the save).
MEGATRON_ASYNC = START + """
    comms = [tessera.torch_dist_comm(dist.new_group(backend="gloo")) for _ in range(8)]

    def exchange(comm):
        for _ in range(3):
            comm.all_gather(b"x" * 100)

    threads = [threading.Thread(target=exchange, args=(c,)) for c in comms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    state = {"w": tessera.ShardedTensor(torch.full((4, 8), float(rank)), (8, 8), (4 * rank, 0)),
             "iteration": 3}
    tessera.megatron.save(state, path, async_sharded_save=True)  # waited for at exit
"""

# A model trained for a step (autograd, Adam) saved by tessera.torch.save_state over the default
# gloo group (replicas compared across the ranks); the process exits right after the save.
SAVE_STATE = START + """
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    tessera.torch.save_state(path, model=net, optimizer=optimizer, step=7)
"""


def start(script, path):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return [subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), str(rank), str(port),
                              path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
            for rank in range(2)]


def run_many(script, tmp_path):
    """Runs `script` on 2 processes RUNS times (AT_ONCE pairs at a time); fails on any process
    that exits with a non-zero status or prints std::terminate's message."""
    failures = []
    for first in range(0, RUNS, AT_ONCE):
        runs = [start(script, str(tmp_path / f"run{i}")) for i in range(first, first + AT_ONCE)]
        for i, processes in enumerate(runs, first):
            for rank, p in enumerate(processes):
                output = p.communicate(timeout=300)[0].decode(errors="replace")
                if p.returncode != 0 or "terminate called" in output:
                    failures.append(f"run {i} rank {rank}: exit code {p.returncode}\n{output}")
    assert not failures, f"{len(failures)} of {2 * RUNS} processes failed:\n" + "\n".join(
        failures)


def test_processes_that_saved_over_gloo_exit_cleanly(tmp_path):
    run_many(MEGATRON_ASYNC, tmp_path)
    import torch
    import tessera
    for i in range(RUNS):  # every save was committed before the exit
        w = tessera.megatron.load_plain_tensors(str(tmp_path / f"run{i}"))["w"]
        assert torch.equal(w, torch.cat([torch.zeros(4, 8), torch.ones(4, 8)]))


def test_processes_that_saved_a_trained_model_over_gloo_exit_cleanly(tmp_path):
    run_many(SAVE_STATE, tmp_path)
    import torch
    import tessera
    import tessera.torch
    for i in range(RUNS):
        net = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
        extra = tessera.torch.load_state(str(tmp_path / f"run{i}"), model=net,
                                         optimizer=optimizer)
        assert extra["step"] == 7
        assert optimizer.state_dict()["state"][0]["step"] == 1


class RecordingGroup:
    """Forwards every call to a process group and records the tensors handed to it."""

    def __init__(self, pg):
        self.pg = pg
        self.tensors = []

    def __getattr__(self, name):
        import torch
        method = getattr(self.pg, name)

        def record(value):
            if isinstance(value, torch.Tensor):
                self.tensors.append(value)
            elif isinstance(value, (list, tuple)):
                for item in value:
                    record(item)

        def call(*args):
            record(args)
            return method(*args)

        return call


def test_a_collective_returns_once_gloo_released_its_tensors():
    """The contract that makes the exit safe: when a collective of tessera's gloo Comm returned,
    nothing but Python references the tensors it handed to gloo (gloo's worker thread dropped
    its own, so it has nothing left that needs the GIL). Before the fix, gloo still held about
    100 of the 4200 tensors here when the call returned."""
    import datetime
    import torch.distributed as dist
    from tessera._torch_comm import TorchDistImpl
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                            world_size=1)
    try:
        group = RecordingGroup(dist.group.WORLD)
        impl = TorchDistImpl(group, 0, 1, None, datetime.timedelta(seconds=60))
        held = []
        for i in range(300):
            group.tensors.clear()
            assert impl.all_gather(b"abc") == [b"abc"]
            assert impl.broadcast(b"xyz", 0) == b"xyz"
            assert impl.all_reduce([1, 2], "sum") == [1, 2]
            assert impl.scatter([b"q"], 0) == b"q"
            assert impl.gather(b"g", 0) == [b"g"]
            assert len(group.tensors) >= 9
            held += [(i, t.shape) for t in group.tensors if t._use_count() > 1]
        assert not held, f"gloo still held {len(held)} tensors after the call returned " \
                         f"(iteration, shape): {held[:10]}"
    finally:
        dist.destroy_process_group()
