"""tessera against the real Hugging Face stack (transformers, safetensors, huggingface_hub;
pinned in requirements/dev.txt, no download: HF_HUB_OFFLINE=1).

- Tiny models built from a config (a Llama with separate lm_head in bfloat16, a GPT-2 whose
  lm_head is tied to its embeddings, in float32) saved by `save_pretrained`, as one file,
  sharded with an index and as a sharded "fp16" variant: `tessera.load_all` reads them bit-exact against `state_dict()`, and
  `tessera.load` reshards them over 2 and 4 ranks, by rows and by columns.
- A training checkpoint of the model saved by tessera over 2 ranks (model, optimizer, step),
  its model's weights exported with `tessera.convert(..., to="safetensors", keys="model.",
  strip_prefix="model.")` (by 1 rank, or 2 sharing the files) loads with `AutoModelForCausalLM.from_pretrained`
  (the config files copied beside, as for any weights-only export), every parameter and
  buffer bit-exact; the `safetensors` package reads every file of the export (with its
  metadata) and the index points every tensor to the file that holds it.
- Files written by `safetensors.torch.save_file` / `safetensors.numpy.save_file` in every
  dtype tessera knows load bit-exact; the dtypes safetensors writes and tessera does not know
  are UnimplementedErrors that name the dtype, the tensor and the file; every tessera dtype exported is
  read back by `safetensors.torch.load_file` bit-exact.
"""

import json
import os
import pathlib

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import safetensors.torch
import torch
import transformers

import tessera
from conftest import rank_box, raw_bytes

INDEX = "model.safetensors.index.json"


def tiny_llama() -> transformers.PreTrainedModel:
    """Untied lm_head, grouped-query attention, bfloat16 weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def tiny_gpt2() -> transformers.PreTrainedModel:
    """lm_head.weight tied to transformer.wte.weight, float32 weights."""
    torch.manual_seed(1)
    config = transformers.GPT2Config(vocab_size=100, n_embd=32, n_layer=2, n_head=4,
                                     n_positions=64, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}
TIED = {"llama": {}, "gpt2": {"lm_head.weight": "transformer.wte.weight"}}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype,
                                                                 got.shape, want.shape)
    assert raw_bytes(got) == raw_bytes(want), what


def plain_state(model: transformers.PreTrainedModel) -> dict:
    """state_dict() detached and made contiguous (what any checkpoint saves)."""
    return {k: v.detach().contiguous() for k, v in model.state_dict().items()}


def save_pretrained(model, directory: pathlib.Path, layout: str) -> None:
    if layout == "single":
        model.save_pretrained(directory)
        assert (directory / "model.safetensors").exists() and not (directory / INDEX).exists()
    elif layout == "sharded":
        model.save_pretrained(directory, max_shard_size="20KB")
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        assert len(set(weight_map.values())) > 2, weight_map
    else:  # model.fp16-0000i-of-0000N.safetensors with model.safetensors.index.fp16.json:
        # tessera reads the shards as a directory without index (FORMAT_HUGGINGFACE.md).
        model.save_pretrained(directory, max_shard_size="20KB", variant="fp16")
        assert (directory / "model.safetensors.index.fp16.json").exists()
        assert len(list(directory.glob("model.fp16-*.safetensors"))) > 2


@pytest.mark.parametrize("layout", ["single", "sharded", "variant"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_save_pretrained_loads_whole_and_resharded(tmp_path, name, layout):
    model = MODELS[name]()
    state = plain_state(model)
    directory = tmp_path / "hf"
    save_pretrained(model, directory, layout)

    loaded = tessera.load_all(str(directory), tensor_type="torch")
    tied = TIED[name]
    # save_pretrained writes a tied weight once, under the name it is tied to.
    assert sorted(loaded) == sorted(set(state) - set(tied))
    for key, tensor in loaded.items():
        assert_same_bits(tensor, state[key], key)
    for key, target in tied.items():
        assert_same_bits(loaded[target], state[key], key)
    assert tessera.read_metadata(str(directory)).user_metadata["format"] == "pt"

    files = {k: state[k] for k in loaded}

    def load_part(comm, dim):
        part = {}
        for key, t in files.items():
            offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, dim)
            part[key] = tessera.ShardedTensor(torch.zeros(sizes, dtype=t.dtype), tuple(t.shape),
                                              tuple(offsets))
        report = tessera.load(part, str(directory), comm=comm, read_sharing="none")
        for key, t in files.items():
            offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, dim)
            want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert_same_bits(part[key].data, want, (comm.rank, key))
        # Read once per job: the union of the boxes, each byte at most once.
        once = tessera.load(part, str(directory), comm=comm, read_sharing="read_once")
        assert once.job_bytes_needed <= once.job_bytes_read <= once.checkpoint_bytes, once
        for key, t in files.items():
            offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, dim)
            want = t[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            assert_same_bits(part[key].data, want, (comm.rank, key))
        return report.bytes_needed, report.bytes_read

    for ranks in (2, 4):
        for dim in (0, 1):
            for needed, read in tessera.run_local(ranks, lambda comm: load_part(comm, dim)):
                assert needed == read > 0  # exactly the bytes of the rank's boxes


def save_with_tessera(state: dict, path: str, ranks: int = 2, training: bool = False) -> None:
    """Every tensor of 2 or more rows split by rows over `ranks` ranks, the others whole on
    rank 0. training: saved as a training checkpoint, {"model": state, "optimizer": {"exp_avg":
    state's shape, zeros}, "step": 100}, instead of state alone."""
    def save(comm):
        part = {}
        for key, t in state.items():
            if t.dim() and t.shape[0] >= comm.size:
                offsets, sizes = rank_box(list(t.shape), comm.rank, comm.size, 0)
                rows = t[offsets[0]:offsets[0] + sizes[0]].clone()
                part[key] = tessera.ShardedTensor(rows, tuple(t.shape), tuple(offsets))
            elif comm.rank == 0:
                part[key] = tessera.ShardedTensor(t.clone(), tuple(t.shape), (0,) * t.dim())
        if training:
            moments = {k: tessera.ShardedTensor(torch.zeros_like(v.data), v.global_shape,
                                                v.global_offset) for k, v in part.items()}
            part = {"model": part, "optimizer": {"exp_avg": moments}, "step": 100}
        tessera.save(part, path, comm=comm)
    tessera.run_local(ranks, save)


def check_export_with_safetensors(directory: pathlib.Path, report, want: dict) -> None:
    """The safetensors package reads every file of the export; the index (if any) maps every
    tensor to the file holding it."""
    shards = [f for f in report.files if f != INDEX]  # report.files: every file written
    seen = {}
    for file_name in shards:
        path = str(directory / file_name)
        with safetensors.safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}, (file_name, f.metadata())
            keys = list(f.keys())
        tensors = safetensors.torch.load_file(path)
        assert sorted(tensors) == sorted(keys)
        for key, tensor in tensors.items():
            assert key not in seen, (key, file_name, seen.get(key))
            seen[key] = file_name
            assert_same_bits(tensor, want[key], key)
    assert sorted(seen) == sorted(want)
    if len(shards) > 1:
        assert sorted(report.files) == sorted(shards + [INDEX])
        index = json.loads((directory / INDEX).read_text())
        assert index["weight_map"] == seen
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in want.values())
    else:
        assert report.files == ["model.safetensors"] and not (directory / INDEX).exists()


