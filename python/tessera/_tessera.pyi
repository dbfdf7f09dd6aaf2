"""Type stubs of the extension module tessera._tessera (python/src/*.cc, pybind11).

Every class, attribute and function here is one the bindings define, with the types pybind11
converts to and from: C++ integers are int, std::string is str, std::vector a list (any
sequence when passed in), std::map a dict, std::optional a value or None. Functions whose
bindings name no py::arg take their arguments positionally only. The public names are
re-exported by tessera (tessera.SaveReport, tessera.Comm, ...); the ones starting with "_" and
the option structs are the Python layer's (tessera/_api.py, tessera/_manager.py).
"""

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal, NoReturn, TypeVar

from typing_extensions import Buffer

from ._errors import Error

_T = TypeVar("_T")

# A progress(done, total) callable: bytes done so far and in all.
_Progress = Callable[[int, int], object]

# ---- statuses (py_status.cc) -------------------------------------------------------------------

def _raise_status(
    code: int, message: str | bytes, detail: dict[str, Any] | None = None
) -> NoReturn: ...

# ---- state dicts (py_state.cc) -----------------------------------------------------------------

def _built_with_cuda() -> bool:
    """Whether this tessera was built with CUDA (CUDA tensors can be saved and loaded)."""

class StateBuilder:
    """The entries of one save or load; built by tessera._state."""

    def __init__(self) -> None: ...
    def __len__(self) -> int: ...
    def add_buffer(
        self,
        key: str,
        data: Buffer,
        dtype: str,
        global_shape: Sequence[int] | None = None,
        global_offset: Sequence[int] = ...,
        local_shape: Sequence[int] = ...,
        replica_id: Sequence[int] = ...,
        flat_range: tuple[int, int] | None = None,
        allow_shape_mismatch: bool = False,
        partial: bool = False,
        writable: bool = False,
    ) -> int: ...
    def add_pointer(
        self,
        key: str,
        data_ptr: int,
        dtype: str,
        shape: Sequence[int],
        owner: object,
        global_shape: Sequence[int] | None = None,
        global_offset: Sequence[int] = ...,
        local_shape: Sequence[int] = ...,
        replica_id: Sequence[int] = ...,
        flat_range: tuple[int, int] | None = None,
        allow_shape_mismatch: bool = False,
        partial: bool = False,
        cuda_device: int = -1,
        stream: int = 0,
    ) -> int: ...
    def add_object(
        self, key: str, data: bytes, replica_id: Sequence[int] = ..., pickled: bool = False
    ) -> int: ...
    def object_data(self, index: int) -> bytes: ...
    def object_encoding(self, index: int) -> str: ...

# ---- communicators (py_comm.cc) ----------------------------------------------------------------

class Comm:
    """A communicator: the ranks that save or load a checkpoint together."""

    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def barrier(self) -> None:
        """COLLECTIVE. Returns when every rank has entered."""
    def broadcast(self, data: bytes | None, root: int = 0) -> bytes:
        """COLLECTIVE. Returns root's bytes on every rank (`data` is ignored elsewhere)."""
    def all_gather(self, data: bytes) -> list[bytes]:
        """COLLECTIVE. Every rank's bytes, indexed by rank."""
    def gather(self, data: bytes, root: int = 0) -> list[bytes] | None:
        """COLLECTIVE. On `root`, every rank's bytes indexed by rank; None elsewhere."""
    def all_reduce(self, values: Sequence[int], op: str = "sum") -> list[int]:
        """COLLECTIVE. Element-wise sum, min or max of int64 values over the ranks."""

def _agree_on_status(comm: Comm, code: int, message: str) -> None: ...
def single_rank_comm() -> Comm:
    """A communicator of one rank."""

def python_comm(impl: object) -> Comm:
    """A communicator whose collectives call methods of `impl` (see docs/PYTHON.md)."""

def run_local(num_ranks: int, fn: Callable[[Comm], _T], timeout: float = 600.0) -> list[_T]:
    """Runs fn(comm) for num_ranks ranks on as many threads; the results indexed by rank."""

