"""torch CUDA tensors through tessera: saved from and loaded into GPU memory, ordered on torch's
current stream. Needs a CUDA GPU, so it is not one of the test_*.py files ctest runs on every
machine (test_devices.py covers the same paths up to the first CUDA call): scripts/gpu-check
runs it with pytest on a machine with a GPU.

    PYTHONPATH=build/python python3 -m pytest -q python/tests/cuda_check.py
"""

import os
import resource

import pytest
import torch

import tessera
try:
    from megatron.core.dist_checkpointing import ShardedTensor as MegatronTensor
except ImportError:
    # The GPU machine has no package registry, hence no Megatron-Core. tessera recognises
    # Megatron's ShardedTensor by its fields (python/tessera/_adapters.py), so a dataclass with
    # those fields and from_rank_offsets' meaning for a whole, unsharded tensor stands in for it
    # here; test_megatron.py runs the same path against Megatron's own class.
    import dataclasses

    @dataclasses.dataclass
    class MegatronTensor:  # noqa: D101 (Megatron-Core 0.19's field names and order)
        key: str
        data: "torch.Tensor"
        dtype: "torch.dtype"
        local_shape: tuple
        global_shape: tuple
        global_offset: tuple
        axis_fragmentations: tuple
        replica_id: object = 0
        prepend_axis_num: int = 0
        allow_shape_mismatch: bool = False
        flattened_range: object = None

        @classmethod
        def from_rank_offsets(cls, key: str, data: "torch.Tensor") -> "MegatronTensor":
            """The whole tensor on this rank (no rank offsets), as Megatron builds it."""
            shape = tuple(data.shape)
            return cls(key, data, data.dtype, shape, shape, (0,) * len(shape), (1,) * len(shape))


@pytest.fixture(autouse=True)
def _gpu():
    assert torch.cuda.is_available(), "cuda_check.py needs a CUDA GPU (torch sees none)"
    assert tessera._tessera._built_with_cuda(), "this tessera was built without CUDA"
    torch.cuda.synchronize()


def same_bytes(a, b):
    """Bit for bit (NaNs included), wherever either lives."""
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.numel() == 0 or b.numel() == 0:
        return a.numel() == b.numel() and a.dtype == b.dtype
    return torch.equal(a.view(torch.uint8).cpu(), b.view(torch.uint8).cpu())


def random_state(device="cuda"):
    g = torch.Generator(device=device).manual_seed(7)
    return {
        "model": {
            "w": torch.randn(1000, 1031, device=device, generator=g).to(torch.bfloat16),
            "b": torch.randn(4097, device=device, generator=g),
            "empty": torch.empty(0, 5, device=device),
            "ids": torch.randint(0, 1 << 40, (7,), device=device, generator=g),
        },
        "cpu_too": torch.arange(10, dtype=torch.float64),
        "step": 5,
    }


def like(state, device):
    return {"model": {k: torch.empty_like(v, device=device) for k, v in state["model"].items()},
            "cpu_too": torch.zeros(10, dtype=torch.float64), "step": 0}


@pytest.mark.parametrize("pieces", [dict(), dict(pinned_bytes=8 << 20, device_piece_bytes=1 << 20)])
def test_save_and_load_cuda_tensors(ckpt, pieces):
    state = random_state()
    tessera.save(state, ckpt, **pieces)
    for device in ("cpu", "cuda"):
        out = like(state, device)
        tessera.load(out, ckpt, **pieces)
        for k, v in state["model"].items():
            assert out["model"][k].device.type == device
            assert same_bytes(out["model"][k], v), k
        assert torch.equal(out["cpu_too"], state["cpu_too"])
    assert tessera.load_all(ckpt)["step"] == 5


def test_deferred_async_save_sees_the_work_queued_before_it(ckpt):
    x = torch.ones(16 << 20, device="cuda")  # 64 MiB
    a = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):
        a = a @ a / 64.0  # keeps the current stream busy
    x.fill_(3.0)  # queued behind the products, not done when async_save is called
    handle = tessera.async_save({"x": x, "a": a}, ckpt, staging="deferred")
    handle.wait_staged()
    x.fill_(4.0)  # allowed after wait_staged: the checkpoint keeps 3.0
    handle.wait()
    out = {"x": torch.zeros(16 << 20), "a": torch.empty_like(a, device="cpu")}
    tessera.load(out, ckpt)
    assert torch.all(out["x"] == 3.0)
    assert same_bytes(out["a"], a)


def test_another_current_stream_orders_save_and_load(ckpt):
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        x = torch.full((1 << 22,), 7.0, device="cuda")
        b = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            b = b @ b / 64.0
        x.fill_(8.0)
        tessera.async_save({"x": x}, ckpt, staging="deferred").wait()
        y = torch.zeros(1 << 22, device="cuda")
        tessera.load({"x": y}, ckpt)
        total = y.sum()  # on `side`: ordered after the load's copies
    side.synchronize()
    assert total.item() == 8.0 * (1 << 22)


def test_load_into_cuda_boxes_and_flat_ranges(ckpt):
    w = torch.arange(64 * 100, dtype=torch.float32).reshape(64, 100)
    tessera.save({"w": w}, ckpt)
    box = torch.zeros(20, 30, device="cuda")
    flat = torch.zeros(500, device="cuda")
    tessera.load({"a": tessera.ShardedTensor(box, [64, 100], [5, 40], key="w")}, ckpt)
    assert torch.equal(box.cpu(), w[5:25, 40:70])
    tessera.load({"w": tessera.ShardedTensor(flat, [64, 100], [0, 0], local_shape=[64, 100],
                                             flat_range=(1000, 1500))}, ckpt)
    assert torch.equal(flat.cpu(), w.reshape(-1)[1000:1500])
    as_bf16 = torch.zeros(64, 100, dtype=torch.bfloat16, device="cuda")
    tessera.load({"w": as_bf16}, ckpt, cast_dtypes=True)
    assert torch.equal(as_bf16.cpu(), w.to(torch.bfloat16))


def test_dtensor_with_a_cuda_local_tensor(ckpt):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    port = 29500 + os.getpid() % 1000
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        local = torch.randn(8, 16, device="cuda")
        dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        tessera.save({"dt": dt}, ckpt)
        back = DTensor.from_local(torch.zeros(8, 16, device="cuda"), mesh, [Shard(0)],
                                  run_check=False)
        tessera.load({"dt": back}, ckpt)
        assert torch.equal(back.to_local(), local)
    finally:
        dist.destroy_process_group()


def test_megatron_drop_in_with_cuda_data(ckpt):
    w = torch.randn(6, 4, device="cuda")
    tessera.megatron.save({"model": {"w": MegatronTensor.from_rank_offsets("w", w)},
                           "iteration": 3}, ckpt)
    into = torch.zeros(6, 4, device="cuda")
    result = tessera.megatron.load({"model": {"w": MegatronTensor.from_rank_offsets("w", into)}},
                                   ckpt)
    assert torch.equal(into, w) and result["iteration"] == 3


def test_memory_stays_flat_over_many_async_saves(ckpt):
    state = {f"t{i}": torch.randn(8 << 20, device="cuda") for i in range(8)}  # 256 MiB
    rss = []
    for i in range(30):
        tessera.async_save(state, ckpt, staging="deferred", sync="none").wait()
        if i in (1, 29):
            with open("/proc/self/statm") as f:
                rss.append(int(f.read().split()[1]) * resource.getpagesize())
    assert rss[1] < rss[0] + (128 << 20), rss
