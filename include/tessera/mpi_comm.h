// MpiComm: a Comm over MPI, for ranks that are processes started by mpirun (or any MPI
// launcher). Its own library, tessera::mpi (target tessera_mpi); the rest of tessera builds
// without MPI.
//
//   MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);   // or let tessera do it
//   Result<std::unique_ptr<Comm>> comm = NewMpiComm(MPI_COMM_WORLD);  // COLLECTIVE
//   Result<SaveReport> saved = Save(state, "/ckpt/step1000", **comm);
//
// Isolation: NewMpiComm duplicates the caller's communicator (MPI_Comm_dup), so tessera's
// messages never mix with the caller's, whatever tags and collectives either uses. Split gives
// each child its own MPI communicator (MPI_Comm_split).
//
// Errors: the duplicated communicator (and every child) has MPI_ERRORS_RETURN; an MPI error
// becomes a Status naming the operation, this rank and MPI_Error_string's text, and never
// aborts the job. (An error of the MPI_Comm_dup in NewMpiComm itself is raised on the caller's
// communicator, under the caller's error handler.)
//
// How collectives map to MPI: each starts with one small MPI_Iallreduce of a fixed header in
// which every rank says which collective it called, with which root and element count, whether
// it has failed or been aborted, and its byte count; its result is the same on every rank, so
// all ranks take the same decision (proceed, or fail the same way). Then:
//   Barrier    the header alone (an all-reduce completes only once every rank has entered)
//   Broadcast  the size travels in the header, then MPI_Ibcast of the data
//   Gather     MPI_Igather of the sizes, then MPI_Igatherv of the data
//   AllGather  MPI_Iallgather of the sizes, then MPI_Iallgatherv of the data
//   Scatter    MPI_Iscatter of the sizes, then MPI_Iscatterv of the data
//   AllReduce  MPI_Iallreduce in place (MPI_SUM on uint64, so a sum wraps around; MIN/MAX on
//              int64)
//   Split      MPI_Comm_split (colors are renumbered first when some are negative)
// The header catches what MPI would turn into a hang or undefined behaviour: ranks calling
// different collectives at the same point, different roots, AllReduce spans of different
// lengths or different ops, an invalid root, a null output on one rank. Every rank then fails
// (InvalidArgument where it detected the error, kAborted where a peer did) and the
// communicator is aborted for later collectives, as with LocalComm.
//
// Large buffers: MPI counts are int. A buffer larger than MpiCommOptions::max_message_bytes
// (1 GiB by default) moves in several MPI calls; Gather, AllGather and Scatter move their data
// in rounds whose total stays under the limit, so any size works (up to memory).
//
// Abort: MPI (before ULFM) has no way to fail a peer's pending collective short of killing
// the job with MPI_Abort, which tessera never calls. Abort(reason) marks this rank's
// communicator (and those split from it) aborted: the rank's next collective on it still
// enters the header, flagged, so every peer's matching collective returns kAborted with "rank
// R aborted: <reason>", and from then on every collective on it returns that status on every
// rank without communicating. Abort does not interrupt a collective this rank is already in,
// and peers blocked waiting for this rank are released only when this rank reaches its next
// collective on that communicator (or one split from it after the abort; aborting a parent
// aborts its children). A rank that aborts and then never calls a collective again leaves
// its peers waiting until their collective deadline. tessera's own protocols (Save, Load,
// AsyncSave) never depend on Abort to release peers: every one carries each rank's status through
// its collectives (a failed rank still takes part and reports the failure, e.g. Save's gathers of
// sealed statuses and AgreeOnStatus), so a failure on one rank fails the operation on every
// rank without a hang. The same holds for a rank whose storage fails mid-save. To leave a
// communicator on which peers may still be waiting (after an error that made this rank skip
// collectives), call Abort and then one more collective, e.g. Barrier: it releases them with
// kAborted, and returns kAborted on every rank once all have left (tessera_mpi_suite does this
// after every case).
//
// Deadline: a rank that waits longer than MpiCommOptions::collective_timeout (10 minutes by
// default) for its peers to enter a collective (a peer that hangs, or stopped calling
// collectives) sends the others a notice, point to point on the communicator under a tag of
// its own; the lowest-ranked rank whose deadline passed collects, for a grace period (a tenth
// of the deadline, 50 ms to 5 s), which ranks are in that collective and tells everyone: each
// waiting rank returns kDeadlineExceeded "<collective> on rank L gave up after waiting T ms
// for ranks R to enter it (collective #N of this communicator)", and so does each late rank
// when it reaches that collective. The communicator is aborted for every rank that gave up.
// The header all-reduce given up on cannot be cancelled (MPI has no way to): it stays pending
// and its small buffers are kept until exit; Open MPI finalises normally with it pending.
//
// The deadline holds in the data transfer too (issue 22): once every rank has entered a
// collective, each of its MPI operations (MPI_Ibcast, MPI_Igatherv, ... one per
// max_message_bytes round) is waited for at most collective_timeout from its start. A rank
// whose operation has not completed by then (a peer stopped or crawls mid-transfer: SIGSTOP, a
// debugger, swapping) gives up on it, tells every other rank (point to point, as above) and
// returns kDeadlineExceeded "<collective> gave up after waiting T ms for a data transfer of
// collective #N of this communicator: every rank had entered it, so a rank stopped or slowed
// down in the middle of its data transfer (MPI does not say which)", the same text on every
// rank. A rank still in that transfer returns the same status as soon as it hears; a rank whose
// part of the transfer had completed returns OK from it and that status from its next
// collective on the communicator, at once; the stalled rank returns it when it runs again. The
// communicator is then aborted on every rank. An operation given up on stays pending inside MPI:
// every buffer MPI reads or writes is the Comm's own (a Broadcast's bytes move into one and back,
// without a copy; other collectives copy the caller's bytes in and out), kept until exit, so
// nothing the caller owns is touched after the collective returns. After a Broadcast given up on
// mid-transfer, its `data` is empty. The one step no deadline covers is MPI_Comm_split in Split
// (MPI has no nonblocking split): a barrier under the deadline comes first, so only a rank that
// stops between that barrier and its own MPI_Comm_split can hold the others there.
// A rank that DIES (crash, kill -9, exit without MPI_Finalize) is a different matter: Open
// MPI's mpirun kills every other process of the job at once ("mpirun noticed that process
// rank 2 ... exited on signal 9"), so the survivors return nothing; see docs/RELIABILITY.md.
//
// Thread safety: as for every Comm, one thread at a time per Comm, and different Comms (a
// parent and a child from Split) may be used concurrently from different threads. With
// MPI_THREAD_MULTIPLE (what NewMpiWorldComm asks for) tessera calls MPI directly. With a lower
// level, tessera serialises all its MPI calls behind one process-wide lock and waits for its
// nonblocking operations by polling MPI_Test, releasing the lock between polls, so a parent
// and a child may still be used from two threads (AsyncSave does), with two limitations:
// (1) MPI_Comm_split blocks while holding the lock, so two threads of one process that call
// Split at the same time on different communicators may deadlock; (2) the caller's own MPI
// calls are not behind that lock, so the caller must not call MPI while tessera runs in
// another thread. With MPI_THREAD_FUNNELED or MPI_THREAD_SINGLE, use tessera only from the
// thread that initialised MPI (no AsyncSave).
//
// Lifetime: destroy every Comm before MPI is finalised: before the caller's MPI_Finalize, or,
// when tessera initialised MPI, before exit (keep Comms out of static storage: tessera's
// std::atexit finalisation runs before the destructors of statics constructed earlier, and a
// Comm's attachments, such as AsyncSave's background thread, may still use MPI). A Comm
// destroyed after MPI_Finalize frees nothing.
#ifndef TESSERA_MPI_COMM_H_
#define TESSERA_MPI_COMM_H_

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <memory>

