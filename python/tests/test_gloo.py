"""tessera over torch.distributed (gloo): two processes started by torch.multiprocessing."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port

FULL = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)


def worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        comm = tessera.torch_dist_comm()
        assert (comm.rank, comm.size) == (rank, size)

        # The collectives, as the library sees them.
        assert comm.all_gather(b"r" * rank) == [b"r" * r for r in range(size)]
        assert comm.broadcast(b"from 1" if rank == 1 else None, 1) == b"from 1"
        gathered = comm.gather(bytes([rank]) * 3, 0)
        assert gathered == ([bytes([r]) * 3 for r in range(size)] if rank == 0 else None)
        assert comm.all_reduce([rank, -rank], "min") == [0, -(size - 1)]
        comm.barrier()

        # Save: rows split over the ranks, a replicated bias, objects.
        half = FULL.shape[0] // size
        state = {"fc": {"weight": tessera.ShardedTensor(FULL[rank * half:(rank + 1) * half].clone(),
                                                        FULL.shape, (rank * half, 0)),
                        "bias": torch.ones(6, dtype=torch.bfloat16)},
                 "step": 42, "rng": {str(rank): tessera.ShardedObject(torch.get_rng_state())}}
        report = tessera.save(state, path, comm=comm)
        assert report.bytes_written > 0
        phases = (report.plan_seconds, report.write_seconds, report.commit_seconds)
        assert all(p >= 0 for p in phases) and report.write_seconds > 0, phases

        # Load under another layout: columns.
        cols = FULL.shape[1] // size
        local = torch.zeros(FULL.shape[0], cols)
        target = {"fc": {"weight": tessera.ShardedTensor(local, FULL.shape, (0, rank * cols)),
                         "bias": torch.zeros(6, dtype=torch.bfloat16)},
                  "step": None, "rng": {str(rank): tessera.ShardedObject(None)}}
        # Strict: every key of the checkpoint is asked for by some rank (each rank its own rng).
        report = tessera.load(target, path, comm=comm)
        # "auto" (the default) on a local filesystem: each rank reads for itself.
        assert report.read_sharing.name == "NONE" and report.job_bytes_exchanged == 0, report
        report = tessera.load(target, path, comm=comm, read_sharing="read_once")
        assert report.read_sharing.name == "READ_ONCE"
        assert torch.equal(local, FULL[:, rank * cols:(rank + 1) * cols])
        assert torch.equal(target["fc"]["bias"], torch.ones(6, dtype=torch.bfloat16))
        assert target["step"] == 42 and torch.is_tensor(target["rng"][str(rank)].value)
        assert report.unexpected_keys == [] and report.missing_keys == []
        # Read once per job: the checksum blocks both column slices touch are read
        # by one rank and sent to the other over gloo; the job reads the checkpoint once (and
        # each rank its own objects); ranks reading alone read more between them.
        assert report.job_bytes_exchanged > 0 and report.bytes_received > 0, report
        assert report.job_bytes_needed <= report.job_bytes_read, report
        assert report.job_bytes_read <= report.checkpoint_bytes + 64 * size, report
        each_alone = tessera.load(target, path, comm=comm, read_sharing="none")
        assert each_alone.job_bytes_read == 0 and each_alone.bytes_received == 0
        assert comm.all_reduce([each_alone.bytes_read], "sum")[0] > report.job_bytes_read
        assert torch.equal(local, FULL[:, rank * cols:(rank + 1) * cols])

        # Asynchronous: the caller's own collectives run while the save is in flight.
        handle = tessera.async_save(state, path + "_async", comm=comm, staging="deferred")
        x = torch.ones(1)
        dist.all_reduce(x)
        assert x.item() == size
        handle.wait_staged()
        handle.wait()

        # Bad input on one rank only: the other does not wait for it in a collective.
        w = torch.zeros(4, 4) if rank == 0 else torch.zeros(4, 4).t()
        try:
            tessera.save({"w": w}, path + "_bad", comm=comm)
        except ValueError as e:
            assert "not contiguous" in str(e) and (rank == 1 or "rank 1" in str(e)), e
        else:
            raise AssertionError("a save with a non-contiguous tensor succeeded")

        # An error on one rank fails the save on every rank, with the same message.
        bad = {"w": torch.zeros(2 + rank)}
        try:
            tessera.save(bad, path + "_bad", comm=comm)
        except ValueError as e:
            assert "global shape" in str(e), e
        else:
            raise AssertionError("a save with disagreeing shapes succeeded")

        # Without comm=, as torch.distributed.checkpoint: the default group, one checkpoint of
        # both ranks (not two one-rank checkpoints racing in one directory).
        tessera.save(state, path + "_default")
        handle = tessera.async_save(state, path + "_default_async")
        target["step"] = None
        tessera.load(target, path + "_default")
        assert target["step"] == 42
        handle.wait()
        # One rank alone only when asked for, explicitly.
        alone = tessera.single_rank_comm()
        tessera.save({"mine": torch.full((2,), float(rank))}, f"{path}_rank{rank}", comm=alone)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")
    for p in (path, path + "_async"):
        tessera.verify(p)
        loaded = tessera.load_all(p)
        assert torch.equal(loaded["fc"]["weight"], FULL)
        assert loaded["step"] == 42 and sorted(loaded["rng"]) == ["0", "1"]
        assert torch.is_tensor(loaded["rng"]["1"])
    assert tessera.read_metadata(path).num_ranks == 2
    for p in (path + "_default", path + "_default_async"):
        assert tessera.read_metadata(p).num_ranks == 2
        assert torch.equal(tessera.load_all(p)["fc"]["weight"], FULL)
    for rank in range(2):
        assert tessera.read_metadata(f"{path}_rank{rank}").num_ranks == 1
        assert torch.equal(tessera.load_all(f"{path}_rank{rank}")["mine"], torch.full((2,), rank))
    with pytest.raises(OSError):  # the failed save committed nothing
        tessera.read_metadata(path + "_bad")


def test_torch_dist_comm_needs_an_initialised_group():
    assert not dist.is_initialized()  # the workers' groups live in their own processes
    with pytest.raises(RuntimeError, match="init_process_group"):
        tessera.torch_dist_comm()
