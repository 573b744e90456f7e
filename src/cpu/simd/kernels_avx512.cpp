// The avx512 variant of the element-wise kernels (flags in src/CMakeLists.txt).
#define KVCOMP_SIMD_NS avx512
#include "cpu/simd/body.inl"
