"""save, load, async_save, load_all, read_metadata, verify, convert, remove_keys: thin wrappers
that flatten the state dict (tessera/_state.py), set the C++ options from keyword arguments and
call the extension module without the GIL."""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Mapping,
                    NoReturn, Optional, Set, Tuple, TypeVar, Union, overload)

from . import _handover
from . import _replicas
from . import _state
from . import _tessera
from ._errors import _INVALID_ARGUMENT, Error, invalid_argument, warn_partial_load
from ._handover import AsyncSaveHandle
from ._tessera import (Comm, ConvertReport, LoadReport, Metadata, RemoveKeysReport, SaveReport,
                       VerifyReport)
from ._torch_comm import default_comm
from ._types import ProgressFn, StateDict, StrPath

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ._types import AsyncSaveOptions, LoadOptions, SaveOptions

_T = TypeVar("_T")
_Options = TypeVar("_Options", _tessera.SaveOptions, _tessera.LoadOptions)

# torch_dist_flavor="2.x" or "1.13": TorchDistOptions::flavor (include/tessera/formats.h).
_TORCH_DIST_FLAVORS = {"2.x": "TORCH_2", "1.13": "TORCH_1_13"}

# Metadata.format of a PyTorch DCP (or Megatron torch_dist) checkpoint.
_TORCH_DIST_FORMAT = "torch_dist"

# Keyword arguments that are not fields of the C++ options structs.
_NOT_OPTIONS = {"missing_keys", "unexpected_keys", "storage", "save", "when_busy",
                "format_options"}


def _set_options(function: str, opts: _Options, options: Mapping[str, Any]) -> _Options:
    """Sets the fields of a C++ options struct (SaveOptions, LoadOptions) from keyword
    arguments of the same names. An enum field also takes its value's name in any case
    (sync="none", read_sharing="broadcast"); sync also takes a bool."""
    for name, value in options.items():
        if name.startswith("_") or name in _NOT_OPTIONS or not hasattr(opts, name):
            raise TypeError(f"{function}() got an unexpected keyword argument {name!r}")
        current = getattr(opts, name)
        members: Any = getattr(type(current), "__members__", None)
        if name == "torch_dist_flavor" and isinstance(value, str):
            if value not in _TORCH_DIST_FLAVORS:
                raise ValueError(f"{function}(): torch_dist_flavor must be one of "
                                 f"{list(_TORCH_DIST_FLAVORS)}, not {value!r}")
            value = members[_TORCH_DIST_FLAVORS[value]]
        if members is not None:
            if name == "sync" and isinstance(value, bool):
                value = "full" if value else "none"
            if isinstance(value, str):
                if value.upper() not in members:
                    raise ValueError(f"{function}(): {name} must be one of "
                                     f"{[m.lower() for m in members]}, not {value!r}")
                value = members[value.upper()]
        if name == "user_metadata":
            value = dict(value or {})
            if _state.STRUCTURE_KEY in value:
                raise invalid_argument(f"user_metadata key '{_state.STRUCTURE_KEY}' is reserved")
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
                raise TypeError("user_metadata must map str to str")
            for k, v in value.items():
                _state.check_text(k, "user_metadata key")
                _state.check_text(v, f"user_metadata[{k!r}]")
        setattr(opts, name, value)
    # torch_dist_flavor and torch_dist_key_paths fill TorchDistOptions (C++ format_options),
    # which only format="torch_dist" takes: with another format they would do nothing.
    if (isinstance(opts, _tessera.SaveOptions) and opts.format_options is not None
            and opts.format != _tessera.CheckpointFormat.TORCH_DIST):
        raise invalid_argument(f"{function}(): torch_dist_flavor and torch_dist_key_paths apply "
                               f"to format='torch_dist' only, not {opts.format.name.lower()!r}")
    return opts


def _comm_handle(comm: Optional[Comm]) -> Optional[Comm]:
    """The Comm a collective call runs over: `comm`; without one, the default process group
    when torch.distributed is initialised with several ranks (as torch.distributed.checkpoint
    does), else None: this process alone. comm=tessera.single_rank_comm() is one process alone,
    explicitly."""
    if comm is None:
        return default_comm()
    if isinstance(comm, _tessera.Comm):
        return comm
    raise TypeError(f"comm must be a tessera.Comm or None, not {type(comm).__name__} (wrap a "
                    "torch.distributed group with tessera.torch_dist_comm(group), an mpi4py "
                    "communicator with tessera.mpi_comm(comm))")


def _status_of(error: Exception) -> Tuple[int, str]:
    """(status code, message) of an exception raised while preparing a call."""
    if isinstance(error, Error):
        return error.status_code, str(error)
    return _INVALID_ARGUMENT, f"{type(error).__name__}: {error}"


