"""tessera.torch.save_state / load_state: a fresh model and fresh optimizers resume a run
exactly (the same losses as the run that did not stop): several optimizers and parameter
groups, an LR scheduler and the RNG state in the extra values; under gloo with a tensor-parallel
model whose state dict holds torch ShardedTensors, resumed on 2 ranks and on 1."""

import datetime

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import torch_compat  # noqa: F401 (torch 1.13 on Python 3.11: makes _shard importable)
import tessera
from conftest import free_port


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.drop = torch.nn.Dropout(0.2)  # draws from the global RNG: resumed with it
        self.fc2 = torch.nn.Linear(16, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def batch(step):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(32, 8, generator=gen)
    return x, torch.sin(x[:, :4] * 3)


def make(seed):
    torch.manual_seed(seed)
    net = Net()
    sgd = torch.optim.SGD([{"params": [net.fc1.weight], "lr": 0.1},
                           {"params": [net.fc1.bias], "lr": 0.05, "momentum": 0.5}],
                          lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(net.fc2.parameters(), lr=0.01, betas=(0.8, 0.95))
    scheduler = torch.optim.lr_scheduler.StepLR(sgd, step_size=2, gamma=0.5)
    return net, {"sgd": sgd, "adam": adam}, scheduler


def train(net, optimizers, scheduler, steps):
    losses = []
    for step in steps:
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(net(x), y)
        for o in optimizers.values():
            o.zero_grad()
        loss.backward()
        for o in optimizers.values():
            o.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def test_fresh_model_and_optimizers_resume_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    net, optimizers, scheduler = make(seed=0)
    train(net, optimizers, scheduler, range(5))
    report = tessera.torch.save_state(path, model=net, optimizer=optimizers, step=5,
                                      scheduler=scheduler.state_dict(),
                                      rng=torch.get_rng_state(), note={"run": "a", "n": [1, 2]})
    assert report.bytes_written > 0
    expected = train(net, optimizers, scheduler, range(5, 12))

    fresh, fresh_optimizers, fresh_scheduler = make(seed=1)  # other weights, no state
    assert fresh_optimizers["adam"].state_dict()["state"] == {}
    assert not torch.equal(fresh.fc1.weight, net.fc1.weight)
    extra = tessera.torch.load_state(path, model=fresh, optimizer=fresh_optimizers)
    assert sorted(extra) == ["note", "rng", "scheduler", "step"]
    assert extra["step"] == 5 and extra["note"] == {"run": "a", "n": [1, 2]}
    assert int(fresh.calls) == 5  # buffers too
    assert fresh_optimizers["sgd"].param_groups[1]["momentum"] == 0.5
    assert len(fresh_optimizers["adam"].state[fresh.fc2.weight]) == 3  # step, exp_avg(_sq)
    fresh_scheduler.load_state_dict(extra["scheduler"])
    torch.set_rng_state(extra["rng"])
    assert train(fresh, fresh_optimizers, fresh_scheduler, range(5, 12)) == expected


def test_optimizer_without_model_is_keyed_by_index(tmp_path):
    path = str(tmp_path / "ckpt")
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    adam = torch.optim.Adam(params, lr=0.1)
    sum((p ** 2).sum() for p in params).backward()
    adam.step()
    tessera.torch.save_state(path, optimizer=adam)
    assert tessera.read_metadata(path).find_tensor("optimizer.state.0.exp_avg") is not None
    fresh = torch.optim.Adam([torch.nn.Parameter(torch.zeros(3, 2)),
                              torch.nn.Parameter(torch.zeros(2))], lr=0.5)
    assert tessera.torch.load_state(path, optimizer=fresh) == {}
    assert fresh.param_groups[0]["lr"] == 0.1
    for a, b in zip(params, fresh.param_groups[0]["params"]):
        assert torch.equal(adam.state[a]["exp_avg_sq"], fresh.state[b]["exp_avg_sq"])


def test_mismatches_are_errors_unless_not_strict(tmp_path):
    path = str(tmp_path / "ckpt")
    net, optimizers, scheduler = make(seed=0)
    train(net, optimizers, scheduler, range(2))
    tessera.torch.save_state(path, model=net, optimizer=optimizers, step=2)
    fresh, fresh_optimizers, _ = make(seed=1)
    with pytest.raises(ValueError, match="holds optimizer state; pass optimizer=... \\(or "
                                         "strict=False\\)"):
        tessera.torch.load_state(path, model=fresh)
    with pytest.raises(ValueError, match=r"holds optimizer a dict of \['sgd', 'adam'\], not "
                                         r"a dict of \['adam', 'sgd'\]"):
        tessera.torch.load_state(path, model=fresh, optimizer={
            "adam": fresh_optimizers["adam"], "sgd": fresh_optimizers["sgd"]})
    with pytest.warns(tessera.PartialLoadWarning, match="tessera.torch.load_state"):
        extra = tessera.torch.load_state(path, model=fresh, strict=False)
    assert extra == {"step": 2} and torch.equal(fresh.fc1.weight, net.fc1.weight)
    with pytest.raises(ValueError, match="not saved by tessera.torch.save_state"):
        tessera.save({"w": torch.ones(1)}, path + "_plain")
        tessera.torch.load_state(path + "_plain", model=fresh)


# ---- tensor parallel, under gloo -------------------------------------------------------------

IN, HIDDEN, OUT = 6, 8, 3
DTYPE = torch.float64


class TPNet(torch.nn.Module):
    """fc2(relu(fc1(x))) with the hidden dimension split over the ranks (fc1 by rows, fc2 by
    columns; fc2's bias replicated). Its state_dict holds torch ShardedTensors of the local
    pieces, views of the parameters."""

    def __init__(self, rank, size, seed):
        super().__init__()
        self.rank, self.size = rank, size
        gen = torch.Generator().manual_seed(seed)  # the same full model for any size
        self.lo, self.hi = HIDDEN * rank // size, HIDDEN * (rank + 1) // size
        full = {"fc1.weight": torch.randn(HIDDEN, IN, generator=gen, dtype=DTYPE),
                "fc1.bias": torch.randn(HIDDEN, generator=gen, dtype=DTYPE),
                "fc2.weight": torch.randn(OUT, HIDDEN, generator=gen, dtype=DTYPE),
                "fc2.bias": torch.randn(OUT, generator=gen, dtype=DTYPE)}
        self.fc1 = torch.nn.Linear(IN, self.hi - self.lo, dtype=DTYPE)
        self.fc2 = torch.nn.Linear(self.hi - self.lo, OUT, dtype=DTYPE)
        with torch.no_grad():
            self.fc1.weight.copy_(full["fc1.weight"][self.lo:self.hi])
            self.fc1.bias.copy_(full["fc1.bias"][self.lo:self.hi])
            self.fc2.weight.copy_(full["fc2.weight"][:, self.lo:self.hi])
            self.fc2.bias.copy_(full["fc2.bias"])
        if size > 1:
            self._register_state_dict_hook(TPNet._sharded)

    @staticmethod
    def _sharded(module, state, prefix, local_metadata):
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharded_tensor import Shard, init_from_local_shards
        for name, dim in (("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1)):
            local = state[prefix + name]
            shape = list(local.shape)
            shape[dim] = HIDDEN
            offsets = [module.lo if d == dim else 0 for d in range(len(shape))]
            shard = Shard(local, ShardMetadata(offsets, list(local.shape),
                                               f"rank:{module.rank}/cpu"))
            state[prefix + name] = init_from_local_shards([shard], *shape)
        return state

    def step(self, x, y, optimizer):
        partial = torch.relu(self.fc1(x)) @ self.fc2.weight.T
        total = partial.detach().clone()
        if self.size > 1:
            dist.all_reduce(total)
        total.requires_grad_()
        loss = ((total + self.fc2.bias - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        partial.backward(total.grad)
        optimizer.step()
        return loss.item()


def tp_batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(16, IN, generator=gen, dtype=DTYPE)
    return x, torch.tanh(x[:, :OUT])


def tp_optimizer(net):
    return torch.optim.Adam([{"params": [net.fc1.weight, net.fc2.weight], "lr": 0.02},
                             {"params": [net.fc1.bias, net.fc2.bias], "lr": 0.01}])


def tp_worker(rank, size, port, path, out):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        comm = tessera.torch_dist_comm()
        torch.manual_seed(rank)
        net = TPNet(rank, size, seed=0)
        optimizer = tp_optimizer(net)
        for step in range(3):
            net.step(*tp_batch(step), optimizer)
        rng = torch.get_rng_state()  # differs between the ranks (seeded by rank)
        tessera.torch.save_state(path, model=net, optimizer=optimizer, comm=comm, step=3,
                                 rng=tessera.torch.per_rank(rng))
        expected = [net.step(*tp_batch(step), optimizer) for step in range(3, 6)]

        fresh = TPNet(rank, size, seed=1)
        fresh_optimizer = tp_optimizer(fresh)
        torch.manual_seed(1234)
        extra = tessera.torch.load_state(path, model=fresh, optimizer=fresh_optimizer,
                                         comm=comm)
        assert extra["step"] == 3
        assert torch.equal(extra["rng"], rng)  # this rank's own
        resumed = [fresh.step(*tp_batch(step), fresh_optimizer) for step in range(3, 6)]
        assert resumed == expected, (resumed, expected)
        if rank == 0:
            torch.save((expected, rng), out)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_resume_on_2_gloo_ranks_and_on_1(tmp_path):
    path, out = str(tmp_path / "ckpt"), str(tmp_path / "losses.pt")
    mp.start_processes(tp_worker, args=(2, free_port(), path, out), nprocs=2, join=True,
                       start_method="spawn")
    metadata = tessera.read_metadata(path)
    shapes = {t.key: list(t.shape) for t in metadata.tensors}
    # The moments of the sharded weights are saved as pieces of one global tensor.
    assert shapes["optimizer.state.fc2.weight.exp_avg"] == [OUT, HIDDEN]
    assert len(metadata.find_tensor("optimizer.state.fc1.weight.exp_avg_sq").chunks) == 2
    assert sorted(o.key for o in metadata.objects if o.key.startswith("extra.rng")) == [
        "extra.rng/rank_0", "extra.rng/rank_1"]

    # One process, an unsharded model: the same run continues (to rounding: the hidden
    # dimension is summed in another order).
    net = TPNet(0, 1, seed=2)
    optimizer = tp_optimizer(net)
    # The per-rank RNG belongs to the 2 ranks of the save: one process must say which it takes.
    with pytest.raises(tessera.InvalidArgumentError,
                       match="extra 'rng' was saved per rank by 2 ranks; this run has 1"):
        other = TPNet(0, 1, seed=2)
        tessera.torch.load_state(path, model=other, optimizer=tp_optimizer(other))
    extra = tessera.torch.load_state(path, model=net, optimizer=optimizer,
                                     per_rank_map=lambda rank, world_size, saved: rank)
    expected, rng = torch.load(out)
    assert extra["step"] == 3 and torch.equal(extra["rng"], rng)  # rank 0's
    resumed = [net.step(*tp_batch(step), optimizer) for step in range(3, 6)]
    assert resumed == pytest.approx(expected, rel=1e-9), (resumed, expected)


# ---- parameters matched to their state-dict entries by identity (issue 22, defect 12) -------

ROWS, COLS = 6, 5


class Renamed(torch.nn.Module):
    """Tensor-parallel rows of one weight, registered as the parameter `fc1_weight` and exposed
    in the state dict as `fc1.weight`, a tessera.ShardedTensor of this rank's rows: the names of
    named_parameters() and of the state dict differ."""

    def __init__(self, rank, size, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        full = torch.randn(ROWS, COLS, generator=gen)
        self.rows = ROWS // size
        self.lo = rank * self.rows
        self.fc1_weight = torch.nn.Parameter(full[self.lo:self.lo + self.rows].clone())
        self.bias = torch.nn.Parameter(torch.zeros(COLS))  # replicated, the same on all ranks
        self._register_state_dict_hook(Renamed._expose)

    @staticmethod
    def _expose(module, state, prefix, local_metadata):
        local = state.pop(prefix + "fc1_weight")
        state[prefix + "fc1.weight"] = tessera.ShardedTensor(local, (ROWS, COLS), (module.lo, 0))
        return state

    def loss(self, rank, step):
        gen = torch.Generator().manual_seed(10 * step + rank)  # each rank its own data
        x = torch.randn(3, self.rows, generator=gen)
        return ((x @ self.fc1_weight + self.bias) ** 2).mean()


def renamed_run(rank, size):
    torch.manual_seed(0)
    net = Renamed(rank, size, seed=0)
    optimizer = torch.optim.Adam([net.fc1_weight], lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        net.loss(rank, step).backward()
        optimizer.step()
    return net, optimizer


def test_optimizer_state_follows_its_parameter_by_identity(ckpt):
    """The Adam moments of a tensor-parallel weight whose parameter name differs from its
    state-dict key are saved sharded like the weight (before, each rank's moments were taken
    for replicas and rank 0's kept), and resume on 2 ranks and on 1."""
    saved = {}

    def save(comm):
        net, optimizer = renamed_run(comm.rank, comm.size)
        saved[comm.rank] = optimizer.state[net.fc1_weight]["exp_avg"].clone()
        tessera.torch.save_state(ckpt, model=net, optimizer=optimizer, comm=comm)

    tessera.run_local(2, save)
    exp_avg = tessera.read_metadata(ckpt).find_tensor("optimizer.state.fc1_weight.exp_avg")
    assert list(exp_avg.shape) == [ROWS, COLS] and len(exp_avg.chunks) == 2
    whole = torch.cat([saved[0], saved[1]])
    assert not torch.equal(saved[0], saved[1])

    def resume(comm):
        net = Renamed(comm.rank, comm.size, seed=1)
        optimizer = torch.optim.Adam([net.fc1_weight], lr=0.1)
        tessera.torch.load_state(ckpt, model=net, optimizer=optimizer, comm=comm)
        return optimizer.state[net.fc1_weight]["exp_avg"]

    assert torch.equal(torch.cat(tessera.run_local(2, resume)), whole)
    assert torch.equal(tessera.run_local(1, resume)[0], whole)


def test_state_of_a_parameter_no_entry_holds_is_refused(ckpt):
    """A parameter the state dict exposes only as a copy cannot be matched to its entry: its
    state is refused, naming it, on every rank (not saved as rank 0's)."""
    class Copied(Renamed):
        @staticmethod
        def _expose(module, state, prefix, local_metadata):
            local = state.pop(prefix + "fc1_weight").clone()  # a copy, not a view
            state[prefix + "fc1.weight"] = tessera.ShardedTensor(local, (ROWS, COLS),
                                                                 (module.lo, 0))
            return state

    def save(comm):
        net, optimizer = renamed_run(comm.rank, comm.size)
        net._state_dict_hooks.clear()
        net._register_state_dict_hook(Copied._expose)
        with pytest.raises(ValueError) as info:
            tessera.torch.save_state(ckpt, model=net, optimizer=optimizer, comm=comm)
        return str(info.value)

    for message in tessera.run_local(2, save):
        assert "optimizer state 'exp_avg' of parameter 'fc1_weight': no entry of the model's " \
               "state dict holds this parameter" in message, message


def test_replicas_that_differ_fail_the_save_naming_key_and_ranks(ckpt):
    """A replicated tensor (saved from rank 0 only) that differs across ranks: save_state
    checks every replica by default, tessera.save those of at most 1 MiB; check_replicas=False
    saves rank 0's."""
    def save(comm, **options):
        state = {"small": torch.full((3,), float(comm.rank % 2)),
                 "big": torch.full((300000,), float(comm.rank)),
                 "same": torch.ones(4)}
        try:
            tessera.save(state, ckpt, comm=comm, **options)
        except tessera.InvalidArgumentError as e:
            return str(e)
        return None

    messages = tessera.run_local(3, save)
    assert "the replicas of tensor 'small' differ across ranks (ranks 0, 2 hold one value; " \
           "rank 1 holds one value)" in messages[0], messages
    assert all("replicas of tensor 'small'" in m for m in messages)
    assert all(m is None for m in tessera.run_local(3, lambda c: save(c, check_replicas=False)))
    # The big one only when every replica is checked.
    def save_big(comm, **options):
        state = {"big": torch.full((300000,), float(comm.rank))}
        try:
            tessera.save(state, ckpt, comm=comm, **options)
        except tessera.InvalidArgumentError as e:
            return str(e)
        return None

    assert tessera.run_local(2, save_big) == [None, None]
    assert all("tensor 'big'" in m for m in tessera.run_local(2, lambda c: save_big(
        c, check_replicas="all")))
    # A box of a sharded tensor held by two ranks under two replica ids.
    def save_box(comm):
        piece = tessera.ShardedTensor(torch.full((2, 3), float(comm.rank)), (2, 3), (0, 0),
                                      replica_id=comm.rank)
        with pytest.raises(tessera.InvalidArgumentError, match=r"tensor 'w' box \[0:2, 0:3\]"):
            tessera.save({"w": piece}, ckpt, comm=comm)

    tessera.run_local(2, save_box)
    with pytest.raises(ValueError, match="check_replicas must be"):
        tessera.save({"w": torch.ones(2)}, ckpt, check_replicas="sometimes")


def replica_worker(rank, size, port, path):
    """Replicas that differ across 2 gloo processes, and those that do not (see below)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=60))
    try:
        comm = tessera.torch_dist_comm()
        differing = {"bias": torch.full((4,), float(rank)), "same": torch.ones(3)}
        sides = "(rank 0 holds one value; rank 1 holds one value)"
        # tessera.save: a differing replica fails the save on every rank, naming it.
        with pytest.raises(tessera.InvalidArgumentError) as info:
            tessera.save(differing, path + "_differ", comm=comm)
        assert f"the replicas of tensor 'bias' differ across ranks {sides}" in str(info.value)
        tessera.save({"bias": torch.ones(4), "same": torch.ones(3)}, path + "_equal", comm=comm)
        tessera.save(differing, path + "_unchecked", comm=comm, check_replicas="none")
        # A rank-local save and a one-rank save compare nothing (no message between ranks).
        tessera.save(differing, path + "_local", comm=comm, collective=False, save_tag="t")
        tessera.save(differing, f"{path}_alone{rank}", comm=tessera.single_rank_comm())

        # save_state: a model whose parameters are equal on both ranks, the Adam moments not
        # (each rank stepped on its own data, without an all-reduce).
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 2)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
        start = {k: v.clone() for k, v in net.state_dict().items()}
        net(torch.full((1, 3), float(rank + 1))).sum().backward()
        optimizer.step()
        net.load_state_dict(start)
        with pytest.raises(tessera.InvalidArgumentError) as info:
            tessera.torch.save_state(path + "_state", model=net, optimizer=optimizer, comm=comm)
        assert f"the replicas of tensor 'optimizer.state.weight.exp_avg' differ across ranks " \
               f"{sides}" in str(info.value), info.value
        tessera.torch.save_state(path + "_state_unchecked", model=net, optimizer=optimizer,
                                 comm=comm, save_options={"check_replicas": "none"})
        # The same data on both ranks: the moments are equal, the save goes through.
        optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
        net.zero_grad()
        net(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        tessera.torch.save_state(path + "_state_equal", model=net, optimizer=optimizer,
                                 comm=comm)
    finally:
        dist.destroy_process_group()


def test_replicas_that_differ_on_2_gloo_processes_fail_the_save(ckpt):
    """tessera.save and tessera.torch.save_state over gloo: replicas that differ across the
    ranks fail the save on every rank (naming the key and the ranks) and commit nothing;
    equal replicas save; check_replicas="none", a rank-local save and a one-rank save do not
    compare (rank 0's value is kept)."""
    mp.start_processes(replica_worker, args=(2, free_port(), ckpt), nprocs=2, join=True,
                       start_method="spawn")
    for failed in (ckpt + "_differ", ckpt + "_state"):
        with pytest.raises(OSError):  # the failed save committed nothing
            tessera.read_metadata(failed)
    assert torch.equal(tessera.load_all(ckpt + "_equal")["bias"], torch.ones(4))
    assert torch.equal(tessera.load_all(ckpt + "_unchecked")["bias"], torch.zeros(4))
    assert torch.equal(tessera.load_all(ckpt + "_local")["bias"], torch.zeros(4))
    for rank in range(2):
        assert torch.equal(tessera.load_all(f"{ckpt}_alone{rank}")["bias"],
                           torch.full((4,), float(rank)))
    for saved in (ckpt + "_state_unchecked", ckpt + "_state_equal"):
        assert tessera.read_metadata(saved).num_ranks == 2
