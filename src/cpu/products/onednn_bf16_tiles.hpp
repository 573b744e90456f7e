// The tiles of the bf16 products on oneDNN's matmul, shared by the products (onednn_bf16.cpp) and the
// probes that check their orders (order_probes.cpp). Internal to src/cpu/products.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <oneapi/dnnl/dnnl.hpp>

#include "cpu/products/onednn_bf16.hpp"

namespace kvcomp::detail {

dnnl::engine& bf16_engine();

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

// The shape with an fp32 C: the one whose primitive chooses B's layout for both.
inline Bf16Shape f32_twin(Bf16Shape s) {
  s.c_bf16 = false;
  return s;
}

// The tile primitive of shape s with `rows` rows (kBf16TileRows by default) and `cols` columns (all N by
// default), with the sum post-op when it accumulates; `packed`: Bf16Kernels::packed. Cached for the
// process. Throws dnnl::error (oneDNN makes no such primitive, or only its reference kernel outside the
// packed test mode) or std::bad_alloc.
TilePrimitive* tile_primitive(bool packed, const Bf16Shape& s, bool accumulate,
                              std::int64_t rows = kBf16TileRows, std::int64_t cols = -1);

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
inline bool run_tiles(std::int64_t tiles, const TilePrimitive* full, const TilePrimitive* last,
                      int num_threads, TileOf&& tile_of) {
  const std::size_t scratch_bytes =
      std::max(full->pd.scratchpad_desc().get_size(), last->pd.scratchpad_desc().get_size());
  std::atomic<bool> ok{true};
  const int threads = static_cast<int>(std::min<std::int64_t>(std::max(num_threads, 1), tiles));
#pragma omp parallel num_threads(threads)
  {
    omp_set_num_threads(1);  // this implicit task's limit only: oneDNN runs the tile on this thread
    try {
      dnnl::stream st(bf16_engine());
      // The primitive's own work memory, per thread (scratchpad_mode::user: nothing shared).
      std::unique_ptr<unsigned char[]> scratch(scratch_bytes ? new unsigned char[scratch_bytes] : nullptr);
      for (std::int64_t i = omp_get_thread_num(); i < tiles; i += omp_get_num_threads()) {
        const Tile x = tile_of(i);
        const auto& pd = x.t->pd;
        dnnl::memory sp(pd.scratchpad_desc(), bf16_engine(), scratch.get());
        dnnl::memory am(pd.src_desc(), bf16_engine(), const_cast<std::uint16_t*>(x.a));
        dnnl::memory wm(pd.weights_desc(), bf16_engine(), const_cast<void*>(x.b));
        dnnl::memory cm(pd.dst_desc(), bf16_engine(), x.c);
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

}  // namespace kvcomp::detail
