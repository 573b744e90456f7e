#!/usr/bin/env bash
# Installs what the Python package (python/, docs/python.md) and its tests need, and registers the
# package's build folder with the interpreter:
#   * torch (2.13.0 when no torch >= 2.4 is importable: a CPU build; never an unpinned "torch", which
#     would fetch a multi-GB CUDA build), nanobind (to build kvcomp._C), numpy, pytest, hypothesis,
#     scikit-build-core (the build backend of `pip install .`, pyproject.toml);
#   * a kvcomp-build.pth file in the interpreter's site-packages naming <repo>/build/python, so that
#     `python3 -c "import kvcomp.torch"` works once scripts/build.sh has run (the folder may not exist
#     yet: Python skips .pth entries that do not exist). KVCOMP_NO_PTH=1 skips this step; then set
#     PYTHONPATH=<repo>/build/python instead.
# Does nothing that is already done. Uses python3, or $PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
pip_install() {
  echo "[kvcomp] installing Python packages: $*"
  "$python" -m pip install --quiet "$@"
}

if ! "$python" -c "import torch, sys; sys.exit(tuple(map(int, torch.__version__.split('.')[:2])) < (2, 4))" \
    >/dev/null 2>&1; then
  pip_install torch==2.13.0
fi

missing=()
for m in nanobind numpy pytest hypothesis scikit_build_core; do
  "$python" -c "import $m" >/dev/null 2>&1 || missing+=("${m//_/-}")
done
((${#missing[@]} == 0)) || pip_install "${missing[@]}"

if [ "${KVCOMP_NO_PTH:-0}" != 1 ]; then
  "$python" - "$PWD/build/python" <<'PY'
import os, site, sys, sysconfig
target = sys.argv[1]
for d in (sysconfig.get_paths()["purelib"], site.getusersitepackages()):
    try:
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "kvcomp-build.pth"), "w") as f:
            f.write(target + "\n")
        print(f"[kvcomp] {d}/kvcomp-build.pth -> {target}")
        break
    except OSError:
        continue
else:
    sys.exit("[kvcomp] could not write kvcomp-build.pth; set PYTHONPATH=" + target)
PY
fi
