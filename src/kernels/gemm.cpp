#include "kernels/gemm.hpp"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <oneapi/dnnl/dnnl.hpp>
#include <vector>

namespace kvcomp::detail {

namespace {

// Tile sizes. Fixed constants: changing them changes the rounding of results
// (still deterministic), so they are part of the numerical contract of a
// release.
constexpr std::int64_t kTileM = 256;
constexpr std::int64_t kTileN = 256;

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

struct TilePrimitive {
  std::int64_t m = 0, n = 0;
  dnnl::memory::desc a_md, b_md, c_md;
  dnnl::matmul prim;
};

dnnl::memory::desc operand_desc(std::int64_t rows, std::int64_t cols, const GemmOperand& op, bool is_a) {
  // A is logically [rows=M, cols=K]; B is [rows=K, cols=N].
  // Not transposed: row-major with ld; transposed: column-major with ld.
  (void)is_a;
  const dnnl::memory::dims dims{rows, cols};
  const dnnl::memory::dims strides =
      op.transposed ? dnnl::memory::dims{1, op.ld} : dnnl::memory::dims{op.ld, 1};
  return dnnl::memory::desc(dims, dnnl::memory::data_type::f32, strides);
}

// Creates a matmul planned for exactly one thread: oneDNN sizes its internal
// parallel split by the calling thread's OpenMP thread limit at creation time.
TilePrimitive make_tile(std::int64_t m, std::int64_t n, std::int64_t k, const GemmOperand& a,
                        const GemmOperand& b, std::int64_t ldc, bool accumulate) {
  TilePrimitive t;
  t.m = m;
  t.n = n;
  t.a_md = operand_desc(m, k, a, true);
  t.b_md = operand_desc(k, n, b, false);
  t.c_md = dnnl::memory::desc({m, n}, dnnl::memory::data_type::f32, dnnl::memory::dims{ldc, 1});
  dnnl::primitive_attr attr;
  if (accumulate) {
    dnnl::post_ops po;
    po.append_sum(1.0f);
    attr.set_post_ops(po);
  }
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  try {
    dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(t.a_md, t.b_md, t.c_md), attr, cpu_engine());
    t.prim = dnnl::matmul(pd);
  } catch (...) {
    omp_set_num_threads(saved);
    throw;
  }
  omp_set_num_threads(saved);
  return t;
}

}  // namespace

bool gemm_f32(std::int64_t M, std::int64_t N, std::int64_t K, GemmOperand a, GemmOperand b, float* c,
              std::int64_t ldc, bool accumulate, int num_threads) {
  if (M <= 0 || N <= 0) return true;
  if (K <= 0) {
    if (!accumulate)
      for (std::int64_t i = 0; i < M; ++i) std::fill(c + i * ldc, c + i * ldc + N, 0.0f);
    return true;
  }
  const std::int64_t tiles_m = (M + kTileM - 1) / kTileM;
  const std::int64_t tiles_n = (N + kTileN - 1) / kTileN;
  // At most four distinct tile shapes: full/edge in each direction.
  std::vector<TilePrimitive> prims;
  try {
    for (std::int64_t mt : {std::min(kTileM, M), M - (tiles_m - 1) * kTileM})
      for (std::int64_t nt : {std::min(kTileN, N), N - (tiles_n - 1) * kTileN}) {
        const bool have = std::any_of(prims.begin(), prims.end(),
                                      [&](const TilePrimitive& p) { return p.m == mt && p.n == nt; });
        if (!have) prims.push_back(make_tile(mt, nt, K, a, b, ldc, accumulate));
      }
  } catch (const std::exception&) {
    return false;
  }
  std::atomic<bool> ok{true};
  const std::int64_t tiles = tiles_m * tiles_n;
#pragma omp parallel num_threads(num_threads) if (tiles > 1)
  {
    dnnl::stream stream(cpu_engine());
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t tile = 0; tile < tiles; ++tile) {
      const std::int64_t m0 = (tile / tiles_n) * kTileM;
      const std::int64_t n0 = (tile % tiles_n) * kTileN;
      const std::int64_t mt = std::min(kTileM, M - m0);
      const std::int64_t nt = std::min(kTileN, N - n0);
      const TilePrimitive* p = nullptr;
      for (const auto& cand : prims)
        if (cand.m == mt && cand.n == nt) p = &cand;
      const float* a_ptr = a.transposed ? a.ptr + m0 : a.ptr + m0 * a.ld;
      const float* b_ptr = b.transposed ? b.ptr + n0 * b.ld : b.ptr + n0;
      float* c_ptr = c + m0 * ldc + n0;
      try {
        dnnl::memory am(p->a_md, cpu_engine(), const_cast<float*>(a_ptr));
        dnnl::memory bm(p->b_md, cpu_engine(), const_cast<float*>(b_ptr));
        dnnl::memory cm(p->c_md, cpu_engine(), c_ptr);
        p->prim.execute(stream, {{DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}});
      } catch (const std::exception&) {
        ok = false;
      }
    }
    stream.wait();
  }
  return ok;
}

}  // namespace kvcomp::detail
