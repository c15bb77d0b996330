#include "tensor_parallel/tensor_parallel_service.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "distributed/world.h"
#include "forward/llama_model.h"
#include "kvflow/models.h"
#include "model/rope.h"
#include "model/tensor_parallel_shard.h"
#include "tensor_parallel/step_messages.h"

namespace kvflow::tp {
namespace {

using Clock = std::chrono::steady_clock;
using dist::Communicator;

// Tags of the driver's setup, the workers' answers, and each step message's header and words.
constexpr int kSetupTag = 7100;
constexpr int kHelloTag = 7101;
constexpr int kHeaderTag = 7102;
constexpr int kWordsTag = 7103;
constexpr int kDriver = 0;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// What fixes the shape of a rank's pools: sent by the driver, taken by every worker.
struct Setup {
  static constexpr size_t kWords = 4;
  int64_t max_model_len = 0, num_kv_blocks = 0, num_host_kv_blocks = 0, block_size = 0;
};

// What a rank built; the driver's must equal every worker's. ok = 0: the worker could not build
// its share (its log says why).
struct Hello {
  static constexpr size_t kWords = 12;
  int64_t words[kWords] = {};
};

Hello HelloOf(const Backend& b, bool ok) {
  const ModelConfig& m = b.model_config();
  const KvCacheLayout& l = b.kv_layout();
  return Hello{{ok ? 1 : 0, m.num_layers, m.hidden_size, m.vocab_size, m.num_heads, m.num_kv_heads, m.head_dim,
                m.intermediate_size, l.num_blocks, b.num_host_blocks(), l.block_size, b.kv_token_bytes()}};
}

std::string DescribeHello(const Hello& h) {
  static const char* const kNames[Hello::kWords] = {"ok",          "layers",      "hidden",    "vocab",
                                                    "heads",       "kv_heads",    "head_dim",  "mlp_width",
                                                    "kv_blocks",   "host_blocks", "block_size", "kv_token_bytes"};
  std::string out;
  for (size_t i = 1; i < Hello::kWords; ++i) out += (i > 1 ? " " : "") + std::string(kNames[i]) + "=" + std::to_string(h.words[i]);
  return out;
}

// The rank's backend for its share of the model.
Result<std::unique_ptr<Backend>> CreateShardBackend(EngineConfig& config, bool max_model_len_requested,
                                                    const ModelFiles& files, int rank, int size) {
  KVFLOW_RETURN_IF_ERROR(CheckTensorParallelSplit(files.config, size));
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights whole, LoadWeightsFor(files, config));
  const TensorShard shard = ShardOf(files.config, rank, size);
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights mine, ShardWeights(whole, files.config, shard));
  whole = LlamaWeights{};  // only the share stays in memory
  spdlog::info("tensor parallel rank {} of {}: query heads [{}, {}), KV heads [{}, {}), MLP columns [{}, {})", rank, size,
               shard.first_head, shard.first_head + shard.num_heads, shard.first_kv_head,
               shard.first_kv_head + shard.num_kv_heads, shard.first_ffn, shard.first_ffn + shard.ffn_width);
  return CreateBackend(config, max_model_len_requested, ShardConfig(files.config, shard), std::move(mine));
}

// Sums each layer's partial kDelta across the ranks.
class AllReduceDeltaReducer final : public DeltaReducer {
 public:
  AllReduceDeltaReducer(Communicator& comm, double timeout_s, std::shared_ptr<ModelParallelStats> stats)
      : comm_(comm), timeout_s_(timeout_s), stats_(std::move(stats)) {}

  Status ReduceDelta(Backend& backend) override {
    KVFLOW_ASSIGN_OR_RETURN(std::span<float> delta, backend.HostActivation(Activation::kDelta));
    const auto start = Clock::now();
    Status st = comm_.AllReduceSum(delta, timeout_s_);
    stats_->all_reduce_seconds += SecondsSince(start);
    ++stats_->all_reduces;
    stats_->all_reduce_bytes += static_cast<int64_t>(delta.size_bytes());
    if (!st.ok()) {
      st = Status::Unavailable("tensor parallel all-reduce: " + st.ToString() +
                               " (a rank died or hangs: the model's other shares are gone)");
      dist::ReportJobBroken(st);
      return st;
    }
    return Status::Ok();
  }

