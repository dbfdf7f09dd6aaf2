"""tessera.save(format="torch_dist"): PyTorch DCP checkpoints that torch 1.13's own
torch.distributed._shard.checkpoint.load_state_dict reads, on one process and over two gloo
processes into ShardedTensors of another layout; the torch 2.x flavour through the stand-in
classes of src/format/torch_dist/testdata/dcp2_standins.py."""

import datetime
import os
import pickle
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_compat  # noqa: F401 (torch 1.13 on Python 3.11: makes _shard importable)
import tessera
from conftest import free_port

from torch.distributed._shard import checkpoint as dcp  # noqa: E402

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(SOURCE, "src", "checkpoint", "testdata"))
import load_dcp_with_torch  # noqa: E402 (torch 1.13 reader for either flavour)

ROWS, COLS = 6, 4
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def state():
    return {
        "model": {"weight": FULL.clone(),
                  "bias": torch.arange(5, dtype=torch.bfloat16),
                  "mask": torch.tensor([True, False, True]),
                  "count": torch.tensor(7, dtype=torch.int64),
                  "table": np.arange(6, dtype=np.int32).reshape(2, 3)},
        "optimizer": {"step": 12, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "blob": b"\x00\xffraw",
    }


def empty_like_flat():
    """What torch's DCP load fills: flat keys, zero tensors, placeholders for objects."""
    return {
        "model.weight": torch.zeros(ROWS, COLS),
        "model.bias": torch.zeros(5, dtype=torch.bfloat16),
        "model.mask": torch.zeros(3, dtype=torch.bool),
        "model.count": torch.tensor(0, dtype=torch.int64),
        "model.table": torch.zeros(2, 3, dtype=torch.int32),
        "optimizer.step": None,
        "optimizer.param_groups.0.lr": None,
        "optimizer.param_groups.0.betas.0": None,  # tuples and lists are containers
        "optimizer.param_groups.0.betas.1": None,
        "blob": None,
    }


def check_loaded(sd):
    want = state()
    assert torch.equal(sd["model.weight"], want["model"]["weight"])
    assert torch.equal(sd["model.bias"], want["model"]["bias"])
    assert torch.equal(sd["model.mask"], want["model"]["mask"])
    assert sd["model.count"].item() == 7 and sd["model.count"].dim() == 0
    assert torch.equal(sd["model.table"], torch.from_numpy(want["model"]["table"]))
    assert sd["optimizer.step"] == 12
    assert sd["optimizer.param_groups.0.lr"] == 0.1
    assert (sd["optimizer.param_groups.0.betas.0"], sd["optimizer.param_groups.0.betas.1"]) == \
        (0.9, 0.99)
    assert sd["blob"] == b"\x00\xffraw"


def flat_keys(sd):
    return sorted(sd)


def test_torch_113_loads_it(ckpt):
    report = tessera.save(state(), ckpt, format="torch_dist", torch_dist_flavor="1.13")
    names = os.listdir(ckpt)
    assert ".metadata" in names and all(
        n == ".metadata" or (n.startswith("__0_") and report.save_id in n) for n in names), names
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)  # torch 1.13's own classes
    assert flat_keys(meta.state_dict_metadata) == flat_keys(empty_like_flat())
    sd = empty_like_flat()
    dcp.load_state_dict(sd, dcp.FileSystemReader(ckpt), no_dist=True)
    check_loaded(sd)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_torch_2_flavour_loads_through_its_classes(ckpt, asynchronous):
    if asynchronous:
        report = tessera.async_save(state(), ckpt, format="torch_dist").wait()
    else:
        report = tessera.save(state(), ckpt, format="torch_dist", torch_dist_flavor="2.x")
    problems = []
    reader = load_dcp_with_torch.Reader(ckpt, {"flavor": "2", "save_id": report.save_id},
                                        problems)
    sd = empty_like_flat()
    dcp.load_state_dict(sd, reader, no_dist=True)
    assert problems == []
    check_loaded(sd)


def test_options_are_checked(ckpt):
    with pytest.raises(ValueError, match="torch_dist_flavor must be one of"):
        tessera.save(state(), ckpt, format="torch_dist", torch_dist_flavor="3")
    with pytest.raises(ValueError, match="format must be one of"):
        tessera.save(state(), ckpt, format="orbax")
    with pytest.raises(tessera.InvalidArgumentError, match="cannot be written"):
        tessera.save(state(), ckpt, format="safetensors")
    with pytest.raises(tessera.InvalidArgumentError, match="user_metadata must be empty"):
        tessera.save(state(), ckpt, format="torch_dist", user_metadata={"a": "b"})
    tessera.save(state(), ckpt)
    with pytest.raises(tessera.FailedPreconditionError, match="holds a tessera checkpoint"):
        tessera.save(state(), ckpt, format="torch_dist")


def worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
        comm = tessera.torch_dist_comm()
        half = ROWS // size
        saved = {"w": tessera.ShardedTensor(FULL[rank * half:(rank + 1) * half].clone(),
                                            FULL.shape, (rank * half, 0)),
                 "step": 3}
        tessera.save(saved, path, comm=comm, format="torch_dist", torch_dist_flavor="1.13")
        # torch's own load into column shards.
        cols = COLS // size
        local = torch.zeros(ROWS, cols)
        target = {"w": init_from_local_shards(
            [Shard.from_tensor_and_offsets(local, [0, rank * cols], rank)], ROWS, COLS),
            "step": None}
        dcp.load_state_dict(target, dcp.FileSystemReader(path))
        assert torch.equal(local, FULL[:, rank * cols:(rank + 1) * cols])
        assert target["step"] == 3
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_save_and_torch_loads_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")
