#!/usr/bin/python3
"""Generates the torch_dist test fixtures with the real torch 1.13 of this machine.

    /usr/bin/python3 src/format/torch_dist/testdata/make_fixtures.py [OUT_DIR]

OUT_DIR defaults to this script's directory. The outputs are committed; the C++ tests
(src/format/torch_dist/*_test.cc) read them and never run this script. Every expectation in an
expected.json is computed here from what torch wrote or loaded, not written by hand.

  items/      torch.save of single objects (DCP items): <name>.pt + expected.json
  dcp113/     checkpoints written by torch 1.13's save_state_dict:
                files/    one file per item (FileSystemWriter's default), no process group
                sharded/  a ShardedTensor with two local shards, single_file_per_rank=True
              + <name>/expected.json (state dict values and the .metadata's content)
  metadata/   .metadata pickles: torch 1.13's own (protocols 2, 3, 4, 5), torch 2.x's (classes
              re-declared in dcp2_standins.py under their real module paths), Megatron-Core's
              (MCoreMetadata, mcore_data, all_local_plans), and refused ones; expected.json
"""
import io
import json
import os
import pathlib
import pickle
import shutil
import struct
import sys
import tempfile
import types
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch113_compat  # noqa: E402,F401  (before torch)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed._shard import checkpoint as dcp  # noqa: E402
from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards  # noqa: E402

import dcp2_standins  # noqa: E402


def dtype_name(dtype):
    return str(dtype).replace("torch.", "")


def raw_hex(t):
    """The row-major bytes of a tensor's values, as hex."""
    t = t.detach().contiguous().reshape(-1)
    if t.numel() == 0:
        return ""
    return t.view(torch.uint8).numpy().tobytes().hex()


