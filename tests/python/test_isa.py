"""The run-time ISA choice seen from Python: kvcomp.kernel_isa() names it, KVCOMP_ISA caps it, and the
outputs of both operators are bitwise the same under every cap (each cap needs its own process: the
choice is made once per process)."""

import os
import subprocess
import sys

import numpy as np

import kvcomp

# Runs one forward and one backward on a fixed case and prints the ISA and a digest of every output.
_CHILD = r"""
import hashlib, sys
import numpy as np
import torch
import kvcomp
from support import make_case
case = make_case(lens=[37, 50], th=True, r=3, coff=2, start_pos=[4, 9], dtype="fp32", seed=5)
k = case.kwargs()
cache = case.state_cache.clone()
cmp_kv, s, kv = kvcomp.compressor_forward(case.x, case.wkv, case.wgate, cache, case.ape, case.cmp_ratio,
                                          grad_enabled=True, **k)
g = torch.Generator().manual_seed(3)
d = torch.randn(cmp_kv.shape, generator=g, dtype=cmp_kv.dtype)
grads = kvcomp.compressor_grad(case.x, case.wkv, case.wgate, d, s, kv, case.cmp_ratio,
                               **{n: k[n] for n in ("cu_seqlens", "seqused", "start_pos", "coff") if n in k})
h = hashlib.sha256()
for t in (cmp_kv, s, kv, cache, *grads):
    h.update(t.contiguous().numpy().tobytes())
print(kvcomp.kernel_isa(), h.hexdigest())
"""


def _run(isa):
    env = dict(os.environ)
    env.pop("KVCOMP_ISA", None)
    if isa:
        env["KVCOMP_ISA"] = isa
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        env=env,
        cwd=os.path.dirname(__file__),
        capture_output=True,
        text=True,
        check=True,
    )
    name, digest = out.stdout.split()
    return name, digest


def test_kernel_isa_names_a_known_variant():
    assert kvcomp.kernel_isa() in ("scalar", "avx2", "avx512")


def test_outputs_do_not_depend_on_the_isa():
    best, ref = _run(None)
    scalar, digest = _run("scalar")
    assert scalar == "scalar"
    assert digest == ref, f"scalar kernels differ from {best}"
    if best in ("avx2", "avx512"):
        avx2, digest2 = _run("avx2")
        assert avx2 == "avx2"
        assert digest2 == ref


def test_release_cached_workspace_keeps_results():
    x = np.ones((1, 8, 4), np.float32)
    w = np.full((2 * 3, 4), 0.1, np.float32)
    cache = np.zeros((2, 8, 2 * 2 * 3), np.float32)
    ape = np.zeros((2, 2 * 3), np.float32)
    table = np.array([[1]], np.int32)
    ca, cb = cache.copy(), cache.copy()
    a = kvcomp.compressor_forward(x, w, w, ca, ape, 2, state_block_table=table, coff=2, grad_enabled=True)
    kvcomp.release_cached_workspace()
    b = kvcomp.compressor_forward(x, w, w, cb, ape, 2, state_block_table=table, coff=2, grad_enabled=True)
    assert len(a) == len(b) == 3
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_array_equal(ca, cb)
    assert np.abs(a[0]).sum() > 0  # a real result, not two empty ones
