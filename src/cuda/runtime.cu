// The CUDA backend's view of the machine (devices, pointers), the
// host copies of index data, and the device copy of the block plan.
#include <algorithm>
#include <cstdint>
#include <mutex>
#include <vector>

#include "cuda/common.hpp"
#include "kvcomp/kvcomp.hpp"

namespace kvcomp {

bool has_cuda_backend() { return true; }

int cuda_device_count() {
  int n = 0;
  // No driver, no device, or a driver older than the runtime: no device to run on.
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky error state for the caller's next CUDA call
    return 0;
  }
  return n;
}

}  // namespace kvcomp

namespace kvcomp::detail::cuda {

namespace {
Status invalid(const std::string& msg) { return {StatusCode::invalid_param, "[kvcomp] " + msg}; }

Status check_device_memory(const std::vector<std::pair<const char*, const Tensor*>>& tensors, Device dev) {
  const int count = cuda_device_count();
  if (dev.index < 0 || dev.index >= count)
    return invalid("x (= on " + device_name(dev) + ") must be on a CUDA device of this machine (it has " +
                   std::to_string(count) + ")");
  for (const auto& [name, t] : tensors) {
    if (!t->data || t->numel() == 0) continue;  // nothing to read or write
    cudaPointerAttributes attr{};
    if (cudaPointerGetAttributes(&attr, t->data) != cudaSuccess) {
      (void)cudaGetLastError();
      return invalid(std::string(name) + " (= a pointer CUDA does not know) must point to memory on " +
                     device_name(dev) + ", the device its tensor names");
    }
    const char* seen = nullptr;
    std::string other;
    switch (attr.type) {
      case cudaMemoryTypeManaged:
        continue;
      case cudaMemoryTypeDevice:
        if (attr.device == dev.index) continue;
        other = "memory of cuda:" + std::to_string(attr.device);
        seen = other.c_str();
        break;
      case cudaMemoryTypeHost:
        seen = "pinned host memory";
        break;
      default:
        seen = "a host pointer";
    }
    return invalid(
        std::string(name) + " (= " + seen + ") must point to memory on " + device_name(dev) +
        ", the device its tensor names: a call's tensors are all in host memory or all on one CUDA "
        "device");
  }
  return Status::success();
}

Status check_not_capturing(void* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture); e != cudaSuccess)
    return cuda_error("cudaStreamIsCapturing", e);
  if (capture == cudaStreamCaptureStatusNone) return Status::success();
  return invalid(
      "stream (= capturing a CUDA graph) must not be capturing while a call is planned: planning reads the "
      "index data on the host; plan before the capture and capture execute() only (the one-call functions "
      "and the Python package plan on every call)");
}

}  // namespace

Status check_execute_stream(void* stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t e = cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &capture);
  if (e == cudaErrorStreamCaptureImplicit) {
    (void)cudaGetLastError();  // ours: reported below
    return invalid(
        "stream (= the legacy default stream, while another stream is capturing a CUDA graph) must be the "
        "stream being captured: execute() queues on the stream the plan was made with (Options::stream); "
        "plan with the capturing stream");
  }
  if (e != cudaSuccess) return cuda_error("cudaStreamIsCapturing", e);
  if (capture == cudaStreamCaptureStatusInvalidated)
    return invalid(
        "stream (= capturing a CUDA graph whose capture was invalidated) must be capturing validly: end the "
        "capture and begin again");
  return Status::success();
}

namespace {

Status copy_index_to_host(const Tensor& t, void* stream, std::vector<std::int32_t>& out) {
  const std::int64_t n = t.numel();
  out.assign(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)), 0);
  if (n <= 0) return Status::success();
  DeviceGuard guard(t.device.index);
  if (!guard.status().ok()) return guard.status();
  auto s = static_cast<cudaStream_t>(stream);
  if (cudaError_t e = cudaMemcpyAsync(out.data(), t.data, static_cast<std::size_t>(n) * sizeof(std::int32_t),
                                      cudaMemcpyDeviceToHost, s);
      e != cudaSuccess)
    return cuda_error("copying the index tensors to the host when planning", e);
  if (cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess)
    return cuda_error("copying the index tensors to the host when planning", e);
  return Status::success();
}

// What validation needs of a CUDA device (common/device_access.hpp), as the functions above.
class Access final : public DeviceAccess {
 public:
  Status check_memory(const NamedTensors& tensors, Device dev) const override {
    return check_device_memory(tensors, dev);
  }
  Status check_not_capturing(void* stream) const override { return cuda::check_not_capturing(stream); }
  Status copy_index_to_host(const Tensor& t, void* stream, std::vector<std::int32_t>& out) const override {
    return cuda::copy_index_to_host(t, stream, out);
  }
};

}  // namespace

