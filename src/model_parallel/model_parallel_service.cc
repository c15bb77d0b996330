#include "model_parallel/model_parallel_service.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdlib>
#include <deque>
#include <thread>
#include <utility>
#include <vector>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "distributed/subgroup_communicator.h"
#include "distributed/world.h"
#include "forward/llama_model.h"
#include "kvflow/models.h"
#include "model/pipeline_stage_split.h"
#include "model/rope.h"
#include "model/tensor_parallel_shard.h"
#include "model_parallel/step_messages.h"
#include "util/thread_pool.h"

namespace kvflow::mp {
namespace {

using Clock = std::chrono::steady_clock;
using dist::Communicator;

// Tags of the driver's setup, the workers' answers, each step message's header and words, the
// residual stream between stages and the last stage's logits.
constexpr int kSetupTag = 7100;
constexpr int kHelloTag = 7101;
constexpr int kHeaderTag = 7102;
constexpr int kWordsTag = 7103;
constexpr int kResidualTag = 7104;
constexpr int kLogitsTag = 7105;
constexpr int kReportTag = 7106;
constexpr int kVocabTag = 7107;
// A stage's tensor-parallel group shifts its tags past the world's.
constexpr int kGroupTagOffset = 20000;
constexpr int kDriver = 0;
// Sends a rank leaves in flight while it goes on (each holds its buffer).
constexpr size_t kMaxPendingSends = 8;
// The driver asks its workers for their own counters after its first step, then at most this often.
constexpr double kReportIntervalSeconds = 1.0;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Where a rank sits in the tp x pp grid.
struct GridPosition {
  int tp = 1, pp = 1, rank = 0;
  int stage() const { return rank / tp; }
  int tp_rank() const { return rank % tp; }
  int RankOf(int stage, int tp_rank) const { return stage * tp + tp_rank; }
  bool last_stage() const { return stage() == pp - 1; }
  // The last stage's ranks compute the logits, each its vocabulary rows' columns; its tp rank 0
  // assembles them (and sends them to the driver, unless it is the driver).
  bool assembles_logits() const { return last_stage() && tp_rank() == 0; }
  std::string Describe() const {
    return "stage " + std::to_string(stage()) + " of " + std::to_string(pp) + ", tensor rank " +
           std::to_string(tp_rank()) + " of " + std::to_string(tp);
  }
};

// A rank's own counters, from the stats its reducer and stage add to.
RankStepStats OwnStats(const ModelParallelStats& s, const GridPosition& at) {
  RankStepStats r;
  r.rank = at.rank;
  r.stage = at.stage();
  r.tensor_rank = at.tp_rank();
  r.microbatches = s.microbatches;
  r.forward_seconds = s.forward_seconds;
  r.all_reduce_seconds = s.all_reduce_seconds;
  r.all_reduce_bytes = s.all_reduce_bytes;
  r.residual_wait_seconds = s.residual_wait_seconds;
  r.residual_send_seconds = s.residual_send_seconds;
  return r;
}

// Steps the driver keeps in flight (EngineConfig::pipeline_batches_in_flight, 0: one per stage);
// tensor parallelism alone has no later stage to overlap with.
int BatchesInFlight(const EngineConfig& config) {
  if (config.pipeline_parallel_size == 1) return 1;
  return config.pipeline_batches_in_flight > 0 ? config.pipeline_batches_in_flight : config.pipeline_parallel_size;
}

std::string DescribeSplit(int tp, int pp) {
  if (pp == 1) return "tensor parallel " + std::to_string(tp);
  if (tp == 1) return "pipeline parallel " + std::to_string(pp);
  return "tensor parallel " + std::to_string(tp) + " x pipeline parallel " + std::to_string(pp);
}

// What fixes the shape of a rank's pools: sent by the driver, taken by every worker.
struct Setup {
  static constexpr size_t kWords = 4;
  int64_t max_model_len = 0, num_kv_blocks = 0, num_host_kv_blocks = 0, block_size = 0;
};

// What a rank built; the driver checks every worker's against what that rank's place in the grid
// implies. ok = 0: the worker could not build its share (its log says why).
struct Hello {
  static constexpr size_t kWords = 13;
  int64_t words[kWords] = {};
};
constexpr size_t kHelloFirstLayer = 1, kHelloNumLayers = 2;

Hello HelloOf(const Backend& b, bool ok) {
  const ModelConfig& m = b.model_config();
  const KvCacheLayout& l = b.kv_layout();
  return Hello{{ok ? 1 : 0, m.first_layer, m.num_layers, m.hidden_size, m.vocab_size, m.num_heads, m.num_kv_heads,
                m.head_dim, m.intermediate_size, l.num_blocks, b.num_host_blocks(), l.block_size,
                b.kv_token_bytes()}};
}

std::string DescribeHello(const Hello& h) {
  static const char* const kNames[Hello::kWords] = {
      "ok",       "first_layer", "layers",      "hidden",     "vocab",      "heads", "kv_heads",
      "head_dim", "mlp_width",   "kv_blocks",   "host_blocks", "block_size", "kv_token_bytes"};
  std::string out;
  for (size_t i = 1; i < Hello::kWords; ++i) out += (i > 1 ? " " : "") + std::string(kNames[i]) + "=" + std::to_string(h.words[i]);
  return out;
}

Status CheckGrid(const ModelConfig& config, int tp, int pp, const std::vector<int>& layer_split) {
  KVFLOW_RETURN_IF_ERROR(CheckTensorParallelSplit(config, tp));
  return CheckPipelineSplit(config, pp, layer_split);
}

// The rank's backend for its share of the model: its stage's layers, split tp ways.
Result<std::unique_ptr<Backend>> CreateRankBackend(EngineConfig& config, bool max_model_len_requested,
                                                   const ModelFiles& files, const GridPosition& at) {
  KVFLOW_RETURN_IF_ERROR(CheckGrid(files.config, at.tp, at.pp, config.pipeline_layer_split));
  const PipelineStageRange range = StageOf(files.config, at.stage(), at.pp, config.pipeline_layer_split);
  const ModelConfig stage_config = StageConfig(files.config, range);
  const TensorShard shard = ShardOf(stage_config, at.tp_rank(), at.tp);
  if (at.tp > 1 && stage_config.num_experts > 0 && config.device != "cpu") {
    return Status::Unsupported("tensor parallelism over a mixture of experts on CUDA ranks is not tested yet (the "
                               "CPU splits the experts)");
  }
  // Only the rank's share is read: its stage's layers, each cut to its shard as soon as it is read,
  // the embedding on the first stage and the head on the last.
  WeightSelection selection;
  selection.first_layer = range.first_layer;
  selection.num_layers = range.num_layers;
  selection.embedding = range.first();
  selection.head = range.last();
  if (at.tp > 1) {
    selection.per_layer = [&](int layer, LlamaLayerWeights& weights) -> Status {
      KVFLOW_ASSIGN_OR_RETURN(weights, ShardLayer(weights, stage_config, shard, layer));
      return Status::Ok();
    };
  }
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights mine, LoadWeightsFor(files, config, selection));
  // The embedding and head are read whole (one matrix at a time), then cut to the rank's rows.
  KVFLOW_RETURN_IF_ERROR(ShardVocabulary(mine, stage_config, shard));
  spdlog::info("model parallel rank {} ({}): layers [{}, {}), query heads [{}, {}), KV heads [{}, {}), MLP columns [{}, {}), "
               "vocabulary rows [{}, {}): {:.1f} MiB of weights",
               at.rank, at.Describe(), range.first_layer, range.first_layer + range.num_layers, shard.first_head,
               shard.first_head + shard.num_heads, shard.first_kv_head, shard.first_kv_head + shard.num_kv_heads,
               shard.first_ffn, shard.first_ffn + shard.ffn_width, shard.first_vocab, shard.first_vocab + shard.vocab_rows,
               mine.bytes() / 1048576.0);
  return CreateBackend(config, max_model_len_requested, ShardConfig(stage_config, shard), std::move(mine));
}

// The communicator of this rank's stage's tensor-parallel group; null without tensor parallelism,
// or when the stage is the whole world (tensor parallelism alone: the sums run over the world).
Result<std::unique_ptr<Communicator>> StageGroup(Communicator& world, const GridPosition& at) {
  if (at.tp == 1 || at.pp == 1) return std::unique_ptr<Communicator>();
  std::vector<int> members;
  for (int i = 0; i < at.tp; ++i) members.push_back(at.RankOf(at.stage(), i));
  KVFLOW_ASSIGN_OR_RETURN(auto group, dist::SubgroupCommunicator::Create(world, std::move(members), kGroupTagOffset));
  return std::unique_ptr<Communicator>(std::move(group));
}

// Sums each layer's partial kDelta across the stage's tensor-parallel group: in host memory over
// the group's communicator, or, for CUDA ranks (`device_group` set), in device memory over the
// device transport (NCCL), after the compute stream's work so far.
class AllReduceDeltaReducer final : public DeltaReducer {
 public:
  AllReduceDeltaReducer(Communicator& group, Communicator* device_group, double timeout_s,
                        std::shared_ptr<ModelParallelStats> stats)
      : group_(group), device_group_(device_group), timeout_s_(timeout_s), stats_(std::move(stats)) {}

