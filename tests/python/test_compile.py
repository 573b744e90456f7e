"""torch.compile: kvcomp.torch.compressor traces into one graph (fullgraph=True, so any graph break is
an error), the compiled training step gives the eager gradients and the same state cache, and the
fake kernels handle dynamic shapes. The inductor test compiles C++ and takes ~20 s on 2 cores."""

import os

import pytest
import torch

import kvcomp.torch as kt
from support import DEVICES, make_case, on_device

CASES = {
    "bsh": dict(lens=[11, 8], r=4, coff=2, start_pos=[5, 0], H=16, D=8),
    "th": dict(
        lens=[13, 6, 9],
        th=True,
        r=3,
        coff=1,
        start_pos=[1, 0, 7],
        seqused=[12, 6, 2],
        cache_mode=2,
        H=16,
        D=8,
    ),
}


def _step(case):
    def step(x, wkv, wgate, ape, cache, target):
        out = kt.compressor(x, wkv, wgate, cache, ape, case.cmp_ratio, **case.kwargs())
        return ((out.float() - target) ** 2).sum()

    return step


def _run(step, case, target):
    params = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    cache = case.state_cache.clone()
    loss = step(*params, cache, target)
    loss.backward()
    return loss.detach(), [p.grad for p in params], cache


def _compare(case, backend):
    step = _step(case)
    probe = kt.compressor(
        case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, case.cmp_ratio, **case.kwargs()
    )
    target = torch.randn(probe.shape, generator=torch.Generator().manual_seed(3)).to(probe.device)
    torch._dynamo.reset()
    eager = _run(step, case, target)
    compiled = _run(torch.compile(step, backend=backend, fullgraph=True), case, target)
    assert torch.allclose(eager[0], compiled[0], rtol=1e-6)
    for a, b in zip(eager[1], compiled[1]):
        assert torch.equal(a, b)  # the same kernels compute the gradients: bitwise equal
    assert torch.equal(eager[2], compiled[2])  # the state-cache mutation survives functionalization


@pytest.mark.parametrize("layout", list(CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_step_equals_eager_aot_eager(layout, device):
    _compare(on_device(make_case(seed=31, **CASES[layout]), device), "aot_eager")


@pytest.mark.skipif(os.environ.get("KVCOMP_SKIP_INDUCTOR") == "1", reason="KVCOMP_SKIP_INDUCTOR=1")
@pytest.mark.parametrize("device", DEVICES)
def test_compiled_step_equals_eager_inductor(device):
    _compare(on_device(make_case(seed=32, **CASES["bsh"]), device), "inductor")


def test_dynamic_shapes():
    """One compiled graph for several token counts (symbolic T: the fake kernels use shape
    arithmetic only, min(T, T//r + B) included)."""
    torch._dynamo.reset()
    fn = torch.compile(
        lambda *a, **k: kt.compressor(*a, **k), backend="aot_eager", fullgraph=True, dynamic=True
    )
    for lens in ([9, 7], [20, 5], [3, 30]):
        case = make_case(seed=33, lens=lens, th=True, r=4, coff=2, start_pos=[2, 5])
        x = case.x.clone().requires_grad_()
        args = (case.wkv, case.wgate)
        out_c = fn(x, *args, case.state_cache.clone(), case.ape, 4, **case.kwargs())
        out_e = kt.compressor(case.x, *args, case.state_cache.clone(), case.ape, 4, **case.kwargs())
        assert torch.equal(out_c, out_e)
        out_c.sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape
