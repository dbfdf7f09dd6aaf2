"""Run by test_mpi.py under mpirun: every rank saves its rows, loads columns, saves async
(deferred staging)."""

import sys

import numpy as np
from mpi4py import MPI

import tessera

FULL = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)


def main(path):
    comm = tessera.mpi_comm(MPI.COMM_WORLD)
    rank, size = comm.rank, comm.size
    assert (rank, size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    half = FULL.shape[0] // size
    state = {"fc": {"weight": tessera.ShardedTensor(FULL[rank * half:(rank + 1) * half].copy(),
                                                    FULL.shape, (rank * half, 0)),
                    "bias": np.ones(6, np.float16)},
             "step": 42, "rng": {str(rank): tessera.ShardedObject({"rank": rank})}}
    tessera.save(state, path, comm=comm)

    cols = FULL.shape[1] // size
    local = np.zeros((FULL.shape[0], cols), np.float32)
    target = {"fc": {"weight": tessera.ShardedTensor(local, FULL.shape, (0, rank * cols)),
                     "bias": np.zeros(6, np.float16)},
              "step": None, "rng": {str(rank): tessera.ShardedObject(None)}}
    tessera.load(target, path, comm=comm)
    assert np.array_equal(local, FULL[:, rank * cols:(rank + 1) * cols])
    assert target["step"] == 42 and target["rng"][str(rank)].value == {"rank": rank}

    handle = tessera.async_save(state, path + "_async", comm=comm, staging="deferred",
                                check_unchanged_until_staged=True)
    MPI.COMM_WORLD.Barrier()  # the caller's MPI traffic while the copy and the save run
    handle.wait_staged()
    handle.wait()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
