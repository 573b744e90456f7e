// Inputs of the two example programs and the way they print results. Shared
// with expected_output.cpp, which computes through the kvcomp C++ API what the
// examples must print; the test suite compares the two outputs.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace example {

// Reproducible values in [-scale, scale] (xorshift32), identical on every machine.
inline std::vector<float> Uniform(int64_t count, uint32_t seed, float scale) {
  std::vector<float> v(static_cast<size_t>(count));
  uint32_t s = seed * 2654435761u + 1u;
  for (float& e : v) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    e = scale * (static_cast<float>(s >> 8) / 8388608.0f - 1.0f);  // 24 bits -> [-1, 1)
  }
  return v;
}

// A softmax over the `rows` rows of each block: [blocks, rows, cols] with every
// column of a block summing to 1, like the forward's softmax_score.
inline std::vector<float> BlockSoftmax(int64_t blocks, int64_t rows, int64_t cols, uint32_t seed) {
  std::vector<float> v = Uniform(blocks * rows * cols, seed, 2.0f);
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t c = 0; c < cols; ++c) {
      double sum = 0.0;
      for (int64_t r = 0; r < rows; ++r)
        sum += std::exp(static_cast<double>(v[static_cast<size_t>((b * rows + r) * cols + c)]));
      for (int64_t r = 0; r < rows; ++r) {
        float& e = v[static_cast<size_t>((b * rows + r) * cols + c)];
        e = static_cast<float>(std::exp(static_cast<double>(e)) / sum);
      }
    }
  }
  return v;
}

// CompressorGrad example: C4A (D 512, coff 2, cmp_ratio 4), BSH, bf16, B 1, S 8,
// H 1024, start_pos 2 (so the first block starts before the sequence and the
// last two tokens are a tail without a block).
struct GradCase {
  int64_t B = 1, S = 8, H = 1024, D = 512, coff = 2, cmpRatio = 4;
  int64_t Sr() const { return (S + cmpRatio - 1) / cmpRatio; }
  std::vector<float> x, wkv, wgate, dCmpKv, softmaxScore, kv;
  std::vector<int32_t> startPos{2};

  GradCase() {
    const int64_t C = coff * D, rows = coff * cmpRatio;
    x = Uniform(B * S * H, 1, 1.0f);
    wkv = Uniform(C * H, 2, 0.05f);
    wgate = Uniform(C * H, 3, 0.05f);
    dCmpKv = Uniform(B * Sr() * D, 4, 1.0f);
    softmaxScore = BlockSoftmax(B * Sr(), rows, D, 5);
    kv = Uniform(B * Sr() * rows * D, 6, 1.0f);
  }
};

// Compressor example: C4Li (D 128, coff 2, cmp_ratio 4), TH with two sequences
// of 5 and 7 tokens, bf16, H 1024, start_pos {3, 0}, paged state cache
// (cache_mode 1) of 4-token blocks, gradEnabled.
struct ForwardCase {
  int64_t H = 1024, D = 128, coff = 2, cmpRatio = 4, cacheMode = 1, blockSize = 4;
  std::vector<int32_t> cuSeqlens{0, 5, 12};
  std::vector<int32_t> startPos{3, 0};
  // Block ids per batch for positions [0,4), [4,8), [8,12); 0 = never written.
  std::vector<int32_t> blockTable{2, 5, 1, 4, 3, 0};
  int64_t blockNum = 6;
  int64_t B() const { return static_cast<int64_t>(cuSeqlens.size()) - 1; }
  int64_t T() const { return cuSeqlens.back(); }
  int64_t tableCols() const { return static_cast<int64_t>(blockTable.size()) / B(); }
  int64_t cmpRows() const { return std::min(T(), T() / cmpRatio + B()); }
  std::vector<float> x, wkv, wgate, ape, stateCache;

  ForwardCase() {
    const int64_t C = coff * D;
    x = Uniform(T() * H, 11, 1.0f);
    wkv = Uniform(C * H, 12, 0.05f);
    wgate = Uniform(C * H, 13, 0.05f);
    ape = Uniform(cmpRatio * C, 14, 0.5f);
    stateCache = Uniform(blockNum * blockSize * 2 * C, 15, 1.0f);  // what earlier tokens left there
  }
};

// One line per tensor: element count, sum, sum of magnitudes, and six values
// spread over it. %.9g prints a float exactly, so equal lines mean equal bits.
inline void PrintSummary(const char* name, const std::vector<float>& v) {
  double sum = 0.0, abs = 0.0;
  for (float e : v) {
    sum += e;
    abs += std::fabs(e);
  }
  std::printf("%s: %zu values, sum %.17g, sum|.| %.17g, samples", name, v.size(), sum, abs);
  for (size_t k = 0; k < 6 && !v.empty(); ++k) std::printf(" %.9g", static_cast<double>(v[k * v.size() / 6]));
  std::printf("\n");
}

}  // namespace example