def _prepare(comm: Optional[Comm], prepare: Callable[[], _T], collective: bool = True) -> _T:
    """Runs prepare() (flattening, checking, options) on this rank. With several ranks, all
    of them then learn whether every rank succeeded (one small collective), so bad input on
    one rank fails the call on every rank instead of leaving the others waiting in the next
    collective. The failing rank raises its own exception; the others a tessera.Error of the
    same status naming it. With collective False (a rank-local save) nothing is exchanged."""
    error = None
    try:
        result = prepare()
    except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
        error = e
    if comm is not None and comm.size > 1 and collective:
        code, message = (0, "") if error is None else _status_of(error)
        try:
            _tessera._agree_on_status(comm, code, message)
        except Error:
            if error is None:
                raise
    if error is not None:
        raise error
    return result


@overload
def _prepare_save(function: str, state_dict: StateDict, comm: Comm, options: Mapping[str, Any]
                  ) -> Tuple[Comm, _tessera.StateBuilder, _tessera.SaveOptions]: ...
@overload
def _prepare_save(function: str, state_dict: StateDict, comm: Optional[Comm],
                  options: Mapping[str, Any]
                  ) -> Tuple[Optional[Comm], _tessera.StateBuilder, _tessera.SaveOptions]: ...
def _prepare_save(function: str, state_dict: StateDict, comm: Optional[Comm],
                  options: Mapping[str, Any]
                  ) -> Tuple[Optional[Comm], _tessera.StateBuilder, _tessera.SaveOptions]:
    """(comm, builder, options) of a save of `state_dict`: the state flattened and checked on
    every rank (_prepare), the replicas compared, rank 0's structure merged. The comm returned
    is `comm`, or for None the default one (_comm_handle)."""
    comm = _comm_handle(comm)
    options = dict(options)
    # collective=False: a rank-local save, which sends nothing (rank 0's structure is kept
    # as it is; load_all decodes the leaves only other ranks hold from the manifest alone).
    collective = options.get("collective", True)
    several = comm is not None and comm.size > 1 and collective

    def prepare() -> Tuple[_state.Flat, _tessera.StateBuilder, _tessera.SaveOptions,
                           Optional[int]]:
        limit, opts = _save_options(function, options)
        # A DCP checkpoint holds the leaves torch's own flattening makes (a tuple is one
        # object), so that torch's dcp.load finds the keys it asks for.
        torch_dist = opts.format == _tessera.CheckpointFormat.TORCH_DIST
        flat = _state.Flat(state_dict, dcp=torch_dist)
        builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=False)
        if torch_dist and not opts.torch_dist_key_paths:
            opts.torch_dist_key_paths = flat.paths  # planner_data: the nesting, for torch
        return flat, builder, opts, limit

    flat, builder, opts, limit = _prepare(comm, prepare, collective)
    if several and comm is not None:
        replicas = []
        if limit != 0:  # the replica check (_replicas.py): which boxes have several holders
            claimed = _replicas.exchange_claims(comm, flat.leaves, _state.ShardedTensor, limit)
            replicas = _replicas.digests(flat.leaves, _state.ShardedTensor, limit, claimed)
        # Rank 0's structure is the one saved: tell it what it cannot see, and the digests
        # of the replicas each rank holds (one small gather).
        summaries = comm.gather(flat.rank_summary(replicas), 0)
        if comm.rank == 0:
            flat.merge_rank_summaries(summaries)
        if limit != 0:  # every rank learns whether replicas differ, before anything is written
            _replicas.check(comm, None if summaries is None else
                            [json.loads(s)["replicas"] for s in summaries])
    if opts.format != _tessera.CheckpointFormat.TORCH_DIST:
        # A DCP checkpoint has no place for it: torch_dist saves keep flat keys only.
        metadata = opts.user_metadata
        metadata[_state.STRUCTURE_KEY] = flat.structure
        opts.user_metadata = metadata
    return comm, builder, opts


