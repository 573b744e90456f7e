"""The layers of src/ and which may include which: every arrow points down.

    api/          the entry points: plan, execute, the one-call wrappers; dispatch to the backends
    cpu/ cuda/    the backends (neither sees the other)
    cpu/products/ the CPU's matrix products: kernels, oneDNN tiles, order probes, the product config;
                  below the CPU drivers (forward, backward, block phases), which it never includes
    validate/     the rules of docs/semantics.md and the block plan of a call
    plan/         the block plan's data, the state-cache view
    common/       what the backends share: numerics, workspace layout, the device-access interface,
                  the environment, the backward path

reference/ (the float64 oracle) and io/ (.npy, case folders) stand apart: public headers only.
A folder under src/ that is not in LAYERS fails the check, so a new one must be placed here. A file
belongs to the deepest layer whose folder holds it; an include is allowed where it names an allowed
layer's folder (or an allowed file).

Usage: check_layers.py SRC_DIR   (exit 1 and one line per upward arrow)
       check_layers.py --self-test   (the check finds an arrow planted in a scratch tree)
"""

import os
import re
import sys
import tempfile

LAYERS = {
    "common": set(),
    "plan": {"common"},
    "validate": {"common", "plan"},
    "cpu": {"common", "plan", "cpu/products"},
    # The products see the CPU's ISA choice and its io conversions, nothing else of the backend.
    "cpu/products": {"common", "cpu/isa.hpp", "cpu/convert.hpp"},
    "cuda": {"common", "plan"},
    "api": {"common", "plan", "validate", "cpu", "cuda"},
    "reference": set(),
    "io": set(),
}


def layer_of(path):
    """The deepest layer whose folder holds `path` (relative to src/, '/'-separated), or None."""
    best = None
    for name in LAYERS:
        if path == name or path.startswith(name + "/"):
            if best is None or len(name) > len(best):
                best = name
    return best


def allowed_target(target, layer):
    """Whether a file of `layer` may include `target` (relative to src/)."""
    if layer_of(target) == layer:
        return True
    for a in LAYERS[layer]:
        if target == a or (target.startswith(a + "/") and layer_of(target) == layer_of(a)):
            return True
    return False
SOURCES = (".hpp", ".cpp", ".cu", ".inl", ".hpp.in", ".h")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def violations(src):
    found = []
    for top in sorted(os.listdir(src)):
        folder = os.path.join(src, top)
        if not os.path.isdir(folder):
            continue
        if top not in LAYERS:
            found.append(f"src/{top}/: a folder no layer rule names (tests/layering/check_layers.py)")
            continue
        for root, _, files in os.walk(folder):
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, src).replace(os.sep, "/")
                layer = layer_of(rel)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = m.group(1)
                        if target.startswith("kvcomp/"):
                            continue  # the public headers (and the generated version header)
                        if ".." in target.split("/") or "/" not in target:
                            found.append(f"src/{rel}:{number}: #include \"{target}\" must name a src/ folder")
                        elif not allowed_target(target, layer):
                            found.append(
                                f"src/{rel}:{number}: #include \"{target}\": {layer}/ must not depend on "
                                f"{layer_of(target) or target.split('/', 1)[0]}/ (it may include "
                                f"{', '.join(sorted(LAYERS[layer] | {layer}))})"
                            )
    return found


def self_test():
    with tempfile.TemporaryDirectory() as d:
        for layer, text in {
            "common": '#include "kvcomp/kvcomp.hpp"\n',
            "validate": '#include "plan/block_plan.hpp"\n#include "cuda/backend.hpp"\n',
            "cpu": '#include "api/api.hpp"\n#include "cpu/products/x.hpp"\n',
            "api": '#include "cpu/backend.hpp"\n#include "cpu/products/config.hpp"\n',
            "cpu/products": '#include "cpu/isa.hpp"\n#include "cpu/backend.hpp"\n',
            "extra": "",
        }.items():
            os.makedirs(os.path.join(d, layer))
            with open(os.path.join(d, layer, "x.hpp"), "w", encoding="utf-8") as f:
                f.write(text)
        found = violations(d)
    expected = ["src/api/x.hpp:2", "src/cpu/products/x.hpp:2", "src/cpu/x.hpp:1", "src/extra/",
                "src/validate/x.hpp:2"]
    ok = len(found) == len(expected) and all(f.startswith(e) for f, e in zip(sorted(found), expected))
    print("\n".join(found))
    print("self-test:", "ok" if ok else f"FAILED (expected reports at {expected})")
    return 0 if ok else 1


def main(argv):
    if argv[1:] == ["--self-test"]:
        return self_test()
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    found = violations(argv[1])
    for line in found:
        print(line)
    print(f"layering: {len(found)} upward include(s)" if found else "layering: every include points down")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
