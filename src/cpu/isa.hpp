// Run-time choice of the instruction set for kvcomp's own kernels (oneDNN
// dispatches its GEMMs by itself). Chosen once per process: the best the CPU
// supports, capped by the environment variable KVCOMP_ISA (scalar, avx2 or
// avx512), so that tests can run every path on one machine.
#pragma once

namespace kvcomp::detail {

enum class Isa : int { scalar = 0, avx2 = 1, avx512 = 2 };

const char* isa_name(Isa isa);
// The best ISA this CPU (and OS) supports.
Isa detected_isa();
// Whether the CPU converts fp16 by F16C (CPUID.1:ECX bit 29; read by cpuid, since clang 14's
// __builtin_cpu_supports does not know "f16c"). Every AVX2 CPU kvcomp targets has it.
bool cpu_has_f16c();
// Whether the CPU has AVX512-BF16 (CPUID.(7,1):EAX bit 5) besides detected_isa() == avx512, read by
// cpuid for the same reason.
bool cpu_has_avx512_bf16();
// Whether the CPU has AMX-TILE and AMX-BF16 and the OS saves the tile state (XCR0); a process still
// asks Linux for the tile data before its first tile instruction (products/amx.hpp).
bool cpu_has_amx_bf16();
// min(detected_isa(), KVCOMP_ISA); an unknown KVCOMP_ISA value is ignored
// with a warning on stderr.
Isa active_isa();

}  // namespace kvcomp::detail
