#include "cpu/products/onednn_bf16.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>

#include "cpu/products/amx.hpp"
#include "cpu/products/onednn_bf16_tiles.hpp"
#include "cpu/products/rows.hpp"

namespace kvcomp::detail {

dnnl::engine& bf16_engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

namespace {

using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

// N, K, lda, ldc, ldb, b_transposed, c_bf16, sum, rows, cols
using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, bool, bool,
                       std::int64_t, std::int64_t>;

dnnl::memory::desc plain_b(const Bf16Shape& s, std::int64_t cols) {
  return {{s.K, cols}, dt::bf16, s.b_transposed ? dims{1, s.ldb} : dims{s.ldb, 1}};
}

bool is_reference(const dnnl::matmul::primitive_desc& pd) {
  return std::strncmp(pd.impl_info_str(), "ref", 3) == 0;
}

// Whether the primitive descriptor `make` returns exists and is not oneDNN's reference kernel.
template <class Make>
bool has_jit_kernel(Make&& make) {
  try {
    return !is_reference(make());
  } catch (const dnnl::error&) {
    return false;
  }
}

}  // namespace

TilePrimitive* tile_primitive(bool packed, const Bf16Shape& s, bool accumulate, std::int64_t rows,
                              std::int64_t cols) {
  if (cols < 0) cols = s.N;
  static std::recursive_mutex mu;
  static std::map<Key, std::unique_ptr<TilePrimitive>> cache;
  const std::lock_guard<std::recursive_mutex> lock(mu);
  auto& slot = cache[Key{s.N, s.K, s.lda, s.ldc, s.ldb, s.b_transposed, s.c_bf16, accumulate, rows, cols}];
  if (!slot) {
    const dnnl::memory::desc a({rows, s.K}, dt::bf16, dims{s.lda, 1});
    const dnnl::memory::desc c({rows, cols}, s.c_bf16 ? dt::bf16 : dt::f32, dims{s.ldc, 1});
    auto attr_of = [](bool sum) {
      dnnl::primitive_attr attr;
      attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
      if (sum) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
      }
      return attr;
    };
    auto make = [&](const dnnl::memory::desc& b, bool sum) {
      return dnnl::matmul::primitive_desc(bf16_engine(), a, b, c, attr_of(sum));
    };
    const dnnl::memory::desc any({s.K, cols}, dt::bf16, dnnl::memory::format_tag::any);
    bool in_place = false;
    dnnl::memory::desc b = any;
    if (accumulate || rows != kBf16TileRows || cols != s.N || s.c_bf16) {
      // B as the plain fp32 tile primitive reads it: in place, or in the layout the caller packed it
      // in for that one (named explicitly, so that the sum post-op or a bf16 C cannot pick another).
      const TilePrimitive* base = tile_primitive(packed, f32_twin(s), false);
      in_place = base->in_place;
      b = in_place ? plain_b(s, cols) : base->pd.weights_desc();
    } else {
      const auto w = make(any, false).weights_desc();
      in_place = w == dnnl::memory::desc({s.K, s.N}, dt::bf16, dnnl::memory::format_tag::ab) ||
                 w == dnnl::memory::desc({s.K, s.N}, dt::bf16, dnnl::memory::format_tag::ba);
      if (in_place && packed) {  // the blocked layout of oneDNN's bf16 brgemm kernels
        in_place = false;
        b = dnnl::memory::desc({s.K, s.N}, dt::bf16, dnnl::memory::format_tag::BA16a64b2a);
      } else if (!in_place && !has_jit_kernel([&] { return make(w, true); })) {
        // The accumulating tiles read the same packed B; where oneDNN would serve them only with its
        // reference kernel, B is read in place instead (a jit kernel always takes a plain B).
        in_place = true;
      }
      if (in_place) b = plain_b(s, cols);
    }
    const auto pd = make(b, accumulate);
    // oneDNN's reference matmul serves what its jit kernels refuse, 100-1000x slower: never on the
    // product path. The packed test mode (+packed) accepts it: brg:avx512_core_bf16 refuses row-strided
    // tiles of a packed B, so there the reference kernel checks our packing and tiling.
    if (is_reference(pd) && !packed)
      throw std::runtime_error(std::string("[kvcomp] oneDNN offers only its reference kernel (") +
                               pd.impl_info_str() + ") for a bf16 product tile");
    slot = std::make_unique<TilePrimitive>(TilePrimitive{pd, dnnl::matmul(pd), in_place});
  }
  return slot.get();
}

