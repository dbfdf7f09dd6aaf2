"""Stand-ins for megatron.core.dist_checkpointing.mapping (Megatron-LM is not installed): the
same dataclass fields, defaults, validation and constructors (from_rank_offsets, and the
from_rank_offsets_flat of core 0.7-0.13, when flattened ranges existed), so tessera meets
what Megatron hands it. Semantics as in Megatron-LM's mapping.py."""

import dataclasses
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple, Union

import torch

ReplicaId = Union[int, Tuple[int, ...]]


class CheckpointingException(Exception):
    pass


@dataclass
class ShardedTensor:
    key: str
    data: Optional[torch.Tensor] = dataclasses.field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    flattened_range: Optional[slice] = None

    def __post_init__(self):
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self):
        has_flattened_range = self.flattened_range is not None
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise CheckpointingException(f"Data dtype should match `dtype` for {self}")
            if not has_flattened_range and self.data.shape != self.local_shape:
                raise CheckpointingException(f"Data shape should match `local_shape` for {self}")
            if has_flattened_range:
                if self.data.ndim != 1:
                    raise CheckpointingException(f"Data should be 1D for a flattened {self}")
                real = self.flattened_range.stop - self.flattened_range.start
                if self.data.numel() != real:
                    raise CheckpointingException(f"Data numel should match the range for {self}")
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset and shape dimensions differ for {self}")
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise CheckpointingException(f"Local shape + prepend_axis_num != global for {self}")
        for off, sh in zip(self.global_offset[self.prepend_axis_num:], self.local_shape):
            if sh != 0 and off % sh != 0:
                raise CheckpointingException(f"Global offset ({off}) must be divisible by local "
                                             f"shape ({sh}) for {self}.")

    @classmethod
    def from_rank_offsets(cls, key, data, *rank_offsets, replica_id=0, prepend_axis_num=0,
                          flattened_range=None, **init_kwargs):
        if flattened_range is not None:
            raise ValueError("use from_rank_offsets_flat")
        global_offset = [0] * (data.ndim + prepend_axis_num)
        global_shape = ([1] * prepend_axis_num) + list(data.shape)
        axis_fragmentations = [1] * (data.ndim + prepend_axis_num)
        for axis, axis_rank_offset, axis_fragm in rank_offsets:
            local_axis_shape = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_axis_shape
            global_offset[axis] = axis_rank_offset * local_axis_shape
            axis_fragmentations[axis] = axis_fragm
        return cls(key, data, data.dtype, tuple(data.shape), tuple(global_shape),
                   tuple(global_offset), tuple(axis_fragmentations), replica_id,
                   prepend_axis_num, flattened_range=flattened_range, **init_kwargs)

    @classmethod
    def from_rank_offsets_flat(cls, key, data, non_flat_local_shape, *args, flattened_range,
                               **kwargs):
        meta = torch.empty(*non_flat_local_shape, dtype=data.dtype, device="meta")
        sh_ten = cls.from_rank_offsets(key, meta, *args, **kwargs)
        instance = replace(sh_ten, data=data, flattened_range=flattened_range)
        instance.validate_metadata_integrity()
        return instance


def is_main_replica(replica_id):
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


@dataclass
class ShardedObject:
    key: str
    data: object
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        if len(self.global_shape) != len(self.global_offset):
            raise CheckpointingException(f"Global offset and shape dimensions differ for {self}")

    @property
    def unique_key(self):
        return (f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
                f"{'.'.join(map(str, self.global_shape))}")


@dataclass
class ShardedTensorFactory:
    key: str
    data: torch.Tensor
    build_fn: Callable
    merge_fn: Callable
    replica_id: ReplicaId = 0
    flattened_range: Optional[slice] = None

    def build(self):
        return self.build_fn(self.key, self.data, self.replica_id, self.flattened_range)


class LocalNonpersistentObject:
    def __init__(self, obj: Any):
        self.obj = obj

    def unwrap(self):
        return self.obj
