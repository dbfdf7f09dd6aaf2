"""PyTorch DCP (torch 2.13) and tessera, both ways, with DTensors on 4 gloo processes.

One job of 4 ranks (torch.multiprocessing, gloo, CPU), a 1-D mesh of 4 and a 2-D mesh of 2 x 2:
- torch's dcp.save of DTensors (Shard and Replicate placements, uneven shards, a dimension
  sharded over both mesh dimensions) and of non-tensor values (ints, nested dicts, tuples, a
  list of floats, bytes, an io.BytesIO) is loaded by tessera.load, without comm= (the default
  process group), into DTensors of other placements;
- tessera.save(format="torch_dist") and tessera.async_save(format="torch_dist") of DTensors
  are loaded by torch's dcp.load into DTensors of other placements and into plain tensors.
Then one process: tessera.load_all, read_metadata, verify, `tessera inspect`, convert (to
tessera and to safetensors) and resharded loads over 3 local ranks of what torch wrote; torch's
dcp.load of what tessera wrote. And the .metadata fields torch 2.x may hold that tessera does
not support are clear errors."""

import datetime
import io
import json
import os
import pickle
import subprocess

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import tessera
from conftest import CLI, free_port, raw_bytes

SIZE = 4


def values(shape, dtype, seed):
    n = torch.Size(shape).numel()
    return ((torch.arange(n, dtype=torch.int64) * 7 + seed) % 251 - 100).reshape(shape).to(dtype)


# name: (global tensor, placements saved on the 2 x 2 mesh, placements loaded on it); 1-D
# placements are on the mesh of 4.
TENSORS = {
    "w": (values((10, 6), torch.float32, 1), (Shard(0),), (Shard(1),)),           # 3,3,3,1 rows
    "emb": (values((7, 5), torch.bfloat16, 2), (Shard(0), Shard(1)), (Replicate(), Shard(0))),
    "norm": (values((5,), torch.float32, 3), (Replicate(),), (Shard(0),)),        # replicated
    "moe": (values((11, 3), torch.int64, 4), (Shard(0), Shard(0)), (Shard(1), Replicate())),
    "mlp": (values((9, 4), torch.float16, 5), (Shard(0), Replicate()), (Shard(1),)),
}
OBJECTS = {"step": 1000, "cfg": {"lr": 0.5, "betas": (0.9, 0.95), "sizes": [1.5, 2.5]},
           "name": "run-7", "blob": b"\x00\xff"}
BYTES_IO = b"the bytes of an io.BytesIO"  # DCP torch.saves the io.BytesIO object


def mesh_for(placements, meshes):
    return meshes[len(placements)]


def dtensors(meshes, which, fill=True):
    out = {}
    for name, (full, saved, loaded) in TENSORS.items():
        placements = saved if which == "saved" else loaded
        src = full if fill else torch.zeros_like(full)
        out[name] = distribute_tensor(src, mesh_for(placements, meshes), list(placements))
    return out


def check_dtensors(state):
    for name, (full, _, _) in TENSORS.items():
        got = state[name]
        assert isinstance(got, DTensor), name
        assert torch.equal(got.full_tensor(), full), name


def worker(rank, size, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=120))
    try:
        meshes = {1: init_device_mesh("cpu", (size,)), 2: init_device_mesh("cpu", (2, 2))}
        # 1. torch saves; tessera loads into other placements (no comm=: the default group).
        state = {"model": dtensors(meshes, "saved"), "plain": torch.arange(6.0), **OBJECTS,
                 "stream": io.BytesIO(BYTES_IO)}
        dcp.save(state, checkpoint_id=os.path.join(out, "by_torch"))
        target = {"model": dtensors(meshes, "loaded", fill=False), "plain": torch.zeros(6),
                  "step": None, "cfg": {"lr": None, "betas": None, "sizes": None},
                  "name": None, "blob": None, "stream": None}
        report = tessera.load(target, os.path.join(out, "by_torch"))
        assert report.missing_keys == [] and report.unexpected_keys == []
        check_dtensors(target["model"])
        assert torch.equal(target["plain"], torch.arange(6.0))
        assert {k: target[k] for k in OBJECTS} == OBJECTS, target
        assert target["stream"].getvalue() == BYTES_IO  # an io.BytesIO, as dcp.load gives

        # 2. tessera saves DCP; torch loads into other placements and into plain tensors.
        saved = {"model": dtensors(meshes, "saved"), **OBJECTS}
        tessera.save(saved, os.path.join(out, "by_tessera"), format="torch_dist")
        back = {"model": dtensors(meshes, "loaded", fill=False), "step": None,
                "cfg": {"lr": None, "betas": None, "sizes": None}, "name": None, "blob": None}
        dcp.load(back, checkpoint_id=os.path.join(out, "by_tessera"))
        check_dtensors(back["model"])
        assert {k: back[k] for k in OBJECTS} == OBJECTS, back
        plain = {"model": {name: torch.zeros_like(full) for name, (full, _, _) in TENSORS.items()}}
        dcp.load(plain, checkpoint_id=os.path.join(out, "by_tessera"))
        for name, (full, _, _) in TENSORS.items():
            assert torch.equal(plain["model"][name], full), name

        # 3. The same asynchronously: the caller's collectives run while it is in flight.
        handle = tessera.async_save(saved, os.path.join(out, "async"), format="torch_dist")
        x = torch.ones(1)
        dist.all_reduce(x)
        handle.wait()
        again = {"model": dtensors(meshes, "loaded", fill=False)}
        dcp.load(again, checkpoint_id=os.path.join(out, "async"))
        check_dtensors(again["model"])
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dcp"))
    mp.start_processes(worker, args=(SIZE, free_port(), out), nprocs=SIZE, join=True,
                       start_method="spawn")
    return out


