#include "kv_runahead/prompt_prefill_service.h"

#include "kvflow/models.h"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <vector>

#include <spdlog/spdlog.h>

#include "backend/backend_factory.h"
#include "distributed/world.h"
#include "model/tensor_source.h"

namespace kvflow::dist {
namespace {

// Tags of the service's own messages; a prefill's layers use tags from kFirstLayerTag on, a window
// of kTagWindows prefills wide, so that nothing left over from a failed prefill matches a later one.
constexpr int kHelloTag = 1;
constexpr int kCommandTag = 2;
constexpr int kTokensTag = 3;
constexpr int kFirstLayerTag = 16;
constexpr int kTagWindows = 64;

enum CommandOp : int64_t { kStop = 0, kPrefill = 1 };

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// What a worker holds: the model's shape, the K/V format on the wire, the tokens its pool holds,
// and the CUDA device it can take the K/V on over NCCL (-1: none).
struct Hello {
  int64_t num_layers = 0, num_kv_heads = 0, head_dim = 0, kv_token_bytes = 0, vocab_size = 0, pool_tokens = 0;
  int64_t nccl_device = -1;
  static constexpr size_t kFields = 7;
};

// The device this rank's K/V would use over NCCL: the backend's, where it packs on a device and
// this build has NCCL.
int NcclDevice(Backend& backend) {
  const KvPacking* packing = backend.As<KvPacking>();
  return HaveNccl() && packing != nullptr ? packing->pack_device() : -1;
}

Hello HelloOf(Backend& backend) {
  const KvCacheLayout& layout = backend.kv_layout();
  return {layout.num_layers, layout.num_kv_heads, layout.head_dim, backend.kv_token_bytes(),
          backend.model_config().vocab_size, static_cast<int64_t>(layout.num_blocks) * layout.block_size,
          NcclDevice(backend)};
}

// A command: [op, method, tag_base, transport, bounds 0..P].
constexpr size_t kCommandHeader = 4;
enum Transport : int64_t { kHostBuffers = 0, kNccl = 1 };

// Opens the NCCL world the K/V go over, on every rank at once (its first prefill that uses it).
Result<std::unique_ptr<Communicator>> OpenKvTransport(Communicator& comm, Backend& backend, double timeout_s) {
  const int device = NcclDevice(backend);
  const auto start = std::chrono::steady_clock::now();
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Communicator> nccl, OpenNcclCommunicator(comm, device, timeout_s));
  spdlog::info("{}: the K/V of distributed prefills go over {} from now on (opened in {:.2f} s)", comm.Describe(),
               nccl->Describe(), SecondsSince(start));
  return nccl;
}

template <typename T>
std::span<const std::byte> Bytes(std::span<const T> values) {
  return std::as_bytes(values);
}

}  // namespace

DistributedPromptPrefiller::DistributedPromptPrefiller(Communicator& comm, Backend& backend, PrefillMethod method,
                                                       int64_t min_tokens, std::optional<PartitionTable> table,
                                                       double timeout_s, bool device_transport)
    : comm_(comm), device_transport_(device_transport), backend_(backend), method_(method), min_tokens_(min_tokens),
      table_(std::move(table)), timeout_s_(timeout_s) {}

