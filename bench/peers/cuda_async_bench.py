"""How long an asynchronous save of CUDA tensors stops the caller: tessera.async_save (deferred
staging) against PyTorch DCP's async_save with its pinned stager, and against copying the
state to the host with tensor.to("cpu"), in the same run. Then a load back into GPU memory,
checked bit for bit. Prints JSON (docs/PERFORMANCE.md); scripts/gpu-check runs it on a machine
with a GPU.

    PYTHONPATH=build/python python3 bench/peers/cuda_async_bench.py --gib 4 --dir /tmp/bench

Figures, each the median of --repeat runs after one warm-up (which allocates the pinned memory
of both sides), with the spread (min and max) beside it as <name>_min / <name>_max:
- to_cpu_seconds: [t.to("cpu") for t in state] (pageable memory), synchronised.
- pinned_d2h_seconds: copy_(non_blocking=True) of every tensor into pinned buffers allocated
  beforehand, synchronised: the plain device-to-host copy of the same bytes.
- tessera_blocking_seconds: the async_save call; tessera_staged_seconds: until wait_staged()
  returns (the caller may change its tensors); tessera_committed_seconds: until wait().
- dcp_blocking_seconds, dcp_staged_seconds (staging_completion), dcp_committed_seconds
  (upload_completion).
Neither side syncs files (tessera sync="none", DCP sync_files=False): "fsynced": false.
"""

import argparse
import json
import os
import shutil
import sys
import time
import traceback

import torch


