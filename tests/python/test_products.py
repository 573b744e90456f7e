"""The CPU's matrix-product kernels (src/cpu/gemm_bf16.hpp): with KVCOMP_PRODUCTS=bf16 (opt-in for now)
the forward projections of bf16 calls run on the bf16 dot-product units (AMX-BF16, AVX512-BF16) when the
CPU has them, through oneDNN's matmul; kvcomp.product_kernels() names what runs; without the variable,
with KVCOMP_PRODUCTS=f32 or KVCOMP_ISA below avx512 every product is fp32. The bf16 path is checked
for determinism across thread counts, row stability and accuracy against the float64 truth (the
fp32-projection bound, with the fp32 path as the golden); ctest also runs the torch-operator sweep
with KVCOMP_PRODUCTS=bf16. Each setting needs its own process (the choice is made once)."""

import os
import subprocess
import sys

import pytest
import torch

from kvcomp.compare import fp32_projection
from support import make_case, reference_forward


def _cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
HAS_BF16_UNITS = bool(FLAGS & {"amx_bf16", "avx512_bf16"})


def _child(code, **env):
    e = dict(os.environ)
    for k in ("KVCOMP_PRODUCTS", "KVCOMP_ISA"):
        e.pop(k, None)
    e.setdefault("KVCOMP_PRODUCTS", "bf16")
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), e.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_NAME = "import kvcomp; print(kvcomp.product_kernels())"


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
def test_bf16_units_are_used_where_the_cpu_has_them():
    name = _child(_NAME)
    assert name.startswith("bf16 (") and name.endswith(" + f32 (dnnl_sgemm)"), name
    if "amx_bf16" in FLAGS:
        assert "amx" in name, name


@pytest.mark.skipif(HAS_BF16_UNITS, reason="this CPU has bf16 units")
def test_fp32_products_without_bf16_units():
    assert _child(_NAME) == "f32 (dnnl_sgemm)"


@pytest.mark.parametrize("env", [{"KVCOMP_PRODUCTS": "f32"}, {"KVCOMP_PRODUCTS": ""}, {"KVCOMP_ISA": "avx2"}])
def test_caps_keep_fp32(env):
    assert _child(_NAME, **env) == "f32 (dnnl_sgemm)"


def test_unknown_value_is_reported_and_ignored():
    e = dict(os.environ, KVCOMP_PRODUCTS="fp8", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _NAME], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "KVCOMP_PRODUCTS (= fp8) must be f32 or bf16" in out.stderr


_THREADS = r"""
import hashlib, torch, kvcomp, kvcomp.torch as kt
from support import make_case
case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=256, D=32, dtype="bf16", seed=9)
h = []
for t in (1, 2, 3):
    kvcomp.set_default_options(num_threads=t)
    with torch.no_grad():
        out = kt.compressor(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs())
    h.append(hashlib.sha256(out.float().numpy().tobytes()).hexdigest())
print(kvcomp.product_kernels().split(" ")[0], len(set(h)))
"""


def test_bf16_forward_is_the_same_for_every_thread_count():
    kind, distinct = _child(_THREADS).split()
    assert distinct == "1", kind


_GOLDEN = r"""
import sys, torch
import kvcomp.torch as kt
from support import make_case
case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=1024, D=64, dtype="bf16", seed=11)
with torch.no_grad():
    out = kt.compressor(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs())
torch.save(out, sys.argv[1] if len(sys.argv) > 1 else "out.pt")
"""


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
def test_bf16_forward_accuracy_against_the_truth(tmp_path):
    """cmp_kv of the bf16 path within the fp32-projection bound of the float64 truth, with the fp32 path
    as the golden (each in its own process)."""
    files = {k: tmp_path / f"{k}.pt" for k in ("f32", "bf16")}
    for k, f in files.items():
        _child(_GOLDEN.replace('sys.argv[1] if len(sys.argv) > 1 else "out.pt"', repr(str(f))), KVCOMP_PRODUCTS=k)
    a, b = torch.load(files["bf16"]), torch.load(files["f32"])
    assert not torch.equal(a, b)  # the two paths really differ
    case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=1024, D=64, dtype="bf16", seed=11)
    leaves = [t.to(torch.float64) for t in (case.x, case.wkv, case.wgate, case.ape)]
    c, _ = reference_forward(*leaves[:3], case.state_cache, leaves[3], case.cmp_ratio, **case.kwargs())
    res = fp32_projection(a.float(), b.float(), c.to(torch.bfloat16).float(), "bf16")
    assert res.passed, res.summary()