  Status ReduceDelta(Backend& backend) override {
    if (device_group_) {
      KVFLOW_ASSIGN_OR_RETURN(KvPacking * device, DeviceBuffers(backend));
      KVFLOW_ASSIGN_OR_RETURN(DeviceRows rows, device->DeviceActivation(Activation::kDelta));
      return SumOnDevice(*device, rows);
    }
    KVFLOW_ASSIGN_OR_RETURN(std::span<float> delta, backend.HostActivation(Activation::kDelta));
    return Sum(delta);
  }
  Status ReduceEmbedding(Backend& backend) override {
    if (device_group_) {
      KVFLOW_ASSIGN_OR_RETURN(KvPacking * device, DeviceBuffers(backend));
      KVFLOW_ASSIGN_OR_RETURN(DeviceRows rows, device->DeviceResidual());
      return SumOnDevice(*device, rows);
    }
    KVFLOW_ASSIGN_OR_RETURN(std::span<float> residual, backend.HostResidual());
    return Sum(residual);
  }

 private:
  static Result<KvPacking*> DeviceBuffers(Backend& backend) {
    KvPacking* device = backend.As<KvPacking>();
    if (device == nullptr) return Status::Unsupported("tensor parallelism's device sums on " + backend.Describe());
    return device;
  }

  Status SumOnDevice(KvPacking& backend, const DeviceRows& rows) {
    const auto start = Clock::now();
    const dist::DeviceElement element = rows.type == DeviceRows::Type::kF32   ? dist::DeviceElement::kF32
                                        : rows.type == DeviceRows::Type::kF16 ? dist::DeviceElement::kF16
                                                                              : dist::DeviceElement::kBF16;
    Result<void*> event = backend.RecordComputeEvent();
    Status st = event.ok() ? device_group_->OrderAfter(event.value()) : event.status();
    if (st.ok()) st = device_group_->AllReduceSumOnDevice(rows.data, rows.count, element, timeout_s_);
    return Counted(st, start, rows.count * (rows.type == DeviceRows::Type::kF32 ? 4 : 2));
  }

  Status Sum(std::span<float> data) {
    const auto start = Clock::now();
    return Counted(group_.AllReduceSum(data, timeout_s_), start, static_cast<int64_t>(data.size_bytes()));
  }

