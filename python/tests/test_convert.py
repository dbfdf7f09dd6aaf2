"""tessera.convert: a state saved sharded by 4 ranks exported to Hugging Face safetensors
(checked with an independent reader and against torch's own dtype conversions) and to tessera,
on one rank, on local ranks and on 2 gloo processes; keys, prefixes, progress, errors."""

import datetime
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port, raw_bytes

TESTDATA = pathlib.Path(__file__).resolve().parents[2] / "src" / "format" / "huggingface" / "testdata"


def full_state():
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "embed.weight": torch.randn(32, 16, generator=g),
            "layers.0.fc1.weight": torch.randn(48, 16, generator=g).to(torch.bfloat16),
            "layers.0.fc2.weight": torch.randn(16, 48, generator=g).to(torch.float16),
            "norm.weight": torch.randn(16, generator=g).float().double(),  # exact in F32
            "positions": torch.arange(10),
        },
        "optimizer": {"exp_avg": torch.randn(32, 16, generator=g)},
        "step": 12,
    }


def save_sharded(path):
    """4 ranks: embed and exp_avg by rows, fc1 by rows, fc2 by columns, the rest on rank 0."""
    full = full_state()

    def save(comm):
        r = comm.rank
        m = full["model"]
        state = {
            "model": {
                "embed.weight": tessera.ShardedTensor(m["embed.weight"][8 * r:8 * r + 8].clone(),
                                                      (32, 16), (8 * r, 0)),
                "layers.0.fc1.weight": tessera.ShardedTensor(
                    m["layers.0.fc1.weight"][12 * r:12 * r + 12].clone(), (48, 16), (12 * r, 0)),
                "layers.0.fc2.weight": tessera.ShardedTensor(
                    m["layers.0.fc2.weight"][:, 12 * r:12 * r + 12].clone(), (16, 48),
                    (0, 12 * r)),
                "norm.weight": m["norm.weight"],
                "positions": m["positions"],
            },
            "optimizer": {"exp_avg": tessera.ShardedTensor(
                full["optimizer"]["exp_avg"][8 * r:8 * r + 8].clone(), (32, 16), (8 * r, 0))},
            "step": full["step"],
        }
        tessera.save(state, path, comm=comm, sync=False)

    tessera.run_local(4, save)
    return full


def flat(state, prefix=""):
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(flat(v, prefix + k + "."))
        elif torch.is_tensor(v):
            out[prefix + k] = v
    return out


def read_hf(directory):
    """The independent reader: {name: (dtype, shape, bytes)} and the file list."""
    doc = json.loads(subprocess.check_output([sys.executable, str(TESTDATA / "read_hf.py"),
                                              str(directory)]))
    return doc, {n: (t["dtype"], t["shape"], bytes.fromhex(t["hex"]))
                 for n, t in doc["tensors"].items()}


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
                      torch.bfloat16: "BF16", torch.int64: "I64"}


def test_export_sharded_state_to_huggingface_shards(tmp_path):
    full = save_sharded(str(tmp_path / "ckpt"))
    report = tessera.convert(tmp_path / "ckpt", tmp_path / "hf", to="safetensors",
                             max_shard_size="2KiB", sync=False)
    assert report.source_format == "tessera" and report.skipped_objects == ["step"]
    doc, tensors = read_hf(tmp_path / "hf")
    n = len(doc["files"])
    assert n >= 3 and doc["files"] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                       for i in range(1, n + 1)]
    assert report.files == doc["files"] + ["model.safetensors.index.json"]
    expected = flat(full)
    assert sorted(tensors) == sorted(expected)
    for name, t in expected.items():
        dtype, shape, data = tensors[name]
        assert dtype == SAFETENSORS_DTYPES[t.dtype] and shape == list(t.shape), name
        assert data == raw_bytes(t), name
    # transformers-style loading needs nothing of tessera: tessera reads it back too.
    loaded = tessera.load_all(tmp_path / "hf", tensor_type="torch")
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())


def test_keys_strip_prefix_and_bf16_match_torch(tmp_path):
    full = save_sharded(str(tmp_path / "ckpt"))
    tessera.convert(tmp_path / "ckpt", tmp_path / "hf", to="safetensors", keys=["model."],
                    strip_prefix="model.", dtype=torch.bfloat16)
    doc, tensors = read_hf(tmp_path / "hf")
    assert doc["files"] == ["model.safetensors"] and doc["index"] is None
    model = {k: v for k, v in flat(full["model"]).items()}
    assert sorted(tensors) == sorted(model)
    for name, t in model.items():
        want = t.to(torch.bfloat16) if t.is_floating_point() else t  # torch rounds to nearest even
        dtype, _, data = tensors[name]
        assert dtype == SAFETENSORS_DTYPES[want.dtype] and data == raw_bytes(want), name


def test_f16_and_f32_targets(tmp_path):
    full = save_sharded(str(tmp_path / "ckpt"))
    for target, torch_dtype in (("f16", torch.float16), ("float32", torch.float32)):
        out = tmp_path / target
        tessera.convert(tmp_path / "ckpt", out, to="safetensors", dtype=target)
        _, tensors = read_hf(out)
        for name, t in flat(full).items():
            want = t.to(torch_dtype) if t.is_floating_point() else t
            assert tensors[name][2] == raw_bytes(want), (target, name)


