"""tessera.load(..., cast_dtypes=True): float tensors load into another float dtype, sharded or
whole, with torch's rounding; without it a mismatch names the key, both dtypes and the Python
argument that allows it."""

import numpy as np
import pytest
import torch

import tessera


@pytest.fixture
def saved(ckpt):
    """A float32 tensor saved by 2 ranks (row halves), and an int32 one."""
    torch.manual_seed(0)
    full = torch.randn(64, 48) * 100
    full[0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])

    def save(comm):
        rows = slice(32 * comm.rank, 32 * comm.rank + 32)
        tessera.save({"w": tessera.ShardedTensor(full[rows].clone(), (64, 48),
                                                 (32 * comm.rank, 0)),
                      "count": torch.arange(6, dtype=torch.int32)}, ckpt, comm=comm)

    tessera.run_local(2, save)
    return ckpt, full


def _same(a, b):
    """Equal values, NaN equal to NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(
        torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_float32_loads_into_other_float_dtypes_resharded(saved, dtype):
    path, full = saved

    def load(comm):  # 3 ranks, a row band each across the saved halves, in `dtype`
        rows = [(0, 20), (20, 50), (50, 64)][comm.rank]
        out = torch.zeros(rows[1] - rows[0], 48, dtype=dtype)
        report = tessera.load({"w": tessera.ShardedTensor(out, (64, 48), (rows[0], 0)),
                               "count": torch.zeros(6, dtype=torch.int32)}, path, comm=comm,
                              cast_dtypes=True)
        assert report.bytes_needed == out.numel() * out.element_size() + 6 * 4
        return out

    got = torch.cat(tessera.run_local(3, load))
    # torch's own conversion rounds to nearest even, as tessera does.
    assert _same(got, full.to(dtype))


def test_mismatch_without_cast_names_key_dtypes_and_python_argument(saved):
    path, _ = saved
    out = torch.zeros(64, 48, dtype=torch.bfloat16)
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.load({"w": out, "count": torch.zeros(6, dtype=torch.int32)}, path)
    message = str(info.value)
    assert "'w'" in message and "F32" in message and "BF16" in message, message
    assert "pass cast_dtypes=True" in message, message
    assert "LoadOptions" not in message, message
    assert (out == 0).all()


def test_integers_are_never_cast(saved):
    path, _ = saved
    with pytest.raises(tessera.InvalidArgumentError, match="'count'.*I32.*F32") as info:
        tessera.load({"w": torch.zeros(64, 48), "count": torch.zeros(6)}, path, cast_dtypes=True)
    assert "LoadOptions" not in str(info.value)


def test_numpy_float16_and_torch_state_dict(saved):
    """NumPy arrays take the option too; so does a plain (unsharded) load."""
    path, full = saved
    w = np.zeros((64, 48), np.float16)
    tessera.load({"w": w, "count": np.zeros(6, np.int32)}, path, cast_dtypes=True)
    assert _same(torch.from_numpy(w), full.to(torch.float16))


def test_megatron_load_takes_cast_dtypes(ckpt):
    """tessera.megatron.load passes cast_dtypes on: a float32 save into a bfloat16 model."""
    from megatron.core.dist_checkpointing import ShardedTensor as MegatronShardedTensor
    from tessera import megatron as dist_checkpointing

    weight = torch.randn(8, 6)
    dist_checkpointing.save({"w": MegatronShardedTensor.from_rank_offsets("w", weight)}, ckpt)
    target = torch.zeros(8, 6, dtype=torch.bfloat16)
    request = {"w": MegatronShardedTensor.from_rank_offsets("w", target)}
    with pytest.raises(tessera.InvalidArgumentError, match="pass cast_dtypes=True"):
        dist_checkpointing.load(request, ckpt)
    dist_checkpointing.load(request, ckpt, cast_dtypes=True)
    assert torch.equal(target, weight.to(torch.bfloat16))