def flat_expected():
    want = {f"model.{name}": full for name, (full, _, _) in TENSORS.items()}
    want["plain"] = torch.arange(6.0)
    return want


def test_the_job_ran(job):
    assert sorted(os.listdir(job)) == ["async", "by_tessera", "by_torch"]


def test_load_all_of_what_torch_saved(job):
    path = os.path.join(job, "by_torch")
    loaded = tessera.load_all(path, tensor_type="torch")
    for key, full in flat_expected().items():
        got = loaded
        for part in key.split(".", 1):  # nested as torch saved it: model -> {name: tensor}
            got = got[part]
        assert raw_bytes(got) == raw_bytes(full) and got.dtype == full.dtype, key
    # Non-tensor values as torch's own load gives them, nested as saved (planner_data).
    assert loaded["step"] == 1000 and loaded["name"] == "run-7" and loaded["blob"] == b"\x00\xff"
    assert loaded["cfg"]["lr"] == 0.5 and loaded["cfg"]["betas"] == (0.9, 0.95)
    assert loaded["cfg"]["sizes"] == [1.5, 2.5] and "cfg.lr" not in loaded
    assert loaded["stream"].getvalue() == BYTES_IO  # the io.BytesIO torch saved


def test_metadata_verify_and_inspect_of_what_torch_saved(job):
    path = os.path.join(job, "by_torch")
    meta = tessera.read_metadata(path)
    assert meta.format == "torch_dist" and not meta.checksums
    w = meta.find_tensor("model.w")
    assert list(w.shape) == [10, 6] and w.dtype == "F32"
    assert sorted(list(c.box.sizes) for c in w.chunks) == [[1, 6], [3, 6], [3, 6], [3, 6]]
    # Replicated over a mesh dimension: torch wrote each box once.
    assert len(meta.find_tensor("model.mlp").chunks) == 2
    assert len(meta.find_tensor("model.norm").chunks) == 1
    report = tessera.verify(path)
    # No checksums in DCP's index, but every zip record's CRC-32 is checked (issue 22).
    assert report.checksums and report.chunks_checked > 0
    assert CLI, "TESSERA_CLI is not set (python/tests/CMakeLists.txt sets it)"
    done = subprocess.run([CLI, "inspect", path, "--json"], capture_output=True, text=True,
                          check=True)
    doc = json.loads(done.stdout)
    assert doc["format"] == "torch_dist"
    assert {t["key"] for t in doc["tensors"]} == set(flat_expected())


def test_resharded_load_of_what_torch_saved(job):
    path = os.path.join(job, "by_torch")
    full = TENSORS["emb"][0]

    def load(comm):  # 3 ranks, column blocks of emb, rows of moe
        cols = [(0, 2), (2, 4), (4, 5)][comm.rank]
        emb = torch.zeros(7, cols[1] - cols[0], dtype=torch.bfloat16)
        moe = torch.zeros(4 if comm.rank < 2 else 3, 3, dtype=torch.int64)
        tessera.load({"model": {"emb": tessera.ShardedTensor(emb, (7, 5), (0, cols[0])),
                                "moe": tessera.ShardedTensor(moe, (11, 3), (4 * comm.rank, 0))}},
                     path, comm=comm, strict=False)
        return emb, moe

    parts = tessera.run_local(3, load)
    assert torch.equal(torch.cat([p[0] for p in parts], dim=1), full)
    assert torch.equal(torch.cat([p[1] for p in parts]), TENSORS["moe"][0])


