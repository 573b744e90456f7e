// The sweep of the CUDA backend's tests: the CPU suite's cases
// (tests/core/sweep.hpp) plus cases longer than the GPU's chunks.
#pragma once

#include <vector>

#include "sweep.hpp"

namespace kvcomp::test {

// The CPU sweep, plus cases longer than the GPU's chunks (16384 rows forward,
// 4096 backward) so that blocks and their prev halves straddle them.
inline std::vector<SweepCase> cuda_sweep() {
  std::vector<SweepCase> v = sweep();
  v.push_back({.name = "gpu_chunks_th_r5_coff2",
               .th = true,
               .B = 3,
               .S = 9000,
               .H = 16,
               .D = 8,
               .r = 5,
               .max_start_pos = 12,
               .allow_empty_segments = false});
  v.push_back({.name = "gpu_chunks_bsh_r600_coff2",
               .B = 1,
               .S = 17500,
               .H = 8,
               .D = 4,
               .r = 600,
               .max_start_pos = 650});
  v.push_back(
      {.name = "gpu_chunks_tiny_th", .th = true, .B = 3000, .S = 12, .H = 8, .D = 8, .max_start_pos = 9});
  return v;
}

}  // namespace kvcomp::test
