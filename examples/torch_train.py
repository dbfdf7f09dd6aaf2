#!/usr/bin/python3
"""Train a small tensor-parallel MLP with a checkpoint manager, kill it, resume it elsewhere.

    python3 examples/torch_train.py [--train-ranks 2] [--resume-ranks 1] [--steps 12]
        [--save-every 4] [--kill-at 10] [--out DIR]

1. `--train-ranks` processes (torch.distributed, gloo) train a 2-layer MLP whose hidden
   dimension is split over the ranks (Megatron-style tensor parallelism: fc1 by rows, fc2 by
   columns, fc2's bias replicated), with Adam. A tessera.CheckpointManager saves the model, the
   optimizer and each rank's RNG state (per-rank state) every `--save-every` steps, in the
   background (staging="deferred": the copy overlaps the next forward and backward passes and
   is waited for just before the optimizer step, checked with check_unchanged_until_staged),
   keeping the newest 2. At step `--kill-at` rank 0 is killed with SIGKILL, mid-run: whatever
   save was in flight never finishes.
2. `--resume-ranks` processes open the same root: the manager restores the newest checkpoint
   that is whole (its latest committed step, whatever the kill interrupted), into their own
   layout (tessera reshards: each rank reads only the pieces it needs; the per-rank RNG states
   of another world size are mapped explicitly), and train to the end, saving as they go.
3. An uninterrupted run of one process gives the reference: the losses of the killed run and
   of the resumed one must agree with it (float64: only the summation order over the hidden
   dimension differs between rank counts), which is asserted.
"""

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tessera

IN, HIDDEN, OUT = 16, 64, 4
SAMPLES, BATCH, LR = 512, 64, 0.01
DTYPE = torch.float64


