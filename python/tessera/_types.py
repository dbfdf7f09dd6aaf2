"""The types of tessera's signatures: what a path, a state dict and a progress callable are, and
the keyword options of save, async_save, load and CheckpointManager as TypedDicts (so that a
type checker names a misspelt option; at run time they are plain dicts).

Each options TypedDict lists exactly the keyword arguments the function accepts (the fields of
the C++ options structs, include/tessera/checkpoint.h, that tessera/_api.py's _set_options
sets, plus check_replicas); the values' types are those _set_options takes: an enum field also
takes its value's name in any case (sync="none", read_sharing="broadcast", format="torch_dist")
and sync a bool.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Literal, Mapping, Sequence, Tuple, TypedDict, Union

from . import _tessera

#: A local path or a URI ("s3://bucket/prefix", "msc://profile/path", "file:///dir").
StrPath = Union[str, os.PathLike[str]]

#: A state dict: a dict (or collections.OrderedDict), list or tuple (or namedtuple), nesting
#: more of them, whose leaves are tensors, arrays, tessera.ShardedTensor/ShardedObject, bytes or
#: any picklable value (tessera/_state.py).
StateDict = Union[Dict[Any, Any], List[Any], Tuple[Any, ...]]

#: progress(done, total): bytes done so far and in all; what it returns is ignored.
ProgressFn = Callable[[int, int], object]

#: check_replicas: "small" (default), "all" (True) or "none" (False); tessera/_replicas.py.
CheckReplicas = Union[Literal["small", "all", "none"], bool]


class ManagerSaveOptions(TypedDict, total=False):
    """The save options of tessera.CheckpointManager(**save_options)."""

    num_io_threads: int
    sync: Union[bool, str, _tessera.SyncPolicy]
    balance_writes: bool
    user_metadata: Mapping[str, str] | None
    remove_stale_files: bool
    plan_cache: bool
    separate_prefixes: Sequence[str]
    collective: bool
    torch_dist_flavor: Union[Literal["2.x", "1.13"], _tessera.TorchDistFlavor]
    torch_dist_key_paths: Mapping[str, Sequence[Union[str, int]]]
    pinned_bytes: int
    device_piece_bytes: int


class _TaggedSaveOptions(ManagerSaveOptions, total=False):
    save_tag: str
    check_replicas: CheckReplicas


class MegatronSaveOptions(_TaggedSaveOptions, total=False):
    """The save options of tessera.megatron.save(**options): save's but format (an argument of
    its own there). progress only with async_sharded_save=False."""

    progress: ProgressFn | None


class AsyncSaveOptions(_TaggedSaveOptions, total=False):
    """The save options of tessera.async_save(**options): save's but progress."""

    format: Union[str, _tessera.CheckpointFormat]


class SaveOptions(AsyncSaveOptions, total=False):
    """The options of tessera.save(**options)."""

    progress: ProgressFn | None


class LoadOptions(TypedDict, total=False):
    """The options of tessera.load, load_all and CheckpointManager.restore (**options)."""

    verify_checksums: bool
    verify_partial_chunks: bool
    num_io_threads: int
    cast_dtypes: bool
    read_sharing: Union[str, _tessera.ReadSharing]
    exchange_bytes: int
    pinned_bytes: int
    device_piece_bytes: int
    progress: ProgressFn | None
