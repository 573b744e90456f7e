// The avx2 variant of the element-wise kernels (flags in src/CMakeLists.txt).
#define KVCOMP_SIMD_NS avx2
#include "cpu/simd/body.inl"