def save(state_dict: StateDict, path: StrPath, *, comm: Optional[Comm] = None,
         **options: Unpack[SaveOptions]) -> SaveReport:
    """Saves `state_dict` as a checkpoint directory at `path`. COLLECTIVE over `comm`: every
    rank calls it with the same path and options, in the same order.

    `path` (here and in every function of tessera that takes one): a local path or a URI,
    "s3://bucket/prefix" (credentials, region and endpoint as the AWS CLI finds them),
    "msc://profile/path" (multi-storage-client's config) or "file:///dir"; docs/S3.md.

    Options (fields of SaveOptions, include/tessera/checkpoint.h, which documents each default
    and cost): num_io_threads=0 (2 data files and threads per rank, 1 on an object store such as
    S3), sync=True ("full"; False or "none": no fsync at all),
    balance_writes=False, user_metadata={} (str -> str; rank 0's is kept),
    remove_stale_files=True, plan_cache=True, separate_prefixes=[] (keys starting with each
    prefix go to data files of their own, so remove_keys of that prefix copies nothing),
    progress=None (a callable progress(done, total): this rank's bytes written so far and in
    all, called from the calling thread every 100 ms and at the end; e.g. a tqdm bar's
    update, see docs/PYTHON.md; what it raises is raised once the save returns),
    format="tessera", collective=True, check_replicas="small" (a collective save over several
    ranks compares the replicas of each replicated tensor of at most 1 MiB across the ranks and
    fails, naming the key and the ranks, when they differ; "all" (True): every replica; "none"
    (False): no check; see tessera/_replicas.py and docs/PYTHON.md).

    collective=False (with save_tag="step-1000", say: the same on every rank, new for every
    save into the directory) is a rank-local save: no message at all between the ranks; each
    commits a manifest of its own part, and load, load_all, read_metadata and verify read the
    parts as one checkpoint once every rank's is there; tessera.finalize(path) merges them.

    format="torch_dist" writes a PyTorch DCP checkpoint (Megatron-Core's torch_dist) that
    torch's own torch.distributed.checkpoint.load_state_dict reads, with torch_dist_flavor="2.x"
    (default: torch 2.x's class paths) or "1.13". Keys are the dotted paths of the leaves; objects
    come back from torch as the values saved (pickled ones unpickled, bytes as bytes). No
    user_metadata; tessera.load_all then returns a flat dict (the nesting is not stored).

    Returns a SaveReport.
    """
    comm, builder, opts = _prepare_save("save", state_dict, comm, options)
    return _tessera._save(builder, os.fspath(path), comm, opts)


def _load_options(strict: bool, options: Mapping[str, Any]) -> _tessera.LoadOptions:
    opts = _tessera.LoadOptions()
    policy = _tessera.KeyPolicy.ERROR if strict else _tessera.KeyPolicy.SKIP
    opts.missing_keys = policy
    opts.unexpected_keys = policy
    return _set_options("load", opts, options)


_OBJECTS = ("unpickle", "bytes")


def _check_objects(objects: str) -> None:
    if objects not in _OBJECTS:
        raise ValueError(f"objects must be one of {list(_OBJECTS)}, not {objects!r}")


def _load_prepared(state_dict: Any, flat: _state.Flat, builder: _tessera.StateBuilder, path: str,
                   comm: Optional[Comm], opts: _tessera.LoadOptions,
                   function: Optional[str] = "tessera.load",
                   objects: str = "unpickle") -> LoadReport:
    report = _tessera._load(builder, path, comm, opts)
    if function is not None:
        warn_partial_load(f"{function}(strict=False)", report.missing_keys,
                          report.unexpected_keys, stacklevel=4)
    new_values = _state.decode_objects(flat, builder, set(report.missing_keys),
                                       unpickle=objects == "unpickle")
    if new_values:
        state_dict = _state.map_leaves(state_dict, lambda i, leaf: new_values.get(i, leaf),
                                       dcp=flat.dcp)
    report.state_dict = state_dict
    return report


def load(state_dict: StateDict, path: StrPath, *, comm: Optional[Comm] = None, strict: bool = True,
         objects: Literal["unpickle", "bytes"] = "unpickle",
         **options: Unpack[LoadOptions]) -> LoadReport:
    """Loads the checkpoint at `path` into `state_dict`, in place: every tensor and array is
    written straight into its memory (any layout, whatever the layout of the save); every
    object is replaced by the loaded one (in the dict or list holding it; a tuple holding one
    is rebuilt). COLLECTIVE over `comm`.

    Security: an object leaf whose placeholder is not bytes/bytearray is unpickled, and
    unpickling runs code the checkpoint chooses. Load only checkpoints you trust, or pass
    objects="bytes": nothing is unpickled, every object comes back as its stored bytes.

    strict=True: a key the checkpoint lacks (MissingKeysError) or a key of the checkpoint that
    no rank asks for (InvalidArgumentError) is an error, and nothing is loaded. strict=False
    loads the keys both sides have, lists the others in the report and says how many with a
    tessera.PartialLoadWarning (warnings.warn).

    Options (fields of LoadOptions): verify_checksums=True, verify_partial_chunks=False,
    num_io_threads=2, read_sharing="auto" ("read_once": the job reads each checksum block once
    and ranks send each other what they need; "none": each rank reads its own; "auto": read_once
    unless every rank reads a local filesystem, where re-reading is cheaper than sending, or
    reading once would save under 5% of the bytes;
    "broadcast", "all_gather": within groups of identical needs only), exchange_bytes=64 MiB,
    cast_dtypes=False (True: a tensor saved in one float dtype, float64/32/16, bfloat16 or a
    float8, loads into a tensor of another, rounded to nearest even as it is read; otherwise a
    dtype mismatch is an InvalidArgumentError naming the key and both dtypes),
    progress=None (a callable progress(done, total): the bytes of this rank's requests loaded
    so far and in all, from the calling thread, as for save).

    Returns a LoadReport (missing_keys, unexpected_keys, shape_mismatched_keys, bytes_read,
    ...) whose `state_dict` is the loaded state dict: `state_dict` itself, or a new one when
    its root is a tuple holding a replaced object.
    """
    comm = _comm_handle(comm)

    def prepare() -> Tuple[_state.Flat, _tessera.StateBuilder, _tessera.LoadOptions, str]:
        _check_objects(objects)
        # A DCP checkpoint's keys are those of torch's flattening (a tuple is one object):
        # flatten the request the same way when the two differ for it.
        dcp = (_state.dcp_differs(state_dict)
               and read_metadata(path).format == _TORCH_DIST_FORMAT)
        flat = _state.Flat(state_dict, for_load=True, dcp=dcp)
        builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=True)
        return flat, builder, _load_options(strict, options), os.fspath(path)

    flat, builder, opts, path = _prepare(comm, prepare)
    return _load_prepared(state_dict, flat, builder, path, comm, opts, objects=objects)


