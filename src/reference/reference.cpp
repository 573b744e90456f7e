// Plain reference of Compressor / CompressorGrad (spec 1.8 and 2.9).
//
// Deliberately naive: every step is its own loop nest over batches, blocks and
// slots, in the order the spec describes them, so that a reader can check it
// line by line against the spec. Speed is irrelevant here.
#include "reference/reference.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace kvcomp::ref {

namespace {

using i64 = std::int64_t;

i64 trunc_to(i64 v, i64 r) { return (v / r) * r; }  // v >= 0 everywhere it is used
i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }
std::size_t idx(i64 i) { return static_cast<std::size_t>(i); }

// The per-batch sequence facts of spec 0.2, read once.
struct Batch {
  i64 base = 0;   // flat row of local token 0
  i64 len = 0;    // tokens of the batch in x
  i64 sp = 0;     // start position
  i64 used = 0;   // seqused
  i64 limit = 0;  // trunc(sp + used, r)
};

Batch batch_info(const Problem& p, i64 b) {
  Batch bt;
  if (p.th) {
    bt.base = p.cu_seqlens[idx(b)];
    bt.len = p.cu_seqlens[idx(b + 1)] - p.cu_seqlens[idx(b)];
  } else {
    bt.base = b * p.S;
    bt.len = p.S;
  }
  bt.sp = p.start_pos.empty() ? 0 : p.start_pos[idx(b)];
  bt.used = p.seqused.empty() ? bt.len : p.seqused[idx(b)];
  bt.limit = trunc_to(bt.sp + bt.used, p.r);
  return bt;
}

// Number of compressed blocks of a batch (spec 1.4): blocks sp/r .. limit/r - 1.
i64 block_count(const Problem& p, const Batch& bt) {
  return bt.limit > bt.sp ? bt.limit / p.r - bt.sp / p.r : 0;
}

void check_problem(const Problem& p) {
  if (p.coff != 1 && p.coff != 2) throw std::invalid_argument("ref: coff must be 1 or 2");
  if (p.r < 1) throw std::invalid_argument("ref: r must be >= 1");
  if (p.th && static_cast<i64>(p.cu_seqlens.size()) != p.B + 1)
    throw std::invalid_argument("ref: TH needs B+1 cu_seqlens");
  if (!p.seqused.empty() && static_cast<i64>(p.seqused.size()) != p.B)
    throw std::invalid_argument("ref: seqused must have B entries");
  if (!p.start_pos.empty() && static_cast<i64>(p.start_pos.size()) != p.B)
    throw std::invalid_argument("ref: start_pos must have B entries");
}

void check_size(std::size_t have, i64 want, const char* what) {
  if (static_cast<i64>(have) != want) throw std::invalid_argument(std::string("ref: wrong size of ") + what);
}

// Element offset of the first float of the slot holding global position `pos`
// of batch b, or -1 when a mode-1 write must be skipped (block id 0). Reads
// pass for_write = false and so never skip (spec 1.3).
template <typename Real>
i64 slot_offset(const CacheState<Real>& cache, i64 b, i64 pos, i64 C, bool for_write) {
  i64 blk = 0;
  if (cache.cache_mode == 1) {
    const i64 col = pos / cache.block_size;
    if (col >= cache.table_cols) throw std::out_of_range("ref: position beyond the block table");
    blk = cache.block_table[idx(b * cache.table_cols + col)];
    if (for_write && blk == 0) return -1;
  } else {
    blk = cache.block_table[idx(b)];
  }
  if (blk < 0 || blk >= cache.block_num) throw std::out_of_range("ref: block id out of range");
  const i64 off = pos % cache.block_size;
  return (blk * cache.block_size + off) * 2 * C;
}

// Flushes exp results below FLT_MIN for the fp32 "same" golden (spec 1.6 /
// 6.3); float64 keeps them since it is the truth.
template <typename Real>
Real flushed_exp(Real v) {
  const Real e = std::exp(v);
  if constexpr (std::is_same_v<Real, float>) {
    if (e < std::numeric_limits<float>::min()) return 0.0f;
  }
  return e;
}

}  // namespace

