"""The systems bench/peers/harness.py compares: one adapter class each, with one interface.

Every adapter runs inside each rank of the job (gloo over the default process group) and saves
the same BenchState (harness_state.py). The harness times what the adapter's methods do; work
an adapter does in unavailable(), prepare(), finish() and end_block() is outside the timing
(imports, building a manager object, for example), and each adapter lists in notes() every
option it forces and every patch it applies to the system, so the JSON says exactly what was
measured.

Interface (System):
  unavailable()            why the system cannot run here, or None (imports the system)
  config(), notes()        the options used; caveats, stubs, patches
  prepare(phase, state, variant)  before a phase (save, load, reshard_load, async_save, or
  finish(phase, variant)   check: the untimed load of an asynchronous checkpoint); after it
  end_block()              after the system's phases of a round (releases staging memory)
  save(state, path)        a synchronous save of the save layout into the directory `path`
  load(state, path, layout)  a load into the targets of `layout` ("load": the same layout,
                           "reshard": the resharded one); returns the loaded flat state dict
  reshard_unavailable()    why the system cannot load under another layout, or None
  async_variants()         {variant: None or the reason it cannot run}
  async_save(state, path, variant)  starts an asynchronous save; returns a function that
                           blocks until the checkpoint is committed (durable with --sync)
  close()                  releases what the adapter holds (once, at the end)
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import re
import time
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist

from harness_state import BenchState, Layout, as_bytes, local_of

Waiter = Callable[[], None]

# bytecheckpoint 0.0.2 (the newest release on PyPI when this harness was written) declares, in
# the METADATA of bytecheckpoint-0.0.2-py3-none-any.whl: Requires-Dist: torch<=2.5.0,>=2.1.0.
BYTECHECKPOINT_PIN = "torch<=2.5.0,>=2.1.0"


def fdatasync_files(paths: list[str]) -> None:
    """fdatasync each file of `paths`."""
    for name in paths:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: str) -> None:
    """fsync the directory `path` (its entries)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_checkpoint_dir(path: str, rank: int, world: int) -> None:
    """What the harness does for a system without an fsync option under --sync: this rank
    fdatasyncs the files of the checkpoint directory tree whose names end in _<rank>.<ext> or
    rank<rank>.<ext>; rank 0 also the files of no rank and the directories. COLLECTIVE (a
    barrier first, so that every rank's files exist)."""
    dist.barrier()
    mine, unowned, dirs = [], [], []
    for root, _, files in os.walk(path):
        dirs.append(root)
        for name in files:
            match = re.search(r"(?:_|rank)(\d+)$", name.rsplit(".", 1)[0])
            owner = int(match.group(1)) if match and int(match.group(1)) < world else None
            full = os.path.join(root, name)
            if owner == rank:
                mine.append(full)
            elif owner is None:
                unowned.append(full)
    fdatasync_files(mine)
    if rank == 0:
        fdatasync_files(unowned)
        for d in dirs:
            fsync_dir(d)


def version_of(distribution: str) -> Optional[str]:
    """The installed version of a distribution, or None."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """pwrite all of `data` at `offset` (a pwrite writes at most about 2 GiB)."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], offset + done)


def read_all(fd: int, data: memoryview, offset: int) -> None:
    """preadv into all of `data` from `offset`."""
    done = 0
    while done < len(data):
        n = os.preadv(fd, [data[done:]], offset + done)
        if n <= 0:
            raise EOFError(f"short read at {offset + done}")
        done += n