  Status Counted(Status st, Clock::time_point start, int64_t bytes) {
    stats_->all_reduce_seconds += SecondsSince(start);
    ++stats_->all_reduces;
    stats_->all_reduce_bytes += bytes;
    if (!st.ok()) {
      st = Status::Unavailable("tensor parallel all-reduce: " + st.ToString() +
                               " (a rank died or hangs: the model's other shares are gone)");
      dist::ReportJobBroken(st);
      return st;
    }
    return Status::Ok();
  }

  Communicator& group_;
  Communicator* device_group_;
  double timeout_s_;
  std::shared_ptr<ModelParallelStats> stats_;
};

// With device "cuda" every rank takes its own GPU: the one of its local rank on its machine under
// mpirun (OMPI_COMM_WORLD_LOCAL_RANK), else of its rank (threads of one process). cuda:N puts every
// rank on device N (a one-GPU test).
void PickRankDevice(EngineConfig& config, const Communicator& world) {
  if (config.device != "cuda") return;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
  config.device = "cuda:" + std::to_string(local ? std::max(0, std::atoi(local)) : world.rank());
}

// The device transport CUDA ranks sum over (null `comm` for host-computing backends and without
// tensor parallelism), and the NCCL communicator when this rank opened it.
struct DeviceGroup {
  std::unique_ptr<Communicator> owned;
  Communicator* comm = nullptr;
};

// `given` (tests), else NCCL over the world, opened by every rank at the same point of the start-up
// (a collective).
Result<DeviceGroup> OpenDeviceGroup(Communicator& world, const Backend& backend, const GridPosition& at,
                                    Communicator* given, double timeout_s) {
  DeviceGroup group;
  if (backend.ComputesOnHost() || at.tp == 1) return group;
  const KvPacking* device = backend.As<KvPacking>();
  if (device == nullptr || device->pack_device() < 0) {
    return Status::Unsupported("tensor parallelism on " + backend.Describe() + ": it hands no device buffers to a transport");
  }
  if (given != nullptr) {
    group.comm = given;
    return group;
  }
  KVFLOW_ASSIGN_OR_RETURN(group.owned, dist::OpenNcclCommunicator(world, device->pack_device(), timeout_s));
  group.comm = group.owned.get();
  return group;
}

// Sends a rank has in flight, each with the buffer it reads.
class PendingSends {
 public:
  // Keeps `buffer` until the send is done; waits for the oldest beyond kMaxPendingSends.
  Status Add(Communicator& comm, int peer, int tag, std::vector<float> buffer, double timeout_s) {
    KVFLOW_ASSIGN_OR_RETURN(dist::MessageHandle h,
                            comm.ISend(peer, tag, std::as_bytes(std::span<const float>(buffer))));
    sends_.push_back({std::move(h), std::move(buffer)});
    while (sends_.size() > kMaxPendingSends) KVFLOW_RETURN_IF_ERROR(WaitOldest(comm, timeout_s));
    return Status::Ok();
  }
  Status WaitAll(Communicator& comm, double timeout_s) {
    Status st = Status::Ok();
    while (!sends_.empty()) {
      Status w = WaitOldest(comm, timeout_s);
      if (st.ok()) st = w;
    }
    return st;
  }
  // A spent buffer to fill for the next send (saves an allocation a micro-batch).
  std::vector<float> TakeBuffer() {
    if (spare_.empty()) return {};
    std::vector<float> b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }

 private:
  struct Send {
    dist::MessageHandle handle;
    std::vector<float> buffer;
  };
  Status WaitOldest(Communicator& comm, double timeout_s) {
    Send s = std::move(sends_.front());
    sends_.pop_front();
    Status st = comm.Wait(std::move(s.handle), timeout_s);
    spare_.push_back(std::move(s.buffer));
    return st;
  }
  std::deque<Send> sends_;
  std::vector<std::vector<float>> spare_;
};

// The last stage's logits under tensor parallelism: each rank of the stage's group computes its
// vocabulary rows' columns; the group's rank 0 (tensor rank 0) receives the others' and places
// every slice in the whole rows.
class VocabGather {
 public:
  VocabGather(Communicator& group, const GridPosition& at, int vocab_size, double timeout_s)
      : group_(group), at_(at), vocab_size_(vocab_size), timeout_s_(timeout_s) {}

  // Tensor rank 0: `mine` (rows x its columns) and the other ranks' slices into `whole`.
  Status Assemble(std::span<const float> mine, int64_t rows, std::vector<float>& whole) {
    whole.resize(static_cast<size_t>(rows * vocab_size_));
    PlaceVocabSlice(mine, rows, VocabShardRows(vocab_size_, 0, at_.tp), vocab_size_, whole);
    for (int r = 1; r < at_.tp; ++r) {
      const std::pair<int, int> theirs = VocabShardRows(vocab_size_, r, at_.tp);
      slice_.resize(static_cast<size_t>(rows * theirs.second));
      Status st = group_.Recv(r, kVocabTag, std::as_writable_bytes(std::span<float>(slice_)), timeout_s_);
      if (!st.ok()) return Broken(st, "receiving tensor rank " + std::to_string(r) + "'s logits");
      PlaceVocabSlice(slice_, rows, theirs, vocab_size_, whole);
    }
    return Status::Ok();
  }
  // Another tensor rank: its slice to tensor rank 0 (returns before it has it).
  Status Send(std::vector<float> slice) {
    return Broken(sends_.Add(group_, 0, kVocabTag, std::move(slice), timeout_s_), "sending its logits");
  }
  std::vector<float> TakeBuffer() { return sends_.TakeBuffer(); }
  Status FinishSends() { return Broken(sends_.WaitAll(group_, timeout_s_), "finishing its logits sends"); }

 private:
  Status Broken(Status st, const std::string& doing) {
    if (st.ok()) return st;
    st = Status::Unavailable("tensor parallel rank " + std::to_string(at_.rank) + " (" + at_.Describe() + "), " + doing +
                             ": " + st.ToString() + " (a rank died or hangs: the model's other shares are gone)");
    dist::ReportJobBroken(st);
    return st;
  }