std::int64_t Problem::out_rows() const {
  if (r < 1) return 0;
  if (th) return std::min(T, T / r + B);
  return B * ceil_div(S, r);
}

template <typename Real>
ForwardOutputs<Real> forward(const Problem& p, ForwardInputs<Real>& in) {
  check_problem(p);
  const i64 rows = p.rows(), H = p.H, D = p.D, C = p.C(), r = p.r, coff = p.coff;
  const i64 nrow = p.block_rows();
  const i64 out_rows = p.out_rows();
  const i64 per_batch_bsh = ceil_div(p.S, r);
  check_size(in.x.size(), rows * H, "x");
  check_size(in.wkv.size(), C * H, "wkv");
  const bool gate = !in.wgate.empty();  // empty: no gate projection, every score 0 (+ ape)
  if (gate) check_size(in.wgate.size(), C * H, "wgate");
  if (!in.ape.empty()) check_size(in.ape.size(), r * C, "ape");  // empty: no APE term
  check_size(in.cache.data.size(), in.cache.block_num * in.cache.block_size * 2 * C, "state cache");

  ForwardOutputs<Real> out;
  out.cmp_kv.assign(idx(out_rows * D), Real(0));
  out.softmax_score.assign(idx(out_rows * nrow * D), Real(0));
  out.kv.assign(idx(out_rows * nrow * D), Real(0));
  out.valid.assign(idx(out_rows), 0);
  out.position.assign(idx(out_rows), -1);

  // Projections for every row (spec 1.1); rows beyond seqused are computed but never used.
  std::vector<Real> new_kv(idx(rows * C), Real(0)), new_score(idx(rows * C), Real(0));
  for (i64 i = 0; i < rows; ++i) {
    for (i64 c = 0; c < C; ++c) {
      Real skv = 0, sg = 0;
      for (i64 h = 0; h < H; ++h) {
        skv += in.x[idx(i * H + h)] * in.wkv[idx(c * H + h)];
        if (gate) sg += in.x[idx(i * H + h)] * in.wgate[idx(c * H + h)];
      }
      new_kv[idx(i * C + c)] = skv;
      new_score[idx(i * C + c)] = sg;
    }
  }

  CacheState<Real>& cache = in.cache;
  i64 th_row = 0;  // TH: blocks of all batches are packed in batch order
  for (i64 b = 0; b < p.B; ++b) {
    const Batch bt = batch_info(p, b);

    // APE (spec 1.2), only on tokens that are used.
    for (i64 s = 0; s < bt.used && !in.ape.empty(); ++s) {
      const i64 t = (bt.sp + s) % r;
      for (i64 c = 0; c < C; ++c) new_score[idx((bt.base + s) * C + c)] += in.ape[idx(t * C + c)];
    }

    // Cache writes (spec 1.3), before this batch's block reads.
    const i64 ring_from = bt.limit - (coff - 1) * r;
    for (i64 s = 0; s < bt.used; ++s) {
      const i64 pos = bt.sp + s;
      if (cache.cache_mode == 2 && pos < ring_from) continue;
      const i64 off = slot_offset(cache, b, pos, C, /*for_write=*/true);
      if (off < 0) continue;
      for (i64 c = 0; c < C; ++c) {
        cache.data[idx(off + c)] = new_kv[idx((bt.base + s) * C + c)];
        cache.data[idx(off + C + c)] = new_score[idx((bt.base + s) * C + c)];
      }
    }

    // Blocks (spec 1.4 - 1.7).
    const i64 nb = block_count(p, bt);
    for (i64 i = 0; i < nb; ++i) {
      const i64 k = bt.sp / r + i;
      const i64 orow = p.th ? th_row++ : b * per_batch_bsh + i;
      if (orow >= out_rows) throw std::out_of_range("ref: more blocks than output rows");
      std::vector<Real> K(idx(nrow * D), Real(0)), Z(idx(nrow * D), Real(0));
      std::vector<std::uint8_t> placeholder(idx(nrow), 0);
      for (i64 t = 0; t < r; ++t) {
        for (i64 c = 0; c < coff; ++c) {  // c = coff-1 is the cur half, c = 0 (coff 2) the prev half
          const i64 pos = k * r + t - (coff - 1 - c) * r;
          const i64 j = t * coff + c;  // interleaved row
          if (pos < 0) {
            placeholder[idx(j)] = 1;
            continue;
          }
          for (i64 d = 0; d < D; ++d) {
            if (pos < bt.sp) {
              const i64 off = slot_offset(cache, b, pos, C, /*for_write=*/false);
              K[idx(j * D + d)] = cache.data[idx(off + c * D + d)];
              Z[idx(j * D + d)] = cache.data[idx(off + C + c * D + d)];
            } else {
              const i64 row = bt.base + (pos - bt.sp);
              K[idx(j * D + d)] = new_kv[idx(row * C + c * D + d)];
              Z[idx(j * D + d)] = new_score[idx(row * C + c * D + d)];
            }
          }
        }
      }

      // Column softmax over the non-placeholder rows, then the weighted sum (spec 1.6).
      Real* S_out = &out.softmax_score[idx(orow * nrow * D)];
      Real* K_out = &out.kv[idx(orow * nrow * D)];
      for (i64 d = 0; d < D; ++d) {
        Real zmax = -std::numeric_limits<Real>::infinity();
        for (i64 j = 0; j < nrow; ++j)
          if (!placeholder[idx(j)]) zmax = std::max(zmax, Z[idx(j * D + d)]);
        Real denom = 0;
        for (i64 j = 0; j < nrow; ++j)
          if (!placeholder[idx(j)]) denom += flushed_exp(Z[idx(j * D + d)] - zmax);
        Real acc = 0;
        for (i64 j = 0; j < nrow; ++j) {
          const Real w = placeholder[idx(j)] ? Real(0) : flushed_exp(Z[idx(j * D + d)] - zmax) / denom;
          S_out[idx(j * D + d)] = w;
          K_out[idx(j * D + d)] = K[idx(j * D + d)];
          acc += w * K[idx(j * D + d)];
        }
        out.cmp_kv[idx(orow * D + d)] = acc;
      }
      out.valid[idx(orow)] = 1;
      out.position[idx(orow)] = k * r;
    }
  }
  return out;
}