Result<std::unique_ptr<DistributedPromptPrefiller>> DistributedPromptPrefiller::Create(
    Communicator& comm, Backend& backend, int64_t max_model_len, PrefillMethod method, int64_t min_tokens,
    std::optional<PartitionTable> table, double timeout_s) {
  if (comm.rank() != comm.size() - 1) {
    return Status::InvalidArgument("the engine runs on the job's last rank; " + comm.Describe() +
                                   " is not (the other ranks run prefill workers)");
  }
  if (backend.As<OffloadedKvPool>() != nullptr) {
    return Status::Unsupported("distributed prefill into an offloaded KV pool");
  }
  const Hello mine = HelloOf(backend);
  bool device_transport = mine.nccl_device >= 0 && comm.size() > 1;
  for (int worker = 0; worker + 1 < comm.size(); ++worker) {
    int64_t theirs[Hello::kFields];
    Status st = comm.Recv(worker, kHelloTag, std::as_writable_bytes(std::span<int64_t>(theirs)), timeout_s);
    if (!st.ok()) return Status(st.code(), "prefill worker " + std::to_string(worker) + " did not say hello: " + st.message());
    const int64_t expected[] = {mine.num_layers, mine.num_kv_heads, mine.head_dim, mine.kv_token_bytes, mine.vocab_size};
    for (size_t i = 0; i < std::size(expected); ++i) {
      if (theirs[i] != expected[i]) {
        return Status::InvalidArgument(
            "prefill worker " + std::to_string(worker) +
            " runs another model or KV format than this rank (layers, KV heads, head_dim, KV bytes per token, "
            "vocab: " + std::to_string(theirs[0]) + ", " + std::to_string(theirs[1]) + ", " + std::to_string(theirs[2]) +
            ", " + std::to_string(theirs[3]) + ", " + std::to_string(theirs[4]) + " against " +
            std::to_string(expected[0]) + ", " + std::to_string(expected[1]) + ", " + std::to_string(expected[2]) +
            ", " + std::to_string(expected[3]) + ", " + std::to_string(expected[4]) + "); start every rank with the "
            "same model and --kv-cache-dtype");
      }
    }
    if (theirs[5] < max_model_len) {
      return Status::InvalidArgument("prefill worker " + std::to_string(worker) + " holds " + std::to_string(theirs[5]) +
                                     " tokens, fewer than max_model_len " + std::to_string(max_model_len) +
                                     "; start every rank with the same --max-model-len");
    }
    if (theirs[6] < 0) device_transport = false;
  }
  if (comm.size() > 1) {
    spdlog::info("distributed prefill: the K/V go {}", device_transport
                                                           ? "over NCCL from device buffers (one GPU per rank)"
                                                           : "over " + comm.Describe() + " from host buffers");
  }
  return std::unique_ptr<DistributedPromptPrefiller>(new DistributedPromptPrefiller(
      comm, backend, method, min_tokens, std::move(table), timeout_s, device_transport));
}

DistributedPromptPrefiller::~DistributedPromptPrefiller() {
  if (broken_) return;
  const std::vector<int64_t> stop(kCommandHeader + static_cast<size_t>(comm_.size() + 1), 0);
  for (int worker = 0; worker + 1 < comm_.size(); ++worker) {
    Status st = comm_.Send(worker, kCommandTag, Bytes(std::span<const int64_t>(stop)), 10.0);
    if (!st.ok()) spdlog::warn("prefill worker {} was not told to stop: {}", worker, st.ToString());
  }
}

int64_t DistributedPromptPrefiller::TokensToPrefill(std::span<const int32_t> prompt, int block_size) const {
  const int64_t n = static_cast<int64_t>(prompt.size());
  if (broken_ || comm_.size() < 2 || n < min_tokens_) return 0;
  // Whole blocks (what the prefix cache maps), short of the last token, whose logits the engine needs.
  const int64_t whole = (n - 1) / block_size * block_size;
  return whole >= comm_.size() ? whole : 0;
}

Status DistributedPromptPrefiller::SendCommand(int worker, std::span<const int64_t> command) {
  return comm_.Send(worker, kCommandTag, Bytes(command), timeout_s_);
}

Status DistributedPromptPrefiller::Prefill(std::span<const int32_t> prompt, int64_t num_tokens,
                                           std::span<const BlockId> block_table) {
  if (broken_) return Status::Unavailable("distributed prefill is off after an earlier failure");
  const int p = comm_.size();
  KVFLOW_ASSIGN_OR_RETURN(PartitionChoice choice, ChoosePartition(table_ ? &*table_ : nullptr, num_tokens, p));
  const std::vector<int64_t>& bounds = choice.partition.bounds;
  const int tag_base = kFirstLayerTag + static_cast<int>(prefills_ % kTagWindows) * backend_.kv_layout().num_layers;
  std::vector<int64_t> command = {kPrefill, static_cast<int64_t>(method_), tag_base,
                                  device_transport_ ? kNccl : kHostBuffers};
  command.insert(command.end(), bounds.begin(), bounds.end());
  const auto start = std::chrono::steady_clock::now();
  Status st;
  for (int worker = 0; worker + 1 < p && st.ok(); ++worker) {
    st = SendCommand(worker, command);
    if (st.ok()) {
      std::span<const int32_t> chunk = prompt.subspan(static_cast<size_t>(bounds[worker]),
                                                      static_cast<size_t>(bounds[worker + 1] - bounds[worker]));
      st = comm_.Send(worker, kTokensTag, Bytes(chunk), timeout_s_);
    }
  }
  if (st.ok() && device_transport_ && kv_comm_ == nullptr) {
    Result<std::unique_ptr<Communicator>> opened = OpenKvTransport(comm_, backend_, timeout_s_);
    if (opened.ok()) {
      kv_comm_ = std::move(opened).value();
    } else {
      st = opened.status();
    }
  }
  if (st.ok()) {
    DistributedPrefillOptions options;
    options.method = method_;
    options.timeout_s = timeout_s_;
    options.tag_base = tag_base;
    std::span<const int32_t> own = prompt.subspan(static_cast<size_t>(bounds[p - 1]),
                                                  static_cast<size_t>(bounds[p] - bounds[p - 1]));
    std::vector<float> logits;  // the engine computes the first token's itself, from the tail
    Communicator& kv = kv_comm_ != nullptr ? *kv_comm_ : comm_;
    st = RunDistributedPrefill(kv, backend_, own, bounds, block_table, options, logits, &last_stats_);
  }
  ++prefills_;
  if (!st.ok()) {
    broken_ = true;
    spdlog::error("{} prefill of a {}-token prompt across {} ranks failed ({}); this rank prefills every prompt "
                  "alone from now on",
                  PrefillMethodName(method_), num_tokens, p, st.ToString());
    return st;
  }
  spdlog::debug("{} prefill of {} tokens across {} ranks at {} ({} partition) in {:.3f} s, waited {:.3f} s",
                PrefillMethodName(method_), num_tokens, p, PartitionToString(choice.partition),
                PartitionSourceName(choice.source), SecondsSince(start), last_stats_.wait_seconds);
  return Status::Ok();
}

