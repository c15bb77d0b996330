// The communicator a process runs in: the MPI world when mpirun started it, else a world of one.
#pragma once

#include <functional>
#include <memory>

#include "distributed/communicator.h"

namespace kvflow::dist {

// True when a launcher started this process as one rank of several (mpirun sets
// OMPI_COMM_WORLD_SIZE, Slurm/MPICH PMI_SIZE, PMIx PMIX_RANK).
bool LaunchedByMpi();

// LaunchedByMpi(): the MPI communicator (collective: every rank opens it together), or Unsupported
// when kvflow was built without MPI. Otherwise an in-process world of one rank.
Result<std::unique_ptr<Communicator>> OpenWorldCommunicator();

// The MPI half of OpenWorldCommunicator, defined by the MPI transport (src/distributed/mpi/) or, in builds
// without MPI, by its stub.
Result<std::unique_ptr<Communicator>> OpenMpiWorldCommunicator();

// The NCCL world over every rank of `bootstrap` (collective: every rank calls it), on CUDA device
// `device`: the device transport of a job whose ranks run CUDA backends. Defined by the NCCL
// transport (src/distributed/nccl/) or, in builds without NCCL, by its stub (Unsupported).
Result<std::unique_ptr<Communicator>> OpenNcclCommunicator(Communicator& bootstrap, int device, double timeout_s);
// The process's world communicator (MPI_COMM_WORLD under mpirun, else a world of one), opened once:
// the MPI world is process-wide, and every part of the process must use the same one.
Result<Communicator*> ProcessWorldCommunicator();

// Whether this build has the NCCL transport.
bool HaveNccl();

// A part of the job that cannot go on (rank 0 of a tensor-parallel job whose worker stopped
// answering) reports why here, once or more; the handler (the server's: end the job cleanly after
// failing what is in flight) runs on the reporting thread, the first time only. No handler: nothing.
void SetJobBrokenHandler(std::function<void(const Status&)> handler);
void ReportJobBroken(const Status& why);

// Ends the whole job with `exit_code`: a rank that cannot go on (a server that failed to start)
// must not leave the other ranks waiting for it. MPI_Abort under MPI, else std::exit.
[[noreturn]] void AbortJob(int exit_code);
// The MPI half of AbortJob (a no-op in builds without MPI or before MPI is initialised).
void AbortMpiJob(int exit_code);

}  // namespace kvflow::dist
