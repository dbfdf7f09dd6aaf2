#!/usr/bin/python3
"""Train a small tensor-parallel MLP with checkpoints, then resume it with another rank count.

    PYTHONPATH=build/python /usr/bin/python3 examples/torch_train.py [--train-ranks 2]
        [--resume-ranks 1] [--steps 12] [--save-every 4] [--out DIR]

1. `--train-ranks` processes (torch.distributed, gloo) train a 2-layer MLP whose hidden
   dimension is split over the ranks (Megatron-style tensor parallelism: fc1 by rows, fc2 by
   columns, fc2's bias replicated), with Adam, for `--steps` steps. Every `--save-every` steps
   the model and the optimizer are saved with tessera.async_save(staging="deferred"): the
   copy of the state overlaps the next forward and backward passes (waited for just before the
   optimizer step, and checked: check_unchanged_until_staged), and training goes on while the
   checkpoint is written.
2. `--resume-ranks` processes load the checkpoint of the middle of the run into their own
   layout (tessera reshards: each rank reads only the pieces it needs) and train the rest.
3. The loss curves of the resumed run and of the uninterrupted one must agree (float64: only
   the summation order over the hidden dimension differs between rank counts), which is
   asserted.
"""

import argparse
import datetime
import json
import os
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


def run(rank, size, port, args, resume_from, first_step, tag):
    comm = None
    if size > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=size, timeout=datetime.timedelta(seconds=60))
        comm = tessera.torch_dist_comm()
    torch.set_num_threads(1)
    model = ShardedMLP(size, rank)
    optimizer = torch.optim.Adam(model.params.values(), lr=LR)
    if resume_from:
        # Adam creates its state on the first step: create it now, then load into it.
        for param in model.params.values():
            optimizer.state[param] = {"step": torch.tensor(0.0),
                                      "exp_avg": torch.zeros_like(param),
                                      "exp_avg_sq": torch.zeros_like(param)}
        state = state_dict(model, optimizer, step=None)
        report = tessera.load(state, resume_from, comm=comm)
        assert state["step"] == first_step, state["step"]
        for param in model.params.values():
            optimizer.state[param]["step"].fill_(first_step)
        if rank == 0:
            print(f"[{tag}] {size} rank(s) resumed from {resume_from} (saved by "
                  f"{tessera.read_metadata(resume_from).num_ranks} ranks) at step {first_step};"
                  f" rank 0 read {report.bytes_read} bytes", flush=True)

    x, y = data()
    losses, handle = {}, None
    for step in range(first_step, args.steps):
        # A save in flight may still be copying the parameters: the optimizer step waits.
        losses[step] = model.train_step(*batch(step, x, y), optimizer,
                                        handle.wait_staged if handle is not None else None)
        if args.save_every and (step + 1) % args.save_every == 0 and not resume_from:
            if handle is not None:
                handle.wait()
            # Returns at once: the copy runs behind the next forward and backward passes, the
            # writing behind the next steps.
            handle = tessera.async_save(state_dict(model, optimizer, step + 1),
                                        os.path.join(args.out, f"step{step + 1}"), comm=comm,
                                        staging="deferred", check_unchanged_until_staged=True)
    if handle is not None:
        handle.wait()
    if rank == 0:
        with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
            json.dump(losses, f)
    if size > 1:
        dist.destroy_process_group()


def launch(size, args, resume_from, first_step, tag):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if size == 1:
        run(0, 1, port, args, resume_from, first_step, tag)
    else:
        mp.start_processes(run, args=(size, port, args, resume_from, first_step, tag),
                           nprocs=size, join=True, start_method="spawn")
    with open(os.path.join(args.out, f"{tag}.json")) as f:
        return {int(k): v for k, v in json.load(f).items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-ranks", type=int, default=2)
    parser.add_argument("--resume-ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=4)
    parser.add_argument("--resume-at", type=int, default=None,
                        help="the checkpoint to resume from (default: the middle one)")
    parser.add_argument("--out", default=None, help="directory for checkpoints (default: temp)")
    args = parser.parse_args()
    saves = list(range(args.save_every, args.steps, args.save_every))
    if not saves:
        parser.error("--save-every must leave a checkpoint before the last step")
    resume_at = args.resume_at or saves[(len(saves) - 1) // 2]
    with tempfile.TemporaryDirectory() as tmp:
        args.out = args.out or tmp
        os.makedirs(args.out, exist_ok=True)
        start = time.time()
        trained = launch(args.train_ranks, args, None, 0, "train")
        checkpoint = os.path.join(args.out, f"step{resume_at}")
        tessera.verify(checkpoint)
        resumed = launch(args.resume_ranks, args, checkpoint, resume_at, "resume")

        print(f"\n{'step':>4}  {f'loss, {args.train_ranks} rank(s)':>22}  "
              f"{f'resumed, {args.resume_ranks} rank(s)':>22}")
        for step in range(args.steps):
            again = f"{resumed[step]:22.12f}" if step in resumed else ""
            mark = "  <- resumed here" if step == resume_at else ""
            print(f"{step:>4}  {trained[step]:22.12f}  {again:>22}{mark}")
        for step, loss in resumed.items():
            assert abs(loss - trained[step]) <= 1e-9 * abs(trained[step]), (
                f"step {step}: resumed loss {loss} differs from {trained[step]}")
        assert trained[args.steps - 1] < trained[0], "the loss did not go down"
        print(f"\nthe resumed run continues the loss curve (to 1e-9 relative) "
              f"[{time.time() - start:.1f} s]")


if __name__ == "__main__":
    sys.exit(main())
