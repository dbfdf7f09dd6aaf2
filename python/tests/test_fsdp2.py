"""FSDP2 (torch.distributed.fsdp.fully_shard) on CPU with gloo, saved and loaded by tessera as
a DCP user saves and loads: the model's and the optimizer's state from
torch.distributed.checkpoint.state_dict.get_state_dict (DTensors sharded by FSDP2), saved by 2
ranks with tessera.save and, for comparison, with dcp.save; resumed on 3 ranks (a change of
world size: other, uneven shards) with tessera.load and set_state_dict, and with dcp.load. The
loaded state is bit for bit what was saved, and training goes on bit for bit as it does after
DCP's own resume."""

import datetime
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import tessera
from conftest import free_port

STEPS = 3


def build(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, betas=(0.8, 0.9))
    return model, optimizer


def train(model, optimizer, rank, first_step):
    losses = []
    for step in range(first_step, first_step + STEPS):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(4, 8, generator=gen)
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def full_state(model, optimizer):
    """Every tensor of the model's and the optimizer's state, whole (collective)."""
    msd, osd = get_state_dict(model, optimizer)
    out = {f"model.{k}": v.full_tensor() for k, v in msd.items()}
    for name, state in osd["state"].items():
        for k, v in state.items():
            out[f"optim.{name}.{k}"] = v.full_tensor() if hasattr(v, "full_tensor") else v.clone()
    return out


def save_job(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        model, optimizer = build(world)
        train(model, optimizer, rank, 0)
        msd, osd = get_state_dict(model, optimizer)
        assert type(msd["0.weight"]).__name__ == "DTensor"
        state = {"model": msd, "optim": osd, "step": STEPS}
        tessera.save(state, os.path.join(out, "tessera"))  # the default group, as DCP
        dcp.save(state, checkpoint_id=os.path.join(out, "dcp"))
        whole = full_state(model, optimizer)
        if rank == 0:
            torch.save(whole, os.path.join(out, "saved.pt"))
    finally:
        dist.destroy_process_group()


def resume_job(rank, world, port, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        resumed = {}
        for name in ("tessera", "dcp"):
            model, optimizer = build(world)
            msd, osd = get_state_dict(model, optimizer)  # a fresh optimizer's state, allocated
            state = {"model": msd, "optim": osd, "step": None}
            if name == "tessera":
                tessera.load(state, os.path.join(out, name))
            else:
                dcp.load(state, checkpoint_id=os.path.join(out, name))
            assert state["step"] == STEPS
            set_state_dict(model, optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
            loaded = full_state(model, optimizer)
            losses = train(model, optimizer, rank, STEPS)
            resumed[name] = (loaded, losses, full_state(model, optimizer))
        saved = torch.load(os.path.join(out, "saved.pt"), weights_only=True)
        for key, value in saved.items():
            assert torch.equal(resumed["tessera"][0][key], value), key  # bit for bit
        assert resumed["tessera"][1] == resumed["dcp"][1]  # the same losses, exactly
        for key, value in resumed["dcp"][2].items():
            assert torch.equal(resumed["tessera"][2][key], value), key
    finally:
        dist.destroy_process_group()


def test_fsdp2_saved_on_2_ranks_resumes_on_3_as_after_dcp(tmp_path):
    out = str(tmp_path)
    mp.start_processes(save_job, args=(2, free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    metadata = tessera.read_metadata(os.path.join(out, "tessera"))
    assert metadata.num_ranks == 2
    # FSDP2 shards dim 0 of each parameter: 16 rows over 2 ranks, 5 rows as 3 + 2.
    assert sorted(list(c.box.sizes) for c in metadata.find_tensor("model.2.weight").chunks) == [
        [2, 16], [3, 16]]
    tessera.verify(os.path.join(out, "tessera"))
    mp.start_processes(resume_job, args=(3, free_port(), out), nprocs=3, join=True,
                       start_method="spawn")