def load_all(path: StrPath, *, comm: Optional[Comm] = None,
             tensor_type: Optional[Literal["numpy", "torch"]] = None,
             objects: Literal["unpickle", "bytes"] = "unpickle",
             **options: Unpack[LoadOptions]) -> Any:
    """Loads the whole checkpoint at `path` into a new state dict, built from its metadata.

    Security: objects saved pickled are unpickled, and unpickling runs code the checkpoint
    chooses (so may importing the namedtuple types its structure names). Load only
    checkpoints you trust, or pass objects="bytes": nothing is unpickled and no module is
    imported; pickled objects come back as their stored bytes, namedtuples as equivalent new
    types unless their type is already imported.

    Saved from Python: the same containers (dict, OrderedDict, list, tuple, namedtuple) and
    leaves: torch tensors where torch tensors were saved, NumPy arrays where arrays were
    (a ShardedTensor comes back as the whole global tensor), objects unpickled, bytes as bytes.
    Otherwise (e.g. saved from C++): a flat dict {key: tensor or bytes}, tensors as NumPy
    arrays. tensor_type="numpy" or "torch" forces the tensor type. A dtype the chosen library
    lacks comes back as integers of the same width holding the raw bits (see docs/PYTHON.md).

    COLLECTIVE over `comm`: every rank reads the manifest and loads every tensor whole.
    Options as for load.
    """
    comm = _comm_handle(comm)

    def prepare() -> Tuple[Any, _state.Flat, _tessera.StateBuilder, _tessera.LoadOptions, str]:
        if tensor_type not in (None, "numpy", "torch"):
            raise ValueError(
                f"tensor_type must be None, 'numpy' or 'torch', not {tensor_type!r}")
        _check_objects(objects)
        template = _state.template_from_metadata(
            read_metadata(path), tensor_type, source=os.fspath(path),
            import_modules=objects == "unpickle")
        flat = _state.Flat(template, for_load=True)
        builder = flat.build(rank=comm.rank if comm is not None else 0, for_load=True)
        return template, flat, builder, _load_options(True, options), os.fspath(path)

    template, flat, builder, opts, path = _prepare(comm, prepare)
    report = _load_prepared(template, flat, builder, path, comm, opts, "tessera.load_all",
                            objects=objects)
    return _state.unwrap(report.state_dict)


def read_metadata(path: StrPath) -> Metadata:
    """The Metadata of the checkpoint at `path` (keys, dtypes, shapes, chunks, files, user
    metadata), from its manifest."""
    return _tessera.read_metadata(os.fspath(path))


def finalize(path: StrPath) -> Metadata:
    """Merges the rank manifests of the rank-local save at `path` (save(..., collective=False))
    into one committed manifest, atomically, and removes the files of earlier saves. Run it
    from one process. Returns the merged Metadata. Raises a tessera.Error naming the missing
    ranks when the save is incomplete."""
    return _tessera._finalize(os.fspath(path))


def verify(path: StrPath, num_threads: int = 2,
           progress: Optional[ProgressFn] = None) -> VerifyReport:
    """Re-reads every chunk and object of the checkpoint at `path`: checksums, file sizes,
    exact coverage, `num_threads` data files at once. Returns a VerifyReport or raises the
    first problem found (usually a CorruptCheckpointError; an InvalidArgumentError for
    num_threads < 1). progress(done, total), if given, is called with the bytes checked."""
    return _tessera.verify(os.fspath(path), num_threads, progress)