template <typename Real>
BackwardOutputs<Real> backward(const Problem& p, const BackwardInputs<Real>& in,
                               const std::function<Real(Real)>& round_dnew) {
  check_problem(p);
  const i64 rows = p.rows(), H = p.H, D = p.D, C = p.C(), r = p.r, coff = p.coff;
  const i64 nrow = p.block_rows();
  const i64 out_rows = p.out_rows();
  const i64 per_batch_bsh = ceil_div(p.S, r);
  check_size(in.x.size(), rows * H, "x");
  check_size(in.wkv.size(), C * H, "wkv");
  const bool gate = !in.wgate.empty();  // empty: no gate projection (forward), no d_wgate
  if (gate) check_size(in.wgate.size(), C * H, "wgate");
  check_size(in.d_cmp_kv.size(), out_rows * D, "d_cmp_kv");
  check_size(in.softmax_score.size(), out_rows * nrow * D, "softmax_score");
  check_size(in.kv.size(), out_rows * nrow * D, "kv");

  BackwardOutputs<Real> out;
  out.d_x.assign(idx(rows * H), Real(0));
  out.d_wkv.assign(idx(C * H), Real(0));
  if (gate) out.d_wgate.assign(idx(C * H), Real(0));
  out.d_ape.assign(idx(r * C), Real(0));

  std::vector<Real> d_new_kv(idx(rows * C), Real(0)), d_new_score(idx(rows * C), Real(0));
  std::vector<Real> dK(idx(nrow * D)), dZ(idx(nrow * D));
  i64 th_row = 0;
  for (i64 b = 0; b < p.B; ++b) {
    const Batch bt = batch_info(p, b);
    const i64 nb = block_count(p, bt);
    for (i64 i = 0; i < nb; ++i) {
      const i64 k = bt.sp / r + i;
      const i64 orow = p.th ? th_row++ : b * per_batch_bsh + i;
      if (orow >= out_rows) throw std::out_of_range("ref: more blocks than output rows");
      const Real* dC = &in.d_cmp_kv[idx(orow * D)];
      const Real* S = &in.softmax_score[idx(orow * nrow * D)];
      const Real* K = &in.kv[idx(orow * nrow * D)];

      // Spec 2.2 in its textbook form: dK = dC*S, dZ = S*(dC*K - sum_rows(S*dC*K)).
      for (i64 d = 0; d < D; ++d) {
        Real sum = 0;
        for (i64 j = 0; j < nrow; ++j) sum += S[j * D + d] * dC[d] * K[j * D + d];
        for (i64 j = 0; j < nrow; ++j) {
          dK[idx(j * D + d)] = dC[d] * S[j * D + d];
          dZ[idx(j * D + d)] = S[j * D + d] * (dC[d] * K[j * D + d] - sum);
        }
      }

      // Routing (spec 2.3 - 2.5): rows read from the cache or placeholders are dropped.
      for (i64 t = 0; t < r; ++t) {
        for (i64 c = 0; c < coff; ++c) {
          const i64 pos = k * r + t - (coff - 1 - c) * r;
          if (pos < bt.sp) continue;
          const i64 j = t * coff + c;
          const i64 row = bt.base + (pos - bt.sp);
          for (i64 d = 0; d < D; ++d) {
            d_new_kv[idx(row * C + c * D + d)] += dK[idx(j * D + d)];
            d_new_score[idx(row * C + c * D + d)] += dZ[idx(j * D + d)];
            out.d_ape[idx(t * C + c * D + d)] += dZ[idx(j * D + d)];
          }
        }
      }
    }
  }

  if (round_dnew) {
    for (Real& v : d_new_kv) v = round_dnew(v);
    for (Real& v : d_new_score) v = round_dnew(v);
  }

  // Matmul backward (spec 2.6).
  for (i64 i = 0; i < rows; ++i) {
    for (i64 h = 0; h < H; ++h) {
      // Two separate products then one add, as the spec writes it (and as the fp32 golden rounds).
      Real akv = 0, ag = 0;
      for (i64 c = 0; c < C; ++c) {
        akv += d_new_kv[idx(i * C + c)] * in.wkv[idx(c * H + h)];
        if (gate) ag += d_new_score[idx(i * C + c)] * in.wgate[idx(c * H + h)];
      }
      out.d_x[idx(i * H + h)] = akv + ag;
    }
  }
  for (i64 c = 0; c < C; ++c) {
    for (i64 h = 0; h < H; ++h) {
      Real akv = 0, ag = 0;
      for (i64 i = 0; i < rows; ++i) {
        akv += d_new_kv[idx(i * C + c)] * in.x[idx(i * H + h)];
        ag += d_new_score[idx(i * C + c)] * in.x[idx(i * H + h)];
      }
      out.d_wkv[idx(c * H + h)] = akv;
      if (gate) out.d_wgate[idx(c * H + h)] = ag;
    }
  }
  return out;
}