def _comm_from_capsule(capsule: object) -> Comm: ...
def _split_comm(comm: Comm) -> Comm: ...
def _comm_cases() -> list[tuple[str, int]]: ...
def _run_comm_case(comm: Comm, name: str, *, agreed_argument_errors: bool) -> None: ...

# ---- options (py_checkpoint.cc) ----------------------------------------------------------------

# Each a py::enum_: its members are class attributes, `__members__` maps their names to
# them, and a member compares, hashes and converts to int by its value.

class SyncPolicy:
    FULL: ClassVar[SyncPolicy]
    NONE: ClassVar[SyncPolicy]
    __members__: ClassVar[dict[str, SyncPolicy]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class KeyPolicy:
    ERROR: ClassVar[KeyPolicy]
    SKIP: ClassVar[KeyPolicy]
    __members__: ClassVar[dict[str, KeyPolicy]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class ReadSharing:
    NONE: ClassVar[ReadSharing]
    BROADCAST: ClassVar[ReadSharing]
    ALL_GATHER: ClassVar[ReadSharing]
    READ_ONCE: ClassVar[ReadSharing]
    AUTO: ClassVar[ReadSharing]
    __members__: ClassVar[dict[str, ReadSharing]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class CheckpointFormat:
    TESSERA: ClassVar[CheckpointFormat]
    TORCH_DIST: ClassVar[CheckpointFormat]
    SAFETENSORS: ClassVar[CheckpointFormat]
    __members__: ClassVar[dict[str, CheckpointFormat]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class TorchDistFlavor:
    TORCH_2: ClassVar[TorchDistFlavor]
    TORCH_1_13: ClassVar[TorchDistFlavor]
    __members__: ClassVar[dict[str, TorchDistFlavor]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class WhenBusy:
    WAIT: ClassVar[WhenBusy]
    QUEUE: ClassVar[WhenBusy]
    __members__: ClassVar[dict[str, WhenBusy]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class StagingMode:
    BLOCKING: ClassVar[StagingMode]
    DEFERRED: ClassVar[StagingMode]
    __members__: ClassVar[dict[str, StagingMode]]
    def __init__(self, value: int) -> None: ...
    def __eq__(self, other: object) -> bool: ...
    def __ne__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def __int__(self) -> int: ...
    def __index__(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def value(self) -> int: ...

class TorchDistOptions:
    flavor: TorchDistFlavor
    key_paths: dict[str, list[str | int]]
    def __init__(self, flavor: TorchDistFlavor = ...,
                 key_paths: Mapping[str, Sequence[str | int]] = ...) -> None: ...

class SaveOptions:
    num_io_threads: int
    sync: SyncPolicy
    balance_writes: bool
    user_metadata: dict[str, str]
    remove_stale_files: bool
    plan_cache: bool
    format: CheckpointFormat
    format_options: TorchDistOptions | None
    torch_dist_flavor: TorchDistFlavor
    torch_dist_key_paths: dict[str, list[str | int]]
    separate_prefixes: list[str]
    collective: bool
    save_tag: str
    pinned_bytes: int
    device_piece_bytes: int
    progress: _Progress | None
    def __init__(self) -> None: ...

class LoadOptions:
    missing_keys: KeyPolicy
    unexpected_keys: KeyPolicy
    verify_checksums: bool
    verify_partial_chunks: bool
    num_io_threads: int
    cast_dtypes: bool
    read_sharing: ReadSharing
    exchange_bytes: int
    pinned_bytes: int
    device_piece_bytes: int
    progress: _Progress | None
    def __init__(self) -> None: ...

class AsyncSaveOptions:
    save: SaveOptions
    when_busy: WhenBusy
    staging: StagingMode
    staging_threads: int
    staging_piece_bytes: int
    check_unchanged_until_staged: bool
    background_nice: int
    staging_budget_bytes: int
    def __init__(self) -> None: ...

class ConvertOptions:
    max_file_bytes: int
    keys: list[str]
    strip_prefix: str
    num_threads: int
    buffer_bytes: int
    sync: SyncPolicy
    format_options: TorchDistOptions | None
    torch_dist_flavor: TorchDistFlavor
    verify_checksums: bool
    def __init__(self) -> None: ...

# ---- reports (py_checkpoint.cc) ----------------------------------------------------------------

class SaveReport:
    """What a save did (tessera.save, AsyncSaveHandle.wait())."""

    @property
    def save_id(self) -> str: ...
    @property
    def bytes_written(self) -> int:
        """by this rank (data files)"""
    @property
    def total_bytes(self) -> int:
        """by all ranks"""
    @property
    def files_written(self) -> int:
        """by this rank"""
    @property
    def plan_seconds(self) -> float:
        """this rank's seconds planning (local plan, agreement, global plan)"""
    @property
    def write_seconds(self) -> float:
        """this rank's seconds writing its data files"""
    @property
    def commit_seconds(self) -> float:
        """this rank's seconds in the commit (waiting for the others included)"""
    @property
    def plan_cache_hit(self) -> bool:
        """the plan of the previous save was reused"""

class LoadReport:
    """What a load did (tessera.load)."""

    # Not a field of the C++ report: tessera.load, load_all and CheckpointManager.restore set
    # it (a dynamic attribute) to the state dict loaded.
    state_dict: Any
    @property
    def missing_keys(self) -> list[str]: ...
    @property
    def unexpected_keys(self) -> list[str]: ...
    @property
    def shape_mismatched_keys(self) -> list[str]: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def bytes_needed(self) -> int: ...
    @property
    def read_calls(self) -> int: ...
    @property
    def bytes_received(self) -> int:
        """from other ranks"""
    @property
    def bytes_received_in_place(self) -> int:
        """of bytes_received, those placed straight in the destination tensors"""
    @property
    def bytes_sent(self) -> int:
        """to other ranks"""
    @property
    def job_bytes_read(self) -> int:
        """from storage by all ranks (read_sharing='read_once'; else 0)"""
    @property
    def job_bytes_needed(self) -> int:
        """the union of the checkpoint bytes the ranks needed (read_once; else 0)"""
    @property
    def job_bytes_exchanged(self) -> int:
        """sent between ranks (read_once; else 0)"""
    @property
    def checkpoint_bytes(self) -> int:
        """tensor data and objects in the checkpoint"""
    @property
    def read_sharing(self) -> ReadSharing:
        """how the ranks shared reads (read_sharing='auto' resolved)"""

class VerifyReport:
    """What tessera.verify checked."""

    @property
    def chunks_checked(self) -> int: ...
    @property
    def bytes_checked(self) -> int: ...
    @property
    def files_checked(self) -> int: ...
    @property
    def format(self) -> str:
        """'tessera', 'torch_dist' or 'safetensors'"""
    @property
    def checksums(self) -> bool:
        """False when the format has none: only the structure was checked"""

class RemoveKeysReport:
    """What tessera.remove_keys removed (or, with dry_run=True, would remove)."""

    @property
    def removed_tensors(self) -> list[str]: ...
    @property
    def removed_objects(self) -> list[str]: ...
    @property
    def matches_per_prefix(self) -> list[int]:
        """keys each prefix matched, in the order given"""
    @property
    def files_before(self) -> int: ...
    @property
    def files_after(self) -> int: ...
    @property
    def files_dropped(self) -> int:
        """held removed chunks only: deleted, nothing copied"""
    @property
    def files_rewritten(self) -> int:
        """held kept and removed chunks: the kept ones copied to a new file"""
    @property
    def bytes_before(self) -> int: ...
    @property
    def bytes_after(self) -> int: ...
    @property
    def bytes_freed(self) -> int: ...
    @property
    def bytes_copied(self) -> int: ...
    @property
    def save_id(self) -> str: ...
    @property
    def dry_run(self) -> bool: ...

class ConvertReport:
    """What tessera.convert wrote."""

    @property
    def source_format(self) -> str: ...
    @property
    def tensors(self) -> int:
        """written, by all ranks"""
    @property
    def objects(self) -> int:
        """written, by all ranks"""
    @property
    def total_bytes(self) -> int:
        """of the output, all ranks"""
    @property
    def bytes_written(self) -> int:
        """by this rank"""
    @property
    def bytes_read(self) -> int:
        """from the source, by this rank"""
    @property
    def files(self) -> list[str]: ...
    @property
    def files_written(self) -> int:
        """by this rank"""
    @property
    def skipped_objects(self) -> list[str]: ...

# ---- metadata (py_checkpoint.cc) ---------------------------------------------------------------

class Box:
    @property
    def offsets(self) -> list[int]: ...
    @property
    def sizes(self) -> list[int]: ...

class ByteLocation:
    @property
    def file_index(self) -> int: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def checksum(self) -> int: ...

class ChunkInfo:
    @property
    def box(self) -> Box: ...
    @property
    def location(self) -> ByteLocation: ...

class TensorInfo:
    @property
    def key(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> list[int]: ...
    @property
    def chunks(self) -> list[ChunkInfo]: ...
    @property
    def partial(self) -> bool: ...
    @property
    def nbytes(self) -> int: ...

class ObjectInfo:
    @property
    def key(self) -> str: ...
    @property
    def location(self) -> ByteLocation: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def encoding(self) -> str:
        """what the stored bytes are: 'bytes', 'pickle', 'torch_save' or 'json'"""

class FileInfo:
    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int: ...

class Metadata:
    """A checkpoint's manifest (tessera.read_metadata)."""

    @property
    def format_version(self) -> int: ...
    @property
    def format(self) -> str:
        """'tessera', 'torch_dist' or 'safetensors' (detected from the files)"""
    @property
    def checksums(self) -> bool:
        """whether the format stores checksums (Hugging Face files and DCP do not)"""
    @property
    def save_id(self) -> str: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def tensors(self) -> list[TensorInfo]: ...
    @property
    def objects(self) -> list[ObjectInfo]: ...
    @property
    def files(self) -> list[FileInfo]: ...
    @property
    def user_metadata(self) -> dict[str, str]: ...
    def find_tensor(self, key: str) -> TensorInfo | None:
        """The tensor saved under `key`, or None."""
    def find_object(self, key: str) -> ObjectInfo | None:
        """The object saved under `key`, or None."""
    @property
    def total_tensor_bytes(self) -> int: ...
    @property
    def total_chunks(self) -> int: ...

# ---- asynchronous saves (py_checkpoint.cc, py_async.h) -----------------------------------------

class AsyncSaveHandle:
    """An asynchronous save in flight (tessera.async_save)."""

    def wait_staged(self) -> None:
        """Blocks until the state is copied into the staging buffers."""
    def staged(self) -> bool:
        """True once the copy into the staging buffers is done (non-blocking)."""
    def wait(self) -> SaveReport:
        """Blocks until the save is committed and returns its SaveReport, or raises its error."""
    def done(self) -> bool:
        """True once the save is committed or failed."""
    def exception(self) -> Error | None:
        """The exception the save failed with; None while in flight or after success."""
    @property
    def report(self) -> SaveReport | None:
        """The SaveReport once committed, else None."""
    def _unseen_failure(self) -> Error | None: ...

# ---- the calls (py_checkpoint.cc) --------------------------------------------------------------

def _format_names() -> list[str]: ...

def _save(
    state: StateBuilder, path: str, comm: Comm | None, options: SaveOptions
) -> SaveReport: ...
def _load(
    state: StateBuilder, path: str, comm: Comm | None, options: LoadOptions
) -> LoadReport: ...
def _async_save(
    state: StateBuilder, path: str, comm: Comm, options: AsyncSaveOptions
) -> AsyncSaveHandle: ...
def read_metadata(path: str) -> Metadata:
    """Reads and checks the manifest of the checkpoint at `path`."""

def _checksum(data: bytes) -> int: ...
def verify(path: str, num_threads: int = 2, progress: _Progress | None = None) -> VerifyReport:
    """Re-reads every chunk and object of the checkpoint at `path` and checks it."""

def _finalize(path: str) -> Metadata: ...
def _remove_keys(
    path: str,
    prefixes: Sequence[str],
    dry_run: bool,
    sync: SyncPolicy,
    num_io_threads: int,
    progress: _Progress | None,
) -> RemoveKeysReport: ...
def _convert(
    src: str,
    dst: str,
    to: str,
    dtype: str | None,
    comm: Comm | None,
    options: ConvertOptions,
    progress: _Progress | None,
) -> ConvertReport: ...

# ---- the checkpoint manager (py_manager.cc) ----------------------------------------------------

class StepInfo:
    """A step directory of a CheckpointManager's root."""

    @property
    def step(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def state(self) -> str:
        """'committed', 'uncommitted' (a save not finished, or running), 'damaged' or 'deleting'"""
    @property
    def problem(self) -> str: ...
    @property
    def marked(self) -> bool: ...

class RetentionDecision:
    """One step's fate in a prune."""

    @property
    def step(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def deleted(self) -> bool: ...
    @property
    def reason(self) -> str: ...

class PruneReport:
    """What a prune deleted (or would delete) and kept."""

    @property
    def dry_run(self) -> bool: ...
    @property
    def steps(self) -> list[RetentionDecision]: ...
    @property
    def deleted(self) -> int: ...

class _RestoreReport:
    @property
    def step(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def skipped(self) -> list[tuple[int, Error, bool]]: ...
    @property
    def per_rank(self) -> dict[str, list[bytes]]: ...
    @property
    def user_metadata(self) -> dict[str, str]: ...

class ReadLease:
    """A reader's claim on a step directory: no CheckpointManager deletes it while held."""

    @property
    def step(self) -> int: ...
    @property
    def path(self) -> str: ...
    @property
    def held(self) -> bool: ...
    def release(self) -> None:
        """Releases the lease (idempotent)."""
    def __enter__(self) -> str: ...
    def __exit__(self, *args: object) -> Literal[False]: ...

class _CheckpointManager:
    def __init__(
        self,
        root: str,
        save: AsyncSaveOptions,
        async_save: bool,
        when_busy: str,
        keep_last: int,
        keep_every: int,
        write_tracker: bool,
        layout: str,
        step_naming: str,
        warn: Callable[[str], object] | None,
    ) -> None: ...
    def save(
        self,
        step: int,
        state: StateBuilder,
        comm: Comm,
        user_metadata: Mapping[str, str],
        per_rank: Mapping[str, bytes],
        deferred: bool,
    ) -> tuple[bool, str, AsyncSaveHandle | None, SaveReport | None]: ...
    def wait(self) -> None: ...
    def close(self) -> None: ...
    def latest_step(self) -> int | None: ...
    def all_steps(self) -> list[int]: ...
    def steps(self) -> list[StepInfo]: ...
    def step_path(self, step: int, /) -> str: ...
    def mark(self, step: int, note: str) -> None: ...
    def unmark(self, step: int, /) -> None: ...
    def lease(self, step: int, /) -> ReadLease: ...
    def prune(self, keep_last: int, keep_every: int, dry_run: bool) -> PruneReport: ...
    def delete(self, step: int, /) -> None: ...
    def last_retention(self) -> PruneReport | None: ...
    def restore_with(
        self,
        comm: Comm,
        step: int | None,
        map_per_rank: Callable[[int, int, int], int | Sequence[int]] | None,
        loader: Callable[[int, str, list[str]], Iterable[bytes]],
    ) -> _RestoreReport | None: ...

def _take_unseen_failures() -> list[Error]: ...
def _forget_unseen_failures_after_fork() -> None: ...