  Communicator& group_;
  GridPosition at_;
  int64_t vocab_size_;
  double timeout_s_;
  PendingSends sends_;
  std::vector<float> slice_;
};

// One rank's place in the pipeline: takes the residual stream from the previous stage's rank of
// the same tensor rank, hands it to the next one's.
class GridStage final : public PipelineStage {
 public:
  GridStage(Communicator& world, const GridPosition& at, double timeout_s, std::shared_ptr<ModelParallelStats> stats)
      : world_(world), at_(at), timeout_s_(timeout_s), stats_(std::move(stats)) {}

  bool first() const override { return at_.stage() == 0; }
  bool last() const override { return at_.last_stage(); }

  Status ReceiveResidual(Backend& backend) override {
    KVFLOW_ASSIGN_OR_RETURN(std::span<float> residual, backend.HostResidual());
    const auto start = Clock::now();
    Status st = world_.Recv(at_.RankOf(at_.stage() - 1, at_.tp_rank()), kResidualTag, std::as_writable_bytes(residual),
                            timeout_s_);
    stats_->residual_wait_seconds += SecondsSince(start);
    return Broken(st, "receiving the residual stream from the stage before");
  }

  Status SendResidual(Backend& backend) override {
    KVFLOW_ASSIGN_OR_RETURN(std::span<float> residual, backend.HostResidual());
    const auto start = Clock::now();
    std::vector<float> buffer = sends_.TakeBuffer();
    buffer.assign(residual.begin(), residual.end());
    Status st = sends_.Add(world_, at_.RankOf(at_.stage() + 1, at_.tp_rank()), kResidualTag, std::move(buffer),
                           timeout_s_);
    stats_->residual_send_seconds += SecondsSince(start);
    stats_->residual_bytes += static_cast<int64_t>(residual.size_bytes());
    return Broken(st, "sending the residual stream to the next stage");
  }

  void AfterLayer() override { world_.Poll(); }

  // The last stage's tp rank 0: the micro-batch's logits to the driver.
  Status SendLogits(std::vector<float> logits) {
    return Broken(sends_.Add(world_, kDriver, kLogitsTag, std::move(logits), timeout_s_), "sending logits to rank 0");
  }
  std::vector<float> TakeBuffer() { return sends_.TakeBuffer(); }

  Status FinishSends() { return Broken(sends_.WaitAll(world_, timeout_s_), "finishing its sends"); }

 private:
  Status Broken(Status st, const char* doing) {
    if (st.ok()) return st;
    st = Status::Unavailable("pipeline parallel rank " + std::to_string(at_.rank) + " (" + at_.Describe() + "), " +
                             doing + ": " + st.ToString() + " (a rank died or hangs: the model's other shares are gone)");
    dist::ReportJobBroken(st);
    return st;
  }

  Communicator& world_;
  GridPosition at_;
  double timeout_s_;
  std::shared_ptr<ModelParallelStats> stats_;
  PendingSends sends_;
};

// The driver's view of its workers.
class WorkerMirror final : public StepMirror {
 public:
  // `batches_in_flight`: BatchesInFlight(config); `microbatches` 0: one a step with batches in
  // flight, else one per stage.
  WorkerMirror(Communicator& world, std::unique_ptr<Communicator> group, DeviceGroup device, const GridPosition& at,
               int vocab_size, int microbatches, int batches_in_flight, double timeout_s)
      : world_(world), group_(std::move(group)), device_(std::move(device)), at_(at),
        steps_in_flight_(batches_in_flight),
        microbatches_(microbatches > 0 ? microbatches : steps_in_flight_ > 1 ? 1 : at.pp), vocab_size_(vocab_size),
        timeout_s_(timeout_s), stats_(std::make_shared<ModelParallelStats>()) {
    stats_->ranks = at.tp * at.pp;
    stats_->batches_in_flight = steps_in_flight_;
    stats_->tensor_parallel_size = at.tp;
    stats_->pipeline_parallel_size = at.pp;
    if (at.tp > 1) {
      reducer_ = std::make_unique<AllReduceDeltaReducer>(group_ ? *group_ : world, device_.comm, timeout_s, stats_);
    }
    if (at.pp > 1) stage_ = std::make_unique<GridStage>(world, at, timeout_s, stats_);
    // Tensor parallelism alone: this rank is the last stage's tensor rank 0.
    if (at.tp > 1 && at.pp == 1) gather_ = std::make_unique<VocabGather>(world, at, vocab_size, timeout_s);
  }

  ~WorkerMirror() override {
    // Steps still in flight (an engine destroyed mid-run) end first: their logits are on their way.
    std::vector<float> discarded;
    while (broken_.ok() && !pending_.empty()) (void)FinishPipelined(discarded);
    if (!broken_.ok()) return;
    // The workers' last counters for the log, then they leave their loops; one that is gone
    // already is no reason to wait long.
    if (stats_->steps > 0 && !GatherReports(10.0).ok()) return;
    Status st = Broadcast(StepMessageKind::kStop, {}, 10.0);
    if (!st.ok()) spdlog::warn("model parallel: telling the workers to stop: {}", st.ToString());
    const ModelParallelStats s = stats();
    spdlog::info("model parallel ({}): {} steps ({} micro-batches, {} started behind another in flight) in {:.3f} s; "
                 "all-reduces {:.1f} MiB in {:.3f} s, sending steps {:.3f} s, residual {:.1f} MiB, waiting for logits "
                 "{:.3f} s",
                 DescribeSplit(at_.tp, at_.pp), s.steps, s.microbatches, s.overlapped_steps, s.step_seconds,
                 s.all_reduce_bytes / 1048576.0, s.all_reduce_seconds, s.send_seconds, s.residual_bytes / 1048576.0,
                 s.logits_wait_seconds);
    for (const RankStepStats& r : s.per_rank) {
      spdlog::info("model parallel rank {} (stage {}, tensor rank {}): {} micro-batches, {:.3f} s in its layers, of "
                   "which all-reduces {:.3f} s and waiting for the stage before {:.3f} s; residual sends {:.3f} s",
                   r.rank, r.stage, r.tensor_rank, r.microbatches, r.forward_seconds, r.all_reduce_seconds,
                   r.residual_wait_seconds, r.residual_send_seconds);
    }
  }

