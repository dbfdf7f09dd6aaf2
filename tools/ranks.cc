#include "tools/ranks.h"

#include "tessera/local_comm.h"
#ifdef TESSERA_HAVE_MPI
#include "tessera/mpi_comm.h"
#endif

namespace tessera::tools {
namespace {

class LocalRunner : public RankRunner {
 public:
  Status Run(int ranks, const std::function<Status(Comm&, bool)>& fn) override {
    std::vector<Status> statuses = RunLocalRanks(ranks, [&](Comm& comm) { return fn(comm, true); });
    // Collectives agree, so rank 0 speaks for all; a rank that failed alone is still reported.
    return statuses[0].ok() ? FirstError(statuses) : statuses[0];
  }
  bool printer() const override { return true; }
  int fixed_size() const override { return 0; }
};

#ifdef TESSERA_HAVE_MPI
class MpiRunner : public RankRunner {
 public:
  explicit MpiRunner(std::unique_ptr<Comm> comm) : comm_(std::move(comm)) {}
  Status Run(int ranks, const std::function<Status(Comm&, bool)>& fn) override {
    if (ranks > comm_->size()) {
      return InvalidArgument("the layout needs " + std::to_string(ranks) +
                             " ranks but mpirun "
                             "started " +
                             std::to_string(comm_->size()));
    }
    return fn(*comm_, comm_->rank() < ranks);
  }
  bool printer() const override { return comm_->rank() == 0; }
  int fixed_size() const override { return comm_->size(); }

 private:
  std::unique_ptr<Comm> comm_;
};
#endif

}  // namespace

Result<std::unique_ptr<RankRunner>> RankRunner::Create(const std::string& kind) {
  if (kind == "local") return std::unique_ptr<RankRunner>(new LocalRunner());
  if (kind == "mpi") {
#ifdef TESSERA_HAVE_MPI
    TESSERA_ASSIGN_OR_RETURN(std::unique_ptr<Comm> comm, NewMpiWorldComm());
    return std::unique_ptr<RankRunner>(new MpiRunner(std::move(comm)));
#else
    return Unimplemented(
        "this tessera was built without MPI (install libopenmpi-dev and "
        "rebuild); use --comm local");
#endif
  }
  return InvalidArgument("unknown --comm '" + kind + "': expected local or mpi");
}

}  // namespace tessera::tools