def test_convert_what_torch_saved(job, tmp_path):
    path = os.path.join(job, "by_torch")
    tessera.convert(path, tmp_path / "t", to="tessera")
    tessera.verify(tmp_path / "t")
    loaded = tessera.load_all(tmp_path / "t", tensor_type="torch")
    for key, full in flat_expected().items():
        assert raw_bytes(loaded[key]) == raw_bytes(full), key
    assert loaded["cfg.betas"] == (0.9, 0.95)
    report = tessera.convert(path, tmp_path / "hf", to="safetensors")
    assert report.tensors == len(flat_expected())
    from safetensors.torch import load_file
    weights = load_file(str(tmp_path / "hf" / "model.safetensors"))
    for key, full in flat_expected().items():
        assert raw_bytes(weights[key]) == raw_bytes(full), key


def test_torch_loads_what_tessera_saved_on_one_process(job):
    for name in ("by_tessera", "async"):
        path = os.path.join(job, name)
        plain = {"model": {n: torch.zeros_like(full) for n, (full, _, _) in TENSORS.items()},
                 "cfg": {"betas": None}}
        dcp.load(plain, checkpoint_id=path, no_dist=True)
        for n, (full, _, _) in TENSORS.items():
            assert torch.equal(plain["model"][n], full), (name, n)
        assert plain["cfg"]["betas"] == (0.9, 0.95)
        with open(os.path.join(path, ".metadata"), "rb") as f:
            meta = pickle.load(f)
        assert type(meta) is dcp_metadata.Metadata
        assert meta.planner_data["model.w"] == ("model", "w")
        # Each box once: the replicas along Replicate() mesh dimensions were written by one rank.
        assert len(meta.state_dict_metadata["model.mlp"].chunks) == 2
        assert len(meta.state_dict_metadata["model.norm"].chunks) == 1


# ---- what tessera does not read: clear errors naming it -------------------------------------

def rewrite_metadata(src, dst, change):
    """A copy of DCP checkpoint `src` at `dst` whose .metadata (unpickled with torch's own
    classes) `change` edits."""
    import shutil
    shutil.copytree(src, dst)
    with open(os.path.join(dst, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    change(meta)
    with open(os.path.join(dst, ".metadata"), "wb") as f:
        pickle.dump(meta, f)


def test_compressed_items_are_refused_naming_them(job, tmp_path):
    def compress(meta):
        for index, info in meta.storage_data.items():
            if index.fqn == "model.w":
                info.transform_descriptors = ["stream.zstd/1"]

    rewrite_metadata(os.path.join(job, "by_torch"), tmp_path / "z", compress)
    for call in (tessera.read_metadata, tessera.load_all):
        with pytest.raises(tessera.Error, match=r"model.w is stored with transform_descriptors "
                                                r"\['stream.zstd/1'\]: compressed"):
            call(tmp_path / "z")


def test_other_layouts_and_storage_classes_are_refused_naming_them(job, tmp_path):
    def sparse(meta):
        meta.state_dict_metadata["model.w"].properties.layout = torch.sparse_coo

    rewrite_metadata(os.path.join(job, "by_torch"), tmp_path / "s", sparse)
    with pytest.raises(tessera.CorruptCheckpointError, match=r"model\.w.*layout"):
        tessera.read_metadata(tmp_path / "s")

    # A class tessera does not know where a _StorageInfo belongs (a module of this test,
    # registered so that pickle can name it): refused, naming it; nothing is imported.
    import sys
    import types
    module = types.ModuleType("somewhere_else")

    class NotStorageInfo:
        def __init__(self, info):
            self.__dict__.update(info.__dict__)

    NotStorageInfo.__module__, NotStorageInfo.__qualname__ = module.__name__, "NotStorageInfo"
    module.NotStorageInfo = NotStorageInfo
    sys.modules[module.__name__] = module

    def foreign(meta):
        for index in list(meta.storage_data):
            if index.fqn == "model.norm":
                meta.storage_data[index] = NotStorageInfo(meta.storage_data[index])

    try:
        rewrite_metadata(os.path.join(job, "by_torch"), tmp_path / "f", foreign)
    finally:
        del sys.modules[module.__name__]
    with pytest.raises(tessera.CorruptCheckpointError, match=r"somewhere_else"):
        tessera.read_metadata(tmp_path / "f")


def test_storage_info_of_torch(job):
    """The fields of _StorageInfo torch 2.13 writes are those tessera reads: relative_path,
    offset, length (and transform_descriptors only when an extension is used)."""
    with open(os.path.join(job, "by_torch", ".metadata"), "rb") as f:
        meta = pickle.load(f)
    assert meta.version == dcp_filesystem.CURRENT_DCP_VERSION
    fields = set()
    for info in meta.storage_data.values():
        assert type(info) is dcp_filesystem._StorageInfo
        fields |= set(info.__getstate__())
    assert fields == {"relative_path", "offset", "length"}


# ---- one process: an optimizer's state dict, whose param_groups hold tuples and lists ------

def adam_state():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.9))
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict()}