std::string DistributedPromptPrefiller::Describe() const {
  return std::string(PrefillMethodName(method_)) + " prefill across " + std::to_string(comm_.size()) + " ranks (" +
         comm_.Describe() + ") for prompts of " + std::to_string(min_tokens_) + "+ tokens, " +
         (table_ ? "partition table of " + std::to_string(table_->entries().size()) + " entries" : "even partitions");
}

Result<std::unique_ptr<Backend>> CreatePrefillRankBackend(EngineConfig config, int64_t max_tokens) {
  KVFLOW_ASSIGN_OR_RETURN(std::string path, ResolveModel(config.model));
  KVFLOW_ASSIGN_OR_RETURN(ModelFiles files, OpenModelFiles(path));
  KVFLOW_RETURN_IF_ERROR(files.config.Validate());
  // As the engine does: no more than the model's context length.
  const int64_t context = files.config.max_position_embeddings;
  if (max_tokens > context) spdlog::warn("{} tokens exceed the model's context length {}; using {}", max_tokens, context, context);
  config.max_model_len = static_cast<int>(max_tokens > 0 ? std::min(max_tokens, context) : context);
  // The pool holds one prompt of max_model_len tokens, and the scheduler's watermark besides.
  const int blocks = BlocksForTokens(config.max_model_len, config.block_size);
  config.num_kv_blocks = blocks + blocks / 50 + 4;
  config.num_host_kv_blocks = 0;
  config.kv_offload.enabled = false;
  KVFLOW_ASSIGN_OR_RETURN(LlamaWeights weights, LoadWeightsFor(files, config));
  return CreateBackend(config, true, files.config, std::move(weights));
}

