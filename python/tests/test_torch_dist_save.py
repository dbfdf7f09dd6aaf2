"""tessera.save(format="torch_dist") and tessera.async_save(format="torch_dist"), the default
torch 2.x flavour, read by the real torch 2.13: torch.distributed.checkpoint.load into nested and
flat state dicts, dcp_to_torch_save (which rebuilds the nesting from planner_data), and every
field of the .metadata unpickled into torch's own classes. Saves over gloo processes read by
dcp.load into DTensors: test_dcp.py. The torch 1.13 flavour: test_torch113_dcp.py (legacy)."""

import io
import os
import pickle

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

import tessera

ROWS, COLS = 6, 4
FULL = torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS)


def state():
    return {
        "model": {"weight": FULL.clone(),
                  "bias": torch.arange(5, dtype=torch.bfloat16),
                  "mask": torch.tensor([True, False, True]),
                  "count": torch.tensor(7, dtype=torch.int64),
                  "f8": torch.arange(4, dtype=torch.float32).to(torch.float8_e4m3fn),
                  "u16": torch.tensor([0, 1, 65535], dtype=torch.int32).to(torch.uint16),
                  "table": np.arange(6, dtype=np.int32).reshape(2, 3)},
        "optimizer": {"step": 12, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]},
        "layers.0": {"w": torch.ones(2)},  # a dict key with a dot: torch's path keeps it whole
        "blob": b"\x00\xffraw",
    }


def zeros_like_state():
    """What a torch user passes to dcp.load: the same nesting, zero tensors, placeholders."""
    return {
        "model": {"weight": torch.zeros(ROWS, COLS),
                  "bias": torch.zeros(5, dtype=torch.bfloat16),
                  "mask": torch.zeros(3, dtype=torch.bool),
                  "count": torch.tensor(0, dtype=torch.int64),
                  "f8": torch.zeros(4, dtype=torch.float8_e4m3fn),
                  "u16": torch.zeros(3, dtype=torch.uint16),
                  "table": torch.zeros(2, 3, dtype=torch.int32)},
        "optimizer": {"step": None, "param_groups": [{"lr": None, "betas": (None, None)}]},
        "layers.0": {"w": torch.zeros(2)},
        "blob": None,
    }


def same(a, b):
    """Equal values, tensors bit for bit (float8 compared by its bits)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, np.ndarray):
        a = torch.from_numpy(a)
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                                b.view(torch.uint8) if b.element_size() == 1 else b))
    return a == b


def test_dcp_load_reads_a_save_into_the_same_nesting(ckpt):
    report = tessera.save(state(), ckpt, format="torch_dist")
    assert report.save_id and sorted(os.listdir(ckpt))[0] == ".metadata"
    loaded = zeros_like_state()
    dcp.load(loaded, checkpoint_id=ckpt, no_dist=True)
    want = state()
    want["model"]["table"] = torch.from_numpy(want["model"]["table"])
    assert same(loaded, want)


def test_dcp_load_reads_flat_keys_and_a_subset(ckpt):
    tessera.save(state(), ckpt, format="torch_dist")
    loaded = {"model.weight": torch.zeros(ROWS, COLS), "optimizer.step": None}
    dcp.load(loaded, checkpoint_id=ckpt, no_dist=True)
    assert torch.equal(loaded["model.weight"], FULL) and loaded["optimizer.step"] == 12


def test_dcp_to_torch_save_rebuilds_the_nesting(ckpt, tmp_path):
    """torch's dcp_to_torch_save (and _load_state_dict_from_keys) rebuild the state dict from
    the .metadata alone, through planner_data: the path of every key in the saved nesting."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    tessera.save(state(), ckpt, format="torch_dist")
    dcp_to_torch_save(ckpt, str(tmp_path / "whole.pt"))
    loaded = torch.load(str(tmp_path / "whole.pt"), weights_only=False)
    want = state()
    want["model"]["table"] = torch.from_numpy(want["model"]["table"])
    # A tuple is one object in DCP (torch's flattening), so it comes back a tuple.
    assert same(loaded, want)