def data():
    """A fixed synthetic regression task."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(SAMPLES, IN, generator=gen, dtype=DTYPE)
    teacher = torch.randn(IN, OUT, generator=gen, dtype=DTYPE)
    return x, torch.tanh(x @ teacher) + 0.1 * torch.randn(SAMPLES, OUT, generator=gen,
                                                           dtype=DTYPE)


def batch(step, x, y):
    """The batch of a step depends on the step only: a resumed run sees the same data."""
    index = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(step))[:BATCH]
    return x[index], y[index]


class ShardedMLP:
    """fc2(relu(fc1(x))) with the hidden dimension split over `tp` ranks; this rank holds
    rows [lo, hi) of fc1 and the same columns of fc2."""

    # name -> (global shape, dimension split over the ranks, or None when replicated)
    LAYOUT = {"fc1.weight": ((HIDDEN, IN), 0), "fc1.bias": ((HIDDEN,), 0),
              "fc2.weight": ((OUT, HIDDEN), 1), "fc2.bias": ((OUT,), None)}

    def __init__(self, tp, rank):
        self.tp, self.rank = tp, rank
        self.lo, self.hi = HIDDEN * rank // tp, HIDDEN * (rank + 1) // tp
        gen = torch.Generator().manual_seed(0)  # the same full initial model for any tp
        self.params = {}
        for name, (shape, dim) in self.LAYOUT.items():
            full = torch.randn(shape, generator=gen, dtype=DTYPE) / shape[-1] ** 0.5
            local = full if dim is None else full.narrow(dim, self.lo, self.hi - self.lo)
            self.params[name] = local.contiguous().requires_grad_()

    def sharded(self, name, tensor):
        """`tensor` (this rank's piece of parameter `name`, or of its Adam moment) as a
        tessera.ShardedTensor: its place in the global tensor and its replica id."""
        shape, dim = self.LAYOUT[name]
        if dim is None:  # replicated over the ranks: rank 0 holds the main replica
            return tessera.ShardedTensor(tensor, shape, replica_id=self.rank)
        offset = [self.lo if d == dim else 0 for d in range(len(shape))]
        return tessera.ShardedTensor(tensor, shape, offset)

    def train_step(self, x, y, optimizer, before_update=None):
        """One step; before_update() runs before the parameters and moments change."""
        p = self.params
        hidden = torch.relu(x @ p["fc1.weight"].T + p["fc1.bias"])
        partial = hidden @ p["fc2.weight"].T  # this rank's share of the output
        total = partial.detach().clone()
        if self.tp > 1:
            dist.all_reduce(total)  # row-parallel fc2: sum the shares
        total.requires_grad_()
        loss = ((total + p["fc2.bias"] - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        partial.backward(total.grad)
        if before_update is not None:
            before_update()
        optimizer.step()
        return loss.item()


def state_dict(model, optimizer, step):
    """What a checkpoint holds: every parameter and Adam moment as this rank's shard, and the
    step. The same keys whatever the number of ranks."""
    moments = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.params.items():
        state = optimizer.state[param]
        for moment in moments:
            moments[moment][name] = model.sharded(name, state[moment])
    return {"model": {n: model.sharded(n, p.data) for n, p in model.params.items()},
            "optimizer": moments, "step": step}


def fresh_optimizer(model):
    """Adam with its state created (it creates it on the first step): a restore loads into it."""
    optimizer = torch.optim.Adam(model.params.values(), lr=LR)
    for param in model.params.values():
        optimizer.state[param] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(param),
                                  "exp_avg_sq": torch.zeros_like(param)}
    return optimizer


def run(rank, size, port, args, tag):
    """One rank of a run: restores from the manager's latest checkpoint (if any), trains to the
    end (or, tag "killed", to --kill-at), saving every --save-every steps. Losses go to
    <out>/<tag>.json after every step."""
    comm = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=60))
        comm = tessera.torch_dist_comm()
    torch.set_num_threads(1)
    torch.manual_seed(1000 + rank)  # each rank's own RNG state: per-rank state
    model = ShardedMLP(size, rank)
    optimizer = fresh_optimizer(model)
    root = os.path.join(args.out, "reference" if tag == "reference" else "run")
    manager = tessera.CheckpointManager(root, comm=comm, keep_last=2, staging="deferred",
                                        check_unchanged_until_staged=True, layout=f"tp{size}")
    # The newest checkpoint that is whole (None on a fresh run). Saved by another number of
    # ranks, the per-rank RNG states need a mapping: each rank takes that of rank % saved.
    restored = manager.restore(state_dict(model, optimizer, step=None),
                               per_rank_map=lambda r, n, saved: r % saved)
    first_step = 0
    if restored is not None:
        first_step = restored.step
        torch.set_rng_state(restored.per_rank["rng"][0])
        for param in model.params.values():
            optimizer.state[param]["step"].fill_(first_step)
        if rank == 0:
            skipped = [s for s, _, _ in restored.skipped]
            print(f"[{tag}] {size} rank(s) resumed at step {first_step} from {restored.path} "
                  f"(the manager's latest whole checkpoint; passed over: {skipped or 'none'}); "
                  f"rank 0 read {restored.report.bytes_read} bytes", flush=True)
    else:
        # Adam's state starts at zero, as it would on its first step.
        optimizer = torch.optim.Adam(model.params.values(), lr=LR)

    x, y = data()
    losses, saved = {}, None
    last = args.kill_at if tag == "killed" else args.steps
    for step in range(first_step, last):
        # A save in flight may still be copying the parameters: the optimizer step waits.
        losses[step] = model.train_step(*batch(step, x, y), optimizer,
                                        saved.wait_staged if saved is not None else None)
        torch.randn(1)  # the RNG moves on, so a wrong restore of it would show
        if rank == 0:
            with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
                json.dump(losses, f)
        if (step + 1) % args.save_every == 0 and step + 1 < args.steps and tag != "reference":
            # Returns at once: the copy runs behind the next forward and backward passes, the
            # writing behind the next steps.
            saved = manager.save(step + 1, state_dict(model, optimizer, step + 1),
                                 per_rank={"rng": torch.get_rng_state()})
    if tag == "killed" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash, with a save perhaps in flight
    manager.close()
    if size > 1:
        dist.destroy_process_group()


def launch(size, args, tag):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if tag == "reference" and size == 1:
        run(0, 1, port, args, tag)  # in this process: no spawn
        size = 0
    try:
        if size:
            mp.start_processes(run, args=(size, port, args, tag), nprocs=size, join=True,
                               start_method="spawn")
    except mp.ProcessExitedException as e:
        if tag != "killed" or e.exit_code != -signal.SIGKILL:
            raise
        print(f"[{tag}] rank 0 was killed (SIGKILL) at step {args.kill_at}", flush=True)
    with open(os.path.join(args.out, f"{tag}.json")) as f:
        return {int(k): v for k, v in json.load(f).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-ranks", type=int, default=2)
    parser.add_argument("--resume-ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--kill-at", type=int, default=None,
                        help="the step at which the first run is killed (default: between the "
                             "last two saves)")
    parser.add_argument("--out", default=None, help="directory for checkpoints (default: temp)")
    args = parser.parse_args()
    saves = list(range(args.save_every, args.steps, args.save_every))
    if not saves:
        parser.error("--save-every must leave a checkpoint before the last step")
    args.kill_at = args.kill_at or min(saves[-1] + args.save_every // 2, args.steps - 1)
    if not saves[0] <= args.kill_at < args.steps:
        parser.error(f"--kill-at must lie in [{saves[0]}, {args.steps})")
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or tmp
        os.makedirs(args.out, exist_ok=True)
        start = time.time()
        reference = launch(1, args, "reference")
        killed = launch(args.train_ranks, args, "killed")
        resumed = launch(args.resume_ranks, args, "resumed")
        manager = tessera.CheckpointManager(os.path.join(args.out, "run"))
        print(f"\nthe root holds steps {manager.all_steps()}; latest {manager.latest_step()}")

        print(f"\n{'step':>4}  {'reference, 1 rank':>24}  "
              f"{f'killed run, {args.train_ranks}':>22}  {f'resumed, {args.resume_ranks}':>22}")
        first_resumed = min(resumed)
        for step in range(args.steps):
            a = f"{killed[step]:22.12f}" if step in killed else ""
            b = f"{resumed[step]:22.12f}" if step in resumed else ""
            mark = ("  <- resumed here" if step == first_resumed else
                    "  <- killed here" if step == args.kill_at - 1 else "")
            print(f"{step:>4}  {reference[step]:24.12f}  {a:>22}  {b:>22}{mark}")
        for run_losses in (killed, resumed):
            for step, loss in run_losses.items():
                assert abs(loss - reference[step]) <= 1e-9 * abs(reference[step]), (
                    f"step {step}: loss {loss} differs from the reference {reference[step]}")
        assert first_resumed <= args.kill_at and first_resumed in saves, first_resumed
        assert max(resumed) == args.steps - 1
        assert reference[args.steps - 1] < reference[0], "the loss did not go down"
        print(f"\nkilled at step {args.kill_at}, resumed at step {first_resumed}: the run "
              f"continues the loss curve (to 1e-9 relative) [{time.time() - start:.1f} s]")


if __name__ == "__main__":
    sys.exit(main())
