// Where the CPU backend's calls spend their time, phase by phase (kvcomp::set_phase_timing,
// kvcomp bench --phases). The drivers (forward.cpp, backward.cpp) run their phases one after another
// on the calling thread, each phase's parallel regions inside it, so a lap of the wall clock between
// two phases is that phase's time. Off by default: then a lap is one relaxed atomic load. The totals
// are process-wide atomics, so calls on several threads at once add to the same totals.
#pragma once

#include <chrono>
#include <cstdint>

namespace kvcomp::detail {

// In the order a call runs them (phase_times() lists them so).
enum class Phase : int {
  fwd_weights,   // the weights packed, converted or written as panels for this call
  fwd_x,         // the chunk's x rows copied or converted for the product (tiles, zero rows)
  fwd_products,  // [new_kv | new_score] = x . [wkv ; wgate]^T
  fwd_ape,       // + ape on the score columns
  fwd_blocks,    // the cache writes, the block softmax and pooling, the outputs
  fwd_rows,      // the carried projection rows moved; output rows without a block zeroed
  bwd_weights,   // the weights copied and packed, or converted
  bwd_blocks,    // d_new and d_ape from the blocks (softmax backward)
  bwd_x,         // the chunk's x rows copied, packed or converted
  bwd_split,     // d_new to the products' operands (bf16 hi [+ lo], transposed; npu_parity on the
                 // bf16 units: transposed only, the blocks wrote it as bf16)
  bwd_dx,        // d_x rows = d_new . [wkv ; wgate] (npu_parity on the bf16 units: written as bf16)
  bwd_dw,        // [d_wkv ; d_wgate] += d_new^T . x
  bwd_outputs,   // d_x rows narrowed (or zeroed) where the product did not write them, d_wkv, d_wgate
                 // and d_ape written
  count
};

struct PhaseName {
  const char* op;
  const char* phase;
};
PhaseName phase_name(Phase p);

bool phase_timing_on();
void set_phase_timing_on(bool on);
void add_phase_ns(Phase p, std::int64_t ns);
std::int64_t phase_ns(Phase p);
// Timed calls of each operator (0 forward, 1 backward); phase_calls: those of p's operator.
void count_phase_call(int op);
std::int64_t phase_calls(Phase p);
void reset_phase_ns();

// Laps of one call of operator op (0 forward, 1 backward): lap(p) adds the time since the previous lap
// (or construction) to phase p. Whether timing is on is read once, at construction, so a call is timed
// whole or not at all.
class PhaseLaps {
 public:
  explicit PhaseLaps(int op) : on_(phase_timing_on()) {
    if (!on_) return;
    count_phase_call(op);
    last_ = std::chrono::steady_clock::now();
  }
  void lap(Phase p) {
    if (!on_) return;
    const auto now = std::chrono::steady_clock::now();
    add_phase_ns(p, std::chrono::duration_cast<std::chrono::nanoseconds>(now - last_).count());
    last_ = now;
  }

 private:
  bool on_;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace kvcomp::detail
