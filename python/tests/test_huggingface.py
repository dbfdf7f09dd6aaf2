"""Hugging Face safetensors checkpoints in Python: files written by the real packages
(`safetensors.torch.save_file`, and `huggingface_hub.save_torch_state_dict` for shards with an
index) load whole with load_all and resharded with load, over 1, 2 and 4 ranks (run_local) and
2 gloo processes, by rows and by columns; bad files (hand-made bytes: no writer makes them) are
CorruptCheckpointErrors naming the file; verify checks structure. test_transformers.py covers
transformers' save_pretrained/from_pretrained and tessera's export."""

import datetime
import json
import os
import struct

import huggingface_hub
import numpy as np
import pytest
import safetensors.torch
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera
from conftest import free_port, rank_box, raw_bytes

INDEX = "model.safetensors.index.json"
# Every dtype tessera knows as torch names it (safetensors' names: docs/FORMAT_HUGGINGFACE.md).
TORCH_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                torch.float8_e4m3fn, torch.float8_e5m2, torch.int64, torch.int32, torch.int16,
                torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64]


def model():
    g = torch.Generator().manual_seed(5)
    return {
        "model.embed_tokens.weight": torch.randn(16, 12, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(12, 12, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(20, 12, generator=g).to(torch.float16),
        "model.norm.weight": torch.randn(12, generator=g).double(),
        "model.rope.inv_freq": torch.arange(6, dtype=torch.int64),
        "model.mask": torch.rand(4, 6, generator=g) > 0.5,
        "model.small": torch.arange(-8, 8, dtype=torch.int8).reshape(4, 4),
        "lm_head.weight": torch.randn(16, 12, generator=g),
    }


def write(directory, layout, tensors):
    """layout: "single" (model.safetensors), "indexed" (huggingface_hub's shards + index) or
    "noindex" (2 files, no index)."""
    directory = str(directory)
    os.makedirs(directory, exist_ok=True)
    names = sorted(tensors)
    if layout == "single":
        path = os.path.join(directory, "model.safetensors")
        safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
        return path
    if layout == "indexed":
        huggingface_hub.save_torch_state_dict(tensors, directory, max_shard_size=1000)
        with open(os.path.join(directory, INDEX)) as f:
            assert len(set(json.load(f)["weight_map"].values())) >= 3
    else:
        for file_name, group in (("part-a.safetensors", names[:4]),
                                 ("part-b.safetensors", names[4:])):
            safetensors.torch.save_file({n: tensors[n] for n in group},
                                        os.path.join(directory, file_name),
                                        metadata={"format": "pt"})
    return directory


@pytest.mark.parametrize("layout", ["single", "indexed", "noindex"])
def test_load_all_reads_every_layout(tmp_path, layout):
    tensors = model()
    path = write(tmp_path / "hf", layout, tensors)
    for where in {path, str(tmp_path / "hf")}:
        loaded = tessera.load_all(where, tensor_type="torch")
        assert sorted(loaded) == sorted(tensors)
        for name, t in tensors.items():
            assert loaded[name].dtype == t.dtype and torch.equal(loaded[name], t), name
    metadata = tessera.read_metadata(path)
    assert metadata.format == "safetensors" and not metadata.checksums
    assert metadata.user_metadata["format"] == "pt"


def test_every_safetensors_dtype_as_numpy(tmp_path):
    g = torch.Generator().manual_seed(1)
    tensors = {}
    for dtype in TORCH_DTYPES:  # random bits, NaNs and all
        size = torch.empty((), dtype=dtype).element_size()
        bits = torch.randint(0, 256, (15 * size,), dtype=torch.uint8, generator=g)
        tensors[f"t.{dtype}"] = ((bits & 1).bool() if dtype == torch.bool else
                                 bits.view(dtype)).reshape(3, 5)
    safetensors.torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = tessera.load_all(tmp_path, tensor_type="numpy")
    assert sorted(loaded) == sorted(tensors)
    for name, t in tensors.items():
        assert loaded[name].shape == (3, 5) and loaded[name].tobytes() == raw_bytes(t), name


def test_verify_checks_structure_only(tmp_path):
    write(tmp_path, "indexed", model())
    report = tessera.verify(tmp_path)
    assert report.format == "safetensors" and report.checksums is False
    with open(tmp_path / INDEX) as f:
        files = set(json.load(f)["weight_map"].values())
    assert report.files_checked == len(files) and report.bytes_checked == 0


def load_sharded(path, tensors, comm, dim):
    """Every rank loads its slice along `dim` of every tensor that has it (the whole of the
    others) and checks it, reading alone (read_sharing="none"), then read once per job
    (read_sharing="read_once"); returns the bytes it needed and read alone, after checking the job's figures."""
    results = []
    for sharing in ("none", "read_once"):
        state = {}
        for name, t in tensors.items():
            offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, dim)
            state[name] = tessera.ShardedTensor(torch.zeros(sizes, dtype=t.dtype),
                                                tuple(t.shape), tuple(offsets))
        report = tessera.load(state, path, comm=comm, read_sharing=sharing)
        for name, t in tensors.items():
            offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, dim)
            want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert torch.equal(state[name].data, want), (comm.rank, name, sharing)
        results.append(report)
    alone, once = results
    # The job reads the union of the slices (whole 256 KiB cells where two ranks share one),
    # each byte at most once.
    assert once.job_bytes_needed <= once.job_bytes_read <= once.checkpoint_bytes, once
    return alone.bytes_needed, alone.bytes_read