  Status MirrorMoves(const SchedulerOutput& sched) override {
    if (sched.swap_out.empty() && sched.swap_in.empty() && sched.copies.empty()) return Status::Ok();
    return Broadcast(StepMessageKind::kMoves, EncodeMoves(sched), timeout_s_);
  }

  Status RunStep(LlamaModel& model, const ForwardBatch& batch, std::vector<float>& logits) override {
    KVFLOW_RETURN_IF_ERROR(broken_);
    const auto start = Clock::now();
    Status st = OnModel(model, [&] {
      return at_.pp == 1 ? RunWhole(model, batch, logits) : RunPipelined(model, batch, logits);
    });
    stats_->step_seconds += SecondsSince(start);
    if (st.ok() && ReportDue()) st = GatherReports(timeout_s_);
    return st;
  }

  int StepsInFlight() const override { return steps_in_flight_; }

  Status SubmitStep(LlamaModel& model, const ForwardBatch& batch) override {
    KVFLOW_RETURN_IF_ERROR(broken_);
    if (steps_in_flight_ < 2) return Status::Internal("model parallel: SubmitStep without batches in flight");
    if (static_cast<int>(pending_.size()) >= steps_in_flight_) {
      return Status::Internal("model parallel: " + std::to_string(pending_.size()) + " steps already in flight");
    }
    const auto start = Clock::now();
    if (!pending_.empty()) ++stats_->overlapped_steps;
    Status st = OnModel(model, [&] { return StartPipelined(model, batch); });
    // The workers' counters come back behind this step (they answer once they have run it).
    if (st.ok() && ReportDue()) {
      last_report_ = Clock::now();
      st = PostBroadcast(StepMessageKind::kReport, {});
      if (st.ok()) pending_.back().report = true;
    }
    stats_->step_seconds += SecondsSince(start);
    return st;
  }

  Status CollectStep(std::vector<float>& logits) override {
    KVFLOW_RETURN_IF_ERROR(broken_);
    if (pending_.empty()) return Status::Internal("model parallel: no step in flight to collect");
    const auto start = Clock::now();
    Status st = FinishPipelined(logits);
    stats_->step_seconds += SecondsSince(start);
    return st;
  }

  ModelParallelStats stats() const override {
    ModelParallelStats s = *stats_;
    s.per_rank = reports_;
    if (s.per_rank.empty()) s.per_rank.resize(1);
    s.per_rank[0] = OwnStats(*stats_, at_);
    return s;
  }

  std::string Describe() const override {
    return DescribeSplit(at_.tp, at_.pp) + " over " + std::to_string(world_.size()) + " ranks (" + world_.Describe() + ")";
  }

 private:
  // Tensor parallelism alone: every rank runs the whole batch and computes its columns of the
  // logits; this one gathers them.
  Status RunWhole(LlamaModel& model, const ForwardBatch& batch, std::vector<float>& logits) {
    ++stats_->microbatches;
    KVFLOW_RETURN_IF_ERROR(Broadcast(StepMessageKind::kForward, EncodeBatch(batch), timeout_s_));
    const auto start = Clock::now();
    Status st = model.Forward(batch, my_columns_);
    stats_->forward_seconds += SecondsSince(start);
    if (!st.ok()) return st;
    const auto wait_start = Clock::now();
    st = gather_->Assemble(my_columns_, batch.num_logit_rows(), logits);
    stats_->logits_wait_seconds += SecondsSince(wait_start);
    if (!st.ok()) return MarkBroken(st, "gathering the logits");
    return Status::Ok();
  }

  // Runs `work` on `model` with this rank's all-reduce and stage seams set, as one step.
  template <typename Work>
  Status OnModel(LlamaModel& model, Work&& work) {
    model.set_delta_reducer(reducer_.get());
    model.set_pipeline_stage(stage_.get());
    Status st = work();
    model.set_delta_reducer(nullptr);
    model.set_pipeline_stage(nullptr);
    ++stats_->steps;
    return st;
  }

  // The workers' counters are asked for after the first step, then at most once a second.
  bool ReportDue() const { return stats_->steps == 1 || SecondsSince(last_report_) >= kReportIntervalSeconds; }

  // Every worker's own counters (kReport), into reports_ by rank.
  Status GatherReports(double timeout_s) {
    last_report_ = Clock::now();
    KVFLOW_RETURN_IF_ERROR(Broadcast(StepMessageKind::kReport, {}, timeout_s));
    return ReceiveReports(timeout_s);
  }

  // The answers to a kReport sent before.
  Status ReceiveReports(double timeout_s) {
    reports_.resize(static_cast<size_t>(world_.size()));
    std::vector<double> words(kRankStatsWords);
    for (int r = 1; r < world_.size(); ++r) {
      Status st = world_.Recv(r, kReportTag, std::as_writable_bytes(std::span<double>(words)), timeout_s);
      if (!st.ok()) return MarkBroken(st, "waiting for rank " + std::to_string(r) + "'s report");
      const GridPosition them{at_.tp, at_.pp, r};
      KVFLOW_ASSIGN_OR_RETURN(reports_[static_cast<size_t>(r)], DecodeRankStats(words, r, them.stage(), them.tp_rank()));
    }
    return Status::Ok();
  }

  // The batch in micro-batches through the stages: this rank runs each through the first stage and
  // sends it on, then takes the last stage's logits of each, in order.
  Status RunPipelined(LlamaModel& model, const ForwardBatch& batch, std::vector<float>& logits) {
    KVFLOW_RETURN_IF_ERROR(StartPipelined(model, batch));
    return FinishPipelined(logits);
  }

