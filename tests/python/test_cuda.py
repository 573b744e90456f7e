"""kvcomp on CUDA tensors through Python: zero copy (outputs on the input's device, the state cache
updated in place), torch's current stream, run-to-run determinism, and agreement with the CPU backend.
The sweep against the float64 references, opcheck and torch.compile on CUDA are the device="cuda"
cases of test_torch_op.py and test_compile.py. Skipped without a GPU or the CUDA backend."""

import pytest
import torch

import kvcomp
import kvcomp.torch as kt
from kvcomp.compare import two_way
from support import CUDA_REASON, make_case, on_device

pytestmark = pytest.mark.skipif(CUDA_REASON is not None, reason=str(CUDA_REASON))

CASE = dict(lens=[37, 21, 9], th=True, r=4, coff=2, start_pos=[5, 0, 11], H=64, D=32, dtype="bf16")


def forward(case, **kw):
    return kvcomp.compressor_forward(
        case.x,
        case.wkv,
        case.wgate,
        case.state_cache,
        case.ape,
        case.cmp_ratio,
        grad_enabled=True,
        **case.kwargs(),
        **kw,
    )


def grad(case, d_cmp_kv, fwd):
    return kvcomp.compressor_grad(
        case.x,
        case.wkv,
        case.wgate,
        d_cmp_kv,
        fwd[1],
        fwd[2],
        case.cmp_ratio,
        cu_seqlens=case.cu_seqlens,
        seqused=case.seqused,
        start_pos=case.start_pos,
        coff=case.coff,
    )


def test_outputs_stay_on_the_device_and_the_cache_is_updated_in_place():
    case = on_device(make_case(seed=41, **CASE), "cuda")
    before = case.state_cache.clone()
    ptr = case.state_cache.data_ptr()
    cmp_kv, s, kv = forward(case)
    assert {t.device.type for t in (cmp_kv, s, kv)} == {"cuda"}
    assert case.state_cache.data_ptr() == ptr and not torch.equal(case.state_cache, before)


def test_runs_on_torch_current_stream_and_is_deterministic():
    base = make_case(seed=42, **CASE)
    ref_case = on_device(base, "cuda")
    ref = forward(ref_case)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    case = on_device(base, "cuda")
    with torch.cuda.stream(side):
        out = forward(case)
        d = torch.randn_like(out[0])
        grads = grad(case, d, out)
    side.synchronize()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
    assert torch.equal(case.state_cache, ref_case.state_cache)
    again = grad(case, d, out)
    for a, b in zip(grads, again):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["precise", "npu_parity"])
def test_autograd_agrees_with_the_cpu_backend(precision):
    base = make_case(seed=43, **CASE)
    results = {}
    for device in ("cpu", "cuda"):
        case = on_device(base, device)
        leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
        cache = case.state_cache.clone()
        kvcomp.set_default_options(precision=precision)
        try:
            out = kt.compressor(
                leaves[0], leaves[1], leaves[2], cache, leaves[3], case.cmp_ratio, **case.kwargs()
            )
            out.backward(torch.ones_like(out))
        finally:
            kvcomp.set_default_options(precision="precise")
        results[device] = [out.detach().cpu()] + [t.grad.cpu() for t in leaves] + [cache.cpu()]
    names = ("cmp_kv", "d_x", "d_wkv", "d_wgate", "d_ape", "state_cache")
    # Different matrix products (cuBLAS on tensor cores, oneDNN), the same block formulas: agreement
    # to the io dtype's tolerance, fp32 outputs included (they inherit the products' rounding).
    for name, a, b in zip(names, results["cuda"], results["cpu"]):
        r = two_way(a, b, "bf16")
        assert r.passed, (name, r.summary())