def record_data_offset(blob, info):
    """Offset of a zip record's data: after its local header, name and extra field."""
    name_len, extra_len = struct.unpack_from("<HH", blob, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def describe_item(blob):
    """What a torch.save'd item holds, from Python's zipfile and torch.load."""
    z = zipfile.ZipFile(io.BytesIO(blob))
    records = [{"name": i.filename, "local_header_offset": i.header_offset, "size": i.file_size,
                "crc32": i.CRC, "data_offset": record_data_offset(blob, i)} for i in z.infolist()]
    out = {"length": len(blob), "records": records}
    obj = torch.load(io.BytesIO(blob))
    if isinstance(obj, torch.Tensor):
        data = [r for r in records if "/data/" in r["name"]]
        assert len(data) == 1, records
        out.update({
            "kind": "tensor", "dtype": dtype_name(obj.dtype), "size": list(obj.shape),
            "stride": list(obj.stride()), "storage_offset": obj.storage_offset(),
            "storage_elements": obj.storage().size(), "requires_grad": obj.requires_grad,
            "storage_key": data[0]["name"].rsplit("/", 1)[1], "data_offset": data[0]["data_offset"],
            "data_size": data[0]["size"], "data_crc32": data[0]["crc32"],
            "storage_hex": z.read(data[0]["name"]).hex(), "values_hex": raw_hex(obj),
            "contiguous": obj.is_contiguous()})
    else:
        out.update({"kind": "object", "data_pkl_hex": z.read(z.namelist()[0]).hex()})
        if isinstance(obj, bytes):
            out["bytes_hex"] = obj.hex()
    return out


def make_items(out):
    os.makedirs(out, exist_ok=True)
    base = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    items = {
        "float32_3x4": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.5,
        "bfloat16_5": torch.tensor([1.0, -2.0, 3.5, 0.0, 1e-3], dtype=torch.bfloat16),
        "int64_2x3": base.clone(),
        "bool_2x3x4x5": (torch.arange(120).reshape(2, 3, 4, 5) % 3) == 0,
        "transposed_int64_3x2": base.t(),  # size (3, 2), stride (1, 3)
        "offset_view_float64": torch.arange(6, dtype=torch.float64)[2:],  # storage offset 2
        "scalar_float32": torch.tensor(3.5),
        "empty_bfloat16_0x3": torch.zeros(0, 3, dtype=torch.bfloat16),
        "requires_grad_float32_2": torch.tensor([1.0, 2.0], requires_grad=True),
        "float16_large_300": torch.arange(300, dtype=torch.float16),
        "int8_7": torch.arange(-3, 4, dtype=torch.int8),
        "uint8_4": torch.tensor([0, 1, 254, 255], dtype=torch.uint8),
        "int32_2x2": torch.tensor([[1, -1], [2**31 - 1, -2**31]], dtype=torch.int32),
        "int16_3": torch.tensor([1, -2, 300], dtype=torch.int16),
        "object_list": [1, b"abc", {"x": 2}],
        "object_bytes": b"hello\xff\x00",
        "object_empty_bytes": b"",
    }
    expected = {}
    for name, obj in items.items():
        buf = io.BytesIO()
        torch.save(obj, buf)
        blob = buf.getvalue()
        with open(os.path.join(out, name + ".pt"), "wb") as f:
            f.write(blob)
        expected[name] = describe_item(blob)
    # Another zip writer's layout: Python's zipfile (CRC and sizes in the local headers, no data
    # descriptors, no alignment, no ZIP64 records), with the records torch 2.x adds and an
    # archive folder named otherwise; torch.load reads it.
    with open(os.path.join(out, "float32_3x4.pt"), "rb") as f:
        src = zipfile.ZipFile(io.BytesIO(f.read()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("tensor/data.pkl", src.read("archive/data.pkl"))
        z.writestr("tensor/.format_version", b"1")
        z.writestr("tensor/.storage_alignment", b"64")
        z.writestr("tensor/byteorder", b"little")
        z.writestr("tensor/data/0", src.read("archive/data/0"))
        z.writestr("tensor/version", b"3\n")
        z.writestr("tensor/.data/serialization_id", b"1234567890" * 4)
    with open(os.path.join(out, "zipfile_layout_float32.pt"), "wb") as f:
        f.write(buf.getvalue())
    expected["zipfile_layout_float32"] = describe_item(buf.getvalue())
    expected["big_uint8"] = make_big_item(out)
    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


class _HeadTailSink:
    """A file-like object for torch.save that keeps only the first and last 4 KiB."""

    def __init__(self):
        self.length, self.head, self.tail = 0, bytearray(), bytearray()

    def write(self, b):
        m = memoryview(b).cast("B")
        if self.length < 4096:
            self.head += m[:4096 - self.length]
        self.tail = (self.tail + m[-4096:])[-4096:]
        self.length += len(m)
        return len(m)

    def flush(self):
        pass


def make_big_item(out):
    """torch.save of a 4 GiB + 100 byte uint8 tensor (zeros, mapped from a sparse file): the
    ZIP64 layout (zip64 extra fields, 24-byte data descriptors). Only the first and last 4 KiB
    are kept (items/big_uint8.head, .tail); the bytes between are the tensor's zeros."""
    n = (4 << 30) + 100
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sparse")
        with open(path, "wb") as f:
            f.truncate(n)
        t = torch.ByteTensor(torch.ByteStorage.from_file(path, shared=True, size=n))
        sink = _HeadTailSink()
        torch.save(t, sink)
        del t
    for suffix, data in (("head", sink.head), ("tail", sink.tail)):
        with open(os.path.join(out, "big_uint8." + suffix), "wb") as f:
            f.write(data)
    return {"kind": "big", "length": sink.length, "numel": n}


def describe_metadata(m):
    """The content of a DCP Metadata object (torch 1.13's or the 2.x stand-ins)."""
    tensors, byte_items = [], []
    for fqn, v in m.state_dict_metadata.items():
        if type(v).__name__ == "BytesStorageMetadata":
            byte_items.append(fqn)
            continue
        p = v.properties
        tensors.append({
            "fqn": fqn, "dtype": dtype_name(p.dtype), "size": list(v.size),
            "requires_grad": p.requires_grad, "pin_memory": p.pin_memory,
            "memory_format": {torch.contiguous_format: 0, torch.channels_last: 1,
                              torch.preserve_format: 2}[p.memory_format],
            "chunks": [[list(c.offsets), list(c.sizes)] for c in v.chunks]})
    storage = []
    for index, info in m.storage_data.items():
        storage.append({
            "fqn": index.fqn, "offset": None if index.offset is None else list(index.offset),
            "index": index.index, "relative_path": info.relative_path,
            "offset_in_file": info.offset, "length": info.length})
    out = {"tensors": tensors, "bytes": byte_items, "storage": storage,
           "version": getattr(m, "version", None),
           "flavor": "1.13" if type(m).__module__.startswith("torch.distributed._shard") else "2",
           "megatron": type(m).__name__ == "MCoreMetadata",
           "all_local_plans": getattr(m, "all_local_plans", None) is not None}
    pd = m.planner_data
    if pd is None:
        out["planner_data"] = None
    elif isinstance(pd, dict) and all(isinstance(p, tuple) for p in pd.values()):
        out["planner_data"] = {k: list(p) for k, p in pd.items()}
    else:
        out["planner_data"] = "other"
    sm = getattr(m, "storage_meta", None)
    out["storage_meta"] = None if sm is None else {
        "checkpoint_id": None if sm.checkpoint_id is None else str(sm.checkpoint_id),
        "save_id": sm.save_id, "load_id": sm.load_id, "modules": list(sm.modules)}
    md = getattr(m, "mcore_data", None)
    out["mcore_data"] = None if md is None else {
        k: (list(v["nd_reformulated_orig_global_shape"])
            if "nd_reformulated_orig_global_shape" in v else None) for k, v in md.items()}
    return out


def describe_state_dict(sd):
    out = {}
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            out[k] = {"kind": "tensor", "dtype": dtype_name(v.dtype), "size": list(v.shape),
                      "values_hex": raw_hex(v)}
        elif isinstance(v, (bytes, bytearray)):
            out[k] = {"kind": "bytes", "bytes_hex": bytes(v).hex()}
        else:
            out[k] = {"kind": "object", "repr": repr(v)}
    return out


def base_state_dict():
    return {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) * 0.25,
        "b": torch.tensor([1.0, -2.0, 3.5, 0.0, 1e-3], dtype=torch.bfloat16),
        "t": torch.arange(6, dtype=torch.int64).reshape(2, 3).t(),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 3, dtype=torch.float16),
        "flags": torch.tensor([[True, False], [False, True]]),
        "step": {"iter": 7, "name": "x"},
        "blob": b"\x00\x01binary",
    }


def make_dcp113(out):
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    # One file per item, no process group.
    sd = base_state_dict()
    ckpt = os.path.join(out, "files")
    dcp.save_state_dict(sd, dcp.FileSystemWriter(ckpt), no_dist=True)
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    with open(os.path.join(out, "files.expected.json"), "w") as f:
        json.dump({"state_dict": describe_state_dict(sd), "metadata": describe_metadata(meta)},
                  f, indent=1, sort_keys=True)

    # A ShardedTensor of two chunks and everything in one file per rank (gloo, one process).
    tmp = tempfile.mkdtemp()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), 1),
                            rank=0, world_size=1)
    full = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    shards = [Shard.from_tensor_and_offsets(full[0:2].clone(), [0, 0], 0),
              Shard.from_tensor_and_offsets(full[2:4].clone(), [2, 0], 0)]
    sd = {"emb": init_from_local_shards(shards, [4, 3]), "norm": torch.ones(3),
          "obj": {"a": 1}}
    ckpt = os.path.join(out, "sharded")
    dcp.save_state_dict(sd, dcp.FileSystemWriter(ckpt, single_file_per_rank=True))
    dist.destroy_process_group()
    shutil.rmtree(tmp)
    with open(os.path.join(ckpt, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    sd["emb"] = full
    with open(os.path.join(out, "sharded.expected.json"), "w") as f:
        json.dump({"state_dict": describe_state_dict(sd), "metadata": describe_metadata(meta)},
                  f, indent=1, sort_keys=True)


def dcp2_metadata(ns, with_extras=True):
    """A torch 2.x Metadata like the files checkpoint's, built from the stand-in classes."""
    def props(dtype, requires_grad=False):
        return ns.TensorProperties(dtype=dtype, requires_grad=requires_grad)

    def tsm(dtype, size, chunks):
        return ns.TensorStorageMetadata(
            props(dtype), torch.Size(size),
            [ns.ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks])

    sdm = {
        "model.w": tsm(torch.float32, [4, 3], [([0, 0], [2, 3]), ([2, 0], [2, 3])]),
        "model.b": tsm(torch.bfloat16, [5], [([0], [5])]),
        "optim.state.0.step": ns.BytesStorageMetadata(),
        "scalar": tsm(torch.float64, [], [([], [])]),
    }
    storage = {
        ns.MetadataIndex("model.w", [0, 0], 0): ns._StorageInfo("__0_0.distcp", 0, 1000),
        ns.MetadataIndex("model.w", [2, 0], 1): ns._StorageInfo("__1_0.distcp", 0, 1000),
        ns.MetadataIndex("model.b", [0], 0): ns._StorageInfo("__0_0.distcp", 1000, 800),
        ns.MetadataIndex("optim.state.0.step"): ns._StorageInfo("__0_0.distcp", 1800, 431),
        ns.MetadataIndex("scalar", [], 0): ns._StorageInfo("__0_0.distcp", 2231, 5_000_000_000),
    }
    m = ns.Metadata(sdm, storage_data=storage, version="1.0.0")
    if with_extras:
        m.planner_data = {"model.w": ("model", "w"), "model.b": ("model", "b"),
                          "optim.state.0.step": ("optim", "state", 0, "step"),
                          "scalar": ("scalar",)}
        m.storage_meta = ns.StorageMeta(checkpoint_id=pathlib.PosixPath("/ckpt/step_100"),
                                        save_id="6f9c1c0e-save", load_id=None,
                                        modules=["model", "optim"])
    return m


def make_metadata(out, dcp113_dir):
    os.makedirs(out, exist_ok=True)
    expected = {}

    def write(name, blob, expect):
        with open(os.path.join(out, name + ".metadata"), "wb") as f:
            f.write(blob)
        expected[name] = expect

    # torch 1.13's own files, and the same objects re-pickled with other protocols.
    for ckpt in ("files", "sharded"):
        with open(os.path.join(dcp113_dir, ckpt, ".metadata"), "rb") as f:
            blob = f.read()
        meta = pickle.loads(blob)
        write("torch113_" + ckpt, blob, describe_metadata(meta))
        for protocol in (2, 3, 5):
            write(f"torch113_{ckpt}_protocol{protocol}", pickle.dumps(meta, protocol=protocol),
                  describe_metadata(meta))

    ns = dcp2_standins.install()
    m = dcp2_metadata(ns)
    for protocol in (2, 4, 5):
        write(f"torch2_protocol{protocol}", pickle.dumps(m, protocol=protocol),
              describe_metadata(m))
    plain = dcp2_metadata(ns, with_extras=False)
    write("torch2_minimal", pickle.dumps(plain, protocol=4), describe_metadata(plain))

    # The memory format as Python < 3.11 pickles enum members: reduce(cls, (value,)).
    saved = ns.TensorProperties.__getstate__
    ns.TensorProperties.__getstate__ = lambda self: (
        self.dtype, self.layout, self.requires_grad,
        ns.ValueReducedEncoding.TORCH_CONTIGUOUS_FORMAT, self.pin_memory)
    write("torch2_enum_by_value", pickle.dumps(m, protocol=4), describe_metadata(m))
    ns.TensorProperties.__getstate__ = saved

    # checkpoint_id as Python 3.13 pickles a path (class pathlib._local.PosixPath), and as a str.
    local = types.ModuleType("pathlib._local")
    local.PosixPath = type("PosixPath", (pathlib.PurePosixPath,), {"__module__": "pathlib._local"})
    sys.modules["pathlib._local"] = local
    m3 = dcp2_metadata(ns)
    m3.storage_meta.checkpoint_id = local.PosixPath("/ckpt", "step_200")
    write("torch2_pathlib_local", pickle.dumps(m3, protocol=4), describe_metadata(m3))
    m2 = dcp2_metadata(ns)
    m2.storage_meta.checkpoint_id = "s3://bucket/ckpt"
    write("torch2_checkpoint_id_str", pickle.dumps(m2, protocol=4), describe_metadata(m2))
    # checkpoint_id as multi-storage-client's DCP writer leaves it: a MultiStoragePath, which
    # pickles as newobj(cls) with the state {"_path": "msc://...", "_internal_path": ...}.
    msc_pathlib = types.ModuleType("multistorageclient.pathlib")

    class MultiStoragePath:
        def __init__(self, path):
            self._path = path
            self._internal_path = pathlib.PurePosixPath("/" + path.split("/", 3)[3])

        def __getstate__(self):
            return {"_path": self._path, "_internal_path": self._internal_path}

        def __str__(self):
            return self._path

    MultiStoragePath.__module__ = "multistorageclient.pathlib"
    MultiStoragePath.__qualname__ = "MultiStoragePath"
    msc_pathlib.MultiStoragePath = MultiStoragePath
    sys.modules.setdefault("multistorageclient", types.ModuleType("multistorageclient"))
    sys.modules["multistorageclient.pathlib"] = msc_pathlib
    m4 = dcp2_metadata(ns)
    m4.storage_meta.checkpoint_id = MultiStoragePath("msc://train/dcp/step_300")
    write("torch2_msc_path", pickle.dumps(m4, protocol=4), describe_metadata(m4))

    # Megatron-Core: an MCoreMetadata (core 0.15) with mcore_data and all_local_plans of
    # MCoreSavePlan / WriteItem objects; and the older form, a plain Metadata with mcore_data.
    mcore_data = {"model.w": {"nd_reformulated_orig_global_shape": (8, 6)}, "model.b": {}}
    plans = [ns.MCoreSavePlan(items=[ns.WriteItem(
        index=ns.MetadataIndex("model.w", [0, 0], 0), type=ns.WriteItemType.SHARD,
        tensor_data=ns.TensorWriteData(
            chunk=ns.ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
            properties=ns.TensorProperties(dtype=torch.float32), size=torch.Size([4, 3])))],
        mcore_data=mcore_data)]
    base = dcp2_metadata(ns, with_extras=False)
    mm = ns.MCoreMetadata(base.state_dict_metadata, storage_data=base.storage_data,
                          version="1.0.0", mcore_data=mcore_data)
    mm.all_local_plans = plans
    write("megatron_mcore_metadata", pickle.dumps(mm, protocol=4), describe_metadata(mm))
    old = dcp2_metadata(ns, with_extras=False)
    old.mcore_data = mcore_data
    old.all_local_plans = plans
    write("megatron_attribute", pickle.dumps(old, protocol=4), describe_metadata(old))

    # Refused: a zstd-compressed item (2.8+ _extensions).
    z = dcp2_metadata(ns)
    key = next(k for k in z.storage_data if k.fqn == "model.b")
    z.storage_data[key].transform_descriptors = ["stream.zstd/1"]
    write("refused_zstd", pickle.dumps(z, protocol=4),
          {"error": "model.b is stored with transform_descriptors ['stream.zstd/1']"})
    # Refused: a storage entry for a chunk that does not exist.
    bad = dcp2_metadata(ns, with_extras=False)
    bad.storage_data[ns.MetadataIndex("model.w", [1, 0], 1)] = ns._StorageInfo("x", 0, 1)
    write("refused_unknown_chunk", pickle.dumps(bad, protocol=4),
          {"error": "storage_data entry for 'model.w' at offset (1, 0) matches no chunk"})

    with open(os.path.join(out, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


def main():
    out = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(__file__))
    make_items(os.path.join(out, "items"))
    make_dcp113(os.path.join(out, "dcp113"))
    make_metadata(os.path.join(out, "metadata"), os.path.join(out, "dcp113"))
    print("fixtures written to", out)


if __name__ == "__main__":
    main()