 private:
  Communicator& comm_;
  double timeout_s_;
  std::shared_ptr<ModelParallelStats> stats_;
};

// The driver's view of its workers.
class WorkerMirror final : public StepMirror {
 public:
  WorkerMirror(Communicator& comm, double timeout_s, std::shared_ptr<ModelParallelStats> stats)
      : comm_(comm), timeout_s_(timeout_s), stats_(std::move(stats)) {}

  ~WorkerMirror() override {
    if (!broken_.ok()) return;
    // The workers leave their loops; one that is gone already is no reason to wait long.
    Status st = Broadcast(StepMessageKind::kStop, {}, 10.0);
    if (!st.ok()) spdlog::warn("tensor parallel: telling the workers to stop: {}", st.ToString());
    spdlog::info("tensor parallel: {} steps; {} all-reduces ({:.1f} MiB) took {:.3f} s, sending steps {:.3f} s",
                 stats_->steps, stats_->all_reduces, stats_->all_reduce_bytes / 1048576.0, stats_->all_reduce_seconds,
                 stats_->send_seconds);
  }

  Status MirrorMoves(const SchedulerOutput& sched) override {
    if (sched.swap_out.empty() && sched.swap_in.empty() && sched.copies.empty()) return Status::Ok();
    return Broadcast(StepMessageKind::kMoves, EncodeMoves(sched), timeout_s_);
  }

  Status MirrorBatch(const ForwardBatch& batch) override {
    ++stats_->steps;
    return Broadcast(StepMessageKind::kForward, EncodeBatch(batch), timeout_s_);
  }

  ModelParallelStats stats() const override { return *stats_; }

  std::string Describe() const override {
    return "tensor parallel over " + std::to_string(comm_.size()) + " ranks (" + comm_.Describe() + ")";
  }

 private:
  Status Broadcast(StepMessageKind kind, const std::vector<int64_t>& words, double timeout_s) {
    KVFLOW_RETURN_IF_ERROR(broken_);
    const auto start = Clock::now();
    const int64_t header[2] = {static_cast<int64_t>(kind), static_cast<int64_t>(words.size())};
    std::vector<dist::MessageHandle> sent;
    Status st = Status::Ok();
    for (int r = 0; r < comm_.size() && st.ok(); ++r) {
      if (r == comm_.rank()) continue;
      auto h = comm_.ISend(r, kHeaderTag, std::as_bytes(std::span<const int64_t>(header)));
      if (h.ok()) sent.push_back(std::move(h).value());
      if (h.ok() && !words.empty()) h = comm_.ISend(r, kWordsTag, std::as_bytes(std::span<const int64_t>(words)));
      if (h.ok() && !words.empty()) sent.push_back(std::move(h).value());
      if (!h.ok()) st = h.status();
    }
    for (dist::MessageHandle& h : sent) {
      Status w = comm_.Wait(std::move(h), timeout_s);
      if (st.ok() && !w.ok()) st = w;
    }
    stats_->send_seconds += SecondsSince(start);
    if (!st.ok()) {
      broken_ = Status::Unavailable("tensor parallel: a worker rank stopped answering (" + st.ToString() +
                                    "); the model's other shares are gone, so this engine cannot run steps");
      spdlog::error("{}", broken_.ToString());
      dist::ReportJobBroken(broken_);
    }
    return broken_;
  }

  Communicator& comm_;
  double timeout_s_;
  std::shared_ptr<ModelParallelStats> stats_;
  Status broken_ = Status::Ok();
};

// Threads per rank when the user gave none: the cores shared among the ranks on this machine.
void DefaultThreadsPerRank(EngineConfig& config) {
  if (config.num_threads != 0) return;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks_here = local ? std::max(1, std::atoi(local)) : 1;
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  config.num_threads = std::max(1, cores / ranks_here);
}

}  // namespace