  // Sends each micro-batch to the workers and runs it through this rank's (the first) stage.
  Status StartPipelined(LlamaModel& model, const ForwardBatch& batch) {
    std::vector<ForwardBatch> mbs = SplitIntoMicrobatches(batch, microbatches_);
    PendingStep& step = pending_.emplace_back();
    step.rows = batch.num_logit_rows();
    for (ForwardBatch& mb : mbs) {
      ++stats_->microbatches;
      step.mb_rows.push_back(mb.num_logit_rows());
      KVFLOW_RETURN_IF_ERROR(PostBroadcast(StepMessageKind::kForward, EncodeBatch(mb)));
      for (SequenceSlice& s : mb.seqs) s.logits = LogitsMode::kNone;  // the last stage makes them
      // The later stages have this micro-batch and wait for its residual stream: without it they
      // cannot go on, so a failure here ends the job.
      const auto start = Clock::now();
      Status forward = model.Forward(mb, no_logits_);
      stats_->forward_seconds += SecondsSince(start);
      if (!forward.ok()) return MarkBroken(forward, "running the first stage");
    }
    return Status::Ok();
  }

  // Takes the oldest started step's logits from the last stage (and the reports behind it).
  Status FinishPipelined(std::vector<float>& logits) {
    const PendingStep step = std::move(pending_.front());
    pending_.pop_front();
    logits.resize(static_cast<size_t>(step.rows * vocab_size_));
    const auto wait_start = Clock::now();
    const int last = at_.RankOf(at_.pp - 1, 0);
    int64_t row = 0;
    Status st = Status::Ok();
    // The last stage sends a micro-batch's logits only where it has rows.
    for (size_t k = 0; k < step.mb_rows.size() && st.ok(); ++k) {
      if (step.mb_rows[k] == 0) continue;
      const std::span<float> rows_k(logits.data() + row * vocab_size_, static_cast<size_t>(step.mb_rows[k] * vocab_size_));
      st = world_.Recv(last, kLogitsTag, std::as_writable_bytes(rows_k), timeout_s_);
      row += step.mb_rows[k];
    }
    stats_->logits_wait_seconds += SecondsSince(wait_start);
    // Every send so far (the next step's batch and residual stream among them) is finished before
    // this rank goes back to its own work: the second stage, which just sent these logits, takes
    // them now, and a large message moves only while both sides are in the transport.
    if (st.ok()) st = FinishBroadcasts(timeout_s_);
    if (st.ok()) st = stage_->FinishSends();
    if (!st.ok()) return MarkBroken(st, "waiting for the last stage's logits");
    if (step.report) return ReceiveReports(timeout_s_);
    return Status::Ok();
  }

  Status MarkBroken(const Status& st, const std::string& doing) {
    if (broken_.ok()) {
      broken_ = Status::Unavailable("model parallel: " + doing + ": " + st.ToString() +
                                    "; the model's other shares are gone, so this engine cannot run steps");
      spdlog::error("{}", broken_.ToString());
      dist::ReportJobBroken(broken_);
    }
    return broken_;
  }

  // A message to every worker, waited for before returning.
  Status Broadcast(StepMessageKind kind, std::vector<int64_t> words, double timeout_s) {
    KVFLOW_RETURN_IF_ERROR(PostBroadcast(kind, std::move(words)));
    return FinishBroadcasts(timeout_s);
  }

  // Starts sending a message to every worker and returns: under pipeline parallelism rank 0 goes
  // on with its own stage while the second stage, busy with the micro-batch before, has not yet
  // posted the receive a large message waits for. FinishBroadcasts waits for them all.
  Status PostBroadcast(StepMessageKind kind, std::vector<int64_t> words) {
    KVFLOW_RETURN_IF_ERROR(broken_);
    const auto start = Clock::now();
    Outgoing& m = outgoing_.emplace_back();
    m.header = {static_cast<int64_t>(kind), static_cast<int64_t>(words.size())};
    m.words = std::move(words);
    Status st = Status::Ok();
    for (int r = 0; r < world_.size() && st.ok(); ++r) {
      if (r == world_.rank()) continue;
      auto h = world_.ISend(r, kHeaderTag, std::as_bytes(std::span<const int64_t>(m.header)));
      if (h.ok()) m.sent.push_back(std::move(h).value());
      if (h.ok() && !m.words.empty()) h = world_.ISend(r, kWordsTag, std::as_bytes(std::span<const int64_t>(m.words)));
      if (h.ok() && !m.words.empty()) m.sent.push_back(std::move(h).value());
      if (!h.ok()) st = h.status();
    }
    stats_->send_seconds += SecondsSince(start);
    if (!st.ok()) {
      (void)FinishBroadcasts(1.0);  // the handles posted so far are spent before the buffers go
      return MarkBroken(st, "a worker rank died or hangs");
    }
    return Status::Ok();
  }

  Status FinishBroadcasts(double timeout_s) {
    const auto start = Clock::now();
    Status st = Status::Ok();
    for (Outgoing& m : outgoing_) {
      for (dist::MessageHandle& h : m.sent) {
        Status w = world_.Wait(std::move(h), timeout_s);
        if (st.ok() && !w.ok()) st = w;
      }
    }
    outgoing_.clear();
    stats_->send_seconds += SecondsSince(start);
    if (!st.ok()) return MarkBroken(st, "a worker rank died or hangs");
    return Status::Ok();
  }

  // A message in flight to the workers, with the buffers its sends read.
  struct Outgoing {
    std::array<int64_t, 2> header{};
    std::vector<int64_t> words;
    std::vector<dist::MessageHandle> sent;
  };

  Communicator& world_;
  std::unique_ptr<Communicator> group_;
  DeviceGroup device_;
  // A step started and not yet collected: its micro-batches' logit rows, and whether the workers'
  // reports come behind it.
  struct PendingStep {
    int64_t rows = 0;
    std::vector<int64_t> mb_rows;
    bool report = false;
  };