def buffer_of(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes."""
    assert tensor.is_contiguous()
    return memoryview(as_bytes(tensor).numpy())  # type: ignore[arg-type]


def copy_into_targets(state: BenchState, loaded: dict[str, Any], layout: Layout) -> None:
    """Copies each loaded tensor of `loaded` that is not the target's memory into the target
    (and puts the target back into `loaded`)."""
    for leaf in state.leaves:
        target = leaf.target(layout)
        local = local_of(target)
        value = loaded[leaf.key]
        value_local = local_of(value) if isinstance(value, torch.Tensor) else value
        if value_local.data_ptr() != local.data_ptr():
            local.copy_(value_local.reshape(local.shape))
        loaded[leaf.key] = target


class System:
    """The interface; see the module docstring."""

    name = ""
    role = "peer"  # "baseline", "tessera" or "peer"

    def __init__(self, sync: bool) -> None:
        self.sync = sync
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    # The module the system's calls need: unavailable() imports it (before any timing).
    module: Optional[str] = None

    def unavailable(self) -> Optional[str]:
        """Why the system cannot run here, or None: by default, why `module` cannot be
        imported (ImportError, or an error of its import-time dependencies)."""
        if self.module is None:
            return None
        try:
            importlib.import_module(self.module)
        except Exception as e:
            return f"import {self.module} failed: {type(e).__name__}: {e}"
        return None

    def config(self) -> dict[str, Any]:
        """The options used."""
        return {}

    def notes(self) -> list[str]:
        """Caveats, stubs and patches."""
        return []

    def prepare(self, phase: str, state: BenchState, variant: Optional[str] = None) -> None:
        """Outside the timing, before a phase."""

    def finish(self, phase: str, variant: Optional[str] = None) -> None:
        """Outside the timing, after a phase."""

    def end_block(self) -> None:
        """Outside the timing, after the system's phases of a round."""

    def save(self, state: BenchState, path: str) -> None:
        """A synchronous save of the save layout into `path`."""
        raise NotImplementedError

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        """A load into the targets of `layout`; returns the loaded flat state dict."""
        raise NotImplementedError

    def reshard_unavailable(self) -> Optional[str]:
        """Why the system cannot load under another layout, or None."""
        return None

    def async_variants(self) -> dict[str, Optional[str]]:
        """{variant: None, or why it cannot run}."""
        return {}

    def async_save(self, state: BenchState, path: str, variant: str) -> Waiter:
        """Starts an asynchronous save; returns a function that waits for the commit."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the adapter holds."""


# ---- raw: the baseline -------------------------------------------------------------------------

class Raw(System):
    """os.pwrite of the bytes each rank holds into one file per rank (fdatasync with --sync),
    os.preadv back into the same memory."""

    name = "raw"
    role = "baseline"

    def config(self) -> dict[str, Any]:
        return {"files": "one per rank: rank<r>.bin", "write": "os.pwrite per tensor",
                "read": "os.preadv per tensor into the target's memory",
                "sync": "fdatasync of the rank's file" if self.sync else "none"}

    def notes(self) -> list[str]:
        return ["the baseline: no metadata, no checksums, no commit protocol; each rank's file "
                "holds its local shards (and the small objects) back to back"]

    def _pieces(self, state: BenchState, layout: Layout) -> Iterator[memoryview]:
        for leaf in state.leaves:
            yield buffer_of(local_of(leaf.target(layout)))

    def save(self, state: BenchState, path: str) -> None:
        name = os.path.join(path, f"rank{self.rank}.bin")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            offset = 0
            for piece in self._pieces(state, "save"):
                write_all(fd, piece, offset)
                offset += len(piece)
            for value in state.objects.values():
                write_all(fd, memoryview(value), offset)
                offset += len(value)
            if self.sync:
                os.fdatasync(fd)
        finally:
            os.close(fd)

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        assert layout == "load"
        loaded = state.flat(layout)
        fd = os.open(os.path.join(path, f"rank{self.rank}.bin"), os.O_RDONLY)
        try:
            offset = 0
            for piece in self._pieces(state, layout):
                read_all(fd, piece, offset)
                offset += len(piece)
            for key, value in state.objects.items():
                buffer = bytearray(len(value))
                read_all(fd, memoryview(buffer), offset)
                offset += len(value)
                loaded[key] = bytes(buffer)
        finally:
            os.close(fd)
        return loaded

    def reshard_unavailable(self) -> Optional[str]:
        return "the baseline writes and reads each rank's own bytes; it has no resharding"

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"-": "the baseline has no asynchronous save"}


# ---- tessera -----------------------------------------------------------------------------------

