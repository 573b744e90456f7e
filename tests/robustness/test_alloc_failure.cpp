// Allocation failure injected at every point of a call: this binary replaces
// the global operator new / delete (every standard form) with a counting
// version that, when armed, throws std::bad_alloc (or returns null for the
// nothrow forms) at exactly the N-th allocation. For a small forward and
// backward call, through the one-call API and through plan + execute, N runs
// 1, 2, 3, ... until a call completes without the hook firing. Every N must
// give success or StatusCode::runtime_error (361001), never an exception out
// of the API or a terminate; a failing call must leave every output and the
// state cache byte for byte as they were; a call that succeeds although an
// allocation failed must give the same bytes as an undisturbed call.
//
// Each N runs in its own child process (a gtest death test in the
// "threadsafe" style: fork + exec, safe with OpenMP threads), so that a
// terminate at one N is reported as a failure for that N and the sweep goes
// on. A child prints a backtrace of the failed allocation and what went
// wrong (gtest shows it when that N fails). Leaks after a failure are found by LeakSanitizer when the suite
// runs under AddressSanitizer (scripts/test-sanitizers.sh): the child exits
// through std::exit, which runs the leak check.
#include <execinfo.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "harness.hpp"

// ------------------------------------------------------------------ the hook

namespace {

namespace hook {
std::atomic<bool> armed{false};
std::atomic<long> count{0};    // allocations seen while armed
std::atomic<long> fail_at{0};  // the allocation (1-based) that fails
std::atomic<bool> fired{false};
constexpr int kMaxFrames = 64;
void* frames[kMaxFrames];
int frame_count = 0;

void arm(long n) {
  count = 0;
  fired = false;
  frame_count = 0;
  fail_at = n;
  armed = true;
}
void disarm() { armed = false; }
}  // namespace hook

void* allocate(std::size_t size, std::size_t align, bool nothrow) {
  if (hook::armed.load(std::memory_order_relaxed)) {
    const long k = hook::count.fetch_add(1) + 1;
    if (k == hook::fail_at.load()) {
      hook::fired = true;
      // Printed at once: the process may not live to report it (terminate).
      // backtrace_symbols_fd writes straight to the descriptor, unallocated.
      hook::frame_count = ::backtrace(hook::frames, hook::kMaxFrames);
      static const char kHeader[] = "[alloc hook] failing this allocation, from:\n";
      [[maybe_unused]] const ssize_t written = ::write(2, kHeader, sizeof kHeader - 1);
      ::backtrace_symbols_fd(hook::frames, hook::frame_count, 2);
      if (nothrow) return nullptr;
      throw std::bad_alloc();
    }
  }
  if (size == 0) size = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(size);
  } else if (::posix_memalign(&p, align, size) != 0) {
    p = nullptr;
  }
  if (!p && !nothrow) throw std::bad_alloc();
  return p;
}

}  // namespace

void* operator new(std::size_t n) { return allocate(n, 0, false); }
void* operator new[](std::size_t n) { return allocate(n, 0, false); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0, true); }
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept { return allocate(n, 0, true); }
void* operator new(std::size_t n, std::align_val_t a) {
  return allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new[](std::size_t n, std::align_val_t a) {
  return allocate(n, static_cast<std::size_t>(a), false);
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a), true);
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return allocate(n, static_cast<std::size_t>(a), true);
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

// ------------------------------------------------------------------ the cases