def remove_keys(path: StrPath, prefixes: Union[str, Iterable[str]], *, dry_run: bool = False,
                sync: bool = True, num_io_threads: int = 2,
                progress: Optional[ProgressFn] = None) -> RemoveKeysReport:
    """Removes from the tessera checkpoint at `path` every tensor and object whose key starts
    with one of `prefixes` (a str or a list of them) and frees their bytes: data files that
    hold only removed keys are deleted; files that also hold kept keys are rewritten, their
    kept chunks copied with every checksum verified on the way; the new manifest is committed
    atomically like a save's, so a crash leaves the old checkpoint or the new one. Keys saved
    with separate_prefixes=[prefix] are removed without copying anything.

    Not collective: call it from one process. dry_run=True reports without changing anything.
    sync=False skips every fsync. progress(done, total): bytes copied so far and to copy.

    Returns a RemoveKeysReport (removed_tensors, removed_objects, matches_per_prefix,
    files_dropped, files_rewritten, bytes_before, bytes_after, bytes_freed, bytes_copied).
    Nothing matching is not an error (the report is empty). Raises FailedPreconditionError for
    a checkpoint in another format, CorruptCheckpointError for a corrupt chunk met while
    copying (nothing is then changed).
    """
    if isinstance(prefixes, (str, bytes)):
        prefixes = [prefixes]
    prefixes = list(prefixes)
    for p in prefixes:
        if not isinstance(p, str):
            raise TypeError(f"remove_keys(): prefixes must be str, not {type(p).__name__}")
    policy = _tessera.SyncPolicy.FULL if sync else _tessera.SyncPolicy.NONE
    return _tessera._remove_keys(os.fspath(path), prefixes, bool(dry_run), policy,
                                 int(num_io_threads), progress)


# ---- conversion ----------------------------------------------------------------------------

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_TARGET_DTYPES = {"bf16": "BF16", "bfloat16": "BF16", "f16": "F16", "float16": "F16",
                  "half": "F16", "f32": "F32", "float32": "F32", "float": "F32", "f64": "F64",
                  "float64": "F64", "double": "F64"}
# The formats the library registers (its format registry), for checking `to` before the call.
_FORMATS: tuple[str, ...] = tuple(_tessera._format_names())


def _size(value: Union[int, str], name: str) -> int:
    """Bytes from an int or a text such as "5GB", "256MiB"."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        if match and match.group(2).upper() in _SIZE_UNITS:
            return int(round(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()]))
    raise ValueError(f"{name} must be a number of bytes or a size such as '5GB' or '256MiB', "
                     f"not {value!r}")


def _target_dtype(dtype: Any) -> Optional[str]:
    """The safetensors name of a float dtype given as text, a torch dtype or a NumPy dtype."""
    if dtype is None:
        return None
    text = str(dtype).lower()
    text = text[len("torch."):] if text.startswith("torch.") else text
    if not isinstance(dtype, str):
        try:
            import numpy  # noqa: PLC0415
            text = numpy.dtype(dtype).name
        except TypeError:
            pass
    if text not in _TARGET_DTYPES:
        raise ValueError(f"dtype must be bf16, f16, f32 or f64 (or the torch or NumPy float "
                         f"dtype), not {dtype!r}")
    return _TARGET_DTYPES[text]


def _progress_bar() -> ProgressFn:
    """A progress callback: tqdm's bar when tqdm is installed, else one line on stderr."""
    try:
        from tqdm import tqdm  # noqa: PLC0415
    except ImportError:
        tqdm = None
    state: Dict[str, Any] = {}

    def update(done: int, total: int) -> None:
        if tqdm is not None:
            bar = state.get("bar")
            if bar is None:
                bar = state["bar"] = tqdm(total=total, unit="B", unit_scale=True, desc="convert")
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
            return
        percent = 100 if total == 0 else 100 * done // total
        sys.stderr.write(f"\rconvert {percent:3d}% {done / 1e6:.1f} / {total / 1e6:.1f} MB")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return update