// oneDNN's implementation name for the plain tile primitive of shape s, or empty where it makes none

namespace {

// C (+)= A . B for each target on kvcomp's AMX kernel: the rows in blocks (multiples of 32, about one
// per thread where there are rows enough), else the columns in blocks of whole group pairs, so that
// every thread has a share; a block is one single-threaded amx_gemm_block. Which block or thread
// computes an element does not change its sum (products/amx.hpp). Row blocks hold 128 rows or more (but
// the last): threads on smaller ones (decode calls) would each read all of B's columns (the weights,
// the bulk of such a call's bytes), where column blocks read each column once (docs/performance.md).
// `a2` (optional): C (+)= A . B + A2 . B, one chain of sums (amx_gemm_block).
void amx_products(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                  std::span<const Bf16Target> targets, bool accumulate, int num_threads,
                  const std::uint16_t* a2 = nullptr) {
  const AmxStore store = s.c_bf16 ? AmxStore::bf16 : accumulate ? AmxStore::add : AmxStore::set;
  const auto n_targets = static_cast<std::int64_t>(targets.size());
  const std::int64_t threads = std::max(num_threads, 1), groups = amx_groups(s.N);
  const std::int64_t row_units = (M + 31) / 32;  // blocks of 32 rows
  const std::int64_t row_blocks = std::clamp((threads + n_targets - 1) / n_targets, std::int64_t{1},
                                             std::max<std::int64_t>(1, row_units / 4));
  const std::int64_t rows = (row_units + row_blocks - 1) / row_blocks * 32;
  const std::int64_t pairs = (groups + 1) / 2;
  const std::int64_t col_blocks =
      std::clamp((threads + n_targets * row_blocks - 1) / (n_targets * row_blocks), std::int64_t{1}, pairs);
  const std::int64_t cols = (pairs + col_blocks - 1) / col_blocks * 2;  // groups per column block
  const std::int64_t per_target = row_blocks * col_blocks, units = n_targets * per_target;
  const std::int64_t c_size = s.c_bf16 ? 2 : 4;
#pragma omp parallel for num_threads(static_cast <int>(std::min(threads, units))) schedule(static)
  for (std::int64_t u = 0; u < units; ++u) {
    const Bf16Target& x = targets[static_cast<std::size_t>(u / per_target)];
    const std::int64_t r0 = u % per_target / col_blocks * rows, g0 = u % col_blocks * cols;
    const std::int64_t m = std::min(rows, M - r0);
    if (m <= 0 || g0 >= groups) continue;
    amx_gemm_block(m, s.N, s.K, a + r0 * s.lda, s.lda, x.b,
                   static_cast<unsigned char*>(x.c) + r0 * s.ldc * c_size, s.ldc, store, g0,
                   std::min(groups, g0 + cols), a2 ? a2 + r0 * s.lda : nullptr);
  }
}

}  // namespace

Bf16Plan bf16_plan(const Bf16Kernels& k, const Bf16Shape& s) {
  if (k.amx) return {true, amx_packed_bytes(s.N, s.K)};
  try {
    const TilePrimitive* t = tile_primitive(k.packed, s, false);
    return {true, t->in_place ? 0 : t->pd.weights_desc().get_size()};
  } catch (const std::exception&) {
    return {};
  }
}

