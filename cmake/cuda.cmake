# The CUDA backend (src/cuda/) is built when KVCOMP_CUDA is ON, or AUTO (the default) and a CUDA
# toolkit with cuBLASLt is found. Without it the build is exactly the CPU product. Sets
# KVCOMP_HAVE_CUDA.
#
# Machine code for sm_80 (Ampere) and sm_90 (Hopper) plus PTX of sm_90 for later GPUs, unless the
# caller sets CMAKE_CUDA_ARCHITECTURES. A toolkit outside the PATH (scripts/install-cuda.sh puts one
# together from PyPI): -DCMAKE_CUDA_COMPILER=<root>/bin/nvcc -DCUDAToolkit_ROOT=<root>.
set(KVCOMP_CUDA AUTO CACHE STRING "Build the CUDA backend: AUTO (when a CUDA toolkit with cuBLASLt is found), ON, OFF")
set_property(CACHE KVCOMP_CUDA PROPERTY STRINGS AUTO ON OFF)
set(KVCOMP_HAVE_CUDA OFF)
if(NOT KVCOMP_CUDA STREQUAL "OFF")
  if(NOT KVCOMP_SANITIZE STREQUAL "")
    message(STATUS "kvcomp: CUDA backend off in a sanitizer build (KVCOMP_SANITIZE=${KVCOMP_SANITIZE})")
  else()
    include(CheckLanguage)
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
        set(CMAKE_CUDA_ARCHITECTURES 80-real 90-real 90-virtual)
      endif()
      enable_language(CUDA)
      set(CMAKE_CUDA_STANDARD 20)
      set(CMAKE_CUDA_STANDARD_REQUIRED ON)
      find_package(CUDAToolkit)
      if(CUDAToolkit_FOUND AND TARGET CUDA::cublasLt AND TARGET CUDA::cudart)
        set(KVCOMP_HAVE_CUDA ON)
        message(STATUS "kvcomp: CUDA backend ON (CUDA ${CUDAToolkit_VERSION}, architectures "
                       "${CMAKE_CUDA_ARCHITECTURES})")
      else()
        set(_kvcomp_cuda_why "the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} has no cuBLASLt")
      endif()
    else()
      set(_kvcomp_cuda_why "no CUDA compiler found")
    endif()
  endif()
  if(NOT KVCOMP_HAVE_CUDA AND KVCOMP_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVCOMP_CUDA=ON but ${_kvcomp_cuda_why} (scripts/install-cuda.sh installs one)")
  elseif(NOT KVCOMP_HAVE_CUDA AND _kvcomp_cuda_why)
    message(STATUS "kvcomp: CUDA backend OFF: ${_kvcomp_cuda_why}")
  endif()
endif()