def convert(src: StrPath, dst: StrPath, *, to: Literal["safetensors", "tessera", "torch_dist"],
            comm: Optional[Comm] = None, max_shard_size: Union[int, str] = "5GB",
            keys: Union[str, Iterable[str], None] = None, strip_prefix: Optional[str] = None,
            dtype: Any = None, num_threads: int = 4, buffer_bytes: Union[int, str] = "256MiB",
            sync: bool = True, verify_checksums: bool = True,
            progress: Union[ProgressFn, bool, None] = None,
            torch_dist_flavor: Literal["2.x", "1.13"] = "2.x") -> ConvertReport:
    """Rewrites the checkpoint at `src` (tessera, PyTorch DCP / Megatron torch_dist, Hugging
    Face safetensors files or one .safetensors file: detected) as a new directory `dst` in the
    format `to`: "safetensors" (Hugging Face: model.safetensors, or model-0000i-of-0000N
    shards and model.safetensors.index.json; whole tensors; objects are not exported),
    "tessera" (objects kept) or "torch_dist" (a PyTorch DCP directory torch's own
    load_state_dict reads, as save(..., format="torch_dist") writes it: whole tensors, objects
    kept, `.metadata` naming torch_dist_flavor's classes, "2.x" (default) or "1.13"; the
    source's user metadata, and with it the nesting of a state dict saved from Python, is not
    kept: DCP has no place for it).

    Streams: memory is bounded by `buffer_bytes` (per rank), not by the checkpoint; each
    tensor is loaded in units of at most buffer_bytes / num_threads (and 32 MiB) and written
    whole. `dst` must not exist (or be an empty directory, or hold only what a conversion that
    died left, which is removed); the output is committed in it as its format commits a save
    (no directory is renamed), so it is a checkpoint or none.

    max_shard_size: largest output file ("5GB", "2GiB" or bytes; a larger tensor gets a file
    of its own). keys: keep only keys starting with this prefix or these prefixes.
    strip_prefix: removed from every output key that starts with it. dtype: "bf16", "f16",
    "f32", "f64" (or torch.bfloat16, numpy.float32, ...): every F64/F32/F16/BF16 tensor is
    written in it, rounded to nearest even; integers and float8 keep theirs. sync=False skips
    fsync. verify_checksums: check the source's checksums where it has them. progress: a
    callable (bytes done, bytes total) of this rank, or True for a bar (tqdm's when installed).

    COLLECTIVE over `comm`: every rank calls it with the same arguments; the output files are
    spread over the ranks. Returns a ConvertReport (tensors, objects, total_bytes, files,
    skipped_objects, bytes_read and bytes_written of this rank, ...).
    """
    comm = _comm_handle(comm)
    if to not in _FORMATS:
        raise ValueError(f"to must be one of {list(_FORMATS)}, not {to!r}")
    if isinstance(keys, str):
        keys = [keys]
    keys = list(keys or [])
    if not all(isinstance(k, str) for k in keys):
        raise TypeError("keys must be a str or a list of str")
    opts = _tessera.ConvertOptions()
    opts.max_file_bytes = _size(max_shard_size, "max_shard_size")
    opts.buffer_bytes = _size(buffer_bytes, "buffer_bytes")
    opts.keys = keys
    opts.strip_prefix = strip_prefix or ""
    opts.num_threads = num_threads
    opts.sync = _tessera.SyncPolicy.FULL if sync else _tessera.SyncPolicy.NONE
    opts.verify_checksums = bool(verify_checksums)
    if torch_dist_flavor not in _TORCH_DIST_FLAVORS:
        raise ValueError(f"convert(): torch_dist_flavor must be one of "
                         f"{list(_TORCH_DIST_FLAVORS)}, not {torch_dist_flavor!r}")
    if to == _TORCH_DIST_FORMAT:
        opts.torch_dist_flavor = getattr(_tessera.TorchDistFlavor,
                                         _TORCH_DIST_FLAVORS[torch_dist_flavor])
    elif torch_dist_flavor != "2.x":
        raise invalid_argument(f"convert(): torch_dist_flavor applies to to='torch_dist' only, "
                               f"not {to!r}")
    if progress is True:
        progress = _progress_bar() if comm is None or comm.rank == 0 else None
    elif progress is False:
        progress = None
    elif progress is not None and not callable(progress):
        raise TypeError("progress must be a callable (done, total), True or None")
    return _tessera._convert(os.fspath(src), os.fspath(dst), to, _target_dtype(dtype), comm, opts,
                             progress)


# ---- asynchronous saves ------------------------------------------------------------------

_default_comm: Optional[Comm] = None
_default_comm_lock = threading.Lock()
_default_comm_submit_lock = threading.Lock()
# Handles of async saves not yet seen done (waited for at exit). Ranks of run_local are threads
# that save at once: every use holds _in_flight_lock.
_in_flight: Set[AsyncSaveHandle] = set()
_in_flight_lock = threading.Lock()


# Kept alive forever in a forked child (see _after_fork_in_child): never destroyed there.
_abandoned: List[object] = []


def _keep_forever(obj: object) -> None:
    """One more reference to `obj` that is never released, not even at interpreter exit (a
    destructor that would wait for a parent's thread must never run in a forked child)."""
    import ctypes  # noqa: PLC0415
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _abandoned.append(obj)


def _after_fork_in_child() -> None:
    """os.register_at_fork(after_in_child=...): the child has none of its parent's threads.
    The parent's asynchronous saves (their handles, and the managers that made them) are
    abandoned in the child: never waited for, never destroyed, not reported at its exit (the
    parent commits or reports them). The C++ side does the same for the savers' threads and
    gives the child a saver of its own (src/checkpoint/async_save.cc), so the child's own
    async_save works. Locks a parent thread may have held at the fork are made anew."""
    global _default_comm_lock, _default_comm_submit_lock, _in_flight_lock
    _default_comm_lock = threading.Lock()
    _default_comm_submit_lock = threading.Lock()
    _in_flight_lock = threading.Lock()
    for handle in list(_in_flight):
        _keep_forever(handle)
    _in_flight.clear()
    for submitter in _handover.forget_after_fork():
        _keep_forever(submitter)
    for hook in _after_fork_hooks:
        hook()


