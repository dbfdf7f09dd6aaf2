"""Tensors outside host memory: CUDA tensors go through the device path (exercised here up to
the first CUDA call, since this machine may have no GPU; python/tests/cuda_check.py runs the
rest on a GPU machine, from scripts/gpu-check), and any other device is a clear error naming
the key."""

import numpy as np
import pytest
import torch

import tessera
from tessera import _tessera


def test_tensor_on_another_device_is_an_error_naming_the_key(tmp_path):
    state = {"model": {"w": torch.empty(4, device="meta")}}
    for call in (lambda: tessera.save(state, tmp_path / "a"),
                 lambda: tessera.async_save(state, tmp_path / "b").wait()):
        with pytest.raises(tessera.InvalidArgumentError) as info:
            call()
        assert "tensor 'model.w'" in str(info.value) and "meta" in str(info.value)
    tessera.save({"model": {"w": torch.ones(4)}}, tmp_path / "c")
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.load(state, tmp_path / "c")
    assert "tensor 'model.w'" in str(info.value)


def test_a_sharded_tensor_on_another_device_names_its_key(tmp_path):
    piece = tessera.ShardedTensor(torch.empty(2, 3, device="meta"), [4, 3], [2, 0], key="emb")
    with pytest.raises(tessera.InvalidArgumentError) as info:
        tessera.save({"x": piece}, tmp_path / "a")
    assert "tensor 'emb'" in str(info.value)


def test_cuda_memory_without_a_cuda_device_is_a_clear_error():
    """What a CUDA tensor becomes (add_pointer with its device and stream), on a machine where
    CUDA has no device or tessera was built without it: an error naming the key and CUDA."""
    if torch.cuda.is_available():
        pytest.fail("this test is for machines without a GPU; python/tests/cuda_check.py "
                    "covers CUDA tensors")
    owner = np.zeros(4, dtype=np.float32)
    builder = _tessera.StateBuilder()
    expected = (tessera.FailedPreconditionError if _tessera._built_with_cuda()
                else tessera.UnimplementedError)
    with pytest.raises(expected) as info:
        builder.add_pointer("dev.w", owner.ctypes.data, "F32", [4], owner, cuda_device=0,
                            stream=0)
    assert "tensor 'dev.w'" in str(info.value) and "CUDA device 0" in str(info.value)
    assert len(builder) == 0


def test_device_staging_options_are_keyword_arguments(tmp_path):
    state = {"w": np.arange(10, dtype=np.float32)}
    tessera.save(state, tmp_path / "a", pinned_bytes=1 << 20, device_piece_bytes=1 << 16)
    tessera.async_save(state, tmp_path / "b", pinned_bytes=0, staging="deferred").wait()
    out = {"w": np.zeros(10, dtype=np.float32)}
    tessera.load(out, tmp_path / "a", pinned_bytes=1 << 20, device_piece_bytes=1 << 16)
    assert (out["w"] == state["w"]).all()
    with pytest.raises(TypeError):
        tessera.save(state, tmp_path / "c", pinned_megabytes=1)
