"""Reading PyTorch DCP checkpoints written by torch 1.13 itself
(src/checkpoint/testdata/make_dcp_read_fixtures.py, run by the interpreter with torch 1.13,
$TESSERA_TORCH113_PYTHON, whichever torch runs these tests: old checkpoints are read under
torch 2.x too): tessera.load_all returns the tensors torch saved (strided views included) and
the objects as the values saved; tessera.load reshards; read_metadata names the format (no
checksums in the index) and verify checks the CRC-32 of every zip record; a damaged item is an
error naming its file. What torch 2.13 writes: test_dcp.py."""

import json
import os
import subprocess

import numpy as np
import pytest
import torch

import tessera

SOURCE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAKE = os.path.join(SOURCE, "src", "checkpoint", "testdata", "make_dcp_read_fixtures.py")
# torch 1.13 writes the fixtures (Debian's Python; python/tests/CMakeLists.txt sets it).
TORCH113_PYTHON = os.environ.get("TESSERA_TORCH113_PYTHON", "/usr/bin/python3")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dcp"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([TORCH113_PYTHON, MAKE, out], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def expected(fixtures, name):
    with open(os.path.join(fixtures, name + ".expected.json")) as f:
        doc = json.load(f)
    tensors = {}
    for key, e in doc["tensors"].items():
        dtype = getattr(torch, e["dtype"])
        raw = bytearray(bytes.fromhex(e["hex"]))
        flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.zeros(0, dtype=torch.uint8)
        tensors[key] = flat.view(dtype).reshape(e["shape"])
    return tensors


def test_load_all_returns_tensors_and_objects(fixtures):
    path = os.path.join(fixtures, "single")
    loaded = tessera.load_all(path, tensor_type="torch")
    want = expected(fixtures, "single")
    assert set(loaded) == set(want) | {"obj_bytes", "obj_dict"}
    for key, t in want.items():
        assert loaded[key].dtype == t.dtype, key
        assert torch.equal(loaded[key], t), key
    assert loaded["obj_bytes"] == b"hello\x00world"
    assert loaded["obj_dict"] == {"step": 7, "lr": [0.5, 1]}


def test_load_all_numpy_and_objects_as_bytes(fixtures):
    path = os.path.join(fixtures, "single")
    loaded = tessera.load_all(path, objects="bytes")
    want = expected(fixtures, "single")
    assert isinstance(loaded["transposed"], np.ndarray)
    assert np.array_equal(loaded["transposed"], want["transposed"].numpy())
    # The torch.save archive, not unpickled.
    assert isinstance(loaded["obj_dict"], bytes) and loaded["obj_dict"].startswith(b"PK\x03\x04")


def test_resharded_load_of_a_two_process_save(fixtures):
    path = os.path.join(fixtures, "sharded2")
    want = expected(fixtures, "sharded2")
    emb = torch.zeros(4, 6)
    proj = torch.zeros(4, 3, dtype=torch.float16)
    state = {"emb": tessera.ShardedTensor(emb, global_shape=(10, 6), global_offset=(3, 0)),
             "proj": tessera.ShardedTensor(proj, global_shape=(4, 9), global_offset=(0, 3))}
    with pytest.warns(tessera.PartialLoadWarning, match="rep"):
        tessera.load(state, path, strict=False)
    assert torch.equal(emb, want["emb"][3:7])
    assert torch.equal(proj, want["proj"][:, 3:6])


def test_metadata_and_verify(fixtures):
    path = os.path.join(fixtures, "single")
    meta = tessera.read_metadata(path)
    assert meta.format == "torch_dist" and not meta.checksums
    assert meta.find_object("obj_dict").encoding == "torch_save"
    assert meta.user_metadata["torch_dist.flavor"] == "1.13"
    # The index has no checksums; the items' zip records carry CRC-32s, which verify checks.
    report = tessera.verify(path)
    assert report.checksums and report.bytes_checked > 0


