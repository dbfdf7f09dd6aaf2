"""Python and the C++ command-line tool read each other's checkpoints."""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

import tessera
from conftest import raw_bytes


def run(cli, *args, check=True):
    result = subprocess.run([cli, *args], capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def test_python_checkpoint_verified_by_the_cli(cli, tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"model": {"w": torch.randn(16, 8, dtype=torch.bfloat16),
                       "b": np.arange(8, dtype=np.int32)},
             "opt": [{"m": torch.zeros(16, 8)}], "step": 3, "tag": b"\x01\x02"}

    def save(comm):  # two ranks, one tensor split
        r = comm.rank
        local = {"model": dict(state["model"], w=tessera.ShardedTensor(
            state["model"]["w"][8 * r:8 * r + 8].clone(), (16, 8), (8 * r, 0))),
            "opt": state["opt"], "step": 3, "tag": state["tag"]}
        tessera.save(local, path, comm=comm, user_metadata={"producer": "pytest"})

    tessera.run_local(2, save)
    verified = run(cli, "verify", path)
    assert "verified" in verified.stdout

    doc = json.loads(run(cli, "inspect", path, "--json").stdout)
    metadata = tessera.read_metadata(path)
    assert doc["save_id"] == metadata.save_id and doc["num_ranks"] == 2
    assert doc["user_metadata"]["producer"] == "pytest"
    assert json.loads(doc["user_metadata"][tessera.STRUCTURE_KEY])["version"] == 1
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert tensors["model.w"]["dtype"] == "BF16" and tensors["model.w"]["shape"] == [16, 8]
    assert tensors["model.w"]["chunks"] == 2
    assert tensors["model.b"]["dtype"] == "I32" and tensors["opt.0.m"]["dtype"] == "F32"
    assert {o["key"]: o["bytes"] for o in doc["objects"]}["tag"] == 2
    assert sorted(tensors) == sorted(t.key for t in metadata.tensors)
    assert doc["total_bytes"] == metadata.total_tensor_bytes

    # Corrupt one byte: the CLI says so and exits non-zero; so does Python.
    location = metadata.find_tensor("model.b").chunks[0].location
    with open(os.path.join(path, metadata.files[location.file_index].name), "r+b") as f:
        f.seek(location.offset)
        f.write(b"\xff")
    failed = run(cli, "verify", path, check=False)
    assert failed.returncode != 0 and "DataLoss" in failed.stderr and "model.b" in failed.stderr
    with pytest.raises(tessera.CorruptCheckpointError, match="model.b"):
        tessera.verify(path)


def read_chunk(path, metadata, chunk):
    """The raw bytes of a chunk, straight from its safetensors data file."""
    location = chunk.location
    with open(os.path.join(path, metadata.files[location.file_index].name), "rb") as f:
        f.seek(location.offset)
        return f.read(location.length)


def safetensors_header(file_path):
    with open(file_path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    from conftest import CLI
    assert CLI and os.path.exists(CLI), (
        f"the tessera command-line tool is not there (TESSERA_CLI={CLI!r}): build it")
    path = str(tmp_path_factory.mktemp("demo") / "ckpt")
    run(CLI, "demo", "--out", path, "--size", "4MiB", "--no-sync")
    return path


def test_cli_checkpoint_loaded_from_metadata(demo_checkpoint):
    path = demo_checkpoint
    metadata = tessera.read_metadata(path)
    assert tessera.STRUCTURE_KEY not in metadata.user_metadata  # made by C++
    loaded = tessera.load_all(path)
    # No saved structure: a flat dict by key, NumPy arrays (BF16 as raw uint16 bits).
    assert sorted(loaded) == sorted([t.key for t in metadata.tensors] +
                                    [o.key for o in metadata.objects])
    for info in metadata.tensors:
        array = loaded[info.key]
        assert isinstance(array, np.ndarray) and list(array.shape) == info.shape
        assert array.dtype == {"BF16": np.uint16, "F32": np.float32}[info.dtype]
        # Every chunk's bytes in the data file equal the box of the loaded array.
        for chunk in info.chunks:
            box = tuple(slice(o, o + s) for o, s in zip(chunk.box.offsets, chunk.box.sizes))
            assert np.ascontiguousarray(array[box]).tobytes() == \
                read_chunk(path, metadata, chunk), (info.key, chunk)
    for info in metadata.objects:
        assert loaded[info.key] == read_chunk(path, metadata, info)


def test_cli_checkpoint_as_torch_and_resharded(demo_checkpoint):
    path = demo_checkpoint
    as_numpy = tessera.load_all(path)
    as_torch = tessera.load_all(path, tensor_type="torch")
    key = "embedding.word_embeddings.weight"
    assert as_torch[key].dtype == torch.bfloat16
    assert as_torch[key].view(torch.int16).numpy().view(np.uint16).tobytes() == \
        as_numpy[key].tobytes()
    shape = tessera.read_metadata(path).find_tensor(key).shape

    def load(comm):  # 3 ranks, column blocks of one tensor, nothing else
        b, e = shape[1] * comm.rank // 3, shape[1] * (comm.rank + 1) // 3
        local = torch.empty(shape[0], e - b, dtype=torch.bfloat16)
        report = tessera.load({key: tessera.ShardedTensor(local, shape, (0, b))}, path,
                              comm=comm, strict=False)
        assert len(report.unexpected_keys) == len(as_numpy) - 1
        return raw_bytes(local) == raw_bytes(as_torch[key][:, b:e])  # bits: NaNs included

    assert all(tessera.run_local(3, load))


def test_data_files_are_safetensors(demo_checkpoint):
    metadata = tessera.read_metadata(demo_checkpoint)
    header = safetensors_header(os.path.join(demo_checkpoint, metadata.files[0].name))
    assert any(isinstance(v, dict) and v.get("dtype") in ("BF16", "F32") for v in header.values())


def test_diff_of_a_dcp_and_a_tessera_checkpoint_of_one_state(cli, tmp_path):
    """Issue 30: torch DCP keeps a list without tensors (Adam's param_groups.0.params) or a tuple
    (betas) as one object, tessera's format keys each element. diff reports those keys as one key
    spelled two ways, never as keys on one side only, and compares what it can: tensors, and
    objects encoded alike; a changed tensor is still a difference."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    tessera.save(state, tmp_path / "tsr")

    def diff(*args):
        run = subprocess.run([cli, "diff", *args], capture_output=True, text=True)
        return run.returncode, run.stdout

    rc, out = diff("--values", "--json", str(tmp_path / "dcp"), str(tmp_path / "tsr"))
    doc = json.loads(out)
    assert rc == 3, out  # same keys; some values could not be compared
    assert doc["only_in_a"] == [] and doc["only_in_b"] == [] and doc["changed"] == []
    spelled = {s["key"]: (s["object_in"], s["elements"]) for s in doc["spelled_differently"]}
    assert spelled == {
        "optim.param_groups.0.betas": ("a", ["optim.param_groups.0.betas.0",
                                             "optim.param_groups.0.betas.1"]),
        "optim.param_groups.0.params": ("a", [f"optim.param_groups.0.params.{i}"
                                              for i in range(4)]),
    }
    assert doc["differing_values"] == [] and not doc["identical"]
    assert "optim.param_groups.0.lr" in {o["key"] for o in doc["objects_not_compared"]}
    rc, out = diff(str(tmp_path / "tsr"), str(tmp_path / "dcp"))
    assert rc == 3 and "one object in b, 4 elements in a" in out, out
    assert "only in" not in out, out

    with torch.no_grad():
        model[0].weight[0, 0] += 1.0
    tessera.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 tmp_path / "changed")
    rc, out = diff("--values", "--json", str(tmp_path / "dcp"), str(tmp_path / "changed"))
    assert rc == 1, out
    assert [d["key"] for d in json.loads(out)["differing_values"]] == ["model.0.weight"]