namespace {

// How one matrix's packing splits into reorders of column slices: the packed layout is one of
// oneDNN's BA16a<n>b2a (columns in blocks of n, each block's rows contiguous), so columns [c0, c1),
// c0 a multiple of n, are the bytes from the packed size of c0 columns on. width: the slices'
// columns (a multiple of n), or 0 where the layout is none of these (one reorder per matrix).
struct PackSlicing {
  dnnl::memory::format_tag tag = dnnl::memory::format_tag::undef;
  std::int64_t width = 0;
};

PackSlicing pack_slicing(const Bf16Shape& s, const dnnl::memory::desc& packed, int slices) {
  using tag = dnnl::memory::format_tag;
  const std::pair<tag, std::int64_t> blocked[] = {
      {tag::BA16a64b2a, 64}, {tag::BA16a48b2a, 48}, {tag::BA16a32b2a, 32}, {tag::BA16a16b2a, 16}};
  for (const auto& [t, n] : blocked) {
    if (packed != dnnl::memory::desc({s.K, s.N}, dt::bf16, t)) continue;
    const std::int64_t blocks = (s.N + n - 1) / n;
    const std::int64_t per = (blocks + std::max(slices, 1) - 1) / std::max(slices, 1);
    return {t, per * n};
  }
  return {};
}

}  // namespace

bool bf16_pack_b(const Bf16Kernels& k, const Bf16Shape& s, const Bf16PackJob* jobs, int count,
                 int num_threads) {
  if (count <= 0) return true;
  if (k.amx) {  // a copy in slices of 8 column groups, dealt to the threads
    constexpr std::int64_t kSlice = 8;
    const std::int64_t groups = amx_groups(s.N), per = (groups + kSlice - 1) / kSlice, units = count * per;
#pragma omp parallel for num_threads(static_cast <int>(std::clamp <std::int64_t>(num_threads, 1, units))) \
    schedule(static)
    for (std::int64_t u = 0; u < units; ++u) {
      const std::int64_t g0 = u % per * kSlice;
      amx_pack_b(s.N, s.K, jobs[u / per].b, s.ldb, s.b_transposed, jobs[u / per].packed, g0,
                 std::min(groups, g0 + kSlice));
    }
    return true;
  }
  const TilePrimitive* t = nullptr;
  try {
    t = tile_primitive(k.packed, s, false);
  } catch (const std::exception&) {
    return false;
  }
  if (t->in_place) return true;  // the products read B where it lies
  // Fewer matrices than threads: each is packed as column slices, so that every thread has a share
  // (one reorder per slice, single-threaded on its thread as below).
  const int threads = std::max(num_threads, 1);
  const PackSlicing slicing =
      count < threads ? pack_slicing(s, t->pd.weights_desc(), (threads + count - 1) / count) : PackSlicing{};
  // Unsliced: one slice of all N columns, in the primitive's own layout.
  const std::int64_t width = slicing.width > 0 ? slicing.width : std::max<std::int64_t>(s.N, 1);
  const std::int64_t per_job = (s.N + width - 1) / width;
  const std::int64_t units = count * per_job;
  std::atomic<bool> ok{true};
#pragma omp parallel num_threads(static_cast <int>(std::min <std::int64_t>(threads, units)))
  {
    omp_set_num_threads(1);  // this implicit task's limit only: the reorder runs on this thread
    try {
      dnnl::stream st(bf16_engine());
      for (std::int64_t u = omp_get_thread_num(); u < units; u += omp_get_num_threads()) {
        const Bf16PackJob& job = jobs[u / per_job];
        const std::int64_t c0 = (u % per_job) * width, cols = std::min(width, s.N - c0);
        const auto sliced = [&](std::int64_t n) {
          return dnnl::memory::desc({s.K, n}, dt::bf16, slicing.tag);
        };
        const std::size_t at = c0 == 0 ? 0 : sliced(c0).get_size();
        dnnl::memory src(plain_b(s, cols), bf16_engine(),
                         const_cast<std::uint16_t*>(job.b + (s.b_transposed ? c0 * s.ldb : c0)));
        dnnl::memory dst(slicing.width > 0 ? sliced(cols) : t->pd.weights_desc(), bf16_engine(),
                         static_cast<unsigned char*>(job.packed) + at);
        dnnl::reorder(src, dst).execute(st, src, dst);
      }
      st.wait();
    } catch (
        const std::exception&) {  // dnnl::error, std::bad_alloc: reported, never thrown out of the region
      ok = false;
    }
  }
  return ok;
}

