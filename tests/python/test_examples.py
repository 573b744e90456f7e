"""The Python examples run: compare_npu.py passes a fabricated NPU run and fails a corrupted one;
train_tiny.py trains (its loss goes down)."""

import os
import re
import subprocess
import sys

import kvcomp

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "python")
ENV = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(kvcomp.__file__)), os.environ.get("PYTHONPATH")])
    ),
)


def run(script, *args):
    return subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, script), *args],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_compare_npu_self_test():
    ok = run("compare_npu.py", "--self-test")
    assert ok.returncode == 0 and "overall: PASS" in ok.stdout, ok.stdout + ok.stderr
    bad = run("compare_npu.py", "--self-test", "--corrupt")
    assert bad.returncode == 1 and "overall: FAIL" in bad.stdout, bad.stdout + bad.stderr
    assert re.search(r"^d_x\s+FAIL", bad.stdout, re.M) and re.search(r"^d_wkv\s+PASS", bad.stdout, re.M)


def test_train_tiny():
    res = run("train_tiny.py", "--steps", "12")
    assert res.returncode == 0, res.stdout + res.stderr
    first, last = map(float, re.search(r"loss ([\d.]+) -> ([\d.]+)", res.stdout).groups())
    assert last < 0.5 * first
