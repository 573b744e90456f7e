#!/usr/bin/env python3
"""Fails when the build relies on a Debian package that the set-up does not install.

The set-up (scripts/install-deps.sh) installs the packages of scripts/debian-packages.txt. A build that
also works because of a package somebody installed by hand passes on that machine and fails on a fresh
one. This check lists every file the build actually uses that belongs to a Debian package:

  * every file the configure step opens, stats or executes (a fresh configure watched with strace, so
    find_package / find_path / find_library probes that succeed are seen, including those made inside
    other projects' CMake packages),
  * every header the compiler read for every object of the finished build (ninja's dependency log),
  * every library given by path on a link line of the finished build,

and requires the Debian package owning each development file among them (headers, CMake and pkg-config
files, static libraries, libX.so links) to be a listed one, a package those depend on (recursively), or a
package every Debian system has (priority required). Files of no Debian package (pip's torch, pyenv's
Python, the project itself) are not its business, with one exception: oneDNN is no Debian package of the
set-up but PyPI's (onednn-devel-cpu-gomp, onednn-cpu-gomp; scripts/install-onednn.sh unpacks them into a
prefix), so every oneDNN file the build uses (headers, CMake package, libdnnl) must lie in that prefix,
and at least one must be seen there (a check that sees none is blind).

Usage: check_deps.py BUILD_DIR [--without PKG ...] [--self-check PKG] [-- cmake arguments of the configure]
(--without PKG: check as if PKG were not listed; --self-check PKG: also require that PKG off the list is
caught, from the same observation, so that a check gone blind fails.)
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(cmd, **kw):
    return subprocess.run(cmd, check=True, text=True, stdout=subprocess.PIPE, **kw).stdout


def listed_packages():
    names = []
    with open(os.path.join(HERE, "debian-packages.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                names.append(line)
    return names + ["cmake"]  # install-deps.sh adds cmake when none is on PATH


def installed(names):
    out = run(["dpkg-query", "-W", "-f", "${Package} ${Status}\n"] + names, stderr=subprocess.DEVNULL)
    return [l.split()[0] for l in out.splitlines() if l.endswith("install ok installed")]


def allowed_packages(listed):
    """The listed packages, what they depend on (installed ones, recursively), and priority required."""
    roots = installed(listed)
    missing = sorted(set(listed) - set(roots) - {"cmake"})
    if missing:
        sys.exit("[kvcomp] check-deps: not installed, run scripts/install-deps.sh first: " + " ".join(missing))
    out = run(
        ["apt-cache", "depends", "--recurse", "--installed", "--no-recommends", "--no-suggests",
         "--no-conflicts", "--no-breaks", "--no-replaces", "--no-enhances"] + roots,
        stderr=subprocess.DEVNULL,
    )
    allowed = set(roots)
    for line in out.splitlines():
        # "pkg" heads a package; "  Depends: dep" / " |Depends: alt" / "  PreDepends: <virtual>" follow.
        name = line.partition(":")[2] if line[:1] in (" ", "|") else line
        name = name.strip().strip("<>").split(":")[0]
        if name:
            allowed.add(name)
    base = run(["dpkg-query", "-W", "-f", "${Package} ${Priority}\n"])
    allowed |= {l.split()[0] for l in base.splitlines() if l.split()[-1] in ("required",)}
    return allowed


LIBRARY = re.compile(r"\.(so(\.\d+)*|a)$")
CONFIG_FILE = re.compile(r"(-config|Config)(-?[Vv]ersion)?\.cmake$")
PATH_IN_CALL = re.compile(r'^(?:\[pid\s+\d+\]\s+|\d+\s+)?(\w+)\((?:AT_FDCWD|\d+)?,?\s*"([^"]+)"')


def configure_files(cmake_args):
    """Files a fresh configure touches successfully, seen by strace (--seccomp-bpf: the other system
    calls run unstopped, which halves the watched configure's time)."""
    tmp = tempfile.mkdtemp(prefix="kvcomp-check-deps-")
    try:
        log = os.path.join(tmp, "strace.log")
        subprocess.run(
            ["strace", "-f", "--seccomp-bpf", "-qq", "-o", log, "-e",
             "trace=open,openat,stat,lstat,newfstatat,statx,access,faccessat,faccessat2,execve",
             "cmake", "-S", ROOT, "-B", os.path.join(tmp, "build"), "-G", "Ninja"] + cmake_args,
            check=True, stdout=subprocess.DEVNULL,
        )
        files, opened = set(), set()
        with open(log, errors="replace") as f:
            for line in f:
                if " = -1 " in line or "<unfinished" in line:
                    continue
                m = PATH_IN_CALL.match(line)
                if m:
                    files.add(m.group(2))
                    if m.group(1) in ("open", "openat"):
                        opened.add(os.path.normpath(m.group(2)))
        # find_package looks at the config file and reads the version file of every candidate it meets
        # (Debian's oneDNN 2.6, for one, where oneDNN >= 3.2 is asked for); a package is used only when
        # its config file is read.
        # find_library, likewise, looks at every candidate (CMake's CUDA module at libOpenCL.so, for
        # one); a library is used when the build links it, which build_files sees on the link lines.
        def probe_only(p):
            m = CONFIG_FILE.search(p)
            if m is not None:
                return os.path.normpath(p[: m.start()] + m.group(1) + ".cmake") not in opened
            return LIBRARY.search(p) is not None and os.path.normpath(p) not in opened
        return {p for p in files if not probe_only(p)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_files(build_dir):
    """Headers every object of the finished build read, and libraries named by path on its link lines."""
    files = set()
    deps = run(["ninja", "-C", build_dir, "-t", "deps"])
    for line in deps.splitlines():
        if line.startswith("    "):
            files.add(os.path.normpath(os.path.join(build_dir, line.strip())))
    cmds = run(["ninja", "-C", build_dir, "-t", "commands"])
    for tok in cmds.split():
        if tok.startswith("/") and re.search(r"\.(so(\.\d+)*|a)$", tok):
            files.add(tok)
    return files


DEV_FILE = re.compile(r"(^/usr/include/|\.(h|hh|hpp|hxx|inc|inl|cmake|pc|a)$|/lib[^/]*\.so$)")


def is_dev_file(path):
    """What only a development package provides: headers, CMake and pkg-config files, static
    libraries, and the unversioned libX.so link the linker looks for. Shared libraries loaded by the
    tools, locale and TLS data are runtime files of the base system, not what a build can lack."""
    return DEV_FILE.search(path) is not None


def owners(paths):
    """Debian package of each development file (as seen, resolved, and with /usr merged or not)."""
    candidates = {}
    for p in paths:
        if not os.path.isabs(p) or not os.path.isfile(p) or p.startswith(ROOT + os.sep) or not is_dev_file(p):
            continue
        forms = {p, os.path.realpath(p)}
        for q in list(forms):
            forms.add(q[4:] if q.startswith("/usr/") else "/usr" + q)
        for q in forms:
            candidates.setdefault(q, p)
    found = {}
    names = sorted(candidates)
    for i in range(0, len(names), 500):
        res = subprocess.run(["dpkg-query", "-S"] + names[i : i + 500], text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        for line in res.stdout.splitlines():
            pkgs, _, path = line.partition(": ")
            if pkgs.startswith("diversion") or path not in candidates:
                continue  # a diversion line or a directory match
            for pkg in pkgs.split(", "):
                found.setdefault(pkg.split(":")[0], set()).add(candidates[path])
    return found


ONEDNN_FILE = re.compile(r"(/oneapi/dnnl/|/dnnl[^/]*\.h(pp)?$|/cmake/dnnl/|/libdnnl\.so)")


def onednn_prefix():
    """The prefix scripts/install-onednn.sh fills (it prints it; the install is skipped when complete)."""
    out = run(["bash", os.path.join(HERE, "install-onednn.sh")])
    return os.path.realpath(out.strip().splitlines()[-1])


def onednn_files(paths, prefix):
    """The oneDNN files among `paths`: (those in the PyPI prefix, those elsewhere)."""
    inside, outside = set(), set()
    for p in paths:
        if not os.path.isabs(p) or not os.path.isfile(p) or not ONEDNN_FILE.search(p):
            continue
        (inside if os.path.realpath(p).startswith(prefix + os.sep) else outside).add(p)
    return inside, outside


def foreign_packages(used, listed):
    """The packages among `used` that neither the list nor every Debian system provides."""
    allowed = allowed_packages(listed)
    return {pkg: files for pkg, files in used.items() if pkg not in allowed}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build_dir", help="a finished Ninja build of the project (its headers and link lines)")
    ap.add_argument("--without", action="append", default=[], metavar="PKG",
                    help="check as if PKG were not in scripts/debian-packages.txt")
    ap.add_argument("--self-check", metavar="PKG",
                    help="also require the same files to be refused with PKG off the list (the check is not blind)")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.cmake_args = argv[cut + 1 :]  # the watched configure's arguments, after --
    for tool in ("strace", "dpkg-query", "apt-cache", "ninja"):
        if shutil.which(tool) is None:
            sys.exit(f"[kvcomp] check-deps: {tool} not found (scripts/install-deps.sh installs what it needs)")
    listed = [p for p in listed_packages() if p not in args.without]
    seen = configure_files(args.cmake_args) | build_files(args.build_dir)
    used = owners(seen)
    foreign = foreign_packages(used, listed)
    prefix = onednn_prefix()
    pypi, elsewhere = onednn_files(seen, prefix)
    if elsewhere or not pypi:
        print(f"[kvcomp] check-deps: oneDNN must come from PyPI's wheels in {prefix} (scripts/install-onednn.sh); "
              f"the build used {len(pypi)} oneDNN files there and these elsewhere: {sorted(elsewhere)[:5]}",
              file=sys.stderr)
        return 1
    print(f"[kvcomp] check-deps: {len(pypi)} oneDNN files, all from PyPI's wheels (scripts/install-onednn.sh)")
    print(f"[kvcomp] check-deps: the build uses development files of {len(used)} Debian packages")
    if foreign:
        print("[kvcomp] check-deps: the build relies on Debian packages that scripts/install-deps.sh does not "
              "install (add them to scripts/debian-packages.txt, or stop needing them):", file=sys.stderr)
        for pkg in sorted(foreign):
            example = sorted(foreign[pkg])[:3]
            print(f"  {pkg}: {', '.join(example)}", file=sys.stderr)
        return 1
    print("[kvcomp] check-deps: each is installed by scripts/install-deps.sh (or by every Debian system)")
    if args.self_check:
        if args.self_check not in foreign_packages(used, [p for p in listed if p != args.self_check]):
            print(f"[kvcomp] check-deps: with {args.self_check} off the list the check still passes: it is blind",
                  file=sys.stderr)
            return 1
        print(f"[kvcomp] check-deps: self-check passed ({args.self_check} off the list is caught)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
