#!/usr/bin/env python3
"""`pip install` of the repository into a fresh virtual environment, as a user does it.

For each of a regular and an editable install (``--modes``):
  1. create a venv in a temporary folder (``--python``: its interpreter),
  2. ``pip install <repo>`` (or ``-e``): scikit-build-core builds libkvcomp and the extension,
  3. check that ``import kvcomp.torch`` resolves to the venv (regular) or the source tree (editable),
     with no PYTHONPATH and no .pth file of the build tree involved,
  4. run pytest files of tests/python against that install, from a folder outside the repository,
  5. ``pip uninstall -y kvcomp`` and check that every file the install added is gone.

Two ways to provide torch, numpy and pytest in the venv:
  * ``--system-site-packages`` (the ctest entry): taken from the interpreter running this script; the
    build is then made without isolation from its scikit-build-core and nanobind, so no network is
    needed;
  * ``--deps "torch==2.11.0 numpy==2.5.2 ..."`` (scripts/test-python312.sh): pip-installed into the
    clean venv, and the build runs in pip's isolated build environment, with oneDNN from PyPI (the
    build requirement onednn-devel-cpu-gomp, the dependency onednn-cpu-gomp): the libdnnl.so.3 the
    import loads must be the venv's. With ``--keep-venv DIR`` that
    venv is made once and reused by later runs (installing torch took about 110 s of each run): kvcomp
    is still installed, tested and uninstalled in it each time, and must leave nothing behind.

Exit status 0 when every check held.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests", "python")


def log(msg):
    print(f"[pip-install-check] {msg}", flush=True)


def run(cmd, **kw):
    log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def clean_env():
    env = dict(os.environ)
    # KVCOMP_EXPECT_CUDA_BACKEND describes the ctest build, not what pip builds.
    for k in ("PYTHONPATH", "PYTHONHOME", "KVCOMP_BUILD_DIR", "VIRTUAL_ENV", "KVCOMP_EXPECT_CUDA_BACKEND"):
        env.pop(k, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def installed_files(py, env):
    """Absolute paths of the files pip recorded for kvcomp (empty when it is not installed)."""
    code = (
        "import importlib.metadata as m, os, sys\n"
        "try:\n    d = m.distribution('kvcomp')\nexcept m.PackageNotFoundError:\n    sys.exit(0)\n"
        "for f in d.files or []:\n    print(os.path.realpath(d.locate_file(f)))\n"
    )
    out = subprocess.run([py, "-c", code], env=env, check=True, text=True, stdout=subprocess.PIPE).stdout
    return [l for l in out.splitlines() if l]


def check_import(py, env, pkg_under, ext_under, onednn_under=None):
    """Imports kvcomp.torch from a neutral folder; the package and its extension must come from where
    the install put them, and (onednn_under) the libdnnl.so.3 the process loaded from that folder."""
    code = (
        "import os, kvcomp, kvcomp.torch, kvcomp._C as c\n"
        "print(os.path.realpath(kvcomp.__file__)); print(os.path.realpath(c.__file__))\n"
        "print(kvcomp.__version__)\n"
        "maps = open('/proc/self/maps').read().split()\n"
        "print(next((os.path.realpath(w) for w in maps if '/libdnnl.so' in w), 'none'))\n"
    )
    env = dict(env)
    env.pop("LD_LIBRARY_PATH", None)  # libkvcomp's RUNPATH must find oneDNN
    out = subprocess.run([py, "-c", code], env=env, check=True, text=True, stdout=subprocess.PIPE,
                         cwd=tempfile.gettempdir()).stdout.split()
    pkg, ext, version, dnnl = out
    log(f"kvcomp {version}: package {pkg}, extension {ext}, oneDNN {dnnl}")
    checks = [("kvcomp", pkg, pkg_under), ("kvcomp._C", ext, ext_under)]
    if onednn_under:
        checks.append(("libdnnl.so.3", dnnl, onednn_under))
    for what, path, under in checks:
        if not path.startswith(os.path.realpath(under) + os.sep):
            raise SystemExit(f"{what} was imported from {path}, expected under {under}")


def kept_venv(args, env):
    """The venv of ``--keep-venv``: made once with ``--deps`` and reused while the interpreter and the
    deps are the same (a marker file names both; written only once the deps are installed, so a run
    cut short is started again). A kvcomp left in it by a run cut short is uninstalled first."""
    venv = args.keep_venv
    marker = os.path.join(venv, "kvcomp-pip-check-deps")
    want = f"{os.path.realpath(args.python)}\n{args.deps}\n"
    py = os.path.join(venv, "bin", "python")
    try:
        with open(marker) as f:
            reuse = f.read() == want and os.access(py, os.X_OK)
    except OSError:
        reuse = False
    if reuse:
        log(f"reusing the venv {venv} (its deps: {args.deps})")
        if installed_files(py, env):
            log("kvcomp is installed there (an earlier run was cut short): uninstalled first")
            run([py, "-m", "pip", "uninstall", "--yes", "--quiet", "kvcomp"], env=env)
        return py
    shutil.rmtree(venv, ignore_errors=True)
    new_venv(args, venv, env)
    with open(marker, "w") as f:
        f.write(want)
    return py


def new_venv(args, venv, env):
    """Makes the venv (seeing this interpreter's packages with --system-site-packages), installs
    --deps into it, and returns its interpreter."""
    cmd = [args.python, "-m", "venv", venv]
    if args.system_site_packages:
        cmd.append("--system-site-packages")
    run(cmd, env=env)
    py = os.path.join(venv, "bin", "python")
    if args.deps:
        run([py, "-m", "pip", "install", "--quiet"] + args.deps.split(), env=env)
    return py


def one_mode(args, editable, work):
    env = clean_env()
    if args.keep_venv:
        py = kept_venv(args, env)
    else:
        py = new_venv(args, os.path.join(work, "venv-editable" if editable else "venv"), env)
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env,
                          check=True, text=True, stdout=subprocess.PIPE).stdout.strip()
    before = set(installed_files(py, env))
    if before:
        raise SystemExit(f"kvcomp is already installed in the venv: {sorted(before)[:3]}")

    install = [py, "-m", "pip", "install", "--quiet"]
    if args.system_site_packages:
        install.append("--no-build-isolation")  # scikit-build-core and nanobind of the base interpreter
        # No download: numpy is the base interpreter's, and oneDNN is the one this build's CMake finds
        # (CMAKE_PREFIX_PATH of the ctest entry), whose folder libkvcomp's RUNPATH then names.
        install.append("--no-deps")
        # Both modes compile the same CMake project with the same settings: the second install
        # reuses the first's build folder (the compile took about 45 s of each on 2 cores), while
        # what differs, how the result is installed and found, is still checked for each.
        install.append("--config-settings=build-dir=" + os.path.join(work, "build"))
    install += ["-e", ROOT] if editable else [ROOT]
    run(install, env=env)
    files = installed_files(py, env)
    if not files:
        raise SystemExit("pip reports no file of kvcomp after the install")
    # An editable install keeps the compiled part in the venv; its Python modules come from the source.
    # Without --system-site-packages, oneDNN is PyPI's onednn-cpu-gomp, a dependency installed in the venv.
    check_import(py, env, os.path.join(ROOT, "python") if editable else site, site,
                 None if args.system_site_packages else os.path.dirname(os.path.dirname(py)))

    tests = [os.path.join(TESTS, t) for t in (args.tests_editable if editable else args.tests)]
    if tests:
        # From outside the repository, so nothing but the install can provide kvcomp; conftest.py
        # falls back to the build tree only when kvcomp is not importable at all.
        run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", os.path.join(TESTS, "pytest.ini"),
             "--rootdir", TESTS] + tests, env=env, cwd=work)

    run([py, "-m", "pip", "uninstall", "--yes", "--quiet", "kvcomp"], env=env)
    left = [f for f in files if os.path.exists(f)]
    if left:
        raise SystemExit(f"pip uninstall left {len(left)} files behind: {left[:5]}")
    if installed_files(py, env):
        raise SystemExit("pip still lists kvcomp after the uninstall")
    leftovers = [n for n in os.listdir(site) if n.lower().startswith(("kvcomp", "_kvcomp"))]
    if leftovers:
        raise SystemExit(f"pip uninstall left in site-packages: {leftovers}")
    log(f"{'editable' if editable else 'regular'} install: {len(files)} files installed, imported, "
        f"tested and removed")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=sys.executable, help="interpreter of the venv (default: this one)")
    ap.add_argument("--system-site-packages", action="store_true",
                    help="let the venv see this interpreter's packages (torch, pytest, scikit-build-core)")
    ap.add_argument("--deps", default="", help="packages to pip-install into the clean venv first")
    ap.add_argument("--keep-venv", default="",
                    help="with --deps: a venv folder kept between runs (made once, reused while the "
                         "interpreter and the deps are the same) instead of a fresh one")
    ap.add_argument("--modes", default="regular,editable", help="regular, editable or both (comma-separated)")
    ap.add_argument("--tests", nargs="*", default=["test_functional.py"],
                    help="tests/python files run against the regular install")
    ap.add_argument("--tests-editable", nargs="*", default=["test_functional.py"],
                    help="tests/python files run against the editable install")
    args = ap.parse_args()
    if not args.system_site_packages and not args.deps:
        ap.error("give --system-site-packages or --deps (the tests need torch, numpy and pytest)")
    if args.keep_venv and (not args.deps or args.system_site_packages):
        ap.error("--keep-venv goes with --deps, without --system-site-packages")
    work = tempfile.mkdtemp(prefix="kvcomp-pip-")
    try:
        for mode in args.modes.split(","):
            one_mode(args, mode == "editable", work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log("passed")


if __name__ == "__main__":
    main()