#include "tessera/comm.h"
#include "tessera/status.h"

namespace tessera {

struct MpiCommOptions {
  // The most bytes one MPI call moves. A larger Broadcast or AllReduce is split into calls of
  // at most this size; Gather, AllGather and Scatter move their data in rounds of at most this
  // many bytes in total (per round, each rank moves at most max_message_bytes / size() bytes
  // when the whole would not fit in one round). Must be in [8, INT_MAX]. Default 1 GiB: big
  // enough that only huge buffers need more than one call. Smaller values cost one collective
  // per chunk; tests lower it to exercise the chunking.
  int64_t max_message_bytes = int64_t{1} << 30;
  // The collective deadline (comm.h): how long a rank waits for its peers to enter a
  // collective. Then the ranks that are waiting agree (point-to-point messages of their own,
  // see "Deadline" above) on the ranks that never came and each returns the same
  // kDeadlineExceeded naming them; so does a late rank when it arrives. Each MPI operation of a
  // collective's data transfer is held to it too (see "Deadline" above). The communicator is
  // then aborted. Zero or less: wait forever (MPI_Wait, no polling). Every rank must pass the
  // same value. Default 10 minutes. Costs polls of MPI_Test and MPI_Iprobe while a rank waits
  // (every 50 us once a wait has lasted 200 ms; without pause before). Without a deadline,
  // ScatterInto moves bytes straight from the root's ranges into the receivers' (indexed
  // datatypes, messages of at most max_message_bytes); with one, it packs and copies, since an
  // MPI transfer given up on may only ever touch memory the Comm owns.
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};
};

// COLLECTIVE over `user_comm`: every rank of it must call. Returns a Comm over a duplicate of
// `user_comm` (MPI_Comm_dup), with MPI_ERRORS_RETURN; the caller keeps `user_comm` and may free
// it at once. MPI must be initialised (MPI_Init or MPI_Init_thread) and not finalised.
// Errors: InvalidArgument for MPI_COMM_NULL or bad options; FailedPrecondition when MPI is not
// initialised or already finalised.
Result<std::unique_ptr<Comm>> NewMpiComm(MPI_Comm user_comm, const MpiCommOptions& options = {});

// COLLECTIVE over MPI_COMM_WORLD. Like NewMpiComm(MPI_COMM_WORLD), but first initialises MPI
// if nobody has: MPI_Init_thread asking for MPI_THREAD_MULTIPLE (MpiProvidedThreadLevel() says
// what MPI provided), and then MPI is finalised at exit (std::atexit), unless the caller has
// finalised it first. MPI initialised by the caller is never finalised by tessera.
Result<std::unique_ptr<Comm>> NewMpiWorldComm(const MpiCommOptions& options = {});

// The thread level MPI provides (MPI_THREAD_SINGLE < FUNNELED < SERIALIZED < MULTIPLE), as
// recorded when NewMpiWorldComm initialised MPI, or queried (MPI_Query_thread); -1 while MPI
// is not initialised.
int MpiProvidedThreadLevel();

// True when tessera initialised MPI (and will finalise it at exit).
bool MpiInitializedByTessera();

}  // namespace tessera

#endif  // TESSERA_MPI_COMM_H_
