"""tessera.CheckpointManager: the checkpoints of a training run under one root directory.

    manager = tessera.CheckpointManager("ckpt/run1", comm=comm, keep_last=2)
    restored = manager.restore(state)             # None on a fresh run
    start = restored.step if restored else 0
    for step in range(start, steps):
        train_step()
        manager.save(step + 1, state)             # returns at once; written in the background
    manager.close()                               # the last save committed, or its error

The C++ CheckpointManager (include/tessera/checkpoint_manager.h) does the work: step directories
"iter_<step>" under the root, saves in the background (one in flight), "latest" from what is
committed, restore with fallback past damaged checkpoints, retention, read leases. This module
flattens state dicts, turns options into keyword arguments, and makes sure a failed background
save is never lost: it is raised by the next call, and at interpreter exit a failure nobody saw
is printed and the exit status becomes 1.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import threading
import warnings
import weakref
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Literal, Mapping, Optional,
                    Sequence, Tuple, TypeVar, Union)

from . import _api
from . import _state
from . import _tessera
from ._errors import Error, invalid_argument
from ._handover import AsyncSaveHandle
from ._types import StateDict, StrPath

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._types import LoadOptions, ManagerSaveOptions

_T = TypeVar("_T")

__all__ = ["CheckpointManager", "CheckpointWarning", "ManagedSave", "RestoreResult"]

# map_per_rank(rank, world_size, saved_world_size) -> the saved rank (or ranks) whose per-rank
# values this rank takes.
PerRankMap = Callable[[int, int, int], Union[int, Sequence[int]]]


class CheckpointWarning(UserWarning):
    """A restore fell back past a checkpoint that failed its checks, or a retention could not
    delete a step: the message names the step and why."""


CheckpointWarning.__module__ = "tessera"


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=2)


@dataclasses.dataclass
class ManagedSave:
    """What CheckpointManager.save did."""

    step: int
    path: str
    #: when_busy="skip" and a save was still being written: nothing was saved (skip_reason).
    skipped: bool
    skip_reason: str
    #: Asynchronous saves: the save in flight (with staging="deferred", call
    #: handle.wait_staged() before changing the tensors). Its failure is raised by the
    #: manager's next call too.
    handle: Optional[AsyncSaveHandle]
    #: Synchronous saves (async_save=False): the SaveReport of the committed save.
    report: Optional[_tessera.SaveReport]

    def wait_staged(self) -> None:
        """Blocks until the state is copied (staging="deferred"); at once otherwise."""
        if self.handle is not None:
            self.handle.wait_staged()


@dataclasses.dataclass
class RestoreResult:
    """What CheckpointManager.restore loaded."""

    step: int
    path: str
    #: (step, exception, failed_checks) of each step newer than the one restored, newest first:
    #: failed_checks is True for a checkpoint that failed its checks (damaged, a load that
    #: failed on a checksum; a CheckpointWarning said so), False for a directory holding no
    #: committed checkpoint (a save that did not finish) or being deleted.
    skipped: List[Tuple[int, Error, bool]]
    #: The per-rank values this rank took (save(..., per_rank=...)): name -> value, or name ->
    #: list of values when per_rank_map gave several saved ranks.
    per_rank: Dict[str, Any]
    #: The checkpoint's user metadata ("step" and "tessera.manager" included).
    user_metadata: Dict[str, str]
    #: The LoadReport of the load (None for restores through a loader of tessera.torch).
    report: Optional[_tessera.LoadReport]
    #: The state dict loaded: the one given, or a new one when its root is a tuple holding a
    #: replaced object.
    state_dict: Any = None


_live: weakref.WeakSet[CheckpointManager] = weakref.WeakSet()  # managers to close at exit


class CheckpointManager:
    """Saves a training run's state every few steps under `root`, keeps the right checkpoints,
    and resumes from the newest one that is whole. See docs/PYTHON.md, "Checkpoint manager".

    root: a directory (created on the first save). Each step's checkpoint is a directory named
    by step_naming, by default ``iter_<step>`` (7 digits at least, Megatron-LM's names), whose
    user metadata records the step (``tessera ls`` shows it);
    ``latest_checkpointed_iteration.txt`` names the newest one, replaced after each commit
    (write_tracker=False: not written).

    step_naming: how the step directories are named, a preset or a pattern: "megatron"
    (``iter_{step:07}``, the default), "torchtitan" (``step-{step}``), "huggingface" or "hf"
    (``checkpoint-{step}``, transformers' Trainer), "step" (``step{step}``), "global_step"
    (``global_step{step}``, DeepSpeed), or a pattern such as ``"ckpt_{step:06}"``. Every listing
    (latest_step, steps, restore, prune) sees the directories of that naming only; a root that
    holds none of them but directories named as another preset names steps raises
    InvalidArgumentError naming them and the preset to pass.

    comm: every rank passes its tessera.Comm (save and restore are COLLECTIVE). None (the
    default): as every tessera call without ``comm=``, the default process group when
    torch.distributed is initialised with several ranks (e.g. under torchrun: the whole job,
    and every rank must make the manager), else one process.

    keep_last: keep the newest N committed checkpoints, delete older ones once a newer one has
    committed (0: keep all). keep_every: also keep steps that are multiples of M. Steps marked
    with mark() are kept, and so is any step being read (lease(), restore()) or written.

    async_save (default True): save() returns once the state is staged; the checkpoint is
    written and committed in the background. when_busy="wait" (default): a save waits for the
    one in flight; "skip": it saves nothing and says why (ManagedSave.skipped). staging,
    staging_threads, check_unchanged_until_staged, background_nice, staging_budget_bytes: as
    for tessera.async_save.

    layout: the run's parallel layout (e.g. "tp2,pp1,dp4"), recorded with per-rank state.

    Other keyword arguments are tessera.save's options (sync, num_io_threads, collective=False
    with no save_tag: the manager tags rank-local saves itself, user_metadata for every save,
    separate_prefixes, ...).
    """

    def __init__(self, root: StrPath, *, comm: Optional[_tessera.Comm] = None,
                 keep_last: int = 0, keep_every: int = 0, async_save: bool = True,
                 when_busy: Literal["wait", "skip"] = "wait",
                 staging: Literal["blocking", "deferred"] = "blocking",
                 staging_threads: Optional[int] = None,
                 check_unchanged_until_staged: bool = False,
                 background_nice: Optional[int] = None,
                 staging_budget_bytes: Optional[int] = None, layout: Optional[str] = None,
                 write_tracker: bool = True, step_naming: str = "megatron",
                 **save_options: Unpack[ManagerSaveOptions]) -> None:
        if when_busy not in ("wait", "skip"):
            raise ValueError(f"when_busy must be 'wait' or 'skip', not {when_busy!r}")
        if staging not in ("blocking", "deferred"):
            raise ValueError(f"staging must be 'blocking' or 'deferred', not {staging!r}")
        for name, value in (("keep_last", keep_last), ("keep_every", keep_every)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, not {value!r}")
        for name in ("progress", "save_tag", "format"):
            if name in save_options:
                raise TypeError(f"CheckpointManager() does not take {name}: "
                                + {"progress": "saves run in the background",
                                   "save_tag": "it tags rank-local saves itself",
                                   "format": "it saves in tessera's format (the step is "
                                             "recorded in the user metadata)"}[name])
        handle = _api._comm_handle(comm)
        self._lock: Optional[threading.Lock] = None
        if handle is None:
            handle, self._lock = _api._single_rank_comm(), _api._default_comm_submit_lock
        self._comm: _tessera.Comm = handle
        self._root = os.fspath(root)
        self._collective = bool(save_options.get("collective", True))
        self._user_metadata = dict(save_options.pop("user_metadata", None) or {})
        self._deferred = staging == "deferred"
        self._last_handle: Optional[_tessera.AsyncSaveHandle] = None
        opts = _api._async_save_options("wait", staging, staging_threads,
                                        check_unchanged_until_staged, background_nice,
                                        staging_budget_bytes)
        opts.save = _api._set_options("CheckpointManager", _tessera.SaveOptions(), save_options)
        self._impl = _tessera._CheckpointManager(self._root, opts, bool(async_save), when_busy,
                                                 keep_last, keep_every, bool(write_tracker),
                                                 layout or "", step_naming, _warn)
        _live.add(self)

    # ---- saving -------------------------------------------------------------------------

    @property
    def root(self) -> str:
        """The root directory."""
        return self._root

    def _locked(self, call: Callable[[], _T]) -> _T:
        if self._lock is None:
            return call()
        with self._lock:
            return call()

    def save(self, step: int, state_dict: StateDict, *,
             per_rank: Optional[Mapping[str, Any]] = None,
             user_metadata: Optional[Mapping[str, str]] = None) -> ManagedSave:
        """COLLECTIVE. Saves `state_dict` (as tessera.save takes it) as the checkpoint of `step`,
        in the background unless async_save=False.

        First the save in flight is waited for (or, with when_busy="skip" and still running,
        this save is skipped); a failure of it that no call raised yet is raised now, and
        nothing is saved. Steps must increase. A step not newer than a committed checkpoint
        under the root (a run that did not restore) raises FailedPreconditionError naming both.

        per_rank: values that depend on the world size (a data loader's position, this rank's
        RNG state), the same names on every rank, each rank its own value (pickled); restore
        gives each rank its own back, and refuses another world size unless per_rank_map says
        how to map them. user_metadata: str -> str for this checkpoint.
        """
        _check_step(step)
        metadata = dict(self._user_metadata)
        metadata.update(user_metadata or {})
        options = {"collective": self._collective, "user_metadata": metadata}
        comm, builder, opts = _api._prepare_save("CheckpointManager.save", state_dict, self._comm,
                                                 options)
        pickled: Dict[str, bytes] = {}
        for name, value in (per_rank or {}).items():
            if not isinstance(name, str):
                raise TypeError(f"per_rank names must be str, not {type(name).__name__}")
            pickled[name] = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        skipped, reason, handle, report = self._locked(lambda: self._impl.save(
            step, builder, comm, opts.user_metadata, pickled, self._deferred))
        if handle is not None:
            # Kept until the next save: with staging="deferred" the handle holds the tensors
            # until they are copied, and a caller that drops the ManagedSave must not wait here.
            self._last_handle = handle
        # The handle is not tracked by tessera.async_save's exit hook: its failure reaches the
        # caller through this manager (the next call, or the exit check below).
        return ManagedSave(step, self.step_path(step), skipped, reason,
                           None if handle is None else AsyncSaveHandle._of(handle), report)

    def wait(self) -> None:
        """Blocks until the save in flight is committed (and the retention after it done);
        raises its failure if no call raised it yet. Not collective."""
        self._impl.wait()
        self._last_handle = None

    def close(self) -> None:
        """wait(), then the manager takes no more saves."""
        self._impl.close()
        self._last_handle = None
        _live.discard(self)

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
            return
        try:  # an exception is on its way already: do not hide it
            self.close()
        except Error as e:
            warnings.warn(f"while handling another exception: {e}", CheckpointWarning)

    # ---- what is there -------------------------------------------------------------------

    def latest_step(self) -> Optional[int]:
        """The newest step whose directory holds a committed, whole checkpoint (its index reads,
        every data file is there), or None."""
        return self._impl.latest_step()

    def all_steps(self) -> List[int]:
        """Every step holding a committed, whole checkpoint, ascending."""
        return self._impl.all_steps()

    def steps(self) -> List[_tessera.StepInfo]:
        """Every step directory with its state ('committed', 'uncommitted', 'damaged',
        'deleting'), its problem and whether it is marked, ascending."""
        return self._impl.steps()

    def step_path(self, step: int) -> str:
        """The directory of `step` under the root."""
        return self._impl.step_path(step)

    # ---- restoring -----------------------------------------------------------------------

    def restore(self, state_dict: StateDict, *, step: Optional[int] = None, strict: bool = True,
                objects: Literal["unpickle", "bytes"] = "unpickle",
                per_rank_map: Optional[PerRankMap] = None,
                **load_options: Unpack[LoadOptions]) -> Optional[RestoreResult]:
        """COLLECTIVE. Loads the newest committed checkpoint (or `step`) into `state_dict` in
        place, as tessera.load does (strict, objects and load options alike). Returns None when
        the root holds no committed checkpoint (a fresh run).

        A checkpoint that fails its checks (damaged index, missing, truncated or corrupt file)
        is passed over for the one before it, with a CheckpointWarning naming the step and the
        error, and listed in RestoreResult.skipped; when every one fails, raises
        CorruptCheckpointError naming each. Other errors (keys the state lacks, shapes) are
        raised at once. A given `step` never falls back.

        per_rank_map(rank, world_size, saved_world_size): which saved rank's (or ranks')
        per-rank values each rank takes when the world size or layout differs from the save's
        (else that is an InvalidArgumentError naming the state and both world sizes).
        """
        _api._check_objects(objects)
        if step is not None:
            _check_step(step)
        self.wait()  # a failed save is raised before anything is loaded
        comm = self._comm
        rank = comm.rank
        loaded: Dict[str, _tessera.LoadReport] = {}

        def load(candidate: int, path: str, keys: List[str]) -> List[bytes]:
            def prepare() -> Tuple[_state.Flat, _tessera.StateBuilder, List[int],
                                   _tessera.LoadOptions]:
                flat = _state.Flat(state_dict, for_load=True)
                builder = flat.build(rank=rank, for_load=True)
                indices = [builder.add_object(k, b"") for k in keys]
                return flat, builder, indices, _api._load_options(strict, dict(load_options))

            flat, builder, indices, opts = _api._prepare(comm, prepare)
            loaded["report"] = _api._load_prepared(state_dict, flat, builder, path, comm, opts,
                                                   "CheckpointManager.restore", objects=objects)
            return [builder.object_data(i) for i in indices]

        report = self._restore_with(load, step, per_rank_map)
        if report is None:
            return None
        load_report = loaded.get("report")
        return _result(report, objects, per_rank_map, load_report,
                       load_report.state_dict if load_report is not None else state_dict)

    def _restore_with(self, load: Callable[[int, str, List[str]], Sequence[bytes]],
                      step: Optional[int], per_rank_map: Optional[PerRankMap]
                      ) -> Optional[_tessera._RestoreReport]:
        """The C++ restore with `load(step, path, per_rank_keys) -> [bytes]` as its loader; None
        when there is nothing to restore (step None only)."""
        return self._locked(lambda: self._impl.restore_with(self._comm, step, per_rank_map,
                                                            load))

    # ---- retention -----------------------------------------------------------------------

    def mark(self, step: int, note: str = "") -> None:
        """Keeps `step` whatever the retention (a file in its directory), with a note."""
        self._impl.mark(step, note)

    def unmark(self, step: int) -> None:
        """Undoes mark()."""
        self._impl.unmark(step)

    def lease(self, step: int) -> _tessera.ReadLease:
        """A read lease on the committed checkpoint of `step`: no manager deletes it while held.
        A context manager giving the step directory: ``with manager.lease(s) as path: ...``."""
        return self._impl.lease(step)

    def prune(self, keep_last: int, keep_every: int = 0,
              dry_run: bool = False) -> _tessera.PruneReport:
        """Deletes the step directories older than the newest committed checkpoint that the
        policy does not keep (marked, leased and written ones stay). dry_run=True changes
        nothing and reports what would go. Not collective."""
        return self._impl.prune(keep_last, keep_every, dry_run)

    def delete(self, step: int) -> None:
        """Deletes the directory of `step` (e.g. newer steps of a history to discard); refused
        for a marked, leased or running one."""
        self._impl.delete(step)

    @property
    def last_retention(self) -> Optional[_tessera.PruneReport]:
        """The retention after the last save that committed (rank 0), or None."""
        return self._impl.last_retention()


def _check_step(step: object) -> None:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an int >= 0, not {step!r}")


def _result(report: _tessera._RestoreReport, objects: str, per_rank_map: Optional[PerRankMap],
            load_report: Optional[_tessera.LoadReport], state_dict: Any) -> RestoreResult:
    per_rank: Dict[str, Any] = {}
    for name, values in report.per_rank.items():
        decoded = [v if objects == "bytes" else pickle.loads(v) for v in values]
        per_rank[name] = decoded if per_rank_map is not None else decoded[0]
    return RestoreResult(report.step, report.path, report.skipped, per_rank,
                         report.user_metadata, load_report, state_dict)


def _unseen_at_exit() -> List[str]:
    """The exit hook's part (_api._exit_checks): closes the managers still open and returns
    the failures of their saves that nothing raised."""
    failures: List[str] = []
    for manager in list(_live):
        try:
            manager._impl.wait()
        except Error as e:
            failures.append(f"the save into {manager.root} failed: {e}")
    failures += [str(e) for e in _tessera._take_unseen_failures()]
    return failures


_api._exit_checks.append(_unseen_at_exit)


def _after_fork_in_child() -> None:
    """A forked child abandons its parent's managers (their background saves have no thread
    in the child): never closed, waited for or destroyed there, and their unseen failures are
    not reported by the child; the child makes its own."""
    for manager in list(_live):
        _api._keep_forever(manager)
    _live.clear()
    # Failures the parent's destroyed managers left unseen: the parent reports them at its exit,
    # so the child, which exits first in most cases, must not (it would exit with status 1).
    _tessera._forget_unseen_failures_after_fork()


_api._after_fork_hooks.append(_after_fork_in_child)