Result<ModelParallelParts> CreateTensorParallelDriver(const ModelParallelContext& ctx) {
  EngineConfig& config = ctx.config;
  Communicator* comm = ctx.communicator;
  if (comm == nullptr) {
    KVFLOW_ASSIGN_OR_RETURN(comm, dist::ProcessWorldCommunicator());
  }
  const int size = config.tensor_parallel_size;
  if (comm->size() != size) {
    return Status::InvalidArgument("tensor_parallel_size " + std::to_string(size) + " needs a job of " +
                                   std::to_string(size) + " ranks (mpirun -np " + std::to_string(size) +
                                   "); this one has " + std::to_string(comm->size()) + " (" + comm->Describe() + ")");
  }
  if (comm->rank() != kDriver) {
    return Status::Internal("the tensor-parallel engine runs on rank 0; this is " + comm->Describe());
  }
  DefaultThreadsPerRank(config);
  const double timeout_s = dist::kDefaultCommTimeoutSeconds;
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                          CreateShardBackend(config, ctx.max_model_len_requested, ctx.files, kDriver, size));
  // Every worker builds its pools to the driver's sizes, then says what it built.
  const int64_t setup[Setup::kWords] = {config.max_model_len, backend->kv_layout().num_blocks,
                                        backend->num_host_blocks(), config.block_size};
  const Hello mine = HelloOf(*backend, true);
  for (int r = 1; r < size; ++r) {
    KVFLOW_RETURN_IF_ERROR(comm->Send(r, kSetupTag, std::as_bytes(std::span<const int64_t>(setup)), timeout_s));
  }
  for (int r = 1; r < size; ++r) {
    Hello theirs;
    // A worker loads its weights now: give it the load's time.
    KVFLOW_RETURN_IF_ERROR(comm->Recv(r, kHelloTag, std::as_writable_bytes(std::span<int64_t>(theirs.words)), 600.0));
    if (theirs.words[0] != 1) {
      return Status::Unavailable("tensor parallel: rank " + std::to_string(r) +
                                 " could not build its share of the model (its log says why)");
    }
    if (!std::equal(std::begin(mine.words), std::end(mine.words), std::begin(theirs.words))) {
      return Status::InvalidArgument("tensor parallel: rank " + std::to_string(r) + " built " + DescribeHello(theirs) +
                                     ", rank 0 built " + DescribeHello(mine) +
                                     " (every rank must run the same model, dtype and settings)");
    }
  }
  auto stats = std::make_shared<ModelParallelStats>();
  stats->ranks = size;
  ModelParallelParts parts;
  parts.backend = std::move(backend);
  parts.reducer = std::make_unique<AllReduceDeltaReducer>(*comm, timeout_s, stats);
  parts.mirror = std::make_unique<WorkerMirror>(*comm, timeout_s, stats);
  spdlog::info("tensor parallel: {} ranks ready ({})", size, comm->Describe());
  return parts;
}

