#include "cpu/gemm_bf16.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <oneapi/dnnl/dnnl.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/numerics.hpp"
#include "cpu/gemm.hpp"
#include "cpu/gemm_amx.hpp"
#include "cpu/gemm_rows.hpp"
#include "cpu/isa.hpp"

namespace kvcomp::detail {

namespace {

using dt = dnnl::memory::data_type;
using dims = dnnl::memory::dims;

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

// One tile's primitive: A [rows, K] bf16 with row stride lda, B [K, cols],
// C [rows, cols] fp32 with row stride ldc (rows kBf16TileRows and cols N,
// except in gemm_bf16_rows), plus the sum post-op when it
// accumulates. B is read where it lies (in_place) when the layout oneDNN
// would pick for it is a plain one anyway (AVX512-BF16: its gemm packs B
// itself), else from the packed copy in that layout (AMX: a blocked layout).
// Cached for the process: a call uses a few shapes, and creating a
// primitive costs a JIT compilation.
struct TilePrimitive {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  bool in_place = false;
};

// N, K, lda, ldc, ldb, b_transposed, c_bf16, sum, rows, cols
using Key = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, bool,
                       bool, std::int64_t, std::int64_t>;

// The shape with an fp32 C: the one whose primitive chooses B's layout for both.
Bf16Shape f32_twin(Bf16Shape s) {
  s.c_bf16 = false;
  return s;
}

dnnl::memory::desc plain_b(const Bf16Shape& s, std::int64_t cols) {
  return {{s.K, cols}, dt::bf16, s.b_transposed ? dims{1, s.ldb} : dims{s.ldb, 1}};
}

// KVCOMP_BF16_PACKED=1: B packed into a blocked layout even where oneDNN's kernel would read a plain
// one (AVX512-BF16), so that any machine with bf16 units runs the packed code (packing, packed prepared
// weights, 64-row tiles), which AMX takes for dense tiles only (oneDNN 2.6's AMX brgemm refuses
// row-strided ones, which then read B in place, as elsewhere); ctest's *_packed runs. Read once per
// process.
bool packed_forced() {
  static const bool on = [] {
    const char* v = std::getenv("KVCOMP_BF16_PACKED");
    return v && std::strcmp(v, "1") == 0;
  }();
  return on;
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

TilePrimitive* tile_primitive(const Bf16Shape& s, bool accumulate, std::int64_t rows = kBf16TileRows,
                              std::int64_t cols = -1) {
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
      return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr_of(sum), engine());
    };
    const dnnl::memory::desc any({s.K, cols}, dt::bf16, dnnl::memory::format_tag::any);
    bool in_place = false;
    dnnl::memory::desc b = any;
    if (accumulate || rows != kBf16TileRows || cols != s.N || s.c_bf16) {
      // B as the plain fp32 tile primitive reads it: in place, or in the layout the caller packed it
      // in for that one (named explicitly, so that the sum post-op or a bf16 C cannot pick another).
      const TilePrimitive* base = tile_primitive(f32_twin(s), false);
      in_place = base->in_place;
      b = in_place ? plain_b(s, cols) : base->pd.weights_desc();
    } else {
      const auto w = make(any, false).weights_desc();
      in_place = w == dnnl::memory::desc({s.K, s.N}, dt::bf16, dnnl::memory::format_tag::ab) ||
                 w == dnnl::memory::desc({s.K, s.N}, dt::bf16, dnnl::memory::format_tag::ba);
      if (in_place && packed_forced()) {  // the blocked layout of oneDNN's bf16 brgemm kernels
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
    // product path. KVCOMP_BF16_PACKED=1 (tests) accepts it: brg:avx512_core_bf16 refuses row-strided
    // tiles of a packed B, so there the reference kernel checks our packing and tiling.
    if (is_reference(pd) && !packed_forced())
      throw std::runtime_error(std::string("[kvcomp] oneDNN offers only its reference kernel (") +
                               pd.impl_info_str() + ") for a bf16 product tile");
    slot = std::make_unique<TilePrimitive>(TilePrimitive{pd, dnnl::matmul(pd), in_place});
  }
  return slot.get();
}

// oneDNN's implementation name for the plain tile primitive of shape s, or empty where it makes none
// (dnnl::error, std::bad_alloc).
std::string tile_kernel_of(const Bf16Shape& s) {
  try {
    return tile_primitive(s, false)->pd.impl_info_str();
  } catch (const std::exception&) {
    return {};
  }
}

bool is_matrix_unit_kernel(const std::string& impl) {
  return impl.find("bf16") != std::string::npos &&
         (impl.find("amx") != std::string::npos || impl.find("avx512_core_bf16") != std::string::npos);
}

// KVCOMP_PRODUCTS, read once per process: auto (unset or empty), bf16 or f32.
enum class Choice { automatic, bf16, f32 };

Choice choice() {
  static const Choice c = [] {
    const char* v = std::getenv("KVCOMP_PRODUCTS");
    if (!v || !*v || std::strcmp(v, "auto") == 0) return Choice::automatic;
    if (std::strcmp(v, "bf16") == 0) return Choice::bf16;
    if (std::strcmp(v, "f32") == 0) return Choice::f32;
    std::fprintf(stderr, "[kvcomp] KVCOMP_PRODUCTS (= %s) must be auto, bf16 or f32; ignored\n", v);
    return Choice::automatic;
  }();
  return c;
}

// On where the CPU has bf16 units, unless KVCOMP_PRODUCTS=f32 or KVCOMP_ISA
// caps the kernels below avx512 (so that one machine tests both paths).
std::string choose_kernel() {
  if (choice() == Choice::f32) return {};
  if (active_isa() != Isa::avx512) return {};
  const std::string impl = tile_kernel_of(Bf16Shape{256, 256, 256, 256, 256, false});
  return is_matrix_unit_kernel(impl) ? impl : std::string{};  // else (none too): fp32 products
}

const std::string& kernel_name() {
  static const std::string name = choose_kernel();
  return name;
}

// Whether the bf16 products run on kvcomp's own AMX kernel (gemm_amx.hpp) instead of oneDNN's: where
// oneDNN's kernel is its AMX one (so DNNL_MAX_CPU_ISA below AMX, KVCOMP_ISA and KVCOMP_PRODUCTS=f32
// keep it off too) and the process may use the tiles; not in the packed emulation
// (KVCOMP_BF16_PACKED=1, which tests oneDNN's packed path) nor with KVCOMP_AMX_KERNEL=0. Read once per
// process.
bool amx_own() {
  static const bool yes = [] {
    const char* v = std::getenv("KVCOMP_AMX_KERNEL");
    const bool off = v && std::strcmp(v, "0") == 0;
    return kernel_name().find("amx") != std::string::npos && !packed_forced() && !off && amx_tiles_usable();
  }();
  return yes;
}

// C (+)= A . B for each target on kvcomp's AMX kernel: the rows in blocks (multiples of 32, about one
// per thread where there are rows enough), else the columns in blocks of whole group pairs, so that
// every thread has a share; a block is one single-threaded amx_gemm_block. Which block or thread
// computes an element does not change its sum (gemm_amx.hpp). Row blocks hold 128 rows or more (but
// the last): threads on smaller ones (decode calls) would each read all of B's columns (the weights,
// the bulk of such a call's bytes), where column blocks read each column once (2 threads, M = 64, N 2 x
// 1024, K 4096, weights in cache: row halves 0.77 ms, column halves 0.65; docs/performance.md).
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
#pragma omp parallel for num_threads(static_cast<int>(std::min(threads, units))) schedule(static)
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

const char* bf16_product_kernel() { return kernel_name().empty() ? nullptr : kernel_name().c_str(); }

bool bf16_split_products() {
  if (!bf16_product_kernel()) return false;
  return choice() == Choice::bf16 || kernel_name().find("amx") != std::string::npos;
}

bool bf16_backward_products() {
  if (!bf16_product_kernel()) return false;
  if (bf16_split_products()) return true;  // AMX, or KVCOMP_PRODUCTS=bf16
  // AVX512-BF16 without AMX: faster than fp32 on AMD (Zen 4: about 1.5x), slower on Intel (about
  // 0.5-0.65x; Cooper Lake, or a Xeon whose AMX the hypervisor hides), docs/performance.md.
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

bool bf16_rows_kernel_available() {
  // The kernel sums in the order of oneDNN's jit gemm, which reads B where it lies. Where oneDNN packs B
  // instead (AMX, whose CPUs have AVX512-BF16 too; KVCOMP_BF16_PACKED=1) its kernels sum otherwise and
  // the rows kernel does not apply (bf16_short_rows_stable): then it is neither used nor named.
  static const bool yes = bf16_product_kernel() && !packed_forced() &&
                          kernel_name().find("amx") == std::string::npos && cpu_has_avx512_bf16() &&
                          active_isa() >= Isa::avx512 && std::getenv("KVCOMP_BF16_ROWS_KERNEL") == nullptr;
  return yes;
}

namespace {

// The kernel oneDNN gives a tile whose C rows lie farther apart than its columns (the two projections
// side by side, ldc = 2N: most of kvcomp's product tiles), where that is not kernel_name(): oneDNN 2.6's
// AMX brgemm takes only dense A and C, so on AMX those tiles run its jit gemm (which multiplies on the
// AMX tiles too, packing B itself on each execution). Empty where the same kernel runs both.
std::string strided_tile_kernel() {
  const std::string impl = tile_kernel_of(Bf16Shape{256, 256, 256, 512, 256, true});
  return impl == kernel_name() ? std::string{} : impl;
}

}  // namespace

const char* product_kernels() {
  static const std::string s = [] {
    // The f32 products' note: decode-sized projections on kvcomp's AVX2 kernel (gemm_rows.hpp).
    const std::string rows = !gemm_rows_kernel_active()  ? ""
                             : gemm_rows_order_probed() ? "; 1-8 rows: kvcomp avx2, order probed per shape"
                                                        : "; 1-8 rows: kvcomp avx2";
    if (kernel_name().empty()) return "f32 (dnnl_sgemm)" + rows;
    const char* backward = bf16_split_products()      ? ", precise as hi+lo"
                           : bf16_backward_products() ? ", precise in f32"
                                                      : ", backward in f32";
    const char* bf16_rows = !bf16_rows_kernel_available() ? ""
                            : bf16_decode_panels_wanted()
                                ? ", 1-8 rows, calls of 128+ rows and prepared weights: kvcomp avx512_bf16"
                                : ", 1-8 rows and prepared weights: kvcomp avx512_bf16";
    if (amx_own()) return std::string("bf16 (kvcomp amx_bf16") + backward + ") + f32 (dnnl_sgemm)" + rows;
    const std::string strided = strided_tile_kernel();
    return "bf16 (" + kernel_name() + (packed_forced() ? ", packed B" : "") +
           (strided.empty() ? "" : ", row-strided tiles " + strided) + backward + bf16_rows +
           ") + f32 (dnnl_sgemm)" + rows;
  }();
  return s.c_str();
}

Bf16Plan bf16_plan(const Bf16Shape& s) {
  if (!bf16_product_kernel()) return {};
  if (amx_own()) return {true, amx_packed_bytes(s.N, s.K)};
  try {
    const TilePrimitive* t = tile_primitive(s, false);
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

bool bf16_pack_b(const Bf16Shape& s, const Bf16PackJob* jobs, int count, int num_threads) {
  if (count <= 0) return true;
  if (amx_own()) {  // a copy in slices of 8 column groups, dealt to the threads
    constexpr std::int64_t kSlice = 8;
    const std::int64_t groups = amx_groups(s.N), per = (groups + kSlice - 1) / kSlice, units = count * per;
#pragma omp parallel for num_threads(static_cast<int>(std::clamp<std::int64_t>(num_threads, 1, units))) \
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
    t = tile_primitive(s, false);
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
#pragma omp parallel num_threads(static_cast<int>(std::min<std::int64_t>(threads, units)))
  {
    omp_set_num_threads(1);  // this implicit task's limit only: the reorder runs on this thread
    try {
      dnnl::stream st(engine());
      for (std::int64_t u = omp_get_thread_num(); u < units; u += omp_get_num_threads()) {
        const Bf16PackJob& job = jobs[u / per_job];
        const std::int64_t c0 = (u % per_job) * width, cols = std::min(width, s.N - c0);
        const auto sliced = [&](std::int64_t n) {
          return dnnl::memory::desc({s.K, n}, dt::bf16, slicing.tag);
        };
        const std::size_t at = c0 == 0 ? 0 : sliced(c0).get_size();
        dnnl::memory src(plain_b(s, cols), engine(),
                         const_cast<std::uint16_t*>(job.b + (s.b_transposed ? c0 * s.ldb : c0)));
        dnnl::memory dst(slicing.width > 0 ? sliced(cols) : t->pd.weights_desc(), engine(),
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

namespace {

// One primitive execution of a product: its primitive and where its A, B and C start.
struct Tile {
  const TilePrimitive* t;
  const std::uint16_t* a;
  const void* b;
  void* c;
};

// Runs `tiles` executions (tile_of(i) says the i-th; all of them with primitive `full` or `last`),
// dealt round-robin over up to num_threads threads, each execution single-threaded on its thread:
// which thread runs a tile cannot change its sums.
template <typename TileOf>
bool run_tiles(std::int64_t tiles, const TilePrimitive* full, const TilePrimitive* last, int num_threads,
               TileOf&& tile_of) {
  const std::size_t scratch_bytes =
      std::max(full->pd.scratchpad_desc().get_size(), last->pd.scratchpad_desc().get_size());
  std::atomic<bool> ok{true};
  const int threads = static_cast<int>(std::min<std::int64_t>(std::max(num_threads, 1), tiles));
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);  // this implicit task's limit only: oneDNN runs the tile on this thread
    try {
      dnnl::stream st(engine());
      // The primitive's own work memory, per thread (scratchpad_mode::user: nothing shared).
      std::unique_ptr<unsigned char[]> scratch(scratch_bytes ? new unsigned char[scratch_bytes] : nullptr);
      for (std::int64_t i = omp_get_thread_num(); i < tiles; i += omp_get_num_threads()) {
        const Tile x = tile_of(i);
        const auto& pd = x.t->pd;
        dnnl::memory sp(pd.scratchpad_desc(), engine(), scratch.get());
        dnnl::memory am(pd.src_desc(), engine(), const_cast<std::uint16_t*>(x.a));
        dnnl::memory wm(pd.weights_desc(), engine(), const_cast<void*>(x.b));
        dnnl::memory cm(pd.dst_desc(), engine(), x.c);
        x.t->prim.execute(
            st, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, wm}, {DNNL_ARG_DST, cm}, {DNNL_ARG_SCRATCHPAD, sp}});
      }
      st.wait();
    } catch (
        const std::exception&) {  // dnnl::error, std::bad_alloc: reported, never thrown out of the region
      ok = false;
    }
  }
  return ok;
}

}  // namespace

bool gemm_bf16(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
               std::span<const Bf16Target> targets, bool accumulate, int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  // C += A . B in bf16 would round twice; a bf16 C only where it holds the fp32 sums' rounding.
  if (s.c_bf16 && (accumulate || !bf16_c_rounds_like_f32(s))) return false;
  if (amx_own()) {  // any M: every row's sums are the same on the AMX kernel
    amx_products(s, M, a, targets, accumulate, num_threads);
    return true;
  }
  if (M % kBf16TileRows != 0 &&
      (accumulate || M > kBf16TileRows || bf16_packed_short_rows(f32_twin(s), M) != M))
    return false;
  const TilePrimitive* full = nullptr;
  const TilePrimitive* last = nullptr;
  std::int64_t unit = kBf16TileRows;
  try {
    const TilePrimitive* base = tile_primitive(f32_twin(s), false);
    // In place: about one tile per thread, between kBf16TileRows and kBf16InPlaceTileRows rows (the
    // kernel packs B on every execution, so taller tiles pack it less often; a row's sums do not
    // depend on the height, so neither do they on the thread count). Packed: kBf16TileRows. The
    // last tile takes the rest.
    if (base->in_place) {
      const std::int64_t share = (M + std::max(num_threads, 1) - 1) / std::max(num_threads, 1);
      unit = std::clamp(bf16_padded_rows(share), kBf16TileRows, kBf16InPlaceTileRows);
    }
    unit = std::min(unit, M);
    full = tile_primitive(s, accumulate, unit);
    last = M % unit ? tile_primitive(s, accumulate, M % unit) : full;
    // B was packed for the plain primitive: the sum post-op must not change its layout.
    if (!base->in_place && full->pd.weights_desc() != base->pd.weights_desc()) return false;
  } catch (const std::exception&) {
    return false;
  }
  const std::int64_t per = (M + unit - 1) / unit;  // tiles of one target
  const std::int64_t c_size = s.c_bf16 ? 2 : 4;
  return run_tiles(
      per * static_cast<std::int64_t>(targets.size()), full, last, num_threads, [&](std::int64_t i) {
        const Bf16Target& x = targets[static_cast<std::size_t>(i / per)];
        const std::int64_t r = i % per;
        return Tile{(r + 1) * unit <= M ? full : last, a + r * unit * s.lda, x.b,
                    static_cast<unsigned char*>(x.c) + r * unit * s.ldc * c_size};
      });
}

namespace {

// A bf16 of random sign, exponent 2^-8 .. 2^8 and mantissa, from a linear congruential state.
std::uint16_t next_probe_value(std::uint32_t& state) {
  state = state * 1664525u + 1013904223u;
  const std::uint32_t r = state >> 8;
  return static_cast<std::uint16_t>((r & 0x8000u) | ((127u - 8u + (r >> 7) % 17u) << 7) | (r & 0x7Fu));
}

// Random operands of one 64-row tile of shape s, from a state seeded by `seed` and the shape: A, and B
// where it lies and packed as `base` (the shape's plain fp32 tile primitive) reads it.
struct ProbeOperands {
  std::vector<std::uint16_t> a, b;
  std::vector<unsigned char> packed;
  const void* read_b = nullptr;  // what the primitives read: b, or its packed copy
};

// False if the packing could not run.
bool make_probe_operands(const Bf16Shape& s, const TilePrimitive* base, std::uint32_t seed,
                         ProbeOperands& o) {
  std::uint32_t state = seed + static_cast<std::uint32_t>(s.K * 131 + s.N);
  o.a.resize(static_cast<std::size_t>(kBf16TileRows * s.lda));
  o.b.resize(static_cast<std::size_t>((s.b_transposed ? s.N : s.K) * s.ldb));
  for (auto& v : o.a) v = next_probe_value(state);
  for (auto& v : o.b) v = next_probe_value(state);
  o.packed.resize(base->in_place ? 0 : base->pd.weights_desc().get_size());
  const Bf16PackJob job{o.b.data(), o.packed.data()};
  if (!bf16_pack_b(f32_twin(s), &job, 1, 1)) return false;
  o.read_b = base->in_place ? static_cast<const void*>(o.b.data()) : o.packed.data();
  return true;
}

// Whether the m-row tile primitive of this shape gives rows [0, m) and [64 - m, 64) of a 64-row tile
// the bits the 64-row primitive gives them, on random operands packed as the products read them; none
// where a reorder or product could not run (oneDNN reports those, e.g. out of memory, as failures).
std::optional<bool> short_packed_tile_matches(const Bf16Shape& s, std::int64_t m) {
  const TilePrimitive* tall = tile_primitive(s, false);
  if (tall->in_place) return false;
  const TilePrimitive* low = tile_primitive(s, false, m);
  if (low->pd.weights_desc() != tall->pd.weights_desc()) return false;
  ProbeOperands o;
  if (!make_probe_operands(s, tall, 0x9E3779B9u, o)) return std::nullopt;
  const std::size_t c_size = static_cast<std::size_t>(kBf16TileRows * s.ldc);
  std::vector<float> want(c_size, 0.0f), got(c_size, 0.0f);
  const auto tall_tile = [&](std::int64_t) { return Tile{tall, o.a.data(), o.read_b, want.data()}; };
  if (!run_tiles(1, tall, tall, 1, tall_tile)) return std::nullopt;
  for (const std::int64_t r0 : {std::int64_t{0}, kBf16TileRows - m}) {
    const bool ran = run_tiles(1, low, low, 1, [&](std::int64_t) {
      return Tile{low, o.a.data() + r0 * s.lda, o.read_b, got.data() + r0 * s.ldc};
    });
    if (!ran) return std::nullopt;
    for (std::int64_t i = r0; i < r0 + m; ++i)
      if (std::memcmp(got.data() + i * s.ldc, want.data() + i * s.ldc, static_cast<std::size_t>(s.N) * 4))
        return false;
  }
  return true;
}

// Whether the bf16-C tile primitive of shape s (c_bf16) gives each element of a 64-row tile the fp32
// twin's sum rounded to nearest even, on random operands laid out as the products read them; none
// where a reorder or product could not run (as above).
std::optional<bool> bf16_c_tile_matches(const Bf16Shape& s) {
  const Bf16Shape twin = f32_twin(s);
  const TilePrimitive* f32 = tile_primitive(twin, false);
  const TilePrimitive* narrow = tile_primitive(s, false);
  if (narrow->pd.weights_desc() != f32->pd.weights_desc()) return false;
  ProbeOperands o;
  if (!make_probe_operands(s, f32, 0x7F4A7C15u, o)) return std::nullopt;
  std::vector<float> want(static_cast<std::size_t>(kBf16TileRows * twin.ldc), 0.0f);
  std::vector<std::uint16_t> got(static_cast<std::size_t>(kBf16TileRows * s.ldc), 0);
  if (!run_tiles(1, f32, f32, 1,
                 [&](std::int64_t) { return Tile{f32, o.a.data(), o.read_b, want.data()}; }) ||
      !run_tiles(1, narrow, narrow, 1,
                 [&](std::int64_t) { return Tile{narrow, o.a.data(), o.read_b, got.data()}; }))
    return std::nullopt;
  for (std::int64_t i = 0; i < kBf16TileRows; ++i) {
    const std::uint16_t* row = got.data() + i * s.ldc;
    const float* sums = want.data() + i * twin.ldc;
    for (std::int64_t j = 0; j < s.N; ++j)
      if (row[j] != f32_to_bf16(sums[j])) return false;
  }
  return true;
}

// A shape and a tile height.
using ProbeKey =
    std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool, std::int64_t>;

// The verdict of probe() for key, probed once per process (verdicts guarded by mu). A probe that could
// not run (none, or std::bad_alloc: out of memory) gives false this time and is probed again next
// time; one that threw anything else (dnnl::error, or only oneDNN's reference kernel) is false for good.
template <class Probe>
bool probed_once(std::mutex& mu, std::map<ProbeKey, bool>& verdicts, const ProbeKey& key, Probe&& probe) {
  const std::lock_guard<std::mutex> lock(mu);
  auto it = verdicts.find(key);
  if (it == verdicts.end()) {
    std::optional<bool> ok;
    try {
      ok = probe();
    } catch (const std::bad_alloc&) {  // ok stays empty
    } catch (const std::exception&) {
      ok = false;
    }
    if (!ok) return false;
    it = verdicts.emplace(key, *ok).first;
  }
  return it->second;
}

}  // namespace

bool gemm_bf16_two_parts(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a, const std::uint16_t* a2,
                         std::span<const Bf16Target> targets, bool accumulate, int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  if (s.c_bf16) return false;
  if (amx_own()) {
    amx_products(s, M, a, targets, accumulate, num_threads, a2);
    return true;
  }
  return gemm_bf16(s, M, a, targets, accumulate, num_threads) &&
         gemm_bf16(s, M, a2, targets, true, num_threads);
}

bool bf16_c_rounds_like_f32(const Bf16Shape& s) {
  if (!s.c_bf16 || !bf16_product_kernel()) return false;
  if (amx_own()) return true;  // the kernel rounds its fp32 sums with f32_to_bf16
  static std::mutex mu;
  static std::map<ProbeKey, bool> verdicts;
  const ProbeKey key{s.N, s.K, s.lda, s.ldc, s.ldb, s.b_transposed, kBf16TileRows};
  return probed_once(mu, verdicts, key, [&] { return bf16_c_tile_matches(s); });  // else: fp32 rows
}

std::int64_t bf16_packed_short_rows(const Bf16Shape& s, std::int64_t n) {
  if (n < 1 || n >= kBf16TileRows || !bf16_product_kernel()) return 0;
  const std::int64_t m = (n + kBf16ShortTileRows - 1) / kBf16ShortTileRows * kBf16ShortTileRows;
  if (amx_own()) return m;  // any height gives a row the same sums
  static std::mutex mu;
  static std::map<ProbeKey, bool> verdicts;
  const ProbeKey key{s.N, s.K, s.lda, s.ldc, s.ldb, s.b_transposed, m};
  // else: a whole 64-row tile
  return probed_once(mu, verdicts, key, [&] { return short_packed_tile_matches(s, m); }) ? m : 0;
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

ColumnTiles column_tiles(const Bf16Shape& s, bool accumulate, std::int64_t M) {
  const std::int64_t cols = tile_primitive(s, false)->in_place ? std::min(kBf16TileCols, s.N) : s.N;
  const TilePrimitive* full = tile_primitive(s, accumulate, M, cols);
  return {cols, full, s.N % cols ? tile_primitive(s, accumulate, M, s.N % cols) : full};
}

}  // namespace

bool bf16_short_rows_stable(const Bf16Shape& s, std::int64_t M) {
  if (M < 2) return false;
  if (amx_own()) return true;  // any M gives a row the same sums
  try {
    const TilePrimitive* base = tile_primitive(s, false);
    if (!base->in_place) return false;
    const auto jit = [](const TilePrimitive* t) {
      return std::strcmp(t->pd.impl_info_str(), "gemm:jit") == 0;
    };
    const ColumnTiles t = column_tiles(s, false, M);  // the tiles gemm_bf16_rows runs
    return jit(base) && jit(t.full) && jit(t.last);
  } catch (const std::exception&) {
    return false;
  }
}

bool gemm_bf16_rows(const Bf16Shape& s, std::int64_t M, const std::uint16_t* a,
                    std::span<const Bf16Target> targets, bool accumulate, int num_threads) {
  if (M <= 0 || s.N <= 0 || targets.empty()) return true;
  if (s.c_bf16) return false;
  if (amx_own()) {
    amx_products(s, M, a, targets, accumulate, num_threads);
    return true;
  }
  ColumnTiles t{};
  try {
    t = column_tiles(s, accumulate, M);
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

namespace {

// Whether gemm_rows_avx512_bf16 gives, for this K, the bits oneDNN's jit gemm gives (its K blocks and
// pairing were measured, not documented): 3 rows x 32 columns of values spread over 2^-8 .. 2^8, both
// ways, on this thread.
bool rows_kernel_matches_jit(std::int64_t K) {
  // C's rows strided as the projections' (two products side by side), which is what makes oneDNN take
  // its jit gemm here.
  constexpr std::int64_t M = 3, N = 32, ldc = 2 * N;
  const Bf16Shape probe{N, K, K, ldc, K, true};
  if (!bf16_short_rows_stable(probe, M)) return false;
  std::vector<std::uint16_t> a(static_cast<std::size_t>(M * K)), b(static_cast<std::size_t>(N * K));
  std::uint32_t state = 0x2545F491u + static_cast<std::uint32_t>(K);
  for (auto& v : a) v = next_probe_value(state);
  for (auto& v : b) v = next_probe_value(state);
  std::vector<float> want(static_cast<std::size_t>(M * ldc)), got(want.size());
  const Bf16Target t{b.data(), want.data()};
  if (!gemm_bf16_rows(probe, M, a.data(), {&t, 1}, false, 1)) return false;
  for (std::int64_t m = 1; m <= M; ++m) {  // the last m rows
    gemm_rows_avx512_bf16(m, N, K, a.data() + (M - m) * K, K, b.data(), K, got.data(), ldc);
    for (std::int64_t i = 0; i < m; ++i)
      if (std::memcmp(got.data() + i * ldc, want.data() + (M - m + i) * ldc, N * sizeof(float)) != 0)
        return false;
  }
  return true;
}

}  // namespace

bool bf16_rows_kernel_applicable(const Bf16Shape& s, std::int64_t M, bool panels) {
  if (M < 1 || (M > kRowsKernelMax && !panels) || !s.b_transposed || s.N % 16 != 0 || s.K < 1 ||
      !bf16_rows_kernel_available())
    return false;
  // Decided once per shape (a decode call's is the same every time): oneDNN's jit gemm reads this B in
  // place, and the kernel's order matches it for this K (checked once per K).
  static std::mutex mu;
  using ShapeKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t>;
  static std::map<ShapeKey, bool> shapes;
  static std::map<std::int64_t, bool> orders;  // K -> the kernel's order holds
  const std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(s.N, s.K, s.lda, s.ldc, s.ldb);
  if (const auto it = shapes.find(key); it != shapes.end()) return it->second;
  bool ok = bf16_short_rows_stable(s, 2);
  if (ok) {
    if (const auto it = orders.find(s.K); it != orders.end()) {
      ok = it->second;
    } else {
#pragma omp parallel num_threads(1)
      {
        omp_set_num_threads(1);
        ok = rows_kernel_matches_jit(s.K);
      }
      orders[s.K] = ok;
    }
  }
  return shapes[key] = ok;
}

bool bf16_decode_panels_wanted() {
  static const bool yes = [] {
    const char* v = std::getenv("KVCOMP_DECODE_PANELS");
    return bf16_rows_kernel_available() && (v == nullptr || v[0] != '0');
  }();
  return yes;
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
  const std::int64_t row_tiles = M <= kRowsKernelMax ? 1
                                                     : std::clamp<std::int64_t>(
                                                           (2 * std::int64_t{num_threads} + col_tiles - 1) /
                                                               col_tiles,
                                                           1, (M + 63) / 64);
  const std::int64_t rows = (M + row_tiles - 1) / row_tiles, tiles = col_tiles * row_tiles;
#pragma omp parallel for num_threads(static_cast<int>(std::clamp<std::int64_t>(num_threads, 1, tiles))) \
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
