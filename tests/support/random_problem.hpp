// Seeded random problems for the tests: a ref::Problem and consistent inputs
// (x, weights, ape, state cache with its block table), plus dtype rounding.
//
// The cache is built so that every position a block reads from the cache
// (positions < start_pos) maps to a real, non-zero block, while other mode-1
// table entries are randomly 0, so the "block id 0 is not written" rule is
// exercised constantly (as in the upstream harnesses, spec 1.3).
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "kvcomp/half.hpp"
#include "kvcomp/kvcomp.hpp"
#include "reference/reference.hpp"
#include "three_way.hpp"

namespace kvcomp::test {

struct RandomOptions {
  bool th = false;
  std::int64_t B = 2;
  std::int64_t S = 8;  // BSH: padded length; TH: maximum segment length
  std::int64_t H = 16, D = 4, coff = 2, r = 4;
  int cache_mode = 1;
  std::int64_t block_size = 4;       // mode 1 page size; mode 2: raised to coff*r + maxlen - 1 if smaller
  std::int32_t max_start_pos = 16;   // start_pos uniform in [0, max]; negative: start_pos absent
  bool random_seqused = true;        // seqused uniform in [0, len]; false: absent
  bool allow_empty_segments = true;  // TH: segment lengths drawn from [0, S] instead of [1, S]
  double data_range = 1.0;           // x, wkv, wgate, ape uniform in [-range, range]
  double cache_range = 1.0;          // state cache contents uniform in [-range, range]
  // Fixed values override the random draws when non-empty (B entries each).
  std::vector<std::int32_t> start_pos, seqused, lengths;  // lengths: TH only
};

template <typename Real>
struct RandomCase {
  ref::Problem problem;
  ref::ForwardInputs<Real> in;
};

namespace detail {

inline std::vector<double> uniform_vector(std::mt19937_64& rng, std::size_t n, double range) {
  std::uniform_real_distribution<double> dist(-range, range);
  std::vector<double> v(n);
  for (double& e : v) e = dist(rng);
  return v;
}

inline std::int32_t uniform_int(std::mt19937_64& rng, std::int64_t lo, std::int64_t hi) {
  return static_cast<std::int32_t>(std::uniform_int_distribution<std::int64_t>(lo, hi)(rng));
}

}  // namespace detail

inline RandomCase<double> make_random_case(const RandomOptions& o, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  RandomCase<double> rc;
  ref::Problem& p = rc.problem;
  p.th = o.th;
  p.B = o.B;
  p.H = o.H;
  p.D = o.D;
  p.coff = o.coff;
  p.r = o.r;
  const auto nb = static_cast<std::size_t>(o.B);

  // Sequence lengths.
  std::vector<std::int64_t> len(nb);
  if (o.th) {
    p.cu_seqlens.assign(nb + 1, 0);
    for (std::size_t b = 0; b < nb; ++b) {
      len[b] =
          !o.lengths.empty() ? o.lengths[b] : detail::uniform_int(rng, o.allow_empty_segments ? 0 : 1, o.S);
      p.cu_seqlens[b + 1] = static_cast<std::int32_t>(p.cu_seqlens[b] + len[b]);
    }
    p.T = p.cu_seqlens[nb];
  } else {
    p.S = o.S;
    std::fill(len.begin(), len.end(), o.S);
  }
  const std::int64_t maxlen = nb == 0 ? 0 : *std::max_element(len.begin(), len.end());

  if (!o.start_pos.empty()) {
    p.start_pos = o.start_pos;
  } else if (o.max_start_pos >= 0) {
    for (std::size_t b = 0; b < nb; ++b) p.start_pos.push_back(detail::uniform_int(rng, 0, o.max_start_pos));
  }
  if (!o.seqused.empty()) {
    p.seqused = o.seqused;
  } else if (o.random_seqused) {
    for (std::size_t b = 0; b < nb; ++b) p.seqused.push_back(detail::uniform_int(rng, 0, len[b]));
  }
  auto sp_of = [&](std::size_t b) -> std::int64_t { return p.start_pos.empty() ? 0 : p.start_pos[b]; };
  auto used_of = [&](std::size_t b) -> std::int64_t { return p.seqused.empty() ? len[b] : p.seqused[b]; };

  const std::int64_t C = p.C(), rows = p.rows();
  rc.in.x = detail::uniform_vector(rng, static_cast<std::size_t>(rows * o.H), o.data_range);
  rc.in.wkv = detail::uniform_vector(rng, static_cast<std::size_t>(C * o.H), o.data_range);
  rc.in.wgate = detail::uniform_vector(rng, static_cast<std::size_t>(C * o.H), o.data_range);
  rc.in.ape = detail::uniform_vector(rng, static_cast<std::size_t>(o.r * C), o.data_range);

  ref::CacheState<double>& cache = rc.in.cache;
  cache.cache_mode = o.cache_mode;
  if (o.cache_mode == 1) {
    std::int64_t max_sp = 0;
    for (std::size_t b = 0; b < nb; ++b) max_sp = std::max(max_sp, sp_of(b));
    cache.block_size = o.block_size;
    cache.table_cols = std::max<std::int64_t>(1, (max_sp + maxlen + o.block_size - 1) / o.block_size);
    cache.block_table.assign(nb * static_cast<std::size_t>(cache.table_cols), 0);
    std::bernoulli_distribution coin(0.5);
    std::int32_t next_id = 1;
    for (std::size_t b = 0; b < nb; ++b) {
      // Cache positions the blocks of this batch read: [trunc(sp,r) - (coff-1)r, sp), when there are blocks.
      const std::int64_t sp = sp_of(b);
      const std::int64_t limit = (sp + used_of(b)) / o.r * o.r;
      const std::int64_t read_lo = std::max<std::int64_t>(0, sp / o.r * o.r - (o.coff - 1) * o.r);
      const std::int64_t read_hi = limit > sp ? sp : read_lo;
      for (std::int64_t col = 0; col < cache.table_cols; ++col) {
        const std::int64_t lo = col * o.block_size, hi = lo + o.block_size;
        const bool needed = lo < read_hi && read_lo < hi;
        if (needed || coin(rng))
          cache.block_table[b * static_cast<std::size_t>(cache.table_cols) + static_cast<std::size_t>(col)] =
              next_id++;
      }
    }
    cache.block_num = next_id;  // ids 1..next_id-1 in use; block 0 exists but must never be written
    // Shuffle the ids so that table order and memory order differ.
    std::vector<std::int32_t> perm(static_cast<std::size_t>(next_id));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin() + 1, perm.end(), rng);
    for (std::int32_t& id : cache.block_table) id = perm[static_cast<std::size_t>(id)];
  } else {
    // Ring: read (>= sp - coff*r + 1) and written (< sp + len) positions never alias (spec 1.3).
    cache.block_size = std::max(o.block_size, o.coff * o.r + maxlen - 1);
    cache.block_num = o.B + 1;  // one spare block nobody uses
    std::vector<std::int32_t> perm(nb + 1);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    cache.block_table.assign(perm.begin(), perm.begin() + static_cast<std::ptrdiff_t>(nb));
  }
  cache.data = detail::uniform_vector(
      rng, static_cast<std::size_t>(cache.block_num * cache.block_size * 2 * C), o.cache_range);
  return rc;
}

