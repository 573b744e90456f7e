"""The layers of src/ and which may include which: every arrow points down.

    api/        the entry points: plan, execute, the one-call wrappers; dispatch to the backends
    cpu/ cuda/  the backends (neither sees the other)
    validate/   the rules of spec section 4 and the block plan of a call
    plan/       the block plan's data
    common/     what the backends share: numerics, workspace layout, the device-access interface

reference/ (the float64 oracle) and io/ (.npy, case folders) stand apart: public headers only.
A folder under src/ that is not in LAYERS fails the check, so a new one must be placed here.

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
    "cpu": {"common", "plan"},
    "cuda": {"common", "plan"},
    "api": {"common", "plan", "validate", "cpu", "cuda"},
    "reference": set(),
    "io": set(),
}
SOURCES = (".hpp", ".cpp", ".cu", ".inl", ".hpp.in", ".h")
INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


def violations(src):
    found = []
    for layer in sorted(os.listdir(src)):
        folder = os.path.join(src, layer)
        if not os.path.isdir(folder):
            continue
        if layer not in LAYERS:
            found.append(f"src/{layer}/: a folder no layer rule names (tests/layering/check_layers.py)")
            continue
        allowed = LAYERS[layer] | {layer}
        for root, _, files in os.walk(folder):
            for name in sorted(files):
                if not name.endswith(SOURCES):
                    continue
                path = os.path.join(root, name)
                rel = os.path.relpath(path, src)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = m.group(1)
                        if target.startswith("kvcomp/"):
                            continue  # the public headers (and the generated version header)
                        top = target.split("/", 1)[0]
                        if ".." in target.split("/") or "/" not in target:
                            found.append(f"src/{rel}:{number}: #include \"{target}\" must name a src/ folder")
                        elif top not in allowed:
                            found.append(
                                f"src/{rel}:{number}: #include \"{target}\": {layer}/ must not depend on {top}/"
                                f" (it may include {', '.join(sorted(allowed))})"
                            )
    return found


def self_test():
    with tempfile.TemporaryDirectory() as d:
        for layer, text in {
            "common": '#include "kvcomp/kvcomp.hpp"\n',
            "validate": '#include "plan/block_plan.hpp"\n#include "cuda/backend.hpp"\n',
            "cpu": '#include "api/api.hpp"\n',
            "extra": "",
        }.items():
            os.makedirs(os.path.join(d, layer))
            with open(os.path.join(d, layer, "x.hpp"), "w", encoding="utf-8") as f:
                f.write(text)
        found = violations(d)
    expected = ["src/cpu/x.hpp:1", "src/extra/", "src/validate/x.hpp:2"]
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