  GridPosition at_;
  int steps_in_flight_;
  int microbatches_;
  int64_t vocab_size_;
  double timeout_s_;
  std::shared_ptr<ModelParallelStats> stats_;
  std::deque<PendingStep> pending_;  // oldest first
  std::unique_ptr<AllReduceDeltaReducer> reducer_;
  std::unique_ptr<GridStage> stage_;
  std::unique_ptr<VocabGather> gather_;
  std::vector<float> no_logits_;
  std::vector<float> my_columns_;  // this rank's columns of the logits (tensor parallelism alone)
  std::deque<Outgoing> outgoing_;  // a deque: the sends read buffers that must not move
  std::vector<RankStepStats> reports_;  // by rank; [0] unused (stats() fills in this rank's own)
  Clock::time_point last_report_ = Clock::now();
  Status broken_ = Status::Ok();
};

// Threads per rank when the user gave none: the cores shared among the ranks on this machine.
void DefaultThreadsPerRank(EngineConfig& config) {
  if (config.num_threads != 0) return;
  const char* local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  const int ranks_here = local ? std::max(1, std::atoi(local)) : 1;
  const int cores = UsableCores();
  config.num_threads = std::max(1, cores / ranks_here);
}

Status CheckJobSize(const EngineConfig& config, const Communicator& comm) {
  const int ranks = config.model_parallel_ranks();
  if (comm.size() == ranks) return Status::Ok();
  return Status::InvalidArgument(DescribeSplit(config.tensor_parallel_size, config.pipeline_parallel_size) + " needs a job of " +
                                 std::to_string(ranks) + " ranks (mpirun -np " + std::to_string(ranks) +
                                 "); this one has " + std::to_string(comm.size()) + " (" + comm.Describe() + ")");
}

}  // namespace

Result<ModelParallelParts> CreateModelParallelDriver(const ModelParallelContext& ctx) {
  EngineConfig& config = ctx.config;
  Communicator* comm = ctx.communicator;
  if (comm == nullptr) {
    KVFLOW_ASSIGN_OR_RETURN(comm, dist::ProcessWorldCommunicator());
  }
  KVFLOW_RETURN_IF_ERROR(CheckJobSize(config, *comm));
  if (comm->rank() != kDriver) {
    return Status::Internal("the model-parallel engine runs on rank 0; this is " + comm->Describe());
  }
  DefaultThreadsPerRank(config);
  PickRankDevice(config, *comm);
  const double timeout_s = dist::kDefaultCommTimeoutSeconds;
  const GridPosition at{config.tensor_parallel_size, config.pipeline_parallel_size, kDriver};
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend,
                          CreateRankBackend(config, ctx.max_model_len_requested, ctx.files, at));
  // Every worker builds its pools to the driver's sizes, then says what it built.
  const int64_t setup[Setup::kWords] = {config.max_model_len, backend->kv_layout().num_blocks,
                                        backend->num_host_blocks(), config.block_size};
  const Hello mine = HelloOf(*backend, true);
  for (int r = 1; r < comm->size(); ++r) {
    KVFLOW_RETURN_IF_ERROR(comm->Send(r, kSetupTag, std::as_bytes(std::span<const int64_t>(setup)), timeout_s));
  }
  for (int r = 1; r < comm->size(); ++r) {
    Hello theirs;
    // A worker loads its weights now: give it the load's time.
    KVFLOW_RETURN_IF_ERROR(comm->Recv(r, kHelloTag, std::as_writable_bytes(std::span<int64_t>(theirs.words)), 600.0));
    if (theirs.words[0] != 1) {
      return Status::Unavailable("model parallel: rank " + std::to_string(r) +
                                 " could not build its share of the model (its log says why)");
    }
    // What rank r should have built: the driver's shapes, its own stage's layers.
    Hello expected = mine;
    const GridPosition them{at.tp, at.pp, r};
    const PipelineStageRange range = StageOf(ctx.files.config, them.stage(), at.pp, config.pipeline_layer_split);
    expected.words[kHelloFirstLayer] = range.first_layer;
    expected.words[kHelloNumLayers] = range.num_layers;
    if (!std::equal(std::begin(expected.words), std::end(expected.words), std::begin(theirs.words))) {
      return Status::InvalidArgument("model parallel: rank " + std::to_string(r) + " built " + DescribeHello(theirs) +
                                     ", rank 0 expected " + DescribeHello(expected) +
                                     " (every rank must run the same model, dtype and settings)");
    }
  }
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group, StageGroup(*comm, at));
  KVFLOW_ASSIGN_OR_RETURN(DeviceGroup device, OpenDeviceGroup(*comm, *backend, at, ctx.device_communicator, timeout_s));
  ModelParallelParts parts;
  parts.backend = std::move(backend);
  parts.mirror = std::make_unique<WorkerMirror>(*comm, std::move(group), std::move(device), at,
                                                ctx.files.config.vocab_size, config.pipeline_microbatches,
                                                BatchesInFlight(config), timeout_s);
  spdlog::info("model parallel: {} ranks ready ({}, {})", comm->size(), DescribeSplit(at.tp, at.pp), comm->Describe());
  if (at.pp > 1) {
    std::string counts;
    for (int n : PipelineLayerCounts(ctx.files.config, at.pp, config.pipeline_layer_split)) {
      counts += (counts.empty() ? "" : " + ") + std::to_string(n);
    }
    spdlog::info("pipeline stages: {} layers ({}; the last stage also runs the LM head, {:.1f} layers' worth of work)",
                 counts, config.pipeline_layer_split.empty() ? "by cost" : "--pipeline-layer-split",
                 PipelineHeadCost(ctx.files.config) / PipelineLayerCost(ctx.files.config));
  }
  return parts;
}

