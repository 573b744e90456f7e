# oneDNN >= 3.2 (DNNL::dnnl), taken from the first of:
#   1. where the user points: dnnl_DIR, dnnl_ROOT, or CMAKE_PREFIX_PATH (the cache variable or the
#      environment variable);
#   2. the PyPI wheel onednn-devel-cpu-gomp in the Python environment of ${Python_EXECUTABLE} or
#      python3 (under `pip install .` that is pip's build environment, pyproject.toml's build
#      requirement: its libdnnl.so.3 comes with the runtime dependency onednn-cpu-gomp);
#   3. CMake's default search: the system (/usr, /usr/local, prefixes of PATH's bin folders, ...);
#   4. the prefix scripts/install-onednn.sh fills from PyPI, ${XDG_CACHE_HOME:-~/.cache}/kvcomp/
#      onednn-2023.2.0, so that the repository's scripts need no flag.
# oneDNN 2.x (Debian 12's libdnnl-dev) is skipped by the version check wherever it is found.
#
# Sets KVCOMP_DNNL_FROM_PYPI_ENV when oneDNN is the wheel of the Python environment (2.), which is how
# `pip install .` gives the installed libkvcomp a RUNPATH relative to its own place (python/).

set(_kvcomp_dnnl_version 3.2)

set(_kvcomp_pypi_dnnl_dir "")
set(_kvcomp_python "${Python_EXECUTABLE}")
if(NOT _kvcomp_python)
  find_program(_kvcomp_python3 NAMES python3)
  set(_kvcomp_python "${_kvcomp_python3}")
endif()
if(_kvcomp_python)
  execute_process(
    COMMAND "${_kvcomp_python}" -c [=[
import importlib.metadata as m, os
d = m.distribution("onednn-devel-cpu-gomp")
print(next(os.path.dirname(os.path.realpath(d.locate_file(f))) for f in d.files or []
           if str(f).endswith("cmake/dnnl/dnnl-config.cmake")))
]=]
    OUTPUT_VARIABLE _kvcomp_pypi_dnnl_dir
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE _kvcomp_pypi_rc
    ERROR_QUIET)
  if(NOT _kvcomp_pypi_rc EQUAL 0)
    set(_kvcomp_pypi_dnnl_dir "")
  endif()
endif()

if(DEFINED ENV{XDG_CACHE_HOME} AND NOT "$ENV{XDG_CACHE_HOME}" STREQUAL "")
  set(_kvcomp_cache_prefix "$ENV{XDG_CACHE_HOME}/kvcomp/onednn-2023.2.0")
else()
  set(_kvcomp_cache_prefix "$ENV{HOME}/.cache/kvcomp/onednn-2023.2.0")
endif()

# 1. Only what the user names (dnnl_DIR is always looked at first by find_package).
find_package(dnnl ${_kvcomp_dnnl_version} CONFIG QUIET NO_SYSTEM_ENVIRONMENT_PATH
             NO_CMAKE_PACKAGE_REGISTRY NO_CMAKE_SYSTEM_PATH NO_CMAKE_INSTALL_PREFIX
             NO_CMAKE_SYSTEM_PACKAGE_REGISTRY)
# 2. The wheel of the Python environment.
if(NOT dnnl_FOUND AND _kvcomp_pypi_dnnl_dir)
  find_package(dnnl ${_kvcomp_dnnl_version} CONFIG QUIET PATHS "${_kvcomp_pypi_dnnl_dir}" NO_DEFAULT_PATH)
endif()
# 3. and 4.
if(NOT dnnl_FOUND)
  find_package(dnnl ${_kvcomp_dnnl_version} CONFIG PATHS "${_kvcomp_cache_prefix}")
endif()
if(NOT dnnl_FOUND)
  message(FATAL_ERROR
    "kvcomp needs oneDNN >= ${_kvcomp_dnnl_version}. Get it from PyPI with scripts/install-onednn.sh (or "
    "`pip install onednn-devel-cpu-gomp==2023.2.0` into the environment of python3), or point "
    "CMAKE_PREFIX_PATH / dnnl_DIR at an installed one (oneDNN 2.x is not supported).")
endif()

set(KVCOMP_DNNL_FROM_PYPI_ENV OFF)
get_filename_component(_kvcomp_found_dnnl_dir "${dnnl_DIR}" REALPATH)
if(_kvcomp_pypi_dnnl_dir AND _kvcomp_found_dnnl_dir STREQUAL _kvcomp_pypi_dnnl_dir)
  set(KVCOMP_DNNL_FROM_PYPI_ENV ON)
endif()
message(STATUS "kvcomp: oneDNN ${dnnl_VERSION} from ${dnnl_DIR}")
