// KvPacking on CUDA: KV-Runahead's wire format built by the pack kernels (kernels/kv_pack.cu), into
// host buffers (one device-to-host copy after the kernel) or, for a device transport, into device
// buffers with nothing crossing to the host and no wait.
#include "backend/cuda/cuda_backend_impl.h"

#include <cstring>

#include "kv_pack.h"

namespace kvflow {
namespace cuda_impl {
namespace {

class CudaAllocation final : public DeviceAllocation {
 public:
  CudaAllocation(int device, void* base, size_t bytes) : device_(device), base_(base), bytes_(bytes) {}
  ~CudaAllocation() override {
    cudaSetDevice(device_);
    cudaFree(base_);
  }
  std::span<std::byte> bytes() const override { return {static_cast<std::byte*>(base_), bytes_}; }

 private:
  int device_;
  void* base_;
  size_t bytes_;
};

}  // namespace

Status CudaBackend::LaunchPack(int layer, std::span<const int64_t> slots, std::byte* packed, bool unpack) {
  const size_t n = slots.size();
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(pack_arena_.base(), slots.data(), n * sizeof(int64_t), cudaMemcpyHostToDevice,
                                     stream_));
  const size_t layer_bytes = layout_.layer_stride() * cuda::DTypeSize(dtype_);
  char* key = key_pool_ + layer * layer_bytes;
  char* value = value_pool_ + layer * layer_bytes;
  const auto* device_slots = reinterpret_cast<const int64_t*>(pack_arena_.base());
  if (unpack) {
    KVFLOW_KERNEL_RETURN(cuda::UnpackKv(dtype_, packed, device_slots, static_cast<int>(n), key, value,
                                        layout_.num_kv_heads, layout_.head_dim, layout_.block_size, stream_));
  } else {
    KVFLOW_KERNEL_RETURN(cuda::PackKv(dtype_, key, value, device_slots, static_cast<int>(n), packed,
                                      layout_.num_kv_heads, layout_.head_dim, layout_.block_size, stream_));
  }
  return Status::Ok();
}

// Host forms: the kernel packs into pack_arena_ behind the slot list and one copy brings it back
// (or one copy takes it up and the kernel unpacks it); the call returns once the copy is done.
Status CudaBackend::PackKv(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, out.size(), *this));
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV packing"));
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  if (kv_offloaded()) return CopyPackedRuns(layer, slots, out.data(), nullptr);
  const size_t list_bytes = AlignUp(slots.size() * sizeof(int64_t));
  KVFLOW_RETURN_IF_ERROR(GrowScratch(pack_arena_, list_bytes + out.size(), "KV packing"));
  std::byte* packed = reinterpret_cast<std::byte*>(pack_arena_.base() + list_bytes);
  KVFLOW_RETURN_IF_ERROR(LaunchPack(layer, slots, packed, false));
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(out.data(), packed, out.size(), cudaMemcpyDeviceToHost, stream_));
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Status CudaBackend::UnpackKv(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, in.size(), *this));
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV packing"));
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  if (kv_offloaded()) return CopyPackedRuns(layer, slots, nullptr, in.data());
  const size_t list_bytes = AlignUp(slots.size() * sizeof(int64_t));
  KVFLOW_RETURN_IF_ERROR(GrowScratch(pack_arena_, list_bytes + in.size(), "KV packing"));
  std::byte* packed = reinterpret_cast<std::byte*>(pack_arena_.base() + list_bytes);
  KVFLOW_CUDA_RETURN(cudaMemcpyAsync(packed, in.data(), in.size(), cudaMemcpyHostToDevice, stream_));
  KVFLOW_RETURN_IF_ERROR(LaunchPack(layer, slots, packed, true));
  // `in` is the caller's again once this returns.
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