# More of the child's resets (tessera/_manager.py adds its own).
_after_fork_hooks: List[Callable[[], None]] = []
os.register_at_fork(after_in_child=_after_fork_in_child)


def _single_rank_comm() -> Comm:
    # One for the process: the asynchronous saver and its staging buffers live with the Comm,
    # and are reused from save to save.
    global _default_comm
    with _default_comm_lock:
        if _default_comm is None:
            _default_comm = _tessera.single_rank_comm()
        return _default_comm


def async_save(state_dict: StateDict, path: StrPath, *, comm: Optional[Comm] = None,
               when_busy: Literal["wait", "queue"] = "wait",
               staging: Literal["blocking", "deferred"] = "blocking",
               staging_threads: Optional[int] = None, check_unchanged_until_staged: bool = False,
               background_nice: Optional[int] = None,
               staging_budget_bytes: Optional[int] = None,
               **options: Unpack[AsyncSaveOptions]) -> AsyncSaveHandle:
    """Saves like save(), but the checkpoint is written and committed in the background.
    COLLECTIVE over `comm`. The caller may use `comm` at once.

    The call hands the save to a thread of tessera's (one per comm, tessera/_handover.py) and
    copies only the containers of `state_dict` (dicts, lists, tuples): the flattening, the
    checks and the collectives run on that thread, over a communicator of its own split from
    `comm` by the first async_save over it (a collective, once).

    staging="blocking" (default): returns once the state is copied into staging buffers; the
    caller may change its tensors at once; errors (a bad state on any rank) are raised here.
    staging="deferred": returns at once, in about a millisecond (the flattening and the copy
    run on background threads while the caller computes); the caller must not change its
    tensors, nor mutable objects in the state, until handle.wait_staged() returns (call it
    before the optimizer step), which raises what the save failed with (a bad state on any
    rank: on every rank); a keyword argument this rank got wrong is raised at once. The handle
    keeps the tensors alive until then.

    when_busy="wait" (default): the staging waits for an earlier async save on the same comm
    (one staged copy in memory at most; with "deferred" the call does not wait, wait_staged()
    does); "queue": stage now and queue (two at most).
    staging_threads (default 4): threads that copy, in pieces. check_unchanged_until_staged=True
    (debugging, with "deferred"): checksums the tensors when copied and again in wait_staged(),
    which raises FailedPreconditionError naming a tensor changed too early (the save fails on
    every rank). background_nice (default 10, 0-19): the nice value of the background work
    (the copy threads, the saving thread and its I/O threads; not the caller's thread), so
    that the save takes the CPU time the training loop leaves idle; 0: normal priority.
    staging_budget_bytes (default 0: none): the most memory this rank's staged copy may hold.
    When the rank's host tensors exceed it, they are copied piece by piece into buffers of at
    most that size as the background save writes them (back-pressure instead of an
    out-of-memory kill): the tensors are the caller's again (wait_staged(); with "blocking",
    this call returns) once all but the budget's worth is written. Not with
    check_unchanged_until_staged when the state exceeds it.

    Returns an AsyncSaveHandle: wait_staged(), staged(), wait() (the SaveReport, or raises the
    save's error), done(), exception(), report. The interpreter waits at exit for saves still
    in flight.
    """
    if when_busy not in ("wait", "queue"):
        raise ValueError(f"when_busy must be 'wait' or 'queue', not {when_busy!r}")
    if staging not in ("blocking", "deferred"):
        raise ValueError(f"staging must be 'blocking' or 'deferred', not {staging!r}")
    if "progress" in options:
        raise TypeError("async_save() does not take progress: the save runs in the background "
                        "(handle.done() polls it)")
    collective = options.get("collective", True)
    explicit = comm is not None
    handle_of = _comm_handle(comm)
    caller: Comm = handle_of if handle_of is not None else _single_rank_comm()
    if handle_of is None or not explicit:
        # The process-wide comm, or the default group's: shared by the threads of the process,
        # and a Comm is used by one thread at a time (only the first call splits it).
        with _default_comm_submit_lock:
            submitter = _handover.submitter(caller, collective)
    else:
        submitter = _handover.submitter(caller, collective)
    # What this rank got wrong in its arguments is raised at once. The save is queued all the
    # same, failing in its agreement: every rank's save fails with this error, none hangs.
    local_error: Optional[Exception] = None
    try:
        async_opts = _async_save_options(when_busy, staging, staging_threads,
                                         check_unchanged_until_staged, background_nice,
                                         staging_budget_bytes)
        _save_options("async_save", options)
    except Exception as e:  # noqa: BLE001 (raised below)
        local_error = e
    # The containers are copied now (microseconds a leaf): the caller may change its dicts
    # once this returns. The leaves are the caller's until staged, as with any deferred save.
    state = _state.copy_containers(state_dict, lambda path, leaf: leaf)
    path = os.fspath(path)

    def work(private: Optional[Comm]) -> _tessera.AsyncSaveHandle:
        # On the submitting thread (tessera/_handover.py), over its private communicator; a
        # rank-local save (no private one) uses the caller's, which it never talks over.
        if private is None:
            private = caller
        if local_error is not None:
            error = local_error
            _prepare(private, lambda: _raise(error), collective)
        _, builder, save_opts = _prepare_save("async_save", state, private, options)
        async_opts.save = save_opts
        return _tessera._async_save(builder, path, private, async_opts)

    handle = submitter.submit(work)
    if local_error is not None:
        raise local_error
    if staging == "blocking":
        handle.wait_staged()  # raises what the save failed with, on every rank
    _track(handle)
    return handle


