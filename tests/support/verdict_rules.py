"""The verdict rules of spec 7 as the Python package defines them (python/kvcomp/compare.py), loaded from
the source tree by path: importing the kvcomp package needs the compiled extension, and the tests that use
these rules (tests/cli, tests/precision) run without it."""

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "python" / "kvcomp" / "compare.py"
_SPEC = importlib.util.spec_from_file_location("kvcomp_compare_rules", _PATH)
compare = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = compare  # dataclasses looks the module up while it builds the result classes
_SPEC.loader.exec_module(compare)