Result<std::unique_ptr<DeviceAllocation>> CudaBackend::AllocatePackBuffer(int64_t bytes) {
  if (bytes < 0) return Status::InvalidArgument("KV pack buffer of negative size");
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  void* base = nullptr;
  if (bytes > 0) {
    const cudaError_t e = cudaMalloc(&base, static_cast<size_t>(bytes));
    if (e != cudaSuccess) {
      cudaGetLastError();
      return Status::OutOfMemory(fmt::format("cannot allocate {:.1f} MiB of device memory for packed KV ({})",
                                             bytes / double(1 << 20), cuda::CudaErrorText(e)));
    }
  }
  return std::unique_ptr<DeviceAllocation>(new CudaAllocation(options_.device, base, static_cast<size_t>(bytes)));
}

// Device forms: no copy to the host and no wait; the transport orders itself after
// RecordComputeEvent. The slot list region of pack_arena_ is rewritten by the next call, after this
// call's kernel in stream order.
Status CudaBackend::PackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<std::byte> out) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, out.size(), *this));
  if (kv_offloaded()) return Status::Unsupported("KV packing into device memory from an offloaded pool");
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV packing"));
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  KVFLOW_RETURN_IF_ERROR(GrowScratch(pack_arena_, AlignUp(slots.size() * sizeof(int64_t)), "KV packing"));
  return LaunchPack(layer, slots, out.data(), false);
}

Status CudaBackend::UnpackKvOnDevice(int layer, std::span<const int64_t> slots, std::span<const std::byte> in) {
  KVFLOW_RETURN_IF_ERROR(ValidateKvPack(layer, slots, in.size(), *this));
  if (kv_offloaded()) return Status::Unsupported("KV packing into device memory from an offloaded pool");
  if (slots.empty()) return Status::Ok();
  KVFLOW_RETURN_IF_ERROR(RefuseUnderCapture("KV packing"));
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  KVFLOW_RETURN_IF_ERROR(GrowScratch(pack_arena_, AlignUp(slots.size() * sizeof(int64_t)), "KV packing"));
  return LaunchPack(layer, slots, const_cast<std::byte*>(in.data()), true);
}

Result<void*> CudaBackend::RecordComputeEvent() {
  KVFLOW_CUDA_RETURN(cudaSetDevice(options_.device));
  KVFLOW_CUDA_RETURN(cudaEventRecord(pack_event_, stream_));
  return static_cast<void*>(pack_event_);
}

Status CudaBackend::CopyPackedRuns(int layer, std::span<const int64_t> slots, std::byte* pack_to,
                                   const std::byte* unpack_from) {
  const int64_t n = static_cast<int64_t>(slots.size());
  const size_t es = cuda::DTypeSize(dtype_);
  const size_t row_bytes = static_cast<size_t>(layout_.head_dim) * es;
  const std::vector<KvSlotRun> runs = KvSlotRuns(slots, layout_.block_size);
  // cudaMemcpyDefault: the offloaded pool is pinned host memory.
  for (int kv = 0; kv < 2; ++kv) {
    char* pool = PoolLayer(kv, layer);
    for (int h = 0; h < layout_.num_kv_heads; ++h) {
      const size_t head_at = static_cast<size_t>((kv * layout_.num_kv_heads + h) * n) * row_bytes;
      for (const KvSlotRun& run : runs) {
        const int block = static_cast<int>(run.first_slot / layout_.block_size);
        const int offset = static_cast<int>(run.first_slot % layout_.block_size);
        char* in_pool = pool + layout_.offset(block, h, offset) * es;
        const size_t at = head_at + static_cast<size_t>(run.index) * row_bytes;
        const size_t bytes = static_cast<size_t>(run.length) * row_bytes;
        if (unpack_from != nullptr) {
          KVFLOW_CUDA_RETURN(cudaMemcpyAsync(in_pool, unpack_from + at, bytes, cudaMemcpyDefault, stream_));
        } else {
          KVFLOW_CUDA_RETURN(cudaMemcpyAsync(pack_to + at, in_pool, bytes, cudaMemcpyDefault, stream_));
        }
      }
    }
  }
  KVFLOW_CUDA_RETURN(cudaStreamSynchronize(stream_));
  return Status::Ok();
}

}  // namespace cuda_impl
}  // namespace kvflow
