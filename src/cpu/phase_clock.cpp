#include "cpu/phase_clock.hpp"

#include <atomic>
#include <iterator>

namespace kvcomp::detail {

namespace {

constexpr int kPhases = static_cast<int>(Phase::count);

std::atomic<bool> g_on{false};
std::atomic<std::int64_t> g_ns[kPhases];
std::atomic<std::int64_t> g_calls[2];

constexpr PhaseName kNames[] = {
    {"forward", "weights"},      {"forward", "x rows"},       {"forward", "products"},
    {"forward", "ape"},          {"forward", "blocks"},       {"forward", "rows"},
    {"backward", "weights"},     {"backward", "blocks"},      {"backward", "x rows"},
    {"backward", "d_new"},       {"backward", "d_x products"}, {"backward", "d_w products"},
    {"backward", "outputs"}};
static_assert(std::size(kNames) == kPhases, "a name for every phase");

}  // namespace

PhaseName phase_name(Phase p) { return kNames[static_cast<int>(p)]; }

bool phase_timing_on() { return g_on.load(std::memory_order_relaxed); }

void set_phase_timing_on(bool on) { g_on.store(on, std::memory_order_relaxed); }

void add_phase_ns(Phase p, std::int64_t ns) {
  g_ns[static_cast<int>(p)].fetch_add(ns, std::memory_order_relaxed);
}

std::int64_t phase_ns(Phase p) { return g_ns[static_cast<int>(p)].load(std::memory_order_relaxed); }

void count_phase_call(int op) { g_calls[op].fetch_add(1, std::memory_order_relaxed); }

std::int64_t phase_calls(Phase p) {
  return g_calls[p < Phase::bwd_weights ? 0 : 1].load(std::memory_order_relaxed);
}

void reset_phase_ns() {
  for (auto& v : g_ns) v.store(0, std::memory_order_relaxed);
  for (auto& v : g_calls) v.store(0, std::memory_order_relaxed);
}

}  // namespace kvcomp::detail
