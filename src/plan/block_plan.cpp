#include "plan/block_plan.hpp"

#include <algorithm>
#include <iterator>
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

namespace {

struct SlotRange {
  std::int64_t id, lo, hi;  // cache block id, slot offsets [lo, hi)
  bool operator<(const SlotRange& o) const { return id != o.id ? id < o.id : lo < o.lo; }
};

// The slots of positions [lo, hi) of batch b, appended to out (mode 1 writes
// skip block id 0).
void slot_ranges(const CacheGeometry& g, std::int64_t b, std::int64_t lo, std::int64_t hi, bool write,
                 std::vector<SlotRange>& out) {
  const std::int64_t bs = g.block_size;
  if (g.cache_mode == 2) {  // one block per batch, offsets wrap
    const std::int64_t id = g.table[b];
    for (std::int64_t p = lo; p < hi;) {
      const std::int64_t off = p % bs, n = std::min(hi - p, bs - off);
      out.push_back({id, off, off + n});
      p += n;
    }
    return;
  }
  for (std::int64_t p = lo; p < hi;) {
    const std::int64_t col = p / bs, off = p % bs, n = std::min(hi - p, bs - off);
    const std::int64_t id = g.table[b * g.table_cols + col];
    if (!(write && id == 0)) out.push_back({id, off, off + n});
    p += n;
  }
}

bool overlaps(const SlotRange& a, const SlotRange& b) { return a.id == b.id && a.lo < b.hi && b.lo < a.hi; }

}  // namespace

CacheGeometry cache_geometry(const ForwardArgs& args, const std::int32_t* table) {
  CacheGeometry g;
  g.block_num = args.state_cache.dim(0);
  g.block_size = args.state_cache.dim(1);
  g.cache_mode = static_cast<int>(args.cache_mode);
  g.table = table;
  g.table_cols = args.cache_mode == 1 ? args.state_block_table->dim(1) : 1;
  g.data = static_cast<float*>(args.state_cache.data);
  g.slot_width = args.state_cache.dim(2);
  g.stride0 = args.state_cache_stride0 ? args.state_cache_stride0 : g.block_size * g.slot_width;
  return g;
}

bool cache_slots_alias(const BlockPlan& plan, const CacheGeometry& g) {
  const Dims& d = plan.dims;
  std::vector<SlotRange> writes, reads;
  for (std::size_t bi = 0; bi < plan.batches.size(); ++bi) {
    const BatchSpan& s = plan.batches[bi];
    const auto b = static_cast<std::int64_t>(bi);
    const std::int64_t write_from = g.cache_mode == 1 ? s.sp : std::max(s.sp, s.limit - (d.coff - 1) * d.r);
    slot_ranges(g, b, write_from, s.sp + s.used, true, writes);
    if (s.nblocks > 0)
      slot_ranges(g, b, std::max<std::int64_t>(0, s.k0 * d.r - (d.coff - 1) * d.r), s.sp, false, reads);
  }
  std::sort(writes.begin(), writes.end());
  for (std::size_t i = 1; i < writes.size(); ++i)
    if (overlaps(writes[i - 1], writes[i])) return true;
  // The writes are now disjoint and sorted: a read meets one only if it meets
  // the last write starting at or before it, or the first starting after it.
  for (const SlotRange& rd : reads) {
    const auto it = std::upper_bound(writes.begin(), writes.end(), SlotRange{rd.id, rd.lo, rd.lo});
    if (it != writes.end() && overlaps(*it, rd)) return true;
    if (it != writes.begin() && overlaps(*std::prev(it), rd)) return true;
  }
  return false;
}

}  // namespace kvcomp::detail
