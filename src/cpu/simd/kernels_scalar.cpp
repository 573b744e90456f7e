// The scalar variant of the element-wise kernels (flags in src/CMakeLists.txt).
#define KVCOMP_SIMD_NS scalar
#include "cpu/simd/body.inl"
