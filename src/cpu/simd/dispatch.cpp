#include "cpu/simd/kernels.hpp"

namespace kvcomp::detail {

// One table per variant, defined by simd/body.inl in its own namespace.
namespace scalar {
extern const SimdKernels kTable;
}
namespace avx2 {
extern const SimdKernels kTable;
}
namespace avx512 {
extern const SimdKernels kTable;
}

const SimdKernels& simd_kernels(Isa isa) {
  switch (isa) {
    case Isa::avx512:
      return avx512::kTable;
    case Isa::avx2:
      return avx2::kTable;
    default:
      return scalar::kTable;
  }
}

const SimdKernels& simd_kernels() {
  static const SimdKernels& table = simd_kernels(active_isa());
  return table;
}

}  // namespace kvcomp::detail