bool gemm_bf16(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
               std::span<const Bf16Target> targets, bool accumulate, int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  // C += A . B in bf16 would round twice; a bf16 C only where it holds the fp32 sums' rounding (the
  // plan asked bf16_c_rounds_like_f32).
  if (s.c_bf16 && accumulate) return false;
  if (k.amx) {  // any M: every row's sums are the same on the AMX kernel
    amx_products(s, M, a, targets, accumulate, num_threads);
    return true;
  }
  // Whole tiles, or one short tile of a height the plan's bf16_packed_short_rows gave.
  if (M % kBf16TileRows != 0 && (accumulate || M > kBf16TileRows || M % kBf16ShortTileRows != 0))
    return false;
  const TilePrimitive* full = nullptr;
  const TilePrimitive* last = nullptr;
  std::int64_t unit = kBf16TileRows;
  try {
    const TilePrimitive* base = tile_primitive(k.packed, f32_twin(s), false);
    // In place: about one tile per thread, between kBf16TileRows and kBf16InPlaceTileRows rows (the
    // kernel packs B on every execution, so taller tiles pack it less often; a row's sums do not
    // depend on the height, so neither do they on the thread count). Packed: kBf16TileRows. The
    // last tile takes the rest.
    if (base->in_place) {
      const std::int64_t share = (M + std::max(num_threads, 1) - 1) / std::max(num_threads, 1);
      unit = std::clamp(bf16_padded_rows(share), kBf16TileRows, kBf16InPlaceTileRows);
    }
    unit = std::min(unit, M);
    full = tile_primitive(k.packed, s, accumulate, unit);
    last = M % unit ? tile_primitive(k.packed, s, accumulate, M % unit) : full;
    // B was packed for the plain primitive: the sum post-op must not change its layout.
    if (!base->in_place && full->pd.weights_desc() != base->pd.weights_desc()) return false;
  } catch (const std::exception&) {
    return false;
  }
  const std::int64_t per = (M + unit - 1) / unit;  // tiles of one target
  const std::int64_t c_size = s.c_bf16 ? 2 : 4;
  return run_tiles(per * static_cast<std::int64_t>(targets.size()), full, last, num_threads,
                   [&](std::int64_t i) {
                     const Bf16Target& x = targets[static_cast<std::size_t>(i / per)];
                     const std::int64_t r = i % per;
                     return Tile{(r + 1) * unit <= M ? full : last, a + r * unit * s.lda, x.b,
                                 static_cast<unsigned char*>(x.c) + r * unit * s.ldc * c_size};
                   });
}

bool gemm_bf16_two_parts(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                         const std::uint16_t* a2, std::span<const Bf16Target> targets, bool accumulate,
                         int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  if (s.c_bf16) return false;
  if (k.amx) {
    amx_products(s, M, a, targets, accumulate, num_threads, a2);
    return true;
  }
  return gemm_bf16(k, s, M, a, targets, accumulate, num_threads) &&
         gemm_bf16(k, s, M, a2, targets, true, num_threads);
}

namespace {

// The column tiles of an M-row product: tiles of kBf16TileCols columns where B is read in place (a
// column block of B is a plain matrix too), one tile over all columns where it is packed (its blocked
// layout is not ours to cut). Throws what tile_primitive throws.
struct ColumnTiles {
  std::int64_t cols;
  const TilePrimitive* full;  // a tile of `cols` columns
  const TilePrimitive* last;  // the last tile (`full` where cols divides N)
};

ColumnTiles column_tiles(bool packed, const Bf16Shape& s, bool accumulate, std::int64_t M) {
  const std::int64_t cols = tile_primitive(packed, s, false)->in_place ? std::min(kBf16TileCols, s.N) : s.N;
  const TilePrimitive* full = tile_primitive(packed, s, accumulate, M, cols);
  return {cols, full, s.N % cols ? tile_primitive(packed, s, accumulate, M, s.N % cols) : full};
}

}  // namespace