template <typename Real>
void epilogue_forward(const Problem& p, const Epilogue<Real>& e, const std::vector<std::int64_t>& position,
                      std::vector<Real>& rows) {
  const i64 D = p.D, from = D - 2 * e.pairs;
  const auto rnd = [&](Real v) { return e.round ? e.round(v) : v; };
  for (i64 row = 0; row < static_cast<i64>(position.size()); ++row) {
    const i64 pos = position[idx(row)];
    if (pos < 0) continue;
    Real* y = &rows[idx(row * D)];
    for (i64 i = 0; i < D; ++i) y[i] = rnd(y[i]);  // the pooled row in the io dtype
    if (!e.norm_weight.empty()) {
      Real ss = 0;
      for (i64 i = 0; i < D; ++i) ss += y[i] * y[i];
      const Real rstd = Real(1) / std::sqrt(ss / static_cast<Real>(D) + e.eps);
      for (i64 i = 0; i < D; ++i) y[i] = rnd(e.norm_weight[idx(i)] * (y[i] * rstd));
    }
    for (i64 q = 0; q < e.pairs; ++q) {
      const Real c = e.cos[idx(pos * e.pairs + q)], s = e.sin[idx(pos * e.pairs + q)];
      const Real a = y[from + 2 * q], b = y[from + 2 * q + 1];
      y[from + 2 * q] = rnd(a * c - b * s);
      y[from + 2 * q + 1] = rnd(a * s + b * c);
    }
  }
}