const DeviceAccess& device_access() {
  static const Access access;
  return access;
}

namespace {

// The one-call workspaces come from a memory pool of the library's own per
// device, which keeps what it holds between calls (release threshold: no
// limit), as the CPU backend keeps its workspace per thread: the default
// pool's threshold of 0 gave the memory back to the driver at every
// synchronisation, so each Python call unmapped and re-mapped ~300 MB.
// release_workspace_pools() (kvcomp::release_cached_workspace) trims them.
std::mutex g_pool_mutex;
std::vector<cudaMemPool_t> g_pools;

Status workspace_pool(int device, cudaMemPool_t* out) {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  const auto d = static_cast<std::size_t>(device);
  if (g_pools.size() <= d) g_pools.resize(d + 1);
  cudaMemPool_t& pool = g_pools[d];
  if (!pool) {
    cudaMemPoolProps props{};
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = device;
    if (cudaError_t e = cudaMemPoolCreate(&pool, &props); e != cudaSuccess) {
      pool = nullptr;
      return cuda_error("creating the workspace memory pool", e);
    }
    std::uint64_t keep_all = UINT64_MAX;
    if (cudaError_t e = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_all);
        e != cudaSuccess)
      return cuda_error("setting the workspace pool's release threshold", e);
  }
  *out = pool;
  return Status::success();
}

}  // namespace

void release_workspace_pools() {
  std::lock_guard<std::mutex> lock(g_pool_mutex);
  for (cudaMemPool_t pool : g_pools)
    if (pool && cudaMemPoolTrimTo(pool, 0) != cudaSuccess) (void)cudaGetLastError();  // nothing to report to
}

Status allocate_async(Device dev, void* stream, std::size_t bytes, void** out) {
  DeviceGuard guard(dev.index);
  if (!guard.status().ok()) return guard.status();
  cudaMemPool_t pool = nullptr;
  if (auto s = workspace_pool(dev.index, &pool); !s.ok()) return s;
  if (cudaError_t e = cudaMallocFromPoolAsync(out, std::max<std::size_t>(bytes, 1), pool,
                                              static_cast<cudaStream_t>(stream));
      e != cudaSuccess) {
    (void)cudaGetLastError();  // reported below, so cleared here
    return {StatusCode::runtime_error,
            "[kvcomp] workspace (= " + std::to_string(bytes) +
                " bytes of device memory) could not be allocated: " + cudaGetErrorString(e)};
  }
  return Status::success();
}

namespace {
// A free nobody can report (a destructor, the end of a one-call entry
// point): its error is cleared here, where it is owned, so that the next
// call does not find it.
void free_quietly(void* p, cudaStream_t s) {
  if (p && cudaFreeAsync(p, s) != cudaSuccess) (void)cudaGetLastError();
}
}  // namespace

void free_async(Device dev, void* stream, void* p) {
  DeviceGuard guard(dev.index);
  free_quietly(p, static_cast<cudaStream_t>(stream));
}

DevicePlan::~DevicePlan() {
  DeviceGuard guard(device);
  free_quietly(dev_batches, stream);
  free_quietly(dev_block_batch, stream);
}

Status build_device_plan(const BlockPlan& plan, Device dev, void* stream, std::int64_t chunk_rows,
                         bool forward, DevicePlan* out) {
  static_cast<ChunkPlan&>(*out) = make_chunk_plan(plan, chunk_rows, forward);
  out->device = dev.index;
  out->stream = static_cast<cudaStream_t>(stream);
  DeviceGuard guard(dev.index);
  if (!guard.status().ok()) return guard.status();
  const std::size_t batch_bytes = std::max<std::size_t>(1, out->batches.size()) * sizeof(DevBatch);
  const std::size_t block_bytes = std::max<std::size_t>(1, out->block_batch.size()) * sizeof(std::int32_t);
  const char* what = "allocating and filling the device block plan";
  cudaStream_t s = out->stream;
  if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out->dev_batches), batch_bytes, s);
      e != cudaSuccess)
    return cuda_error(what, e);
  if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out->dev_block_batch), block_bytes, s);
      e != cudaSuccess)
    return cuda_error(what, e);
  if (!out->batches.empty())
    if (cudaError_t e = cudaMemcpyAsync(out->dev_batches, out->batches.data(),
                                        out->batches.size() * sizeof(DevBatch), cudaMemcpyHostToDevice, s);
        e != cudaSuccess)
      return cuda_error(what, e);
  if (!out->block_batch.empty())
    if (cudaError_t e =
            cudaMemcpyAsync(out->dev_block_batch, out->block_batch.data(),
                            out->block_batch.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, s);
        e != cudaSuccess)
      return cuda_error(what, e);
  // Planning may wait: the host arrays above must outlive the copies.
  if (cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess) return cuda_error(what, e);
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