def _raise(error: Exception) -> NoReturn:
    raise error


def _async_save_options(when_busy: str, staging: str, staging_threads: Optional[int],
                        check_unchanged_until_staged: bool,
                        background_nice: Optional[int],
                        staging_budget_bytes: Optional[int] = None
                        ) -> _tessera.AsyncSaveOptions:
    """The AsyncSaveOptions of async_save's arguments (its `save` field set later)."""
    opts = _tessera.AsyncSaveOptions()
    opts.when_busy = _tessera.WhenBusy.WAIT if when_busy == "wait" else _tessera.WhenBusy.QUEUE
    opts.staging = (_tessera.StagingMode.BLOCKING if staging == "blocking"
                    else _tessera.StagingMode.DEFERRED)
    if staging_threads is not None:
        opts.staging_threads = staging_threads  # TypeError unless an int
        if staging_threads < 1:  # as AsyncSave's own check (src/checkpoint/async_save.cc)
            raise invalid_argument(f"staging_threads must be at least 1, not {staging_threads}")
    opts.check_unchanged_until_staged = bool(check_unchanged_until_staged)
    if background_nice is not None:
        opts.background_nice = background_nice  # TypeError unless an int
        if not 0 <= background_nice <= 19:  # as AsyncSave's own check
            raise invalid_argument(f"background_nice must be 0 to 19, not {background_nice}")
    if staging_budget_bytes is not None:
        if isinstance(staging_budget_bytes, bool) or not isinstance(staging_budget_bytes, int):
            raise TypeError(f"staging_budget_bytes must be an int, not {staging_budget_bytes!r}")
        if staging_budget_bytes < 0:
            raise invalid_argument(
                f"staging_budget_bytes must be >= 0 (0: no budget), not {staging_budget_bytes}")
        opts.staging_budget_bytes = staging_budget_bytes
    return opts


def _save_options(function: str, options: Mapping[str, Any]
                  ) -> Tuple[Optional[int], _tessera.SaveOptions]:
    """(the replica check's size limit, the SaveOptions) of a save's keyword arguments; raises
    what is wrong with them (local and cheap: async_save checks them on the caller's thread)."""
    options = dict(options)
    limit = _replicas.limit_of(options.pop("check_replicas", "small"))
    return limit, _set_options(function, _tessera.SaveOptions(), options)


def _track(handle: AsyncSaveHandle) -> None:
    """Keeps `handle` for the exit hook until it is done and its outcome shown to its owner."""
    with _in_flight_lock:
        _in_flight.difference_update(
            [h for h in _in_flight if h.done() and h.report is not None])
        _in_flight.add(handle)


# More checks of the exit hook: callables returning the messages of failed saves nobody was told
# of (tessera/_manager.py adds the open CheckpointManagers').
_exit_checks: List[Callable[[], List[str]]] = []


@atexit.register
def _wait_for_async_saves() -> None:
    """At exit: waits for the saves in flight; a failed save whose failure nobody was shown
    (by wait(), wait_staged() or exception() of its handle, or a manager's call) is printed and
    the process exits with status 1: it never ends as if the checkpoint had been saved."""
    failures = []
    with _in_flight_lock:
        handles = list(_in_flight)
    for handle in handles:
        error = handle._unseen_failure()
        if error is not None:
            failures.append(f"an asynchronous save failed: {error}")
    for check in _exit_checks:
        failures += check()
    if not failures:
        return
    for failure in failures:
        sys.stderr.write(f"tessera: error: {failure} (nothing reported it before exit)\n")
    sys.stderr.flush()
    sys.stdout.flush()
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    os._exit(1)