template <typename Real>
void epilogue_backward(const Problem& p, const Epilogue<Real>& e, const std::vector<std::int64_t>& position,
                       const std::vector<Real>& pooled, std::vector<Real>& d_rows,
                       std::vector<Real>* d_norm_weight) {
  const i64 D = p.D, from = D - 2 * e.pairs;
  if (d_norm_weight) d_norm_weight->assign(idx(D), Real(0));
  for (i64 row = 0; row < static_cast<i64>(position.size()); ++row) {
    const i64 pos = position[idx(row)];
    Real* g = &d_rows[idx(row * D)];
    if (pos < 0) {
      std::fill(g, g + D, Real(0));
      continue;
    }
    // The transpose of the rotation.
    for (i64 q = 0; q < e.pairs; ++q) {
      const Real c = e.cos[idx(pos * e.pairs + q)], s = e.sin[idx(pos * e.pairs + q)];
      const Real ga = g[from + 2 * q], gb = g[from + 2 * q + 1];
      g[from + 2 * q] = ga * c + gb * s;
      g[from + 2 * q + 1] = gb * c - ga * s;
    }
    if (e.norm_weight.empty()) continue;
    // y_i = w_i * x_i * rstd: dx_i = rstd * (w_i g_i) - x_i * rstd^3 * mean_j(w_j g_j x_j); dw_i = g_i x_i
    // rstd.
    const Real* x = &pooled[idx(row * D)];
    Real ss = 0;
    for (i64 i = 0; i < D; ++i) ss += x[i] * x[i];
    const Real rstd = Real(1) / std::sqrt(ss / static_cast<Real>(D) + e.eps);
    Real m = 0;
    for (i64 i = 0; i < D; ++i) m += e.norm_weight[idx(i)] * g[i] * x[i];
    m /= static_cast<Real>(D);
    for (i64 i = 0; i < D; ++i) {
      if (d_norm_weight) (*d_norm_weight)[idx(i)] += g[i] * x[i] * rstd;
      g[i] = rstd * e.norm_weight[idx(i)] * g[i] - x[i] * rstd * rstd * rstd * m;
    }
  }
}

template void epilogue_forward<double>(const Problem&, const Epilogue<double>&,
                                       const std::vector<std::int64_t>&, std::vector<double>&);
template void epilogue_backward<double>(const Problem&, const Epilogue<double>&,
                                        const std::vector<std::int64_t>&, const std::vector<double>&,
                                        std::vector<double>&, std::vector<double>*);

template ForwardOutputs<double> forward<double>(const Problem&, ForwardInputs<double>&);
template ForwardOutputs<float> forward<float>(const Problem&, ForwardInputs<float>&);
template BackwardOutputs<double> backward<double>(const Problem&, const BackwardInputs<double>&,
                                                  const std::function<double(double)>&);
template BackwardOutputs<float> backward<float>(const Problem&, const BackwardInputs<float>&,
                                                const std::function<float(float)>&);

}  // namespace kvcomp::ref
