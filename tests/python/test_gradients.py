"""Finite-difference checks of the gradients of kvcomp.torch.compressor. The core has no float64 io,
so torch.autograd.gradcheck's float64 default does not apply: the checks run on fp32 io with a step
and tolerances sized for fp32 (central differences along random directions, and gradcheck in its
fast mode with those tolerances)."""

import warnings

import pytest
import torch

import kvcomp.torch as kt
from support import make_case

CASES = {
    "bsh_c2_unaligned": dict(lens=[10, 7], r=4, coff=2, start_pos=[3, 0], H=12, D=4),
    "th_c1_ring_odd_r": dict(lens=[11, 9], th=True, r=3, coff=1, start_pos=[2, 4], cache_mode=2, H=10, D=4),
}


def _loss_fn(case, weights):
    def f(x, wkv, wgate, ape):
        cache = case.state_cache.clone()  # every evaluation starts from the same cache
        out = kt.compressor(x, wkv, wgate, cache, ape, case.cmp_ratio, **case.kwargs())
        return (out.double() * weights).sum()

    return f


@pytest.mark.parametrize("name", list(CASES))
def test_directional_finite_differences(name):
    case = make_case(seed=21, **CASES[name])
    g = torch.Generator().manual_seed(5)
    probe = kt.compressor(
        case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, case.cmp_ratio, **case.kwargs()
    )
    f = _loss_fn(case, torch.randn(probe.shape, generator=g, dtype=torch.float64))
    params = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    f(*params).backward()
    h = 1e-2
    for i, p in enumerate(params):
        for _ in range(3):
            v = torch.randn(p.shape, generator=g)
            shifted = [q.detach() for q in params]
            shifted[i] = p.detach() + h * v
            f_plus = f(*shifted).item()
            shifted[i] = p.detach() - h * v
            f_minus = f(*shifted).item()
            numeric = (f_plus - f_minus) / (2 * h)
            analytic = (p.grad.double() * v.double()).sum().item()
            # fp32 forward noise ~1e-7 * |terms| / h, truncation ~h^2: 1e-3 of the magnitude is ample.
            assert abs(numeric - analytic) <= 1e-3 * max(abs(analytic), 1.0), (i, numeric, analytic)


def test_gradcheck_fast_mode_fp32():
    case = make_case(seed=22, **CASES["bsh_c2_unaligned"])
    w = torch.randn(
        kt.compressor(
            case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
        ).shape
    )

    def f(x, wkv, wgate, ape):
        out = kt.compressor(x, wkv, wgate, case.state_cache.clone(), ape, 4, **case.kwargs())
        return (out * w).sum(dim=-1)

    inputs = tuple(t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "not double precision": known, and why eps/tolerances are wide
        assert torch.autograd.gradcheck(f, inputs, eps=1e-2, atol=2e-3, rtol=2e-3, fast_mode=True)