Status RunPrefillWorker(const EngineConfig& config, Communicator& comm, double timeout_s, bool* ready) {
  if (ready) *ready = false;
  KVFLOW_RETURN_IF_ERROR(ParsePrefillMethod(config.prefill_parallel.method).status());
  KVFLOW_ASSIGN_OR_RETURN(std::unique_ptr<Backend> backend, CreatePrefillRankBackend(config, config.max_model_len));
  std::vector<BlockId> table(static_cast<size_t>(backend->kv_layout().num_blocks));
  for (size_t b = 0; b < table.size(); ++b) table[b] = static_cast<BlockId>(b);
  const int leader = comm.size() - 1;
  const Hello hello = HelloOf(*backend);
  const int64_t fields[Hello::kFields] = {hello.num_layers,   hello.num_kv_heads, hello.head_dim,   hello.kv_token_bytes,
                                          hello.vocab_size,   hello.pool_tokens,  hello.nccl_device};
  KVFLOW_RETURN_IF_ERROR(comm.Send(leader, kHelloTag, Bytes(std::span<const int64_t>(fields)), timeout_s));
  if (ready) *ready = true;
  spdlog::info("prefill worker {} ready: {} on {}, waiting for rank {}", comm.Describe(),
               backend->model_config().name, backend->Describe(), leader);
  std::vector<int64_t> command(kCommandHeader + static_cast<size_t>(comm.size() + 1));
  int64_t served = 0;
  std::unique_ptr<Communicator> kv_comm;  // the NCCL world, once a command asked for it
  while (true) {
    // The server may idle for hours: wait in slices, and stop only when the last rank is gone.
    const auto start = std::chrono::steady_clock::now();
    Status st = comm.Recv(leader, kCommandTag, std::as_writable_bytes(std::span<int64_t>(command)), 60.0);
    if (!st.ok()) {
      if (st.code() == StatusCode::kUnavailable && SecondsSince(start) >= 59.0) continue;
      return st;
    }
    if (command[0] == kStop) {
      spdlog::info("prefill worker {}: stopped by rank {} after {} prefills", comm.Describe(), leader, served);
      return Status::Ok();
    }
    if (command[0] != kPrefill || (command[1] != static_cast<int64_t>(PrefillMethod::kKvRunahead) &&
                                   command[1] != static_cast<int64_t>(PrefillMethod::kTsp))) {
      return Status::Internal("prefill worker: unknown command from rank " + std::to_string(leader));
    }
    const std::vector<int64_t> bounds(command.begin() + kCommandHeader, command.end());
    KVFLOW_RETURN_IF_ERROR(ValidatePrefillBounds(bounds, comm.size()));
    const int me = comm.rank();
    std::vector<int32_t> tokens(static_cast<size_t>(bounds[me + 1] - bounds[me]));
    KVFLOW_RETURN_IF_ERROR(comm.Recv(leader, kTokensTag, std::as_writable_bytes(std::span<int32_t>(tokens)), timeout_s));
    if (command[3] == kNccl && kv_comm == nullptr) {
      KVFLOW_ASSIGN_OR_RETURN(kv_comm, OpenKvTransport(comm, *backend, timeout_s));
    }
    DistributedPrefillOptions options;
    options.method = static_cast<PrefillMethod>(command[1]);
    options.timeout_s = timeout_s;
    options.tag_base = static_cast<int>(command[2]);
    std::vector<float> logits;
    DistributedPrefillStats stats;
    st = RunDistributedPrefill(command[3] == kNccl ? *kv_comm : comm, *backend, tokens, bounds, table, options, logits,
                               &stats);
    if (!st.ok()) {
      // The last rank fails this prefill too and stops asking.
      spdlog::error("prefill worker {}: {}", comm.Describe(), st.ToString());
      return st;
    }
    ++served;
    spdlog::debug("prefill worker {}: chunk [{}, {}) in {:.3f} s (waited {:.3f} s)", comm.Describe(), bounds[me],
                  bounds[me + 1], stats.total_seconds, stats.wait_seconds);
  }
}

Result<bool> RunPrefillWorkerIfNotLastRank(const EngineConfig& config) {
  if (config.prefill_parallel.method.empty()) return false;
  KVFLOW_ASSIGN_OR_RETURN(Communicator * comm, ProcessWorldCommunicator());
  if (comm->rank() == comm->size() - 1) return false;
  bool ready = false;
  Status st = RunPrefillWorker(config, *comm, kDefaultCommTimeoutSeconds, &ready);
  if (!st.ok() && !ready) {
    spdlog::error("prefill worker {} cannot start, ending the job: {}", comm->Describe(), st.ToString());
    AbortJob(1);
  }
  KVFLOW_RETURN_IF_ERROR(st);
  return true;
}

Result<std::unique_ptr<PromptPrefiller>> CreatePromptPrefiller(const EngineConfig& config, Backend& backend,
                                                               Communicator* comm) {
  KVFLOW_ASSIGN_OR_RETURN(PrefillMethod method, ParsePrefillMethod(config.prefill_parallel.method));
  if (comm == nullptr) {
    KVFLOW_ASSIGN_OR_RETURN(comm, ProcessWorldCommunicator());
  }
  if (comm->size() == 1) {
    spdlog::warn("prefill_parallel {}: this process is a job of one rank (start it under mpirun -np P), so every "
                 "prompt is prefilled here",
                 config.prefill_parallel.method);
  }
  std::optional<PartitionTable> table;
  if (!config.prefill_parallel.partition_table.empty()) table = LoadPartitionTableOrWarn(config.prefill_parallel.partition_table);
  KVFLOW_ASSIGN_OR_RETURN(auto prefiller, DistributedPromptPrefiller::Create(*comm, backend, config.max_model_len, method,
                                                                             config.prefill_parallel.min_tokens,
                                                                             std::move(table)));
  return std::unique_ptr<PromptPrefiller>(std::move(prefiller));
}

}  // namespace kvflow::dist