class Tessera(System):
    """tessera.save / tessera.load / tessera.async_save over the default process group
    (comm=None, as a DCP user calls it), in tessera's own format or format="torch_dist"."""

    role = "tessera"
    module = "tessera"

    def __init__(self, sync: bool, fmt: str) -> None:
        super().__init__(sync)
        self.format = fmt
        self.name = "tessera" if fmt == "tessera" else "tessera_torch_dist"
        # Objects: a bytes placeholder receives the stored bytes; tessera's own format stores
        # the saved bytes as they are, torch_dist stores a torch.save archive of them, which
        # a None placeholder decodes (tessera.load's docstring).
        self.placeholder: Optional[bytes] = b"" if fmt == "tessera" else None

    def config(self) -> dict[str, Any]:
        import tessera
        return {"package": os.path.dirname(tessera.__file__), "format": self.format,
                "comm": "None (the default process group, gloo)",
                "sync": "True (full: data files, manifest, directory)" if self.sync
                else "False (none)",
                "options": "defaults otherwise (num_io_threads=2, verify_checksums=True on "
                           "load)"}

    def notes(self) -> list[str]:
        out = []
        if self.format == "torch_dist":
            out.append("objects are loaded into a None placeholder (decoded from the torch.save "
                       "archive DCP stores); a bytes placeholder would receive the archive")
        return out

    def save(self, state: BenchState, path: str) -> None:
        import tessera
        start = time.perf_counter()
        report = tessera.save(state.flat("save"), path, sync=self.sync, format=self.format)
        total = time.perf_counter() - start
        # Where this rank's time went (SaveReport's phases); "python" is the rest of the call:
        # flattening the state dict (DTensors, optimizer state) and the argument checks.
        phases = {"plan": report.plan_seconds, "write": report.write_seconds,
                  "commit": report.commit_seconds}
        self.last_save_breakdown = {"python": total - sum(phases.values()), **phases}

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        import tessera
        report = tessera.load(state.flat(layout, self.placeholder), path)
        return dict(report.state_dict)

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"staging=blocking": None, "staging=deferred": None}

    def async_save(self, state: BenchState, path: str, variant: str) -> Waiter:
        import tessera
        staging = variant.split("=", 1)[1]
        handle = tessera.async_save(state.flat("save"), path, sync=self.sync, format=self.format,
                                    staging=staging)  # type: ignore[arg-type]

        def wait() -> None:
            handle.wait()
        return wait


# ---- PyTorch DCP -------------------------------------------------------------------------------

class Dcp(System):
    """torch.distributed.checkpoint of the torch in use: dcp.save / dcp.load /
    dcp.async_save with FileSystemWriter(path, sync_files=--sync) and FileSystemReader."""

    name = "dcp"
    module = "torch.distributed.checkpoint"

    def __init__(self, sync: bool) -> None:
        super().__init__(sync)
        self._stager: Any = None

    def _staging_options(self) -> Any:
        from torch.distributed.checkpoint.staging import StagingOptions
        return StagingOptions(use_pinned_memory=False, use_shared_memory=True,
                              use_async_staging=True, use_non_blocking_copy=False)

    def config(self) -> dict[str, Any]:
        return {"torch": torch.__version__,
                "writer": f"FileSystemWriter(path, sync_files={self.sync}) (defaults: "
                          "single_file_per_rank=True, thread_count=1)",
                "reader": "FileSystemReader(path)", "planner": "default",
                "async": {"default": "dcp.async_save(state, storage_writer=...) with no stager: "
                                     "its own DefaultStager(StagingOptions(False, False, False, "
                                     "False)), a thread executor",
                          "shm_async_stager": "async_stager=DefaultStager("
                                              f"{self._staging_options()}), one stager per "
                                              "block, made and warmed before the timing (one "
                                              "untimed stage() of the state, which allocates the "
                                              "staging buffers it caches, as a trainer's first "
                                              "checkpoint does) and closed after the block"}}

    def notes(self) -> list[str]:
        out = ["async committed = the upload future's result (AsyncSaveResponse."
               "upload_completion with a stager that stages asynchronously)",
               "sync_files=True fsyncs each data file and .metadata (not the directory); "
               "sync_files=False fsyncs nothing"]
        out.append("shm_async_stager: pinned memory and non-blocking copies are off (they are "
                   "for device tensors, and need CUDA, which this CPU state and a CPU-only torch "
                   "do not have)")
        return out

    def save(self, state: BenchState, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        dcp.save(state.flat("save"), storage_writer=dcp.FileSystemWriter(path,
                                                                          sync_files=self.sync))

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        flat = state.flat(layout)
        dcp.load(flat, storage_reader=dcp.FileSystemReader(path))
        return flat

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"default": None, "shm_async_stager": None}

    def async_save(self, state: BenchState, path: str, variant: str) -> Waiter:
        import torch.distributed.checkpoint as dcp
        stager = self._stager if variant == "shm_async_stager" else None
        response = dcp.async_save(state.flat("save"),
                                  storage_writer=dcp.FileSystemWriter(path, sync_files=self.sync),
                                  async_stager=stager)
        future: Any = getattr(response, "upload_completion", response)

        def wait() -> None:
            future.result()
        return wait

    def prepare(self, phase: str, state: BenchState, variant: Optional[str] = None) -> None:
        from concurrent.futures import Future

        from torch.distributed.checkpoint.staging import DefaultStager
        if phase == "async_save" and variant == "shm_async_stager" and self._stager is None:
            self._stager = DefaultStager(self._staging_options())
            staged = self._stager.stage(state.flat("save"))
            if isinstance(staged, Future):
                staged.result()

    def end_block(self) -> None:
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def close(self) -> None:
        self.end_block()