def zeroed(value):
    """`value` with every tensor zeroed and every other leaf None, tuples and lists kept."""
    if isinstance(value, dict):
        return {k: zeroed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(zeroed(v) for v in value)
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else None


def test_optimizer_state_both_ways_through_dcp(tmp_path):
    """Adam's param_groups hold a tuple (betas) and a list of ints (params), which torch's
    flattening stores as one object each: tessera writes and reads the same keys."""
    want = adam_state()
    dcp.save(want, checkpoint_id=str(tmp_path / "torch"), no_dist=True)
    got = zeroed(want)
    tessera.load(got, tmp_path / "torch")
    assert got["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert torch.equal(got["optim"]["state"][0]["exp_avg"], want["optim"]["state"][0]["exp_avg"])
    assert torch.equal(got["model"]["weight"], want["model"]["weight"])

    tessera.save(want, tmp_path / "tessera", format="torch_dist")
    back = zeroed(want)
    dcp.load(back, checkpoint_id=str(tmp_path / "tessera"), no_dist=True)
    assert back["optim"]["param_groups"] == want["optim"]["param_groups"]
    assert torch.equal(back["optim"]["state"][1]["exp_avg_sq"],
                       want["optim"]["state"][1]["exp_avg_sq"])
    with open(os.path.join(tmp_path / "tessera", ".metadata"), "rb") as f:
        torch_keys = set(pickle.load(f).state_dict_metadata)
    with open(os.path.join(tmp_path / "torch", ".metadata"), "rb") as f:
        assert torch_keys == set(pickle.load(f).state_dict_metadata)


def _same(a, b, where="root"):
    """Equal values of the same container types; tensors by dtype, shape and bytes."""
    assert type(a) is type(b), (where, type(a), type(b))
    if isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    else:
        assert a == b, where


NESTED_STATES = {
    "issue_example": lambda: {"layer.w": torch.arange(6.0).reshape(2, 3), "step": 77,
                              "cfg": {"lr": 0.5}},
    "deep_dicts_lists_tuples": lambda: {
        "model": {"enc": {"w": torch.ones(2, 2), "b": torch.zeros(2)}},
        "lists": {"tensors": [torch.full((2,), 1.0), torch.full((3,), 2.0)],
                  "mixed": [torch.arange(3), {"inner": torch.ones(1), "n": 4}, 5],
                  "plain": [1.5, 2.5], "nested": [[torch.ones(2)], [torch.zeros(1)]]},
        "tup": (1, "a", 2.0),
        "tensor_tuple": (torch.ones(2), torch.zeros(2)),
        "int_keys": {0: torch.ones(1), 1: {"x": 3}},
        "none": None, "blob": b"\x00\xff", "step": 3},
    "optimizer": lambda: adam_state(),
}


@pytest.mark.parametrize("name", sorted(NESTED_STATES))
def test_load_all_rebuilds_torch_nesting_like_dcp_to_torch_save(tmp_path, name):
    """Issue 30, item 2: load_all of a torch dcp.save of a nested state dict gives what torch's
    own dcp_to_torch_save gives (planner_data's paths: dicts, lists, int keys), not dotted keys."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    state = NESTED_STATES[name]()
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "torch.pt"))
    want = torch.load(tmp_path / "torch.pt", weights_only=False)
    got = tessera.load_all(tmp_path / "dcp", tensor_type="torch")
    _same(got, want)
    if name == "issue_example":
        assert got["cfg"] == {"lr": 0.5} and "cfg.lr" not in got and got["step"] == 77


def test_crafted_planner_paths_are_refused_naming_the_key(tmp_path):
    """A .metadata whose planner_data puts two keys at one place, or gives an index beyond any
    list, is a CorruptCheckpointError naming the key (never a silent overwrite or a huge list)."""
    dcp.save({"a": {"x": torch.ones(1)}, "b": torch.zeros(1)},
             checkpoint_id=str(tmp_path / "c"), no_dist=True)
    meta_path = tmp_path / "c" / ".metadata"
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    for bad, match in (({"a.x": ("a", "x"), "b": ("a", "x")}, "collides"),
                       ({"a.x": ("a", 10**12), "b": ("b",)}, "path")):
        meta.planner_data = bad
        with open(meta_path, "wb") as f:
            pickle.dump(meta, f)
        with pytest.raises(tessera.CorruptCheckpointError, match=match):
            tessera.load_all(tmp_path / "c")
