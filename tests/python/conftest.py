"""Makes the built package importable when pytest is run by hand (ctest sets PYTHONPATH itself; by hand
the default is ../../build/python, or $KVCOMP_BUILD_DIR/python) and the test support module importable
from every test file."""

import os
import sys
import tempfile

# hypothesis keeps its files in ./.hypothesis by default: keep the source tree clean.
os.environ.setdefault(
    "HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "kvcomp-hypothesis")
)

_here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, _here)
try:
    import kvcomp  # noqa: F401
except ImportError:
    _build = os.environ.get("KVCOMP_BUILD_DIR", os.path.join(_here, "..", "..", "build"))
    sys.path.insert(0, os.path.join(_build, "python"))