template <typename To, typename From>
std::vector<To> convert(const std::vector<From>& v) {
  return std::vector<To>(v.begin(), v.end());
}

// The same inputs in fp32 (for the "same" golden of spec 6.2).
inline ref::ForwardInputs<float> to_float(const ref::ForwardInputs<double>& in) {
  ref::ForwardInputs<float> f;
  f.x = convert<float>(in.x);
  f.wkv = convert<float>(in.wkv);
  f.wgate = convert<float>(in.wgate);
  f.ape = convert<float>(in.ape);
  f.cache.block_num = in.cache.block_num;
  f.cache.block_size = in.cache.block_size;
  f.cache.cache_mode = in.cache.cache_mode;
  f.cache.block_table = in.cache.block_table;
  f.cache.table_cols = in.cache.table_cols;
  f.cache.data = convert<float>(in.cache.data);
  return f;
}

// Convenience: the io inputs (x, wkv, wgate) rounded to an io dtype in place,
// so that every party of a comparison starts from exactly representable data.
inline void round_io_inputs(ref::ForwardInputs<double>& in, DType dt) {
  in.x = round_to_dtype(in.x, dt);
  in.wkv = round_to_dtype(in.wkv, dt);
  in.wgate = round_to_dtype(in.wgate, dt);
}

}  // namespace kvcomp::test
