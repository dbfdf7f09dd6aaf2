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
    manager = tessera.CheckpointManager(root, keep_last=2)  # save every N steps, resume

See docs/PYTHON.md.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import _tessera
from . import megatron
from . import torch
from ._comm import python_comm, run_local, single_rank_comm
from ._api import (async_save, convert, finalize, load, load_all, read_metadata, remove_keys, save,
                   verify)
from ._manager import CheckpointManager, CheckpointWarning, ManagedSave, RestoreResult
from ._errors import (AlreadyExistsError, CommError, CommTimeoutError, CorruptCheckpointError,
                      Error, ErrorDetail, FailedPreconditionError, InternalError,
                      InvalidArgumentError,
                      MissingKeysError, NotFoundError, PartialLoadWarning, StorageError,
                      UnimplementedError)
from ._state import STRUCTURE_KEY, ShardedObject, ShardedTensor
from ._torch_comm import torch_dist_comm
from ._handover import AsyncSaveHandle
from ._tessera import (Comm, ConvertReport, LoadReport, Metadata, RemoveKeysReport, SaveReport,
                       VerifyReport)

if TYPE_CHECKING:
    from mpi4py import MPI

__version__ = "0.1.0"

def _find_mpi_module() -> bool:
    """Whether this tessera was built with its MPI Comm (the module tessera._tessera_mpi)."""
    import importlib.util  # noqa: PLC0415
    return importlib.util.find_spec("tessera._tessera_mpi") is not None


# Whether tessera was built with its MPI Comm. Importing tessera never loads libmpi: only
# mpi_comm() does.
HAS_MPI = _find_mpi_module()


def mpi_comm(comm: MPI.Comm | None = None) -> Comm:
    """COLLECTIVE. A tessera.Comm over an mpi4py communicator (default ``MPI.COMM_WORLD``).

    Loads tessera's MPI module (and with it libmpi) on first use. Raises NotImplementedError when
    this tessera was built without MPI.
    """
    if not HAS_MPI:
        raise NotImplementedError("this tessera was built without its MPI Comm")
    from mpi4py import MPI  # noqa: PLC0415
    from . import _tessera_mpi  # noqa: PLC0415
    comm = MPI.COMM_WORLD if comm is None else comm
    return _tessera._comm_from_capsule(_tessera_mpi.new_mpi_comm_capsule(MPI._handleof(comm)))


__all__ = [
    "AlreadyExistsError", "AsyncSaveHandle", "CheckpointManager", "CheckpointWarning", "Comm",
    "CommError", "CommTimeoutError", "ManagedSave", "RestoreResult",
    "ConvertReport", "convert",
    "CorruptCheckpointError", "Error", "ErrorDetail", "FailedPreconditionError", "HAS_MPI", "InternalError",
    "InvalidArgumentError", "LoadReport", "Metadata", "MissingKeysError", "NotFoundError",
    "PartialLoadWarning", "STRUCTURE_KEY", "SaveReport", "ShardedObject", "ShardedTensor", "StorageError",
    "UnimplementedError", "VerifyReport", "async_save", "finalize", "load", "load_all", "mpi_comm",
    "python_comm", "read_metadata", "remove_keys", "RemoveKeysReport", "run_local", "save",
    "single_rank_comm", "torch_dist_comm",
    "verify", "megatron", "torch",
]
