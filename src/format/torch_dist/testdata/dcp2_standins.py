"""Stand-ins for the torch 2.x DCP classes (and Megatron-Core's), for torch 1.13 machines.

torch 2.x is not installable here, so the classes torch 2.x pickles into a `.metadata` are
re-declared, with the same fields, `__getstate__`/`__setstate__` and dataclass options as the
torch 2.x sources (torch/distributed/checkpoint/{metadata,filesystem,planner}.py) and
Megatron-Core (megatron/core/dist_checkpointing/strategies/torch.py), in modules registered in
sys.modules under the real module paths. Pickling instances of them writes what torch 2.x's
pickle.dump writes; unpickling resolves those class paths to them. torch.Size, dtypes and
layouts are torch 1.13's real objects, which pickle the same way in 2.x.

install() registers the modules and returns a namespace with the classes.
"""
import dataclasses
import enum
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch

METADATA = "torch.distributed.checkpoint.metadata"
FILESYSTEM = "torch.distributed.checkpoint.filesystem"
PLANNER = "torch.distributed.checkpoint.planner"
MEGATRON = "megatron.core.dist_checkpointing.strategies.torch"


def _module(name):
    if name in sys.modules:
        return sys.modules[name]
    module = types.ModuleType(name)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(_module(parent), child, module)
    return module


def _define(module_name, *classes):
    module = _module(module_name)
    for cls in classes:
        cls.__module__ = module_name
        setattr(module, cls.__name__, cls)


@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


class _MEM_FORMAT_ENCODING(enum.Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = field(default=torch.strided)
    requires_grad: bool = False
    memory_format: torch.memory_format = field(default=torch.contiguous_format)
    pin_memory: bool = False

    def __getstate__(self):
        encoding = {
            torch.contiguous_format: _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT,
            torch.channels_last: _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST,
            torch.preserve_format: _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT,
        }[self.memory_format]
        return (self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory)

    def __setstate__(self, state):
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        self.memory_format = {
            _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT: torch.contiguous_format,
            _MEM_FORMAT_ENCODING.TORCH_CHANNELS_LAST: torch.channels_last,
            _MEM_FORMAT_ENCODING.TORCH_PRESERVE_FORMAT: torch.preserve_format,
        }[encoding]


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: List[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: Optional[str] = None
    load_id: Optional[str] = None
    modules: List[str] = field(default_factory=list)


@dataclass
class Metadata:
    state_dict_metadata: Dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Optional[StorageMeta] = None
    version: Optional[str] = None


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: Optional[torch.Size] = None
    index: Optional[int] = field(hash=False, compare=False, default=None)

    def __init__(self, fqn, offset=None, index=None):
        object.__setattr__(self, "fqn", fqn)
        object.__setattr__(self, "index", index)
        if offset is not None:
            object.__setattr__(self, "offset", torch.Size(offset))


@dataclass
class _StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Optional[Sequence[str]] = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if v is not None}


class WriteItemType(enum.Enum):
    TENSOR = enum.auto()
    SHARD = enum.auto()
    BYTE_IO = enum.auto()


@dataclass(frozen=True)
class TensorWriteData:
    chunk: ChunkStorageMetadata
    properties: TensorProperties
    size: torch.Size


@dataclass(frozen=True)
class WriteItem:
    index: MetadataIndex
    type: WriteItemType
    tensor_data: Optional[TensorWriteData] = None


@dataclass(frozen=True)
class SavePlan:
    items: List[WriteItem]
    storage_data: Any = None
    planner_data: Any = None
    usable: bool = True


@dataclass(frozen=True)
class MCoreSavePlan(SavePlan):
    mcore_data: Dict[str, Dict[str, Any]] = None


@dataclass
class MCoreMetadata(Metadata):
    mcore_data: Optional[Dict[str, Dict[str, Any]]] = None


class ValueReducedEncoding(enum.Enum):
    """_MEM_FORMAT_ENCODING as Python < 3.11 pickles enum members: reduce(cls, (value,))."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2

    def __reduce_ex__(self, protocol):
        return _MEM_FORMAT_ENCODING, (self.value,)


def install():
    _define(METADATA, ChunkStorageMetadata, _MEM_FORMAT_ENCODING, TensorProperties,
            TensorStorageMetadata, BytesStorageMetadata, StorageMeta, Metadata, MetadataIndex)
    _define(FILESYSTEM, _StorageInfo)
    _define(PLANNER, WriteItemType, TensorWriteData, WriteItem, SavePlan)
    _define(MEGATRON, MCoreSavePlan, MCoreMetadata)
    return types.SimpleNamespace(**{
        c.__name__: c for c in (
            ChunkStorageMetadata, _MEM_FORMAT_ENCODING, TensorProperties, TensorStorageMetadata,
            BytesStorageMetadata, StorageMeta, Metadata, MetadataIndex, _StorageInfo,
            WriteItemType, TensorWriteData, WriteItem, SavePlan, MCoreSavePlan, MCoreMetadata,
            ValueReducedEncoding)})