bool bf16_short_rows_stable(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M) {
  if (M < 2) return false;
  if (k.amx) return true;  // any M gives a row the same sums
  try {
    const TilePrimitive* base = tile_primitive(k.packed, s, false);
    if (!base->in_place) return false;
    const auto jit = [](const TilePrimitive* t) {
      return std::strcmp(t->pd.impl_info_str(), "gemm:jit") == 0;
    };
    const ColumnTiles t = column_tiles(k.packed, s, false, M);  // the tiles gemm_bf16_rows runs
    return jit(base) && jit(t.full) && jit(t.last);
  } catch (const std::exception&) {
    return false;
  }
}

bool gemm_bf16_rows(const Bf16Kernels& k, const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                    std::span<const Bf16Target> targets, bool accumulate, int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  if (s.c_bf16) return false;
  if (k.amx) {
    amx_products(s, M, a, targets, accumulate, num_threads);
    return true;
  }
  ColumnTiles t{};
  try {
    t = column_tiles(k.packed, s, accumulate, M);
  } catch (const std::exception&) {
    return false;
  }
  const std::int64_t per = (s.N + t.cols - 1) / t.cols;  // tiles of one target
  return run_tiles(
      per * static_cast<std::int64_t>(targets.size()), t.full, t.last, num_threads, [&](std::int64_t i) {
        const Bf16Target& x = targets[static_cast<std::size_t>(i / per)];
        const auto* bb = static_cast<const std::uint16_t*>(x.b);
        const std::int64_t n0 = i % per * t.cols;
        const std::uint16_t* b_tile = t.cols == s.N ? bb : s.b_transposed ? bb + n0 * s.ldb : bb + n0;
        return Tile{n0 + t.cols <= s.N ? t.full : t.last, a, b_tile, static_cast<float*>(x.c) + n0};
      });
}

void gemm_bf16_rows_kernel(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                           std::span<const Bf16Target> targets, int num_threads,
                           const std::uint16_t* const* panels) {
  const std::int64_t group = 32 * bf16_panel_pairs(s.K);  // bf16 values of one 16-column group
  const auto n_targets = static_cast<std::int64_t>(targets.size());
  const std::int64_t width = dealt_tile_cols(s.N, n_targets, kBf16TileCols, num_threads);
  const std::int64_t per = (s.N + width - 1) / width;
  const std::int64_t col_tiles = per * n_targets;
  // More than 8 rows (panels only): the rows too in tiles of at least 64, where the column tiles are
  // fewer than two per thread.
  const std::int64_t row_tiles =
      M <= kRowsKernelMax
          ? 1
          : std::clamp<std::int64_t>((2 * std::int64_t{num_threads} + col_tiles - 1) / col_tiles, 1,
                                     (M + 63) / 64);
  const std::int64_t rows = (M + row_tiles - 1) / row_tiles, tiles = col_tiles * row_tiles;
#pragma omp parallel for num_threads(static_cast <int>(std::clamp <std::int64_t>(num_threads, 1, tiles))) \
    schedule(dynamic, 1)
  for (std::int64_t i = 0; i < tiles; ++i) {
    const std::int64_t j = i % col_tiles, r0 = i / col_tiles * rows, m = std::min(rows, M - r0);
    if (m <= 0) continue;
    const Bf16Target& x = targets[static_cast<std::size_t>(j / per)];
    const std::int64_t n0 = j % per * width, nt = std::min(width, s.N - n0);
    const std::uint16_t* ar = a + r0 * s.lda;
    float* cr = static_cast<float*>(x.c) + r0 * s.ldc + n0;
    if (panels)
      gemm_rows_avx512_bf16_panels(m, nt, s.K, ar, s.lda, panels[j / per] + n0 / 16 * group, cr, s.ldc);
    else
      gemm_rows_avx512_bf16(m, nt, s.K, ar, s.lda, static_cast<const std::uint16_t*>(x.b) + n0 * s.ldb, s.ldb,
                            cr, s.ldc);
  }
}

}  // namespace kvcomp::detail