Status RunTensorParallelWorker(const EngineConfig& input, Communicator& comm, double timeout_s, bool* ready) {
  if (ready) *ready = false;
  if (comm.rank() == kDriver) return Status::Internal("rank 0 drives the tensor-parallel job; it runs no worker");
  if (comm.size() != input.tensor_parallel_size) {
    return Status::InvalidArgument("tensor_parallel_size " + std::to_string(input.tensor_parallel_size) +
                                   " needs a job of that many ranks; this one has " + std::to_string(comm.size()));
  }
  EngineConfig config = input;
  DefaultThreadsPerRank(config);
  // The driver loads its share first: wait in slices until it says how to build ours.
  int64_t setup[Setup::kWords] = {};
  for (;;) {
    const auto start = Clock::now();
    Status st = comm.Recv(kDriver, kSetupTag, std::as_writable_bytes(std::span<int64_t>(setup)), 60.0);
    if (st.ok()) break;
    if (st.code() == StatusCode::kUnavailable && SecondsSince(start) >= 59.0) continue;
    return st;
  }
  config.max_model_len = static_cast<int>(setup[0]);
  config.num_kv_blocks = static_cast<int>(setup[1]);
  config.num_host_kv_blocks = static_cast<int>(setup[2]);
  config.block_size = static_cast<int>(setup[3]);
  auto build = [&]() -> Result<std::unique_ptr<Backend>> {
    KVFLOW_ASSIGN_OR_RETURN(std::string path, ResolveModel(config.model));
    KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, OpenModelFiles(path));
    KVFLOW_RETURN_IF_ERROR(files.config.Validate());
    SelectRopeFactorsForContext(files.config, config.max_model_len);
    return CreateShardBackend(config, true, files, comm.rank(), comm.size());
  };
  Result<std::unique_ptr<Backend>> built = build();
  const Hello hello = built.ok() ? HelloOf(*built.value(), true) : Hello{};
  KVFLOW_RETURN_IF_ERROR(comm.Send(kDriver, kHelloTag, std::as_bytes(std::span<const int64_t>(hello.words)), timeout_s));
  if (!built.ok()) return built.status();
  std::unique_ptr<Backend> backend = std::move(built).value();
  if (ready) *ready = true;
  auto stats = std::make_shared<ModelParallelStats>();
  AllReduceDeltaReducer reducer(comm, timeout_s, stats);
  LlamaModel model(*backend);
  model.set_delta_reducer(&reducer);
  spdlog::info("tensor parallel worker {} ready: {} on {}", comm.Describe(), backend->model_config().name,
               backend->Describe());
  std::vector<int64_t> words;
  std::vector<float> no_logits;
  for (;;) {
    // The server may idle for hours: wait for the next step in slices.
    int64_t header[2] = {};
    const auto start = Clock::now();
    Status st = comm.Recv(kDriver, kHeaderTag, std::as_writable_bytes(std::span<int64_t>(header)), 60.0);
    if (!st.ok()) {
      if (st.code() == StatusCode::kUnavailable && SecondsSince(start) >= 59.0) continue;
      return st;
    }
    const auto kind = static_cast<StepMessageKind>(header[0]);
    if (kind == StepMessageKind::kStop) {
      spdlog::info("tensor parallel worker {}: stopped after {} steps ({} all-reduces, {:.3f} s)", comm.Describe(),
                   stats->steps, stats->all_reduces, stats->all_reduce_seconds);
      return Status::Ok();
    }
    if ((kind != StepMessageKind::kMoves && kind != StepMessageKind::kForward) || header[1] < 0 ||
        header[1] > (int64_t{1} << 31)) {
      return Status::Internal("tensor parallel worker: an unknown message from rank 0");
    }
    words.resize(static_cast<size_t>(header[1]));
    if (!words.empty()) {
      KVFLOW_RETURN_IF_ERROR(comm.Recv(kDriver, kWordsTag, std::as_writable_bytes(std::span<int64_t>(words)), timeout_s));
    }
    if (kind == StepMessageKind::kMoves) {
      KVFLOW_ASSIGN_OR_RETURN(StepMoves moves, DecodeMoves(words));
      KVFLOW_RETURN_IF_ERROR(backend->CopyBlocks(moves.swap_out, BlockCopyKind::kDeviceToHost));
      KVFLOW_RETURN_IF_ERROR(backend->CopyBlocks(moves.swap_in, BlockCopyKind::kHostToDevice));
      KVFLOW_RETURN_IF_ERROR(backend->CopyBlocks(moves.copies, BlockCopyKind::kDeviceToDevice));
      continue;
    }
    KVFLOW_ASSIGN_OR_RETURN(ForwardBatch batch, DecodeBatch(words));
    ++stats->steps;
    // The driver's step fails too (its all-reduce times out); this rank cannot go on without it.
    KVFLOW_RETURN_IF_ERROR(model.Forward(batch, no_logits));
  }
}

Result<bool> RunTensorParallelWorkerIfNotDriver(const EngineConfig& config) {
  if (config.tensor_parallel_size == 1) return false;
  KVFLOW_ASSIGN_OR_RETURN(Communicator * comm, dist::ProcessWorldCommunicator());
  if (comm->rank() == kDriver) return false;
  Status st = RunTensorParallelWorker(config, *comm);
  if (!st.ok()) {
    // The driver cannot compute without this rank's share: end the whole job.
    spdlog::error("tensor parallel worker {} failed, ending the job: {}", comm->Describe(), st.ToString());
    dist::AbortJob(1);
  }
  return true;
}

}  // namespace kvflow::tp
