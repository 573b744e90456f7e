#include "cpu/isa.hpp"

#include <cpuid.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace kvcomp::detail {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return "avx512";
    case Isa::avx2:
      return "avx2";
    default:
      return "scalar";
  }
}

bool cpu_has_f16c() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return __get_cpuid(1, &a, &b, &c, &d) != 0 && (c & bit_F16C) != 0;
}

bool cpu_has_avx512_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  return detected_isa() == Isa::avx512 && __get_cpuid_count(7, 1, &a, &b, &c, &d) != 0 &&
         (a & (1u << 5)) != 0;
}

bool cpu_has_amx_bf16() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;  // AMX-TILE, AMX-BF16
  if (!__get_cpuid(1, &a, &b, &c, &d) || (c & (1u << 27)) == 0) return false;  // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (lo & (3u << 17)) == (3u << 17);  // XTILECFG and XTILEDATA enabled by the OS
}

Isa detected_isa() {
  // __builtin_cpu_supports also checks that the OS saves the wide registers
  // (XGETBV), so a feature it reports can be used.
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma"))
    return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::avx2;
  return Isa::scalar;
}

namespace {

Isa choose() {
  const Isa best = detected_isa();
  const char* cap = std::getenv("KVCOMP_ISA");
  if (!cap || !*cap) return best;
  for (Isa isa : {Isa::scalar, Isa::avx2, Isa::avx512})
    if (std::strcmp(cap, isa_name(isa)) == 0) return std::min(best, isa);
  std::fprintf(stderr, "[kvcomp] KVCOMP_ISA (= %s) must be scalar, avx2 or avx512; ignored\n", cap);
  return best;
}

}  // namespace

Isa active_isa() {
  static const Isa isa = choose();
  return isa;
}

}  // namespace kvcomp::detail
