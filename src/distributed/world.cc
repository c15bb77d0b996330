#include "distributed/world.h"

#include <cstdlib>
#include <mutex>

#include "distributed/in_process_communicator.h"

namespace kvflow::dist {

bool LaunchedByMpi() {
  for (const char* variable : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(variable) != nullptr) return true;
  }
  return false;
}

void AbortJob(int exit_code) {
  if (LaunchedByMpi()) AbortMpiJob(exit_code);
  std::exit(exit_code);
}

Result<std::unique_ptr<Communicator>> OpenWorldCommunicator() {
  if (LaunchedByMpi()) return OpenMpiWorldCommunicator();
  return std::move(InProcessWorld::Create(1).front());
}

namespace {
std::mutex g_broken_mutex;
std::function<void(const Status&)> g_broken_handler;
bool g_broken_reported = false;
}  // namespace

void SetJobBrokenHandler(std::function<void(const Status&)> handler) {
  std::lock_guard<std::mutex> lock(g_broken_mutex);
  g_broken_handler = std::move(handler);
  g_broken_reported = false;
}

void ReportJobBroken(const Status& why) {
  std::function<void(const Status&)> handler;
  {
    std::lock_guard<std::mutex> lock(g_broken_mutex);
    if (g_broken_reported || !g_broken_handler) return;
    g_broken_reported = true;
    handler = g_broken_handler;
  }
  handler(why);
}

Result<Communicator*> ProcessWorldCommunicator() {
  static std::mutex mutex;
  static std::unique_ptr<Communicator> world;
  std::lock_guard<std::mutex> lock(mutex);
  if (!world) {
    KVFLOW_ASSIGN_OR_RETURN(world, OpenWorldCommunicator());
  }
  return world.get();
}

}  // namespace kvflow::dist