@pytest.mark.parametrize("max_shard_size", ["5GB", "20KB"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_tessera_export_loads_with_from_pretrained(tmp_path, name, max_shard_size):
    model = MODELS[name]()
    state = plain_state(model)
    ckpt, export = str(tmp_path / "ckpt"), tmp_path / "export"
    save_with_tessera(state, ckpt, training=True)

    options = dict(to="safetensors", max_shard_size=max_shard_size, keys="model.",
                   strip_prefix="model.")
    if max_shard_size == "5GB":
        report = tessera.convert(ckpt, str(export), **options)
    else:  # the files spread over 2 ranks
        reports = tessera.run_local(2, lambda comm: tessera.convert(ckpt, str(export), comm=comm,
                                                                   **options))
        assert all(r.files_written for r in reports), reports
        report = reports[0]
    assert report.tensors == len(state) and not report.skipped_objects
    assert (len(report.files) > 3) == (max_shard_size == "20KB"), report.files
    check_export_with_safetensors(export, report, state)

    # The export holds weights only: the config travels beside it, as with any export.
    model.config.save_pretrained(export)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export)
    assert type(loaded) is type(model)
    got = plain_state(loaded)
    assert sorted(got) == sorted(state)
    for key, tensor in got.items():
        assert_same_bits(tensor, state[key], key)
    for key, target in TIED[name].items():  # still tied after loading
        assert loaded.state_dict()[key].data_ptr() == loaded.state_dict()[target].data_ptr()
    # It computes what the model saved by save_pretrained computes once loaded (both in eval
    # mode and with the attention implementation from_pretrained picks).
    model.save_pretrained(tmp_path / "reference")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference")
    tokens = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, reference(tokens).logits)


def test_bfloat16_export_matches_torch_rounding_and_loads(tmp_path):
    """`dtype=torch.bfloat16` rounds as torch's `.to(torch.bfloat16)` does, bit for bit, and
    the export loads in bfloat16."""
    model = tiny_gpt2()
    state = plain_state(model)
    ckpt, export = str(tmp_path / "ckpt"), tmp_path / "export"
    save_with_tessera(state, ckpt, ranks=3)
    report = tessera.convert(ckpt, str(export), to="safetensors", dtype=torch.bfloat16,
                             max_shard_size="10KB")
    want = {k: v.to(torch.bfloat16) for k, v in state.items()}
    check_export_with_safetensors(export, report, want)
    model.config.save_pretrained(export)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.bfloat16)
    for key, tensor in plain_state(loaded).items():
        assert_same_bits(tensor, want[key], key)


# Every dtype tessera knows, as torch names it, and safetensors' name of it.
TORCH_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64",
}
# What safetensors writes from torch and tessera does not hold (include/tessera/dtype.h).
UNKNOWN_TO_TESSERA = {torch.complex64: "C64", torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
                      torch.float8_e5m2fnuz: "F8_E5M2FNUZ", torch.float8_e8m0fnu: "F8_E8M0",
                      torch.float4_e2m1fn_x2: "F4"}


