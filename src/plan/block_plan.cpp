#include "plan/block_plan.hpp"

#include <algorithm>
#include <limits>
#include <string>

namespace kvcomp::detail {

namespace {
Status reject(const std::string& msg) { return {StatusCode::invalid_param, "[kvcomp] " + msg}; }
}  // namespace

Status BlockPlan::build(const Dims& dims, const std::int32_t* cu, const std::int32_t* seqused,
                        const std::int32_t* start_pos, BlockPlan* out) {
  BlockPlan plan;
  plan.dims = dims;
  plan.batches.resize(static_cast<std::size_t>(dims.B));
  const std::int64_t r = dims.r;
  const std::int64_t bsh_rows = dims.layout == Layout::bsh ? compressed_rows_bsh(dims.S, r) : 0;
  if (dims.layout == Layout::th) {
    if (cu[0] != 0) return reject("cu_seqlens[0] (= " + std::to_string(cu[0]) + ") must be 0");
    if (cu[dims.B] != dims.T)
      return reject("cu_seqlens[" + std::to_string(dims.B) + "] (= " + std::to_string(cu[dims.B]) +
                    ") must equal the token count T = " + std::to_string(dims.T));
  }
  std::int64_t out_row = 0;
  for (std::int64_t b = 0; b < dims.B; ++b) {
    BatchSpan& s = plan.batches[static_cast<std::size_t>(b)];
    if (dims.layout == Layout::th) {
      if (cu[b + 1] < cu[b])
        return reject("cu_seqlens[" + std::to_string(b + 1) + "] (= " + std::to_string(cu[b + 1]) +
                      ") must be >= cu_seqlens[" + std::to_string(b) + "] (= " + std::to_string(cu[b]) + ")");
      s.base = cu[b];
      s.len = cu[b + 1] - cu[b];
    } else {
      s.base = b * dims.S;
      s.len = dims.S;
    }
    s.sp = start_pos ? start_pos[b] : 0;
    if (s.sp < 0)
      return reject("start_pos[" + std::to_string(b) + "] (= " + std::to_string(s.sp) + ") must be >= 0");
    if (s.sp + s.len > std::numeric_limits<std::int32_t>::max())
      return reject("start_pos[" + std::to_string(b) + "] + length (= " + std::to_string(s.sp + s.len) +
                    ") must fit in int32");
    s.used = seqused ? seqused[b] : s.len;
    if (s.used < 0 || s.used > s.len)
      return reject("seqused[" + std::to_string(b) + "] (= " + std::to_string(s.used) + ") must be in [0, " +
                    std::to_string(s.len) + "], the length of batch " + std::to_string(b));
    s.limit = (s.sp + s.used) / r * r;
    s.k0 = s.sp / r;
    s.nblocks = s.limit > s.sp ? (s.limit - s.sp + r - 1) / r : 0;
    if (dims.layout == Layout::bsh) {
      s.out_row = b * bsh_rows;
    } else {
      s.out_row = out_row;
      out_row += s.nblocks;
    }
    plan.total_blocks += s.nblocks;
  }
  *out = std::move(plan);
  return Status::success();
}

std::size_t first_batch_ending_after(const BlockPlan& plan, std::int64_t row) {
  auto it = std::partition_point(plan.batches.begin(), plan.batches.end(),
                                 [row](const BatchSpan& s) { return s.base + s.len <= row; });
  return static_cast<std::size_t>(it - plan.batches.begin());
}

}  // namespace kvcomp::detail