def test_to_tessera_keeps_structure_and_objects(tmp_path):
    full = save_sharded(str(tmp_path / "ckpt"))
    report = tessera.convert(tmp_path / "ckpt", tmp_path / "out", to="tessera",
                             max_shard_size=1000)
    assert report.objects >= 1 and report.skipped_objects == []
    assert tessera.verify(tmp_path / "out").checksums
    loaded = tessera.load_all(tmp_path / "out", tensor_type="torch")
    assert loaded["step"] == 12
    for name, t in flat(full).items():  # the saved structure: {"model": {...}, ...}
        top, rest = name.split(".", 1)
        assert torch.equal(loaded[top][rest], t), name
    # Renamed keys: a flat dict by the new names (the saved structure no longer applies).
    tessera.convert(tmp_path / "ckpt", tmp_path / "renamed", to="tessera", keys="model.",
                    strip_prefix="model.")
    renamed = tessera.load_all(tmp_path / "renamed", tensor_type="torch")
    assert torch.equal(renamed["embed.weight"], full["model"]["embed.weight"])
    assert "step" not in renamed and "optimizer" not in renamed


def test_local_ranks_write_the_same_files(tmp_path):
    save_sharded(str(tmp_path / "ckpt"))
    tessera.convert(tmp_path / "ckpt", tmp_path / "one", to="safetensors", max_shard_size="2KiB")
    reports = tessera.run_local(3, lambda comm: tessera.convert(
        tmp_path / "ckpt", tmp_path / "three", to="safetensors", max_shard_size="2KiB",
        comm=comm))
    assert sum(r.files_written for r in reports) == len(reports[0].files) - 1
    assert sorted(os.listdir(tmp_path / "one")) == sorted(os.listdir(tmp_path / "three"))
    for name in os.listdir(tmp_path / "one"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "three" / name).read_bytes()


def gloo_worker(rank, size, port, src, dst):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        report = tessera.convert(src, dst, to="safetensors", max_shard_size="2KiB",
                                 comm=tessera.torch_dist_comm())
        assert report.files_written >= 1, report
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes(tmp_path):
    full = save_sharded(str(tmp_path / "ckpt"))
    mp.start_processes(gloo_worker, args=(2, free_port(), str(tmp_path / "ckpt"),
                                          str(tmp_path / "hf")), nprocs=2, join=True,
                       start_method="spawn")
    _, tensors = read_hf(tmp_path / "hf")
    for name, t in flat(full).items():
        assert tensors[name][2] == raw_bytes(t), name


def test_progress(tmp_path):
    save_sharded(str(tmp_path / "ckpt"))
    calls = []
    report = tessera.convert(tmp_path / "ckpt", tmp_path / "hf", to="safetensors",
                             progress=lambda done, total: calls.append((done, total)))
    assert calls and calls[-1] == (report.bytes_written, report.bytes_written)
    assert all(a[0] <= b[0] for a, b in zip(calls, calls[1:]))

    def fail(done, total):
        raise KeyError("from the callback")

    with pytest.raises(KeyError, match="from the callback"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "hf2", to="safetensors", progress=fail)
    assert (tmp_path / "hf2" / "model.safetensors").exists()  # the conversion itself finished


@pytest.mark.parametrize("ranks", [1, 2])
def test_torch_dist_loads_in_torchs_own_dcp(tmp_path, ranks):
    """to="torch_dist" (torch 2.x's class paths): torch 2.13's own dcp.load reads every tensor
    and the object; the nesting is not kept (the source's user metadata is dropped): keys are
    flat. The torch 1.13 flavour: test_torch113_dcp.py."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    save_sharded(str(tmp_path / "ckpt"))
    seen = []

    def convert(comm):
        return tessera.convert(tmp_path / "ckpt", tmp_path / "dcp", to="torch_dist",
                               num_threads=2, max_shard_size="1KB",
                               comm=comm, progress=lambda d, t: seen.append((d, t)))

    reports = tessera.run_local(ranks, convert)
    report = reports[0]
    assert report.tensors == 6 and report.objects == 1, report
    assert report.files[-1] == ".metadata" and len(report.files) >= 4, report.files
    assert sorted(os.listdir(tmp_path / "dcp")) == sorted(report.files)
    assert seen and all(d <= t for d, t in seen)
    full = full_state()
    flat = {f"model.{k}": v for k, v in full["model"].items()}
    flat["optimizer.exp_avg"] = full["optimizer"]["exp_avg"]
    loaded = {k: torch.zeros_like(v) for k, v in flat.items()}
    loaded["step"] = None
    dcp.load(loaded, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    for key, value in flat.items():
        assert raw_bytes(loaded[key]) == raw_bytes(value), key
    assert loaded["step"] == 12


def test_errors(tmp_path):
    save_sharded(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="torch_dist_flavor must be one of"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "dcp", to="torch_dist",
                        torch_dist_flavor="1.12")
    with pytest.raises(tessera.InvalidArgumentError,
                       match="torch_dist_flavor applies to to='torch_dist' only, not 'safetensors'"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "dcp", to="safetensors",
                        torch_dist_flavor="1.13")
    assert not (tmp_path / "dcp").exists()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(tessera.AlreadyExistsError, match="exists and is not empty"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "taken", to="safetensors")
    with pytest.raises(ValueError, match="to must be one of"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "x", to="gguf")
    with pytest.raises(ValueError, match="dtype must be bf16, f16, f32 or f64"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "x", to="safetensors", dtype=torch.int8)
    with pytest.raises(ValueError, match="max_shard_size must be"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "x", to="safetensors", max_shard_size="lots")
    with pytest.raises(tessera.InvalidArgumentError, match="no key to export"):
        tessera.convert(tmp_path / "ckpt", tmp_path / "x", to="safetensors", keys="nothing.")
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "taken"]
