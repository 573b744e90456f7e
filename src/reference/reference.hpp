// The plain float64 reference ("oracle") of Compressor and CompressorGrad.
//
// Written straight from the behavioural spec (sections 1.8 and 2.9), with no
// tiling, no threads, no chunking, no clever numerics: one loop nest per step.
// It is templated on the scalar type so the same code also gives the fp32
// "same" golden of spec 6.2 (Real = float, with round_dnew set to the io-dtype
// rounding), which the three-way precision criterion (spec 7.2) needs.
//
// Everything is dense row-major std::vector<Real>; the state cache is
// contiguous.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace kvcomp::ref {

struct Problem {
  bool th = false;     // TH layout (x is [T,H] with cu_seqlens) else BSH ([B,S,H])
  std::int64_t B = 0;  // batches
  std::int64_t S = 0;  // BSH padded sequence length (ignored for TH)
  std::int64_t T = 0;  // TH total tokens (ignored for BSH; rows = B*S there)
  std::int64_t H = 0;
  std::int64_t D = 0;
  std::int64_t coff = 1;                 // 1 or 2
  std::int64_t r = 4;                    // cmp_ratio
  std::vector<std::int32_t> cu_seqlens;  // TH: B+1 entries
  std::vector<std::int32_t> seqused;     // empty: absent (= len_b)
  std::vector<std::int32_t> start_pos;   // empty: absent (= 0)

  std::int64_t C() const { return coff * D; }
  std::int64_t rows() const { return th ? T : B * S; }  // token rows of x
  std::int64_t out_rows() const;                        // rows of cmp_kv (flat: BSH B*ceil(S/r))
  std::int64_t block_rows() const { return coff * r; }
};

template <typename Real>
struct CacheState {
  std::int64_t block_num = 0;
  std::int64_t block_size = 0;
  int cache_mode = 1;                     // 1 paged, 2 ring
  std::vector<std::int32_t> block_table;  // mode 1: [B, table_cols]; mode 2: [B]
  std::int64_t table_cols = 0;            // mode 1 only
  std::vector<Real> data;                 // [block_num, block_size, 2*C]
};

template <typename Real>
struct ForwardInputs {
  std::vector<Real> x;      // [rows, H]
  std::vector<Real> wkv;    // [C, H]
  std::vector<Real> wgate;  // [C, H]; empty: no gate projection, every score 0 (+ ape)
  std::vector<Real> ape;    // [r, C]; empty: no APE term
  CacheState<Real> cache;   // updated in place by forward()
};

template <typename Real>
struct ForwardOutputs {
  std::vector<Real> cmp_kv;            // [out_rows, D]; padding rows 0
  std::vector<Real> softmax_score;     // [out_rows, coff*r, D]; interleaved rows; padding 0
  std::vector<Real> kv;                // same shape; raw assembled kv
  std::vector<std::uint8_t> valid;     // [out_rows]: 1 for rows holding a compressed block
  std::vector<std::int64_t> position;  // [out_rows]: the block's first token's position, k * r; -1: none
};

template <typename Real>
struct BackwardInputs {
  std::vector<Real> x, wkv, wgate;  // as forward
  std::vector<Real> d_cmp_kv;       // [out_rows, D]
  std::vector<Real> softmax_score;  // [out_rows, coff*r, D]
  std::vector<Real> kv;             // [out_rows, coff*r, D]
};

template <typename Real>
struct BackwardOutputs {
  std::vector<Real> d_x;      // [rows, H]
  std::vector<Real> d_wkv;    // [C, H]
  std::vector<Real> d_wgate;  // [C, H]; empty where wgate is
  std::vector<Real> d_ape;    // [r, C]
};

// Forward: updates in.cache.data in place (write rules of spec 1.3) and
// returns cmp_kv / softmax_score / kv. No io-dtype rounding is applied to
// cmp_kv (callers round if they need to).
template <typename Real>
ForwardOutputs<Real> forward(const Problem& p, ForwardInputs<Real>& in);

// Backward. round_dnew, if set, is applied to every element of d_new_kv and
// d_new_score before the matrix products (the "same" golden's io staging).
template <typename Real>
BackwardOutputs<Real> backward(const Problem& p, const BackwardInputs<Real>& in,
                               const std::function<Real(Real)>& round_dnew = {});

// The model-level epilogue (kvcomp.hpp's Epilogue), on rows [out_rows, D] of a forward's cmp_kv, in
// place: each row holding a block (position >= 0) rounded by `round` (when set: the io dtype), then
// RMSNorm (norm_weight not empty) and RoPE (pairs > 0) on it, each result rounded again.
template <typename Real>
struct Epilogue {
  std::vector<Real> norm_weight;  // [D]; empty: no RMSNorm
  Real eps = Real(1e-6);
  std::vector<Real> cos, sin;  // [positions, pairs]
  std::int64_t pairs = 0;      // rd / 2; 0: no RoPE
  std::function<Real(Real)> round;
};
template <typename Real>
void epilogue_forward(const Problem& p, const Epilogue<Real>& e, const std::vector<std::int64_t>& position,
                      std::vector<Real>& rows);
// The exact backward (no roundings) of the epilogue at the pooled rows `pooled` (as rounded): d_rows holds
// the gradient of the epilogue's rows and becomes that of the pooled rows; d_norm_weight (when not null)
// is summed over the rows.
template <typename Real>
void epilogue_backward(const Problem& p, const Epilogue<Real>& e, const std::vector<std::int64_t>& position,
                       const std::vector<Real>& pooled, std::vector<Real>& d_rows,
                       std::vector<Real>* d_norm_weight);

}  // namespace kvcomp::ref
