"""Type stubs of the extension module tessera._tessera_mpi (python/src/mpi_module.cc), built
only with MPI (tessera.HAS_MPI); tessera.mpi_comm() is its one user."""

def new_mpi_comm_capsule(handle: int) -> object:
    """COLLECTIVE. A capsule holding a Comm over a duplicate of the MPI communicator `handle`."""
