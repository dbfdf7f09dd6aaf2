"""tessera: distributed checkpoints of sharded tensors.

Saves and loads the state of a model trained across many ranks, where each rank holds only
pieces of each tensor; a checkpoint saved under one layout loads under any other. The API
mirrors torch.distributed.checkpoint:

    tessera.save(state_dict, path, comm=comm)
    tessera.load(state_dict, path, comm=comm)          # in place, any layout
    handle = tessera.async_save(state_dict, path)      # handle.wait()
    state = tessera.load_all(path)                     # a new state dict from the metadata
    tessera.read_metadata(path); tessera.verify(path)
    tessera.convert(src, dst, to="safetensors")        # e.g. export for inference
    tessera.remove_keys(path, "optimizer.")            # drop keys, free their bytes

See docs/PYTHON.md.
"""

from . import _tessera
from . import megatron
from . import torch
from ._api import (async_save, convert, finalize, load, load_all, read_metadata, remove_keys, save,
                   verify)
from ._errors import (AlreadyExistsError, CommError, CommTimeoutError, CorruptCheckpointError,
                      Error, FailedPreconditionError, InternalError, InvalidArgumentError,
                      MissingKeysError, NotFoundError, PartialLoadWarning, StorageError,
                      UnimplementedError)
from ._state import STRUCTURE_KEY, ShardedObject, ShardedTensor
from ._torch_comm import torch_dist_comm
from ._tessera import (AsyncSaveHandle, Comm, ConvertReport, LoadReport, Metadata,
                       RemoveKeysReport, SaveReport, VerifyReport, python_comm, run_local, single_rank_comm)

__version__ = "0.1.0"

# Whether the extension was built against tessera's MPI Comm (include/tessera/mpi_comm.h).
HAS_MPI = bool(_tessera._has_mpi)


def mpi_comm(comm=None):
    """A tessera.Comm over an mpi4py communicator (default MPI.COMM_WORLD)."""
    if not HAS_MPI:
        raise NotImplementedError("this tessera was built without its MPI Comm")
    from mpi4py import MPI  # noqa: PLC0415
    comm = MPI.COMM_WORLD if comm is None else comm
    return _tessera._mpi_comm(MPI._handleof(comm))


__all__ = [
    "AlreadyExistsError", "AsyncSaveHandle", "Comm", "CommError", "CommTimeoutError",
    "ConvertReport", "convert",
    "CorruptCheckpointError", "Error", "FailedPreconditionError", "HAS_MPI", "InternalError",
    "InvalidArgumentError", "LoadReport", "Metadata", "MissingKeysError", "NotFoundError",
    "PartialLoadWarning", "STRUCTURE_KEY", "SaveReport", "ShardedObject", "ShardedTensor", "StorageError",
    "UnimplementedError", "VerifyReport", "async_save", "finalize", "load", "load_all", "mpi_comm",
    "python_comm", "read_metadata", "remove_keys", "RemoveKeysReport", "run_local", "save",
    "single_rank_comm", "torch_dist_comm",
    "verify", "megatron", "torch",
]
