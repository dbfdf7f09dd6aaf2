// Running a command's per-rank work on the communicator the user chose:
//   local: N threads of this process talking through LocalComm (the default; needs nothing)
//   mpi:   this process is one rank of MPI_COMM_WORLD (start the tool with mpirun)
#ifndef TESSERA_TOOLS_RANKS_H_
#define TESSERA_TOOLS_RANKS_H_

#include <functional>
#include <memory>
#include <string>

#include "tessera/comm.h"
#include "tessera/status.h"

namespace tessera::tools {

class RankRunner {
 public:
  // `kind` is "local" or "mpi". Under MPI this initialises MPI (collective over the world).
  static Result<std::unique_ptr<RankRunner>> Create(const std::string& kind);
  virtual ~RankRunner() = default;

  // Runs fn(comm, active) on every rank: `ranks` threads (local), or every process of the world
  // (mpi), where ranks >= `ranks` get active = false and must still take part in collectives.
  // Returns the status of rank 0 (local) or of this process (mpi); tessera's collectives give
  // every rank the same outcome.
  virtual Status Run(int ranks, const std::function<Status(Comm&, bool active)>& fn) = 0;
  // Whether this process prints the results (every process under local; rank 0 under mpi).
  virtual bool printer() const = 0;
  // The ranks available: 0 for local (any number), the world size for mpi.
  virtual int fixed_size() const = 0;
};

}  // namespace tessera::tools

#endif  // TESSERA_TOOLS_RANKS_H_