def make_state(total_bytes, tensors, device):
    """`tensors` tensors of unequal sizes, bf16 and fp32 (as weights and optimizer state),
    `total_bytes` in all, random."""
    weights = [1 + i % 7 for i in range(tensors)]
    state = {}
    g = torch.Generator(device=device).manual_seed(1)
    for i, w in enumerate(weights):
        dtype = torch.bfloat16 if i % 2 == 0 else torch.float32
        size = torch.empty((), dtype=dtype).element_size()
        n = max(1, total_bytes * w // sum(weights) // size)
        state[f"layer{i:03d}.{'w' if dtype == torch.bfloat16 else 'exp_avg'}"] = (
            torch.randn(n, device=device, generator=g).to(dtype))
    synchronize()
    return state


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def same_bytes(a, b):
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def state_bytes(state):
    return sum(t.numel() * t.element_size() for t in state.values())


def timed(fn):
    synchronize()
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def to_cpu(state):
    def run():
        out = [t.to("cpu") for t in state.values()]
        synchronize()
        return out
    return timed(run)[0]


def pinned_d2h(state, pinned):
    def run():
        for t, p in zip(state.values(), pinned):
            p.copy_(t, non_blocking=True)
        synchronize()
    return timed(run)[0]


def tessera_round(tessera, state, path, threads):
    t0 = time.perf_counter()
    handle = tessera.async_save(state, path, staging="deferred", sync="none",
                                num_io_threads=threads)
    blocking = time.perf_counter() - t0
    handle.wait_staged()
    staged = time.perf_counter() - t0
    handle.wait()
    return blocking, staged, time.perf_counter() - t0


def dcp_round(dcp, stager, state, path, threads):
    from torch.distributed.checkpoint import FileSystemWriter
    writer = FileSystemWriter(path, sync_files=False, thread_count=threads)
    synchronize()
    t0 = time.perf_counter()
    response = dcp.async_save(state, storage_writer=writer, async_stager=stager, no_dist=True)
    blocking = time.perf_counter() - t0
    if hasattr(response, "staging_completion"):
        response.staging_completion.result()
        staged = time.perf_counter() - t0
        response.upload_completion.result()
    else:  # a plain Future: staging was done inside the call
        staged = blocking
        response.result()
    return blocking, staged, time.perf_counter() - t0


def spread(result, name, values):
    """Records the median of `values` as `name`, and their min and max beside it."""
    ordered = sorted(values)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    result[name] = median
    result[name + "_min"] = ordered[0]
    result[name + "_max"] = ordered[-1]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--tensors", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--dir", default="/tmp/tessera-cuda-bench")
    parser.add_argument("--out", default=None, help="also write the JSON here")
    parser.add_argument("--device", default="cuda",
                        help="cpu: a dry run of the script on a machine without a GPU (host "
                             "tensors, DCP's stager without pinned memory); its figures mean "
                             "nothing")
    args = parser.parse_args()

    import tessera
    cuda = args.device == "cuda"
    result = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
              "torch": torch.__version__, "fsynced": False, "errors": {}}
    state = make_state(int(args.gib * (1 << 30)), args.tensors, args.device)
    result["state_bytes"] = state_bytes(state)
    result["tensors"] = len(state)
    os.makedirs(args.dir, exist_ok=True)

    def step(name, fn):
        try:
            fn()
        except Exception as e:  # noqa: BLE001 (every step reports, none stops the others)
            result["errors"][name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()

    def baselines():
        to_cpu(state)
        spread(result, "to_cpu_seconds", [to_cpu(state) for _ in range(args.repeat)])
        pinned = [torch.empty_like(t, device="cpu") for t in state.values()]
        if cuda:
            pinned = [p.pin_memory() for p in pinned]
        pinned_d2h(state, pinned)
        spread(result, "pinned_d2h_seconds",
               [pinned_d2h(state, pinned) for _ in range(args.repeat)])
        del pinned

    def tessera_side():
        path = os.path.join(args.dir, "tessera")
        rows = [tessera_round(tessera, state, path, args.threads) for _ in range(args.repeat + 1)]
        rows = rows[1:]
        for i, name in enumerate(("blocking", "staged", "committed")):
            spread(result, f"tessera_{name}_seconds", [r[i] for r in rows])
        # Load back into fresh GPU memory, bit for bit.
        into = {k: torch.empty_like(v) for k, v in state.items()}
        synchronize()
        t0 = time.perf_counter()
        tessera.load(into, path, num_io_threads=args.threads)
        synchronize()
        result["tessera_load_seconds"] = time.perf_counter() - t0
        result["load_bit_exact"] = all(same_bytes(into[k], v) for k, v in state.items())
        shutil.rmtree(path, ignore_errors=True)

    def dcp_side():
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        def new_stager():
            return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                use_async_staging=cuda,
                                                use_non_blocking_copy=cuda))

        def closed(stager):
            # torch 2.11's async_save closes the stager it was given after the save (its
            # deepcopy dispatch table is cleared, and the next save fails with KeyError); 2.13
            # keeps it open for reuse. A closed one is replaced, which costs DCP a fresh pinned
            # allocation in that round: recorded as dcp_stager_reused.
            inner = getattr(stager, "_state_dict_stager", None)
            return inner is not None and not getattr(inner, "_deepcopy_dispatch", True)

        stager = new_stager()
        result["dcp_stager_reused"] = True
        try:
            rows = []
            for r in range(args.repeat + 1):
                if closed(stager):
                    result["dcp_stager_reused"] = False
                    stager = new_stager()
                path = os.path.join(args.dir, f"dcp{r}")
                rows.append(dcp_round(dcp, stager, state, path, args.threads))
                shutil.rmtree(path, ignore_errors=True)
            rows = rows[1:]
            for i, name in enumerate(("blocking", "staged", "committed")):
                spread(result, f"dcp_{name}_seconds", [r[i] for r in rows])
        finally:
            stager.close()

    step("baselines", baselines)
    step("tessera", tessera_side)
    step("dcp", dcp_side)
    d2h = result.get("pinned_d2h_seconds")
    if d2h and "tessera_blocking_seconds" in result:
        # The goal: at most 0.1 of a plain device-to-host copy of the same bytes.
        result["tessera_blocking_over_pinned_d2h"] = result["tessera_blocking_seconds"] / d2h
        result["tessera_staged_over_pinned_d2h"] = result["tessera_staged_seconds"] / d2h
    if "dcp_blocking_seconds" in result and "tessera_blocking_seconds" in result:
        result["dcp_blocking_over_tessera_blocking"] = (
            result["dcp_blocking_seconds"] / result["tessera_blocking_seconds"])
    if "to_cpu_seconds" in result and "tessera_blocking_seconds" in result:
        result["to_cpu_over_tessera_blocking"] = (
            result["to_cpu_seconds"] / result["tessera_blocking_seconds"])
    text = json.dumps(result, indent=2, sort_keys=True)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if result["errors"] or not result.get("load_bit_exact") else 0


if __name__ == "__main__":
    sys.exit(main())
