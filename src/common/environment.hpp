// What the environment may say to the backends, read once per process, in one place. Behaviour a caller
// relies on is in Options (row stability, precision), never here: these only pick among kernels that
// give the same results (or, KVCOMP_PRODUCTS and KVCOMP_ISA, restrict a machine to a subset of its
// paths so that one machine tests several), and ask for diagnostics.
//
//   KVCOMP_ISA       scalar | avx2 | avx512: caps kvcomp's own CPU kernels (cpu/isa.hpp)
//   KVCOMP_PRODUCTS  auto | bf16 | f32: the CPU's product kernels (cpu/products/config.hpp)
//   KVCOMP_KERNELS   a comma list of kernel switches, each "-name" (off) or "+name" (on), for tests:
//                      -amx     kvcomp's AMX kernel off: oneDNN's AMX kernels run the bf16 products
//                      +packed  bf16 products from a B packed into oneDNN's blocked layout, also where
//                               oneDNN would read it in place (tests the packed code on AVX512-BF16)
//                      -rows    kvcomp's decode rows kernels off (AVX2 fp32, AVX512-BF16): oneDNN's
//                               products, with the same bits
//                      -panels  no decode panels in prepared weights or written per call
//                      +splitk  CUDA: products split over K in chunks (cuda/gemm.hpp)
//   KVCOMP_VERBOSE   1: every planned CPU call prints to stderr which kernel runs each of its
//                      products and why the others do not
//
// An unknown value is ignored with one line on stderr, never an error: a misspelt switch must not
// stop a server.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace kvcomp::detail {

struct KernelSwitches {
  bool amx = true;       // -amx
  bool packed = false;   // +packed
  bool rows = true;      // -rows
  bool panels = true;    // -panels
  bool split_k = false;  // +splitk
};

// KVCOMP_KERNELS parsed; `text` null or empty: the defaults. Unknown entries are reported on stderr.
inline KernelSwitches parse_kernel_switches(const char* text) {
  KernelSwitches k;
  if (!text) return k;
  std::string rest(text);
  while (!rest.empty()) {
    const std::size_t comma = rest.find(',');
    const std::string item = rest.substr(0, comma);
    rest = comma == std::string::npos ? std::string() : rest.substr(comma + 1);
    if (item.empty()) continue;
    const char sign = item[0];
    const std::string name = item.substr(1);
    bool* flag = name == "amx"      ? &k.amx
                 : name == "packed" ? &k.packed
                 : name == "rows"   ? &k.rows
                 : name == "panels" ? &k.panels
                 : name == "splitk" ? &k.split_k
                                    : nullptr;
    if ((sign != '+' && sign != '-') || !flag) {
      std::fprintf(stderr,
                   "[kvcomp] KVCOMP_KERNELS entry (= %s) must be +name or -name, name one of amx, packed, "
                   "rows, panels, splitk; ignored\n",
                   item.c_str());
      continue;
    }
    *flag = sign == '+';
  }
  return k;
}

inline const KernelSwitches& kernel_switches() {
  static const KernelSwitches k = parse_kernel_switches(std::getenv("KVCOMP_KERNELS"));
  return k;
}

// KVCOMP_VERBOSE=1.
inline bool verbose() {
  static const bool on = [] {
    const char* v = std::getenv("KVCOMP_VERBOSE");
    return v && std::strcmp(v, "1") == 0;
  }();
  return on;
}

}  // namespace kvcomp::detail
