"""The torch 1.13 flavour of PyTorch DCP, read by torch 1.13 itself: what tessera.save(...,
format="torch_dist", torch_dist_flavor="1.13") and tessera.convert(..., to="torch_dist",
torch_dist_flavor="1.13") write loads with torch 1.13's own
torch.distributed._shard.checkpoint.load_state_dict, on one process and over two gloo processes
into torch ShardedTensors of another layout.

Legacy run only (python/tests/CMakeLists.txt: Debian's Python with torch 1.13). torch 2.x
cannot read this flavour at all: its torch.distributed._shard.checkpoint is an alias whose
submodules load as second copies of torch.distributed.checkpoint's, so its dcp.load rejects the
1.13 class paths ("expected BytesStorageMetadata but found <class
'torch.distributed._shard.checkpoint.metadata.BytesStorageMetadata'>"), for checkpoints torch
1.13 wrote as much as for tessera's. The 2.x flavour is tested against torch 2.13 in
test_torch_dist_save.py."""

import datetime
import os
import pickle
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_compat  # noqa: F401 (torch 1.13 on Python 3.11: makes _shard importable)
import tessera
from conftest import free_port, raw_bytes

assert torch.__version__.startswith("1."), (
    f"{__file__} checks torch 1.13's own reader and runs under the legacy interpreter only "
    f"(LEGACY_TESTS in python/tests/CMakeLists.txt), not torch {torch.__version__}")

from torch.distributed._shard import checkpoint as dcp  # noqa: E402

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
        # A tuple of numbers is one object, as torch 2.x's DCP flattens it (so dcp.load finds
        # Adam's betas); tessera keys both flavours alike.
        "optimizer.param_groups.0.betas": None,
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
    assert sd["optimizer.param_groups.0.betas"] == (0.9, 0.99)
    assert sd["blob"] == b"\x00\xffraw"


def test_torch_113_loads_a_save(ckpt):
    report = tessera.save(state(), ckpt, format="torch_dist", torch_dist_flavor="1.13")
    names = os.listdir(ckpt)
    assert ".metadata" in names and all(
        n == ".metadata" or (n.startswith("__0_") and report.save_id in n) for n in names), names
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)  # torch 1.13's own classes
    assert type(meta) is dcp.Metadata
    assert sorted(meta.state_dict_metadata) == sorted(empty_like_flat())
    sd = empty_like_flat()
    dcp.load_state_dict(sd, dcp.FileSystemReader(ckpt), no_dist=True)
    check_loaded(sd)


def worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
        half = ROWS // size
        saved = {"w": tessera.ShardedTensor(FULL[rank * half:(rank + 1) * half].clone(),
                                            FULL.shape, (rank * half, 0)),
                 "step": 3}
        tessera.save(saved, path, format="torch_dist", torch_dist_flavor="1.13")
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
    # The process ends here without finalizing the interpreter. Its last collectives are torch
    # 1.13's own (dcp.load_state_dict's all_gather_object), whose tensors Python dropped after
    # work.wait(): gloo's worker thread then holds their last reference and takes the GIL to
    # drop it when it destroys the finished work, a moment later. If the interpreter began to
    # exit meanwhile, that thread is ended by pthread_exit inside a noexcept frame and the process
    # aborts ("terminate called without an active exception", seen once in CI on a loaded
    # machine). tessera's own collectives wait for gloo to let go (python/tessera/_torch_comm.py);
    # torch 1.13's cannot be made to, so the worker exits before the race can happen. A failure
    # above raises before this line and reaches the parent as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_two_gloo_processes_save_and_torch_loads_resharded(tmp_path):
    path = str(tmp_path / "ckpt")
    mp.start_processes(worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")


def test_convert_to_the_113_flavour_loads_in_torch_113(tmp_path):
    """to="torch_dist" with torch 1.13's class paths, written by 2 ranks in several files:
    torch's load_state_dict reads every tensor and the object under flat keys."""
    w = torch.randn(8, 6)
    bias = torch.arange(6, dtype=torch.bfloat16)

    def save(comm):
        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        tessera.save({"model": {"w": tessera.ShardedTensor(w[rows].clone(), (8, 6),
                                                           (4 * comm.rank, 0)), "b": bias},
                      "step": 12}, str(tmp_path / "ckpt"), comm=comm)

    tessera.run_local(2, save)

    def convert(comm):
        return tessera.convert(tmp_path / "ckpt", tmp_path / "dcp", to="torch_dist",
                               torch_dist_flavor="1.13", num_threads=2, max_shard_size="100B",
                               comm=comm)

    report = tessera.run_local(2, convert)[0]
    assert report.tensors == 2 and report.objects == 1 and len(report.files) >= 3, report
    loaded = {"model.w": torch.zeros(8, 6), "model.b": torch.zeros(6, dtype=torch.bfloat16),
              "step": None}
    dcp.load_state_dict(loaded, dcp.FileSystemReader(str(tmp_path / "dcp")), no_dist=True)
    assert raw_bytes(loaded["model.w"]) == raw_bytes(w)
    assert raw_bytes(loaded["model.b"]) == raw_bytes(bias)
    assert loaded["step"] == 12