Status RunModelParallelWorker(const EngineConfig& input, Communicator& comm, double timeout_s, bool* ready,
                              Communicator* device_comm) {
  if (ready) *ready = false;
  if (comm.rank() == kDriver) return Status::Internal("rank 0 drives the model-parallel job; it runs no worker");
  KVFLOW_RETURN_IF_ERROR(CheckJobSize(input, comm));
  EngineConfig config = input;
  DefaultThreadsPerRank(config);
  PickRankDevice(config, comm);
  const GridPosition at{config.tensor_parallel_size, config.pipeline_parallel_size, comm.rank()};
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
    return CreateRankBackend(config, true, files, at);
  };
  Result<std::unique_ptr<Backend>> built = build();
  const Hello hello = built.ok() ? HelloOf(*built.value(), true) : Hello{};
  KVFLOW_RETURN_IF_ERROR(comm.Send(kDriver, kHelloTag, std::as_bytes(std::span<const int64_t>(hello.words)), timeout_s));
  if (!built.ok()) return built.status();
  std::unique_ptr<Backend> backend = std::move(built).value();
  if (ready) *ready = true;
  auto stats = std::make_shared<ModelParallelStats>();
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> group, StageGroup(comm, at));
  KVFLOW_ASSIGN_OR_RETURN(DeviceGroup device, OpenDeviceGroup(comm, *backend, at, device_comm, timeout_s));
  std::unique_ptr<AllReduceDeltaReducer> reducer;
  if (at.tp > 1) reducer = std::make_unique<AllReduceDeltaReducer>(group ? *group : comm, device.comm, timeout_s, stats);
  std::unique_ptr<GridStage> stage;
  if (at.pp > 1) stage = std::make_unique<GridStage>(comm, at, timeout_s, stats);
  std::unique_ptr<VocabGather> gather;
  if (at.tp > 1 && at.last_stage()) {
    gather = std::make_unique<VocabGather>(group ? *group : comm, at, backend->model_config().vocab_size, timeout_s);
  }
  // Every send finished (before a report, so the time counted is all of it, and before stopping).
  auto finish_sends = [&]() -> Status {
    if (stage) KVFLOW_RETURN_IF_ERROR(stage->FinishSends());
    if (gather) KVFLOW_RETURN_IF_ERROR(gather->FinishSends());
    return Status::Ok();
  };
  const bool logits_before_next = BatchesInFlight(config) > 1;
  LlamaModel model(*backend);
  model.set_delta_reducer(reducer.get());
  model.set_pipeline_stage(stage.get());
  spdlog::info("model parallel worker {} ({}) ready: {} on {}", comm.Describe(), at.Describe(),
               backend->model_config().name, backend->Describe());
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
      KVFLOW_RETURN_IF_ERROR(finish_sends());
      spdlog::info("model parallel worker {}: stopped after {} micro-batches ({} all-reduces, {:.3f} s)", comm.Describe(),
                   stats->microbatches, stats->all_reduces, stats->all_reduce_seconds);
      return Status::Ok();
    }
    if (kind == StepMessageKind::kReport) {
      KVFLOW_RETURN_IF_ERROR(finish_sends());
      const std::vector<double> report = EncodeRankStats(OwnStats(*stats, at));
      KVFLOW_RETURN_IF_ERROR(comm.Send(kDriver, kReportTag, std::as_bytes(std::span<const double>(report)), timeout_s));
      continue;
    }
    if ((kind != StepMessageKind::kMoves && kind != StepMessageKind::kForward) || header[1] < 0 ||
        header[1] > (int64_t{1} << 31)) {
      return Status::Internal("model parallel worker: an unknown message from rank 0");
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
    ++stats->microbatches;
    // The driver's step fails too (its all-reduce, send or wait times out); this rank cannot go on
    // without it.
    const auto forward_start = Clock::now();
    if (!at.last_stage()) {
      for (SequenceSlice& s : batch.seqs) s.logits = LogitsMode::kNone;
      KVFLOW_RETURN_IF_ERROR(model.Forward(batch, no_logits));
      stats->forward_seconds += SecondsSince(forward_start);
      continue;
    }
    // The last stage: this rank's columns of the logits (all of them without tensor parallelism).
    std::vector<float> logits = at.assembles_logits() ? stage->TakeBuffer() : gather->TakeBuffer();
    KVFLOW_RETURN_IF_ERROR(model.Forward(batch, logits));
    const int64_t rows = batch.num_logit_rows();
    if (rows > 0 && gather && !at.assembles_logits()) {
      KVFLOW_RETURN_IF_ERROR(gather->Send(std::move(logits)));
    } else if (rows > 0) {
      // The last stage's tensor rank 0, the driver being on the first stage.
      if (gather) {
        std::vector<float> whole = stage->TakeBuffer();
        KVFLOW_RETURN_IF_ERROR(gather->Assemble(logits, rows, whole));
        logits.swap(whole);
      }
      KVFLOW_RETURN_IF_ERROR(stage->SendLogits(std::move(logits)));
      // With batches in flight the driver waits for these logits before it starts the next step:
      // finish handing them over now, while it waits, not at this rank's next layer's poll (a large
      // message moves only as both sides make progress), which would hold the driver up for a
      // whole step of this stage.
      if (logits_before_next) KVFLOW_RETURN_IF_ERROR(stage->FinishSends());
    }
    stats->forward_seconds += SecondsSince(forward_start);
  }
}

Result<bool> RunModelParallelWorkerIfNotDriver(const EngineConfig& config) {
  if (config.model_parallel_ranks() == 1) return false;
  KVFLOW_ASSIGN_OR_RETURN(Communicator * comm, dist::ProcessWorldCommunicator());
  if (comm->rank() == kDriver) return false;
  Status st = RunModelParallelWorker(config, *comm);
  if (!st.ok()) {
    // The driver cannot compute without this rank's share: end the whole job.
    spdlog::error("model parallel worker {} failed, ending the job: {}", comm->Describe(), st.ToString());
    dist::AbortJob(1);
  }
  return true;
}

}  // namespace kvflow::mp