# ---- safetensors -------------------------------------------------------------------------------

class Safetensors(System):
    """safetensors.torch.save_file / load_file of each rank's local shards, one file per rank
    (the objects, hex-encoded, in the file's metadata)."""

    name = "safetensors"
    module = "safetensors.torch"

    def config(self) -> dict[str, Any]:
        return {"safetensors": version_of("safetensors"),
                "save": "safetensors.torch.save_file({key: local shard}, "
                        "'rank<r>.safetensors', metadata={object key: hex})",
                "load": "safetensors.torch.load_file('rank<r>.safetensors'), then each tensor "
                        "copied into the target (inside the timing)"}

    def notes(self) -> list[str]:
        out = ["a file format, not a distributed checkpointer: no global metadata, no commit "
               "protocol; each rank's file holds its own shards"]
        if self.sync:
            out.append("--sync: save_file has no fsync option; the harness fdatasyncs the "
                       "rank's file after save_file returns, inside the timing")
        return out

    def _file(self, path: str) -> str:
        return os.path.join(path, f"rank{self.rank}.safetensors")

    def save(self, state: BenchState, path: str) -> None:
        from safetensors.torch import save_file
        tensors = {leaf.key: local_of(leaf.saved) for leaf in state.leaves}
        save_file(tensors, self._file(path),
                  metadata={key: value.hex() for key, value in state.objects.items()})
        if self.sync:
            fdatasync_files([self._file(path)])

    def load(self, state: BenchState, path: str, layout: Layout) -> dict[str, Any]:
        from safetensors import safe_open
        from safetensors.torch import load_file
        assert layout == "load"
        loaded: dict[str, Any] = dict(load_file(self._file(path)))
        copy_into_targets(state, loaded, layout)
        with safe_open(self._file(path), framework="pt") as f:
            for key, value in (f.metadata() or {}).items():
                loaded[key] = bytes.fromhex(value)
        return loaded

    def reshard_unavailable(self) -> Optional[str]:
        return ("a file per rank of its local shards, no global metadata: it cannot load "
                "under another layout")

    def async_variants(self) -> dict[str, Optional[str]]:
        return {"-": "safetensors has no asynchronous save"}


# ---- ByteCheckpoint ----------------------------------------------------------------------------

class ByteCheckpoint(System):
    """ByteCheckpoint: listed so the table says why it is absent."""

    name = "bytecheckpoint"

    def unavailable(self) -> Optional[str]:
        installed = version_of("bytecheckpoint")
        pin = (f"bytecheckpoint 0.0.2, the newest release on PyPI (0.0.1, 0.0.2), declares "
               f"Requires-Dist: {BYTECHECKPOINT_PIN} in its wheel's METADATA (pip download "
               f"--no-deps bytecheckpoint==0.0.2), and this environment runs torch "
               f"{torch.__version__}")
        if installed is None:
            return f"not installed: {pin}; it cannot run here"
        return f"installed ({installed}) but the harness has no adapter for it: {pin}"