def test_every_metadata_field_is_torchs(ckpt):
    """The .metadata unpickles into torch 2.13's own classes, field by field, as torch's
    FileSystemWriter writes them."""
    report = tessera.save(state(), ckpt, format="torch_dist")
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    assert type(meta) is dcp_metadata.Metadata
    assert meta.version == dcp_filesystem.CURRENT_DCP_VERSION
    assert type(meta.storage_meta) is dcp_metadata.StorageMeta
    assert meta.storage_meta.save_id == report.save_id
    assert os.fspath(meta.storage_meta.checkpoint_id) == ckpt
    assert meta.storage_meta.load_id is None and meta.storage_meta.modules == []
    want = state()
    tensors = {"model.weight": FULL, "model.bias": want["model"]["bias"],
               "model.mask": want["model"]["mask"], "model.count": want["model"]["count"],
               "model.f8": want["model"]["f8"], "model.u16": want["model"]["u16"],
               "model.table": torch.from_numpy(want["model"]["table"]),
               "layers.0.w": torch.ones(2)}
    # Keys as torch's flattening makes them: a tuple is one object.
    objects = {"optimizer.step", "optimizer.param_groups.0.lr", "optimizer.param_groups.0.betas",
               "blob"}
    assert set(meta.state_dict_metadata) == set(tensors) | objects
    for fqn, value in meta.state_dict_metadata.items():
        if fqn in objects:
            assert type(value) is dcp_metadata.BytesStorageMetadata, fqn
            continue
        assert type(value) is dcp_metadata.TensorStorageMetadata, fqn
        assert value.properties == dcp_metadata.TensorProperties.create_from_tensor(tensors[fqn])
        assert type(value.size) is torch.Size and value.size == tensors[fqn].shape
        assert [type(c) for c in value.chunks] == [dcp_metadata.ChunkStorageMetadata]
        assert value.chunks[0].offsets == torch.Size([0] * tensors[fqn].dim())
        assert value.chunks[0].sizes == tensors[fqn].shape
    # planner_data: the path of each key in the saved nesting, as torch's flatten_state_dict.
    assert meta.planner_data["model.weight"] == ("model", "weight")
    assert meta.planner_data["layers.0.w"] == ("layers.0", "w")
    assert meta.planner_data["optimizer.param_groups.0.betas"] == (
        "optimizer", "param_groups", 0, "betas")
    assert set(meta.planner_data) == set(meta.state_dict_metadata)
    files = set(os.listdir(ckpt)) - {".metadata"}
    assert len(meta.storage_data) == len(meta.state_dict_metadata)
    for index, info in meta.storage_data.items():
        assert type(index) is dcp_metadata.MetadataIndex
        assert type(info) is dcp_filesystem._StorageInfo
        assert info.relative_path in files and info.transform_descriptors is None
        if index.fqn in objects:
            assert index.offset is None
        else:
            assert index.offset == torch.Size([0] * tensors[index.fqn].dim())
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                item = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
            assert same(item, tensors[index.fqn]), index.fqn


def test_async_save_in_dcp_format_loads_in_torch(ckpt):
    handle = tessera.async_save(state(), ckpt, format="torch_dist", staging="deferred")
    handle.wait_staged()
    handle.wait()
    loaded = zeros_like_state()
    dcp.load(loaded, checkpoint_id=ckpt, no_dist=True)
    assert torch.equal(loaded["model"]["weight"], FULL) and loaded["blob"] == b"\x00\xffraw"
    # Saved again into the same directory: the new .metadata wins, the old files go.
    second = state()
    second["model"]["weight"] += 1
    tessera.async_save(second, ckpt, format="torch_dist").wait()
    dcp.load(loaded, checkpoint_id=ckpt, no_dist=True)
    assert torch.equal(loaded["model"]["weight"], FULL + 1)


def test_options_are_checked(ckpt):
    with pytest.raises(ValueError, match="torch_dist_flavor must be one of"):
        tessera.save(state(), ckpt, format="torch_dist", torch_dist_flavor="3")
    with pytest.raises(ValueError, match="format must be one of"):
        tessera.save(state(), ckpt, format="orbax")
    with pytest.raises(tessera.InvalidArgumentError, match="cannot be written"):
        tessera.save(state(), ckpt, format="safetensors")
    # The torch_dist options (C++ TorchDistOptions) with another format would do nothing.
    for options in ({"torch_dist_flavor": "1.13"}, {"torch_dist_key_paths": {"w": ["w"]}}):
        with pytest.raises(tessera.InvalidArgumentError,
                           match="apply to format='torch_dist' only, not 'tessera'"):
            tessera.save(state(), ckpt, **options)
        with pytest.raises(TypeError, match="unexpected keyword argument 'format_options'"):
            tessera.save(state(), ckpt, format_options=None)
    assert not os.path.exists(ckpt) or not os.listdir(ckpt)
    with pytest.raises(tessera.InvalidArgumentError, match="user_metadata must be empty"):
        tessera.save(state(), ckpt, format="torch_dist", user_metadata={"a": "b"})
    tessera.save(state(), ckpt)
    with pytest.raises(tessera.FailedPreconditionError, match="holds a tessera checkpoint"):
        tessera.save(state(), ckpt, format="torch_dist")
