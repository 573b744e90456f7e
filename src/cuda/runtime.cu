// The CUDA backend's view of the machine (devices, pointers), the
// host copies of index data, and the device copy of the block plan.
#include <algorithm>

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
}  // namespace

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

Status allocate_async(Device dev, void* stream, std::size_t bytes, void** out) {
  DeviceGuard guard(dev.index);
  if (!guard.status().ok()) return guard.status();
  if (cudaError_t e =
          cudaMallocAsync(out, std::max<std::size_t>(bytes, 1), static_cast<cudaStream_t>(stream));
      e != cudaSuccess)
    return {StatusCode::runtime_error,
            "[kvcomp] workspace (= " + std::to_string(bytes) +
                " bytes of device memory) could not be allocated: " + cudaGetErrorString(e)};
  return Status::success();
}

void free_async(Device dev, void* stream, void* p) {
  DeviceGuard guard(dev.index);
  (void)cudaFreeAsync(p, static_cast<cudaStream_t>(stream));
}

DevicePlan::~DevicePlan() {
  DeviceGuard guard(device);
  if (batches) (void)cudaFreeAsync(batches, stream);
  if (block_batch) (void)cudaFreeAsync(block_batch, stream);
}

Status build_device_plan(const BlockPlan& plan, Device dev, void* stream, std::int64_t chunk_rows,
                         bool forward, DevicePlan* out) {
  const Dims& d = plan.dims;
  out->device = dev.index;
  out->stream = static_cast<cudaStream_t>(stream);
  out->chunk_rows = chunk_rows;
  out->total_blocks = plan.total_blocks;
  // Per block: its batch, its last row and its first gradient row (both
  // non-decreasing in the block index: batches and blocks are in row order).
  std::vector<std::int32_t> block_batch;
  std::vector<std::int64_t> last_row, first_row;
  block_batch.reserve(static_cast<std::size_t>(plan.total_blocks));
  long long first_block = 0;
  for (std::size_t bi = 0; bi < plan.batches.size(); ++bi) {
    const BatchSpan& s = plan.batches[bi];
    out->host_batches.push_back(
        {s.base, s.len, s.sp, s.used, s.limit, s.k0, s.nblocks, s.out_row, first_block});
    for (std::int64_t i = 0; i < s.nblocks; ++i) {
      const std::int64_t k = s.k0 + i;
      block_batch.push_back(static_cast<std::int32_t>(bi));
      last_row.push_back(s.base + (k * d.r + d.r - 1 - s.sp));
      first_row.push_back(s.base + std::max(k * d.r - (d.coff - 1) * d.r, s.sp) - s.sp);
    }
    first_block += s.nblocks;
  }
  // Chunks: the blocks each visits, and (backward) whether its rows get gradient.
  std::size_t g_lo = 0, g_hi = 0, bi = 0;
  for (std::int64_t a = 0; a < d.T; a += chunk_rows) {
    Chunk c;
    c.a = a;
    c.b = std::min(d.T, a + chunk_rows);
    while (g_lo < last_row.size() && last_row[g_lo] < a) ++g_lo;
    if (forward) {
      g_hi = g_lo;
      while (g_hi < last_row.size() && last_row[g_hi] < c.b) ++g_hi;
    } else {
      g_hi = std::max(g_hi, g_lo);
      while (g_hi < first_row.size() && first_row[g_hi] < c.b) ++g_hi;
      while (bi < plan.batches.size() && plan.batches[bi].base + plan.batches[bi].len <= a) ++bi;
      std::int64_t grad_rows = 0;
      for (std::size_t j = bi; j < plan.batches.size() && plan.batches[j].base < c.b; ++j) {
        const BatchSpan& s = plan.batches[j];
        const std::int64_t hi = s.base + std::min(s.len, std::max<std::int64_t>(0, s.limit - s.sp));
        grad_rows += std::max<std::int64_t>(0, std::min(hi, c.b) - std::max(s.base, a));
      }
      c.has_grad = grad_rows > 0;
      c.all_grad = grad_rows == c.b - a;
    }
    c.g_lo = static_cast<std::int64_t>(g_lo);
    c.g_hi = static_cast<std::int64_t>(std::max(g_hi, g_lo));
    out->max_chunk_blocks = std::max(out->max_chunk_blocks, c.g_hi - c.g_lo);
    out->chunks.push_back(c);
  }
  DeviceGuard guard(dev.index);
  if (!guard.status().ok()) return guard.status();
  const std::size_t batch_bytes = std::max<std::size_t>(1, out->host_batches.size()) * sizeof(DevBatch);
  const std::size_t block_bytes = std::max<std::size_t>(1, block_batch.size()) * sizeof(std::int32_t);
  const char* what = "allocating and filling the device block plan";
  cudaStream_t s = out->stream;
  if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out->batches), batch_bytes, s);
      e != cudaSuccess)
    return cuda_error(what, e);
  if (cudaError_t e = cudaMallocAsync(reinterpret_cast<void**>(&out->block_batch), block_bytes, s);
      e != cudaSuccess)
    return cuda_error(what, e);
  if (!out->host_batches.empty())
    if (cudaError_t e =
            cudaMemcpyAsync(out->batches, out->host_batches.data(),
                            out->host_batches.size() * sizeof(DevBatch), cudaMemcpyHostToDevice, s);
        e != cudaSuccess)
      return cuda_error(what, e);
  if (!block_batch.empty())
    if (cudaError_t e = cudaMemcpyAsync(out->block_batch, block_batch.data(),
                                        block_batch.size() * sizeof(std::int32_t), cudaMemcpyHostToDevice, s);
        e != cudaSuccess)
      return cuda_error(what, e);
  // Planning may wait: the host arrays above must outlive the copies.
  if (cudaError_t e = cudaStreamSynchronize(s); e != cudaSuccess) return cuda_error(what, e);
  return Status::success();
}

}  // namespace kvcomp::detail::cuda
