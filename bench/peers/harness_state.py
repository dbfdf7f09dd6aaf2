"""The state every system of bench/peers/harness.py saves and loads, built in each rank.

Two kinds (--state):

* "megatron" (default): the Megatron-style workload of `tessera bench io`
  (src/workload/model_state.cc, described in bench/peers/dcp_bench.py): for L = 4 layers,
  hidden h, ffn = vocab = 4h, the BF16 parameters

      embedding.word_embeddings.weight [vocab, h]
      decoder.layers.{l}.input_layernorm.weight [h]
      decoder.layers.{l}.self_attention.linear_qkv.weight [3h, h]
      decoder.layers.{l}.self_attention.linear_proj.weight [h, h]
      decoder.layers.{l}.mlp.linear_fc1.weight [ffn, h]
      decoder.layers.{l}.mlp.linear_fc2.weight [h, ffn]
      decoder.final_layernorm.weight [h]

  each with its F32 Adam moments optimizer.exp_avg.<key> and optimizer.exp_avg_sq.<key>, and
  a small object optimizer.step (b"step=1000"). h = int(sqrt(size / 10 / (12 L + 4))) as in
  ModelConfig::ForBytes, rounded down to a multiple of 8 so that every dimension divides
  evenly over 2 or 4 ranks (Megatron's ShardedTensor.from_rank_offsets needs equal
  fragments). Element values: (crc32(key) + global linear index) % 251, exact in BF16 and F32.

* "transformers": a LlamaForCausalLM built from a LlamaConfig (no download; F32 weights,
  untied lm_head, 4 layers, vocab 4h, head dim 64, hidden h sized from --size at 12 bytes a
  parameter), sharded with FSDP2 fully_shard on the CPU mesh, one AdamW step on random tokens,
  then torch.distributed.checkpoint.state_dict.get_state_dict. The model's and the
  optimizer's state dicts are flattened to dotted keys ("model.<fqn>", "optim.state.<fqn>.
  exp_avg", "optim.state.<fqn>.step", a plain replicated scalar tensor) and the optimizer's
  param_groups become one pickled object, so every system gets the same flat dict.

Every tensor is a DTensor on a 1-D CPU DeviceMesh of all ranks, placed Shard(0) (the save
layout; FSDP2 places its parameters so too). Each rank also holds two zeroed targets: the
same layout (Shard(0)) for the load, and the resharded layout for the resharded load:
Shard(1) (columns) for tensors of two or more dimensions, Replicate() for 1-D tensors (a
1-D tensor has no second dimension to shard).
"""

from __future__ import annotations

import math
import pickle
import re
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, zeros
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

Layout = Literal["save", "load", "reshard"]
LOAD_NAMES = {"save": "save", "load": "load (same layout)", "reshard": "resharded load"}
STEP_VALUE = b"step=1000"
LAYERS = 4