def test_damaged_item_names_its_file(fixtures, tmp_path):
    import shutil
    path = str(tmp_path / "damaged")
    shutil.copytree(os.path.join(fixtures, "single"), path)
    item = os.path.join(path, "__0_2.distcp")  # the transposed tensor's item
    with open(item, "r+b") as f:
        f.seek(-22, os.SEEK_END)
        f.write(b"\x00" * 22)
    with pytest.raises(tessera.CorruptCheckpointError, match="__0_2.distcp"):
        tessera.load_all(path)


def test_flipped_element_byte_is_a_crc_mismatch(fixtures, tmp_path):
    # Issue 22: DCP items carry a CRC-32 per zip record; a load that reads a record whole
    # checks it (before: the flipped byte loaded silently).
    import shutil
    path = str(tmp_path / "flipped")
    shutil.copytree(os.path.join(fixtures, "single"), path)
    meta = tessera.read_metadata(path)
    item = os.path.join(path, "__0_0.distcp")  # layer.weight's item: float32 (8, 6)
    with open(item, "r+b") as f:
        data = bytearray(f.read())
        # The data record's local header: its name, then an "FB" field padding to 64 bytes.
        at = data.find(b"FB", data.find(b"archive/data/0"))
        assert at > 0
        start = (at + 4 + 63) // 64 * 64 + 8
        data[start] ^= 0x40
        f.seek(0)
        f.write(data)
    assert meta.format == "torch_dist"
    with pytest.raises(tessera.CorruptCheckpointError, match=r"CRC-32 mismatch in key 'layer\.weight'"):
        tessera.load_all(path)
    with pytest.raises(tessera.CorruptCheckpointError, match="__0_0.distcp"):
        tessera.verify(path)


def test_megatron_checkpoint(fixtures):
    path = os.path.join(fixtures, "megatron")
    loaded = tessera.load_all(path, tensor_type="torch")
    want = expected(fixtures, "megatron")
    key = "optimizer.state.exp_avg.decoder.weight"
    assert loaded[key].shape == (4, 6)  # the original tensor, not (2, 2, 6)
    assert torch.equal(loaded[key], want[key])
    assert loaded["metadata.json"]["sharded_backend"] == "torch_dist"
    assert loaded["common.pt"] == {"iteration": 100, "args": {"tp": 2}}
    assert loaded["optimizer.param_groups/shard_0_1"] == [{"lr": 0.1}]


def test_deeply_nested_megatron_metadata_json_is_a_tessera_error(fixtures, tmp_path):
    # Issue 22, defect 7: a metadata.json nested 100,000 deep raised RecursionError out of
    # load_all; now a CorruptCheckpointError naming the object (the file) and what is wrong.
    import shutil
    path = str(tmp_path / "megatron")
    shutil.copytree(os.path.join(fixtures, "megatron"), path)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write("[" * 100000 + "]" * 100000)
    with pytest.raises(tessera.CorruptCheckpointError,
                       match=r"object 'metadata.json'.*nested too deeply"):
        tessera.load_all(path)
    # objects="bytes" never parses it.
    assert tessera.load_all(path, objects="bytes")["metadata.json"].startswith(b"[[[")


def test_load_gives_objects_back_as_torch_load_does(fixtures):
    # As torch's load_state_dict: an object entry (any placeholder but bytes) becomes the value
    # torch.load gives for its item; a bytes placeholder receives the stored bytes.
    path = os.path.join(fixtures, "single")
    state = {"obj_dict": None, "obj_bytes": b"", "scalar": torch.zeros(())}
    with pytest.warns(tessera.PartialLoadWarning):
        tessera.load(state, path, strict=False)
    assert state["obj_dict"] == {"step": 7, "lr": [0.5, 1]}
    assert state["obj_bytes"].startswith(b"PK\x03\x04")  # the torch.save archive
    assert state["scalar"].item() == 2.5
