// Streaming (non-temporal) stores of fp32 runs, for rows this call writes and a later one reads: the
// forward's cache slots and its exported softmax_score / kv rows. Through the caches each line would
// first be read for ownership, then evict the inputs the call is still reading; streamed, it goes
// straight to memory. Only the route of the stores differs, never a value.
//
// SSE2, x86-64's baseline, so every ISA variant (simd/kernels_*.cpp) can include it; internal linkage
// (an anonymous namespace, as common/numerics.hpp), so that a copy compiled with AVX-512 flags is never
// the one a scalar path calls. Streamed stores are weakly ordered: a thread sees its own at once, other
// threads only after it runs _mm_sfence (the block phases do, once per thread, before their region ends).
#pragma once

#include <emmintrin.h>

#include <cstdint>

namespace kvcomp::detail {
namespace {

// dst[0, n) = src[0, n), streamed from dst's first 16-byte boundary on (plain stores before it and for a
// tail of under 4 floats).
inline void stream_floats(float* dst, const float* src, std::int64_t n) {
  std::int64_t i = 0;
  for (; i < n && (reinterpret_cast<std::uintptr_t>(dst + i) & 15) != 0; ++i) dst[i] = src[i];
  for (; i + 4 <= n; i += 4) _mm_stream_ps(dst + i, _mm_loadu_ps(src + i));
  for (; i < n; ++i) dst[i] = src[i];
}

}  // namespace
}  // namespace kvcomp::detail