def parse_size(text: str) -> int:
    """Bytes of a size such as 512MiB, 2GiB, 8GiB, 1000000 or 1.5GB."""
    units = {"": 1, "B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "K": 1 << 10,
             "M": 1 << 20, "G": 1 << 30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([A-Za-z]*)", text.strip())
    if not match or match.group(2) not in units:
        raise ValueError(f"bad size {text!r}: expected e.g. 512MiB, 2GiB, 8GiB")
    return int(round(float(match.group(1)) * units[match.group(2)]))


def megatron_config(size: int) -> dict[str, int]:
    """ModelConfig::ForBytes, with the hidden size rounded down to a multiple of 8."""
    h = max(8, int(math.sqrt(size / 10.0 / (12.0 * LAYERS + 4.0))) // 8 * 8)
    return {"hidden": h, "ffn": 4 * h, "vocab": 4 * h, "layers": LAYERS}


def megatron_params(c: dict[str, int]) -> list[tuple[str, tuple[int, ...]]]:
    """(key, global shape) of every parameter, as Params(config, pp=1)."""
    h = c["hidden"]
    out: list[tuple[str, tuple[int, ...]]] = [("embedding.word_embeddings.weight",
                                               (c["vocab"], h))]
    for layer in range(c["layers"]):
        p = f"decoder.layers.{layer}."
        out += [(p + "input_layernorm.weight", (h,)),
                (p + "self_attention.linear_qkv.weight", (3 * h, h)),
                (p + "self_attention.linear_proj.weight", (h, h)),
                (p + "mlp.linear_fc1.weight", (c["ffn"], h)),
                (p + "mlp.linear_fc2.weight", (h, c["ffn"]))]
    out.append(("decoder.final_layernorm.weight", (h,)))
    return out


def pattern(key: str, offsets: tuple[int, ...], sizes: tuple[int, ...],
            global_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The values of the box (offsets, sizes) of tensor `key`: (crc32(key) + global linear
    index) % 251, built from a per-row and a per-column term (1-D and 2-D tensors)."""
    base = zlib.crc32(key.encode()) % 251
    if len(sizes) == 1:
        index = torch.arange(offsets[0], offsets[0] + sizes[0], dtype=torch.int64) + base
        return (index % 251).to(dtype)
    assert len(sizes) == 2, key
    rows = torch.arange(offsets[0], offsets[0] + sizes[0], dtype=torch.int64)
    row_term = ((rows * global_shape[1] + base) % 251).to(torch.int16).view(-1, 1)
    col_term = torch.arange(offsets[1], offsets[1] + sizes[1], dtype=torch.int64) % 251
    values = row_term + col_term.to(torch.int16).view(1, -1)  # in [0, 500]
    values -= (values >= 251).to(torch.int16) * 251
    return values.to(dtype)


def reshard_placement(ndim: int) -> Shard | Replicate:
    """The placement of the resharded load: columns, or whole for a 1-D tensor."""
    return Shard(1) if ndim >= 2 else Replicate()


def local_of(value: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard (a view of its memory) or the
    tensor itself."""
    return value.to_local() if isinstance(value, DTensor) else value


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's memory (for bit-exact comparisons and I/O)."""
    return tensor.reshape(-1).view(torch.uint8)


@dataclass
class Leaf:
    """One tensor of the state: the saved value and the two zeroed load targets."""

    key: str
    saved: torch.Tensor   # a DTensor placed Shard(0), or a plain (replicated) tensor
    load: torch.Tensor    # same layout as saved, zeroed
    reshard: torch.Tensor  # Shard(1) / Replicate() for a DTensor; a plain tensor stays plain

    def target(self, layout: Layout) -> torch.Tensor:
        """The tensor of `layout`."""
        return {"save": self.saved, "load": self.load, "reshard": self.reshard}[layout]


@dataclass
class BenchState:
    """What one rank saves and loads: tensors (Leaf) and small objects (bytes)."""

    kind: str
    mesh: DeviceMesh
    rank: int
    world: int
    leaves: list[Leaf]
    objects: dict[str, bytes]
    description: dict[str, Any] = field(default_factory=dict)

    def flat(self, layout: Layout, placeholder: Any = b"") -> dict[str, Any]:
        """A new flat state dict of `layout`: key -> DTensor or tensor (shared with this
        state, so a load writes into the targets) and key -> object (the saved bytes for the
        save, `placeholder` for a load)."""
        out: dict[str, Any] = {leaf.key: leaf.target(layout) for leaf in self.leaves}
        for key, value in self.objects.items():
            out[key] = value if layout == "save" else placeholder
        return out

    def local_bytes(self) -> int:
        """Bytes of tensor data this rank holds in the save layout."""
        return sum(local_of(leaf.saved).numel() * local_of(leaf.saved).element_size()
                   for leaf in self.leaves)

    def global_bytes(self) -> int:
        """Bytes of the state: every tensor element once, plus the objects."""
        return (sum(math.prod(leaf.saved.shape) * leaf.saved.element_size()
                    for leaf in self.leaves) + sum(len(v) for v in self.objects.values()))

    def zero(self, layout: Layout) -> None:
        """Zeroes the targets of `layout` (before a load whose values are checked)."""
        assert layout != "save"
        for leaf in self.leaves:
            local_of(leaf.target(layout)).zero_()

    def check(self, loaded: dict[str, Any], layout: Layout, system: str) -> None:
        """Raises unless the targets of `layout` hold, bit for bit, what was saved, and
        `loaded` (the state dict the load returned) holds the saved objects. COLLECTIVE for
        the resharded layout (the expected shard of each tensor comes from redistributing
        the saved one)."""
        for leaf in self.leaves:
            target = leaf.target(layout)
            got = local_of(target)
            if layout == "reshard" and isinstance(leaf.saved, DTensor):
                assert isinstance(target, DTensor)
                want = leaf.saved.redistribute(self.mesh, target.placements).to_local()
            else:
                want = local_of(leaf.saved)
            if tuple(got.shape) != tuple(want.shape) or not torch.equal(
                    as_bytes(got.contiguous()), as_bytes(want.contiguous())):
                raise RuntimeError(f"{system}: {LOAD_NAMES[layout]}: '{leaf.key}' on rank "
                                   f"{self.rank} differs from the saved values")
            if loaded.get(leaf.key) is not None and loaded[leaf.key] is not target:
                other = local_of(loaded[leaf.key])
                if other.data_ptr() != got.data_ptr():
                    raise RuntimeError(f"{system}: {LOAD_NAMES[layout]} returned '{leaf.key}' in "
                                       "other memory than the target it was given")
        for key, value in self.objects.items():
            got_object = loaded.get(key)
            if isinstance(got_object, (bytearray, memoryview)):
                got_object = bytes(got_object)
            if got_object != value:
                raise RuntimeError(f"{system}: {LOAD_NAMES[layout]}: object '{key}' on rank "
                                   f"{self.rank} is {got_object!r}, saved {value!r}")


def _dtensor(local: torch.Tensor, mesh: DeviceMesh, placement: Shard | Replicate,
             shape: tuple[int, ...]) -> DTensor:
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def _targets(saved: torch.Tensor, mesh: DeviceMesh) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed (load, reshard) targets of a saved tensor."""
    if not isinstance(saved, DTensor):
        return torch.zeros_like(saved), torch.zeros_like(saved)
    shape = tuple(saved.shape)
    load = zeros(shape, dtype=saved.dtype, device_mesh=mesh, placements=list(saved.placements))
    reshard = zeros(shape, dtype=saved.dtype, device_mesh=mesh,
                    placements=[reshard_placement(len(shape))])
    return load, reshard


def build_megatron(size: int, mesh: DeviceMesh) -> BenchState:
    """The workload of `tessera bench io` (module docstring), Shard(0) over `mesh`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    c = megatron_config(size)
    leaves: list[Leaf] = []
    for key, shape in megatron_params(c):
        for name, dtype in ((key, torch.bfloat16), (f"optimizer.exp_avg.{key}", torch.float32),
                            (f"optimizer.exp_avg_sq.{key}", torch.float32)):
            local_shape, offset = compute_local_shape_and_global_offset(shape, mesh, [Shard(0)])
            local = pattern(name, tuple(offset), tuple(local_shape), shape, dtype)
            saved = _dtensor(local, mesh, Shard(0), shape)
            load, reshard = _targets(saved, mesh)
            leaves.append(Leaf(name, saved, load, reshard))
    state = BenchState("megatron", mesh, rank, world, leaves, {"optimizer.step": STEP_VALUE})
    state.description = {"model": c, "tensors": len(leaves), "objects": 1,
                         "dtypes": "BF16 parameters, F32 exp_avg and exp_avg_sq"}
    return state


def transformers_config(size: int) -> dict[str, int]:
    """A LlamaConfig's sizes for about `size` bytes of F32 parameters and two F32 moments:
    2 V h + L (4 h^2 + 3 h ffn) parameters with V = 4h, ffn = 8h/3 rounded up to 64 (about
    56 h^2), 12 bytes each; h a multiple of 64 (head dim 64), at least 64."""
    h = max(64, int(math.sqrt(size / 12.0 / 56.0)) // 64 * 64)
    ffn = (8 * h // 3 + 63) // 64 * 64
    return {"hidden": h, "intermediate": ffn, "vocab": 4 * h, "layers": LAYERS,
            "heads": h // 64}


def build_transformers(size: int, mesh: DeviceMesh) -> BenchState:
    """A Llama model (module docstring), FSDP2 on `mesh`, after one AdamW step."""
    import transformers
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    c = transformers_config(size)
    config = transformers.LlamaConfig(
        vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
        num_hidden_layers=c["layers"], num_attention_heads=c["heads"],
        num_key_value_heads=c["heads"], max_position_embeddings=128,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, c["vocab"], (1, 32), generator=torch.Generator().manual_seed(rank))
    model(input_ids=tokens, labels=tokens).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    msd: dict[str, Any] = dict(model_sd)
    osd: dict[str, Any] = dict(optim_sd)
    flat: dict[str, Any] = {f"model.{k}": v for k, v in msd.items()}
    for fqn, entry in osd["state"].items():
        for name, value in entry.items():
            flat[f"optim.state.{fqn}.{name}"] = value
    leaves: list[Leaf] = []
    objects = {"optim.param_groups": pickle.dumps(osd["param_groups"])}
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"transformers state: {key} is a {type(value).__name__}")
        if isinstance(value, DTensor):
            local = value.to_local()
            if not local.is_contiguous() or list(value.placements) != [Shard(0)]:
                raise RuntimeError(f"transformers state: {key} is placed {value.placements} "
                                   f"(contiguous: {local.is_contiguous()}), not Shard(0)")
        load, reshard = _targets(value, mesh)
        leaves.append(Leaf(key, value, load, reshard))
    state = BenchState("transformers", mesh, rank, world, leaves, objects)
    state.description = {
        "model": {"class": "LlamaForCausalLM", **c},
        "parameters": sum(math.prod(v.shape) for v in msd.values()),
        "tensors": len(leaves), "objects": 1,
        "dtypes": "F32 parameters and AdamW moments (after one step), F32 scalar steps",
        "source": "get_state_dict(model, optimizer) of an FSDP2 (fully_shard) model, "
                  "flattened to dotted keys; param_groups pickled into one object"}
    return state


def build_state(kind: str, size: int, mesh: DeviceMesh) -> BenchState:
    """The state of --state `kind` at about `size` bytes."""
    if kind == "megatron":
        return build_megatron(size, mesh)
    if kind == "transformers":
        return build_transformers(size, mesh)
    raise ValueError(f"unknown state {kind!r}")

