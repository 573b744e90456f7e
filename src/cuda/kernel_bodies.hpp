// The element-wise phases of the CUDA backend, one function per thread of
// each kernel (cuda/kernels.cu launches them; the host emulation of the
// drivers in tests/cuda calls them in loops, so their logic is tested on any
// machine). The same formulas in the same order per element as the CPU
// backend (cpu/block_phases.cpp with cpu/simd/body.inl; both round through
// common/numerics.hpp). Include only from files compiled without
// multiply-add contraction (nvcc --fmad=false, g++ -ffp-contract=off).
#pragma once

#include <cstdint>

#include "common/numerics.hpp"
#include "cuda/kernels.hpp"

namespace kvcomp::detail::cuda::body {

using i64 = std::int64_t;

KVCOMP_HD float load_io(const void* p, i64 i, DType io) {
  switch (io) {
    case DType::bf16:
      return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::f16:
      return fp16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    default:
      return static_cast<const float*>(p)[i];
  }
}

KVCOMP_HD void store_io(void* p, i64 i, DType io, float v) {
  switch (io) {
    case DType::bf16:
      static_cast<std::uint16_t*>(p)[i] = f32_to_bf16(v);
      break;
    case DType::f16:
      static_cast<std::uint16_t*>(p)[i] = f32_to_fp16(v);
      break;
    default:
      static_cast<float*>(p)[i] = v;
  }
}

// v rounded to io and back.
KVCOMP_HD float round_to(float v, DType io) {
  switch (io) {
    case DType::bf16:
      return round_io<DType::bf16>(v);
    case DType::f16:
      return round_io<DType::f16>(v);
    default:
      return v;
  }
}

// The batch owning flat row `row`: the first whose rows reach past it (B if none).
KVCOMP_HD i64 find_batch(const Geometry& g, i64 row) {
  i64 lo = 0, hi = g.B;
  while (lo < hi) {
    const i64 mid = (lo + hi) / 2;
    if (g.batches[mid].base + g.batches[mid].len <= row)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

// Whether row gets gradient: a token inside its batch's compressed region.
KVCOMP_HD bool row_has_grad(const Geometry& g, i64 row) {
  const i64 b = find_batch(g, row);
  if (b >= g.B) return false;
  const DevBatch& s = g.batches[b];
  const i64 tok = row - s.base;
  return tok >= 0 && tok < s.len && tok < s.limit - s.sp;
}

// Cache block of position pos of batch b. Ids are clamped to the cache, so
// even a table changed after planning cannot send a thread outside it.
KVCOMP_HD i64 cache_block(const ForwardKernelArgs& p, i64 b, i64 pos) {
  const i64 id = p.cache_mode == 1 ? p.table[b * p.table_cols + pos / p.block_size] : p.table[b];
  return id < 0 ? 0 : (id >= p.block_num ? p.block_num - 1 : id);
}

// Where slot j of block k (batch b) comes from, for column d.
struct SlotSource {
  const float* kv = nullptr;  // null: a placeholder (no history), weight exactly 0
  const float* sc = nullptr;
  const float* ape =
      nullptr;  // fresh rows: the ape to add to the score (null without APE); cache rows hold it
};

KVCOMP_HD SlotSource slot_source(const ForwardKernelArgs& p, const DevBatch& s, i64 b, i64 k, i64 j, i64 d) {
  const Geometry& g = p.g;
  const i64 t = j / g.coff, c = j % g.coff;
  const i64 pos = k * g.r + t - (g.coff - 1 - c) * g.r;
  SlotSource src;
  if (pos < 0) return src;
  if (pos < s.sp) {
    const float* slot = p.cache + cache_block(p, b, pos) * p.cache_stride0 + (pos % p.block_size) * 2 * g.C;
    src.kv = slot + c * g.D + d;
    src.sc = slot + g.C + c * g.D + d;
    return src;
  }
  const float* row = p.panel + (s.base + pos - s.sp - p.panel_first) * p.panel_ld;
  src.kv = row + c * g.D + d;
  src.sc = row + g.C + c * g.D + d;
  if (p.ape) src.ape = p.ape + (pos % g.r) * g.C + c * g.D + d;  // else a call without APE
  return src;
}

KVCOMP_HD float score_of(const SlotSource& src) { return src.ape ? *src.sc + *src.ape : *src.sc; }

// Block blk, column d.
KVCOMP_HD void forward_block(const ForwardKernelArgs& p, i64 blk, i64 d) {
  const Geometry& g = p.g;
  if (d >= g.D) return;
  const i64 b = g.block_batch[blk];
  const DevBatch s = g.batches[b];
  const i64 k = s.k0 + (blk - s.first_block);
  const i64 orow = s.out_row + (k - s.k0);
  const i64 cr = g.coff * g.r;
  // Three passes over the rows of the block (max, sum, weights), each in row
  // order, with the CPU kernel's operations: exp is recomputed in the third
  // pass rather than stored (the same function of the same value).
  double mx = -u2d(0x7ff0000000000000ull);  // -inf
  for (i64 j = 0; j < cr; ++j) {
    const SlotSource src = slot_source(p, s, b, k, j, d);
    if (!src.kv) continue;
    const double v = score_of(src);
    mx = v > mx ? v : mx;  // NaN never wins (as fmax)
  }
  double sum = 0.0;
  for (i64 j = 0; j < cr; ++j) {
    const SlotSource src = slot_source(p, s, b, k, j, d);
    if (!src.kv) continue;
    sum += exp_nonpositive(static_cast<double>(score_of(src)) - mx);
  }
  const double inv = 1.0 / sum;
  double out = 0.0;
  float* s_out = p.softmax_score ? p.softmax_score + orow * cr * g.D + d : nullptr;
  float* k_out = p.kv ? p.kv + orow * cr * g.D + d : nullptr;
  for (i64 j = 0; j < cr; ++j) {
    const SlotSource src = slot_source(p, s, b, k, j, d);
    if (!src.kv) {
      if (s_out) s_out[j * g.D] = 0.0f;
      if (k_out) k_out[j * g.D] = 0.0f;
      continue;
    }
    const double sj = exp_nonpositive(static_cast<double>(score_of(src)) - mx) * inv;
    const float kv = *src.kv;
    out += sj * static_cast<double>(kv);
    if (s_out) s_out[j * g.D] = static_cast<float>(sj);
    if (k_out) k_out[j * g.D] = kv;
  }
  store_io(p.cmp_kv, orow * g.D + d, g.io, static_cast<float>(out));
}

// Token row `row`, column col of 2C.
KVCOMP_HD void cache_write(const ForwardKernelArgs& p, i64 row, i64 col) {
  const Geometry& g = p.g;
  if (col >= 2 * g.C) return;
  const i64 b = find_batch(g, row);
  if (b >= g.B) return;
  const DevBatch& s = g.batches[b];
  const i64 tok = row - s.base;
  if (tok < 0 || tok >= s.used) return;  // tokens past seqused are never written
  const i64 pos = s.sp + tok;
  const i64 ring_from = s.limit - (g.coff - 1) * g.r;
  const i64 write_from = p.cache_mode == 1 ? s.sp : (ring_from > s.sp ? ring_from : s.sp);
  if (pos < write_from) return;
  if (p.cache_mode == 1 && p.table[b * p.table_cols + pos / p.block_size] == 0) return;  // id 0: do not write
  const i64 id = cache_block(p, b, pos);
  if (p.cache_mode == 1 && p.last_writer_only) {
    // Positions sharing this slot sit whole blocks apart; the last written
    // one wins (the CPU writes in position order). Ring mode never wraps
    // inside one call (block_size >= coff*r + S - 1).
    for (i64 q = pos + p.block_size; q < s.sp + s.used; q += p.block_size) {
      const i64 raw = p.table[b * p.table_cols + q / p.block_size];
      if (raw != 0 && cache_block(p, b, q) == id) return;
    }
  }
  float* slot = p.cache + id * p.cache_stride0 + (pos % p.block_size) * 2 * g.C;
  const float* src = p.panel + (row - p.panel_first) * p.panel_ld;
  float v = src[col];
  if (col >= g.C && p.ape) v = v + p.ape[(pos % g.r) * g.C + (col - g.C)];
  slot[col] = v;
}

// Output row `row`, column d.
KVCOMP_HD void zero_padding(const ForwardKernelArgs& p, i64 row, i64 d) {
  const Geometry& g = p.g;
  if (d >= g.D) return;
  const bool pad =
      p.bsh_rows > 0 ? row % p.bsh_rows >= g.batches[row / p.bsh_rows].nblocks : row >= p.total_blocks;
  if (!pad) return;
  store_io(p.cmp_kv, row * g.D + d, g.io, 0.0f);
  const i64 cr = g.coff * g.r;
  for (i64 j = 0; j < cr; ++j) {
    if (p.softmax_score) p.softmax_score[(row * cr + j) * g.D + d] = 0.0f;
    if (p.kv) p.kv[(row * cr + j) * g.D + d] = 0.0f;
  }
}

KVCOMP_HD void store_dnew(const BackwardKernelArgs& p, i64 at, float v) {
  switch (p.mode) {
    case BackwardPath::f32:
      static_cast<float*>(p.dnew_hi)[at] = v;
      break;
    case BackwardPath::f32_rounded:  // the CPU's npu_parity on fp32 products (on the GPU: fp32 io only)
      static_cast<float*>(p.dnew_hi)[at] = round_to(v, p.g.io);
      break;
    case BackwardPath::parity16:
      store_io(p.dnew_hi, at, p.g.io, v);
      break;
    case BackwardPath::precise16: {
      // v = hi + lo / lo_scale: hi is v rounded to io, the difference is exact
      // in fp32 and the power-of-two scale keeps lo's 16-bit mantissa clear of
      // the subnormal range. Where hi overflows to +-inf (fp16 from |v| >=
      // 65520; v infinite) lo is 0, not -+inf, so the products give the
      // overflow's inf, as npu_parity does, rather than inf - inf = NaN.
      const float hi = round_to(v, p.g.io);
      const bool hi_inf = (f2u(hi) & 0x7fffffffu) == 0x7f800000u;  // NaN stays NaN in both parts
      store_io(p.dnew_hi, at, p.g.io, hi);
      store_io(p.dnew_lo, at, p.g.io, hi_inf ? 0.0f : (v - hi) * p.lo_scale);
      break;
    }
  }
}

// Block blk (the g_lo-th is the chunk's first), column d, for the chunk rows [a, b_end).
KVCOMP_HD void backward_block(const BackwardKernelArgs& p, i64 g_lo, i64 blk, i64 d, i64 a, i64 b_end) {
  const Geometry& g = p.g;
  if (d >= g.D) return;
  const DevBatch s = g.batches[g.block_batch[blk]];
  const i64 k = s.k0 + (blk - s.first_block);
  const i64 orow = s.out_row + (k - s.k0);
  const i64 cr = g.coff * g.r;
  const float* S = p.softmax_score + orow * cr * g.D + d;
  const float* K = p.kv + orow * cr * g.D + d;
  const float dc = load_io(p.d_cmp_kv, orow * g.D + d, p.d_cmp_dtype);
  // w = sum_j S_j K_j over every row of the block, in float64 (each product exact).
  double wsum = 0.0;
  for (i64 j = 0; j < cr; ++j) wsum += static_cast<double>(S[j * g.D]) * static_cast<double>(K[j * g.D]);
  // The tokens of this batch inside the chunk that get gradient.
  const i64 lo = (a > s.base ? a : s.base) - s.base;
  i64 hi = (b_end < s.base + s.len ? b_end : s.base + s.len) - s.base;
  hi = hi < s.limit - s.sp ? hi : s.limit - s.sp;
  double* part = p.partials + (blk - g_lo) * g.r * g.C + d;
  for (i64 t = 0; t < g.r; ++t) {
    for (i64 c = 0; c < g.coff; ++c) {
      const i64 pos = k * g.r + t - (g.coff - 1 - c) * g.r;
      const i64 tok = pos - s.sp;
      double dz = 0.0;
      if (pos >= s.sp && tok >= lo && tok < hi) {  // cache rows and other chunks' tokens: nothing here
        const i64 j = t * g.coff + c;
        const float sv = S[j * g.D];
        dz = static_cast<double>(sv) * static_cast<double>(dc) * (static_cast<double>(K[j * g.D]) - wsum);
        const float dk = dc * sv;
        const float dzf = static_cast<float>(dz);
        const i64 at = (s.base + tok - a) * p.dnew_ld + c * g.D + d;
        store_dnew(p, at, dk);  // parity16 rounds to io here, as the CPU's npu_parity does
        store_dnew(p, at + g.C, dzf);
      }
      part[t * g.C + c * g.D] = dz;
    }
  }
}

// Element i of d_ape.
// The sum runs block after block (the CPU's order: d_ape is the CPU's, bit
// for bit), but the loads of 8 blocks are issued before their adds, so a
// thread has 8 reads in flight instead of one (the kernel is bound by the
// latency of ~1000 dependent block reads per chunk, not by bandwidth).
KVCOMP_HD void dape_accumulate(const double* partials, i64 blocks, i64 n, double* dape, i64 i) {
  if (i >= n) return;
  constexpr i64 kBatch = 8;
  double acc = dape[i];
  i64 blk = 0;
  for (; blk + kBatch <= blocks; blk += kBatch) {
    double v[kBatch];
    for (i64 j = 0; j < kBatch; ++j) v[j] = partials[(blk + j) * n + i];
    for (i64 j = 0; j < kBatch; ++j) acc += v[j];
  }
  for (; blk < blocks; ++blk) acc += partials[blk * n + i];
  dape[i] = acc;
}

// Row i of the chunk starting at row a, column h.
KVCOMP_HD void gradient_row(const Geometry& g, const void* src, bool src_f32, void* dst, i64 a, i64 H, i64 i,
                            i64 h) {
  if (h >= H) return;
  const i64 at = i * H + h;
  const bool keep = row_has_grad(g, a + i);
  if (src_f32) {
    store_io(dst, at, g.io, keep ? static_cast<const float*>(src)[at] : 0.0f);
  } else if (g.io == DType::f32) {
    static_cast<float*>(dst)[at] = keep ? static_cast<const float*>(src)[at] : 0.0f;
  } else {
    static_cast<std::uint16_t*>(dst)[at] =
        keep ? static_cast<const std::uint16_t*>(src)[at] : std::uint16_t{0};
  }
}

// Element (i, j) of the plain product's D (cuBLAS's column-major terms):
// op(A)(i, p) op(B)(p, j) summed over p in order in fp32.
KVCOMP_HD void plain_gemm_element(const LtCall& c, i64 i, i64 j) {
  float acc = 0.0f;
  for (i64 p = 0; p < c.k; ++p) {
    const float a = load_io(c.a.data, c.trans_a ? p + i * c.a.ld : i + p * c.a.ld, c.a.type);
    const float b = load_io(c.b.data, c.trans_b ? j + p * c.b.ld : p + j * c.b.ld, c.b.type);
    acc = acc + a * b;
  }
  void* d = const_cast<void*>(c.d.data);
  const i64 at = i + j * c.d.ld;
  const float prev = c.beta != 0.0f ? load_io(d, at, c.d.type) : 0.0f;
  store_io(d, at, c.d.type, c.alpha * acc + c.beta * prev);
}

// Element i of a narrowing to io.
KVCOMP_HD void narrow(const float* src, void* dst, DType io, i64 i) { store_io(dst, i, io, src[i]); }

}  // namespace kvcomp::detail::cuda::body