def random_tensor(dtype: torch.dtype, shape, seed: int) -> torch.Tensor:
    """Random bits of `dtype` (NaNs and all): any byte pattern must come back unchanged."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (data & 1).bool().reshape(shape)
    return data.view(dtype).reshape(shape)


def test_every_dtype_saved_by_safetensors_torch_loads_bit_exact(tmp_path):
    tensors = {f"t.{name}": random_tensor(dtype, (3, 5), i)
               for i, (dtype, name) in enumerate(TORCH_DTYPES.items())}
    tensors["scalar"] = torch.tensor(2.5)
    tensors["empty"] = torch.zeros(0, 4)
    path = str(tmp_path / "model.safetensors")
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt", "note": "x"})
    loaded = tessera.load_all(path, tensor_type="torch")
    assert sorted(loaded) == sorted(tensors)
    for key, tensor in tensors.items():
        assert_same_bits(loaded[key], tensor, key)
    assert tessera.read_metadata(path).user_metadata == {"format": "pt", "note": "x"}
    assert tessera.verify(str(tmp_path)).files_checked == 1

    # Resharded by rows over 2 ranks (1 row and 2), every dtype; rank 1 also takes the rest.
    def load_rows(comm):
        part = {k: tessera.ShardedTensor(torch.zeros(1 + comm.rank, 5, dtype=t.dtype), (3, 5),
                                         (comm.rank, 0))
                for k, t in tensors.items() if k.startswith("t.")}
        if comm.rank == 1:
            part.update({k: torch.ones_like(tensors[k]) for k in ("scalar", "empty")})
        tessera.load(part, path, comm=comm)
        for k, t in part.items():
            rows = tensors[k][comm.rank:2 * comm.rank + 1] if k.startswith("t.") else tensors[k]
            assert_same_bits(getattr(t, "data", t), rows, (comm.rank, k))
    tessera.run_local(2, load_rows)


def test_every_numpy_dtype_saved_by_safetensors_numpy_loads_bit_exact(tmp_path):
    rng = np.random.default_rng(3)
    dtypes = [np.float64, np.float32, np.float16, np.int64, np.int32, np.int16, np.int8,
              np.uint8, np.uint16, np.uint32, np.uint64]
    arrays = {f"a.{np.dtype(d).name}": rng.integers(0, 256, 8 * 6, dtype=np.uint8).view(d)
              .reshape(2, -1) for d in dtypes}
    arrays["a.bool"] = rng.integers(0, 2, (3, 4)).astype(np.bool_)
    safetensors.numpy.save_file(arrays, str(tmp_path / "model.safetensors"))
    loaded = tessera.load_all(str(tmp_path), tensor_type="numpy")
    assert sorted(loaded) == sorted(arrays)
    for key, array in arrays.items():
        assert loaded[key].dtype == array.dtype and loaded[key].shape == array.shape, key
        assert loaded[key].tobytes() == array.tobytes(), key


@pytest.mark.parametrize("dtype", sorted(UNKNOWN_TO_TESSERA, key=str))
def test_a_safetensors_dtype_tessera_lacks_names_it(tmp_path, dtype):
    path = str(tmp_path / "model.safetensors")
    safetensors.torch.save_file({"ok": torch.ones(2), "odd": random_tensor(dtype, (2, 2), 0)},
                                path)
    name = UNKNOWN_TO_TESSERA[dtype]
    # A valid file tessera cannot read: UnimplementedError (not "corrupt"), naming the file,
    # the tensor and the dtype.
    for call in (tessera.read_metadata, tessera.load_all, tessera.verify):
        with pytest.raises(tessera.UnimplementedError) as e:
            call(path)
        assert path in str(e.value) and (
            f'entry "odd": dtype "{name}" is not supported by tessera' in str(e.value)), str(e.value)


def test_every_tessera_dtype_exported_is_read_by_safetensors(tmp_path):
    tensors = {f"t.{name}": random_tensor(dtype, (4, 6), 10 + i)
               for i, (dtype, name) in enumerate(TORCH_DTYPES.items())}
    tensors.update({"scalar": torch.tensor(-1.5, dtype=torch.bfloat16),
                    "empty": torch.zeros(0, 3, dtype=torch.int32)})
    ckpt, export = str(tmp_path / "ckpt"), tmp_path / "export"
    save_with_tessera(tensors, ckpt)
    report = tessera.convert(ckpt, str(export), to="safetensors", max_shard_size="100B")
    assert len(report.files) > 3, report.files
    check_export_with_safetensors(export, report, tensors)
    for file_name in report.files[:-1]:
        with safetensors.safe_open(str(export / file_name), framework="pt") as f:
            for key in f.keys():
                if not key.startswith("t."):
                    continue
                sl = f.get_slice(key)
                assert sl.get_dtype() == TORCH_DTYPES[tensors[key].dtype], key
                assert_same_bits(sl[1:3], tensors[key][1:3], key)