@pytest.mark.parametrize("layout", ["single", "indexed", "noindex"])
@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_resharded_load_on_local_ranks(tmp_path, layout, ranks, dim):
    tensors = model()
    path = write(tmp_path / "hf", layout, tensors)
    results = tessera.run_local(ranks, lambda comm: load_sharded(path, tensors, comm, dim))
    for needed, read in results:
        assert needed == read, results  # no checksums: exactly the bytes needed


def gloo_worker(rank, size, port, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        comm = tessera.torch_dist_comm()
        for dim in (0, 1):
            needed, read = load_sharded(path, model(), comm, dim)
            assert needed == read > 0
    finally:
        dist.destroy_process_group()


def test_resharded_load_on_two_gloo_processes(tmp_path):
    path = write(tmp_path / "hf", "indexed", model())
    mp.start_processes(gloo_worker, args=(2, free_port(), path), nprocs=2, join=True,
                       start_method="spawn")


def raw_file(path, header, data, declared=None):
    text = header.encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text) if declared is None else declared))
        f.write(text + data)


def test_an_unknown_dtype_names_the_tensor_and_the_file(tmp_path):
    path = str(tmp_path / "model.safetensors")
    # Not a dtype of the format: a damaged header (the format's own dtypes tessera lacks are
    # UnimplementedErrors: test_transformers.py).
    raw_file(path, '{"w":{"dtype":"F9","shape":[2],"data_offsets":[0,1]}}', b"\0")
    with pytest.raises(tessera.CorruptCheckpointError) as e:
        tessera.load_all(tmp_path)
    assert path in str(e.value) and 'entry "w": dtype "F9" is not supported' in str(e.value)


@pytest.mark.parametrize("header,data,declared,what", [
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(8), 9999,
     "runs past the end of the file"),
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]', bytes(8), None, "invalid JSON"),
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
     '"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}', bytes(12), None, "overlap"),
    ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}', bytes(4), None,
     "entries end at byte 8"),
    ('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', bytes(8), None,
     "do not match 12 bytes"),
])
def test_invalid_headers_name_the_file(tmp_path, header, data, declared, what):
    write(tmp_path, "indexed", model())
    with open(tmp_path / INDEX) as f:
        shard = str(tmp_path / sorted(set(json.load(f)["weight_map"].values()))[1])
    raw_file(shard, header, data, declared)
    for call in (tessera.read_metadata, tessera.load_all, tessera.verify):
        with pytest.raises(tessera.CorruptCheckpointError) as e:
            call(str(tmp_path))
        assert shard in str(e.value) and what in str(e.value), str(e.value)