namespace kvcomp::test {
namespace {

// What a child reports through its exit code (away from 0, 1 and the
// sanitizers' exit codes: a leak report at exit must not read as an outcome).
enum Outcome : int {
  kFailedCleanly = 40,   // the hook fired, runtime_error with a sentence, nothing written
  kDoneUnfired = 41,     // the call needed fewer than N allocations: the sweep is over
  kRecovered = 42,       // the hook fired, the call succeeded with the undisturbed result
  kWrongCode = 43,       // the hook fired, a status other than success or runtime_error
  kPartialWrite = 44,    // runtime_error, but an output or the cache changed
  kEscaped = 45,         // an exception left the API
  kWrongResult = 46,     // success after a failed allocation, but not the undisturbed result
  kUnfiredFailure = 47,  // the hook did not fire, yet the call did not succeed
  kPrefixWrite = 48,     // runtime_error; what changed holds the undisturbed result's bytes
};

std::vector<unsigned char> bytes(Buffer& b) {
  const auto* p = static_cast<const unsigned char*>(b.data());
  return {p, p + b.size() * dtype_size(b.dtype)};
}

// Outputs hold a sentinel byte pattern, so that any element written differs.
void sentinel(Buffer& b) { std::memset(b.data(), 0x5a, b.size() * dtype_size(b.dtype)); }

RandomOptions shape(bool th, bool large) {
  RandomOptions o;
  o.th = th;
  o.B = 2;
  o.H = 64;
  o.D = 16;
  o.coff = 2;
  o.r = 4;
  o.block_size = 16;
  o.max_start_pos = 9;
  o.allow_empty_segments = false;
  if (large) {
    o.S = 640;  // T = 1280: two chunks of 1024 rows (a forward on the bf16 units: several of 256-1024)
  } else {
    // T <= 256: one chunk on every product path and thread count (a forward on the bf16 units runs
    // 256 rows per chunk on 1-2 threads, cpu/forward.cpp), so the strict rule holds there too.
    o.S = 126;
    if (th) o.lengths = {110, 146};
  }
  return o;
}

struct Images {
  std::vector<std::string> names;
  std::vector<std::vector<unsigned char>> data;
  // The names of the tensors whose bytes differ from `other`'s.
  std::string diff(const Images& other) const {
    std::string s;
    for (std::size_t i = 0; i < data.size(); ++i)
      if (data[i] != other.data[i]) s += (s.empty() ? "" : ", ") + names[i];
    return s;
  }
};

struct ForwardCase {
  RandomCase<double> rc;
  std::unique_ptr<ForwardRun> run;
  ForwardCase(bool th, bool large) {
    RandomOptions o = shape(th, large);
    o.random_seqused = false;  // every batch writes the cache
    o.cache_mode = large ? 2 : 1;
    rc = make_random_case(o, large ? 501 : 502);
    round_io_inputs(rc.in, DType::bf16);
    run = std::make_unique<ForwardRun>(rc.problem, rc.in, DType::bf16);
    sentinel(run->cmp_kv);
    sentinel(run->softmax_score);
    sentinel(run->kv);
  }
  Images image() {
    return {{"state_cache", "cmp_kv", "softmax_score", "kv"},
            {bytes(run->cache), bytes(run->cmp_kv), bytes(run->softmax_score), bytes(run->kv)}};
  }
  Status one_call() { return compressor_forward(run->args); }
  template <typename Arm>
  Status two_phase(Arm&& arm) {
    ForwardPlan plan;
    arm();
    const Status s = plan_forward(run->args, {}, &plan);
    hook::disarm();
    if (!s.ok()) return s;
    std::vector<unsigned char> ws(plan.workspace_size());  // the caller's memory, not counted
    hook::armed = true;
    return execute(plan, ws.data(), ws.size());
  }
};

struct BackwardCase {
  RandomCase<double> rc;
  BackwardData bd;
  std::unique_ptr<BackwardRun> run;
  BackwardCase(bool th, bool large) {
    RandomOptions o = shape(th, large);
    o.random_seqused = true;
    // Both 1024-row chunks hold rows with gradient (and rows without).
    if (large) o.seqused = {600, 500};
    rc = make_random_case(o, large ? 503 : 504);
    round_io_inputs(rc.in, DType::bf16);
    bd = make_backward_data(rc.problem, rc.in, DType::bf16, 505);
    run = std::make_unique<BackwardRun>(rc.problem, rc.in, bd, DType::bf16);
    sentinel(run->d_x);
    sentinel(run->d_wkv);
    sentinel(run->d_wgate);
    sentinel(run->d_ape);
  }
  Images image() {
    return {{"d_x", "d_wkv", "d_wgate", "d_ape"},
            {bytes(run->d_x), bytes(run->d_wkv), bytes(run->d_wgate), bytes(run->d_ape)}};
  }
  Status one_call() { return compressor_backward(run->args); }
  template <typename Arm>
  Status two_phase(Arm&& arm) {
    BackwardPlan plan;
    arm();
    const Status s = plan_backward(run->args, {}, &plan);
    hook::disarm();
    if (!s.ok()) return s;
    std::vector<unsigned char> ws(plan.workspace_size());
    hook::armed = true;
    return execute(plan, ws.data(), ws.size());
  }
};

struct SweepParam {
  const char* name;
  bool backward, th, large, two_phase;
};

void PrintTo(const SweepParam& p, std::ostream* os) { *os << p.name; }

// Whether a runtime_error may leave a prefix of the result written (kPrefixWrite): only for a
// call of several chunks whose products run on the bf16 units. oneDNN's matmul and
// reorder primitives allocate with operator new on every execution (their argument maps), so a
// failure there in a later chunk comes after the earlier chunks wrote their rows; those rows and
// cache slots then hold exactly the undisturbed result's bytes, and calling again gives the whole
// result (a call's cache writes never alias the slots it reads). docs/robustness.md. The fp32
// path (dnnl_sgemm, no operator new) keeps the strict rule: ctest runs this binary again with
// KVCOMP_PRODUCTS=f32.
bool prefix_allowed(const SweepParam& p) {
  const std::string k = product_kernels();
  const bool units = k.rfind("bf16 (", 0) == 0;
  // The backward runs in precise mode here: bf16 products only where it splits d_new.
  return p.large && units && (!p.backward || k.find("precise as hi+lo") != std::string::npos);
}

// Every byte that changed holds the undisturbed result's byte.
bool only_result_bytes(const Images& before, const Images& after, const Images& expected) {
  for (std::size_t i = 0; i < after.data.size(); ++i)
    for (std::size_t j = 0; j < after.data[i].size(); ++j)
      if (after.data[i][j] != before.data[i][j] && after.data[i][j] != expected.data[i][j]) return false;
  return true;
}

// Runs the call once with allocation n failing and exits with the outcome.
template <typename Case>
[[noreturn]] void child(long n, const SweepParam& p, const Images& expected) {
  Case c(p.th, p.large);
  const Images before = c.image();
  Status s;
  std::string escaped;
  try {
    if (p.two_phase) {
      s = c.two_phase([n] { hook::arm(n); });
    } else {
      hook::arm(n);
      s = c.one_call();
    }
  } catch (const std::exception& e) {
    escaped = e.what();
  } catch (...) {
    escaped = "an exception of unknown type";
  }
  hook::disarm();
  const bool fired = hook::fired;
  const Images after = c.image();
  Outcome out;
  std::string what;
  if (!escaped.empty()) {
    out = kEscaped;
    what = "exception escaped the API: " + escaped;
  } else if (!fired) {
    out = s.ok() ? kDoneUnfired : kUnfiredFailure;
    what = "status " + std::to_string(s.value()) + " " + s.message;
  } else if (s.ok()) {
    const std::string d = after.diff(expected);
    out = d.empty() ? kRecovered : kWrongResult;
    what = "success, differing from the undisturbed result in: " + d;
  } else if (s.code != StatusCode::runtime_error || s.message.rfind("[kvcomp] ", 0) != 0) {
    out = kWrongCode;
    what =
        "status " + std::to_string(s.value()) + " (want 361001 and a \"[kvcomp] \" sentence): " + s.message;
  } else {
    const std::string d = after.diff(before);
    out = d.empty()                                    ? kFailedCleanly
          : only_result_bytes(before, after, expected) ? kPrefixWrite
                                                       : kPartialWrite;
    what = "status 361001 (" + s.message + "); changed: " + d;
  }
  std::fprintf(stderr, "[alloc %ld] outcome %d: %s\n", n, static_cast<int>(out), what.c_str());
  std::fflush(stderr);
  std::exit(out);
}

std::string describe(int status) {
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  if (!WIFEXITED(status)) return "status " + std::to_string(status);
  switch (WEXITSTATUS(status)) {
    case kWrongCode:
      return "wrong status code";
    case kPartialWrite:
      return "runtime_error, but outputs written";
    case kPrefixWrite:
      return "runtime_error, a prefix of the result written (allowed only on the bf16 path)";
    case kEscaped:
      return "exception escaped the API";
    case kWrongResult:
      return "success with a wrong result";
    case kUnfiredFailure:
      return "failed without an allocation failure";
    default:  // e.g. 1: AddressSanitizer / LeakSanitizer found an error (its report is above)
      return "exit code " + std::to_string(WEXITSTATUS(status)) + " (a sanitizer report?)";
  }
}

int last_status = -1;
bool prefix_ok = false;  // prefix_allowed() for the sweep under way
bool accepted_exit(int status) {
  last_status = status;
  if (!WIFEXITED(status)) return false;
  const int code = WEXITSTATUS(status);
  return code == kFailedCleanly || code == kDoneUnfired || code == kRecovered ||
         (prefix_ok && code == kPrefixWrite);
}

class AllocFailure : public ::testing::TestWithParam<SweepParam> {};

template <typename Case>
void sweep(const SweepParam& p) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Warm-up: loads backtrace's unwinder, and gives the undisturbed result.
  void* warm[2];
  (void)::backtrace(warm, 2);
  Case reference(p.th, p.large);
  {
    hook::arm(0);  // counts, never fails
    const Status s = p.two_phase ? reference.two_phase([] { hook::arm(0); }) : reference.one_call();
    hook::disarm();
    ASSERT_TRUE(s.ok()) << s.message;
    ASSERT_GT(hook::count.load(), 0) << "the call allocates nothing: the sweep would test nothing";
  }
  const Images expected = reference.image();
  prefix_ok = prefix_allowed(p);
  constexpr long kMaxN = 100000;
  long n = 1;
  std::string failing;  // one line per failing N, for the summary
  for (; n <= kMaxN; ++n) {
    SCOPED_TRACE("allocation " + std::to_string(n));
    EXPECT_EXIT(child<Case>(n, p, expected), accepted_exit, "");
    if (WIFEXITED(last_status) && WEXITSTATUS(last_status) == kDoneUnfired) break;
    if (!accepted_exit(last_status))
      failing += "\n  allocation " + std::to_string(n) + ": " + describe(last_status);
  }
  EXPECT_LE(n, kMaxN) << "the sweep did not end";
  EXPECT_GT(n, 1) << "no allocation was ever failed";
  EXPECT_TRUE(failing.empty()) << p.name << ": " << n - 1
                               << " allocations failed one at a time; wrong at:" << failing;
}

TEST_P(AllocFailure, EveryAllocationFailsCleanly) {
  const SweepParam& p = GetParam();
  if (p.backward)
    sweep<BackwardCase>(p);
  else
    sweep<ForwardCase>(p);
}

const SweepParam kSweeps[] = {
    {"forward_th_one_call", false, true, false, false},
    {"forward_th_two_phase", false, true, false, true},
    {"forward_bsh_T1280_one_call", false, false, true, false},
    {"forward_bsh_T1280_two_phase", false, false, true, true},
    {"backward_th_one_call", true, true, false, false},
    {"backward_th_two_phase", true, true, false, true},
    {"backward_bsh_T1280_one_call", true, false, true, false},
    {"backward_bsh_T1280_two_phase", true, false, true, true},
};

INSTANTIATE_TEST_SUITE_P(Issue5, AllocFailure, ::testing::ValuesIn(kSweeps),
                         [](const auto& tp) { return std::string(tp.param.name); });

}  // namespace
}  // namespace kvcomp::test
