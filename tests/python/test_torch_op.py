"""kvcomp.torch.compressor against autograd through the small-ops float64 implementation
(support.reference_forward): a sweep over layouts, coff, cmp_ratio, start_pos, seqused, cache modes
and io dtypes, judged by the three-way criterion of spec 7.2 (and ~1e-5 relative agreement with the
float64 truth for fp32 io); plus the operator's registration and autograd behaviour."""

import inspect
import zlib

import pytest
import torch

import kvcomp
import kvcomp.torch as kt
from kvcomp.compare import three_way, two_way
from support import (DEVICES, GRAD_NAMES, IO_DTYPES, assert_close_to_truth, io_ulp, kvcomp_intermediates,
                     make_case, on_device, reference_grads)

SWEEP = {
    "bsh_c1_r4": dict(lens=[12, 12], r=4, coff=1),
    "bsh_c2_r4_unaligned_sp_seqused": dict(lens=[13, 9], r=4, coff=2, start_pos=[5, 0]),
    "th_c2_r4_unaligned_sp_seqused": dict(
        lens=[15, 10, 1], th=True, r=4, coff=2, start_pos=[5, 3, 7], seqused=[10, 10, 1]
    ),
    "th_c1_r5_odd": dict(lens=[23, 17], th=True, r=5, coff=1, start_pos=[2, 11]),
    "bsh_c2_r3_ring": dict(lens=[14, 14], r=3, coff=2, start_pos=[4, 7], cache_mode=2),
    "th_c2_r7_ring_seqused": dict(
        lens=[20, 16], th=True, r=7, coff=2, start_pos=[9, 0], seqused=[18, 5], cache_mode=2
    ),
    "bsh_c1_r128": dict(lens=[300], r=128, coff=1, start_pos=[70], H=16, D=8),
    "th_c2_r128_ring": dict(
        lens=[260, 140], th=True, r=128, coff=2, start_pos=[100, 0], cache_mode=2, H=16, D=8
    ),
    "th_c2_r4_block_id_zero": dict(lens=[30, 25], th=True, r=4, coff=2, start_pos=[6, 13], zero_ids=0.3),
    "bsh_c2_no_blocks": dict(lens=[3, 2], r=8, coff=2, start_pos=[1, 0]),
    "th_c1_seqused_zero": dict(lens=[9, 12], th=True, r=4, coff=1, seqused=[0, 12], start_pos=[3, 1]),
    "th_c2_empty_segment": dict(lens=[0, 11, 6], th=True, r=4, coff=2, start_pos=[0, 2, 5]),
}


def run_kvcomp(case, d_cmp_kv, requires=(True, True, True, True)):
    """cmp_kv, {grad name: grad or None}, updated state cache of kvcomp.torch.compressor."""
    leaves = [
        t.detach().clone().requires_grad_(rq)
        for t, rq in zip((case.x, case.wkv, case.wgate, case.ape), requires)
    ]
    x, wkv, wgate, ape = leaves
    cache = case.state_cache.clone()
    out = kt.compressor(x, wkv, wgate, cache, ape, case.cmp_ratio, **case.kwargs())
    if out.requires_grad:
        out.backward(d_cmp_kv)
    return out.detach(), dict(zip(GRAD_NAMES, (t.grad for t in leaves))), cache


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(SWEEP))
@pytest.mark.parametrize("device", DEVICES)
def test_sweep(name, dtype, device):
    """kvcomp on `device`; the references always in host memory, float64."""
    case = make_case(dtype=dtype, seed=zlib.crc32(name.encode()) % 1000, **SWEEP[name])
    io = IO_DTYPES[dtype]
    dev_case = on_device(case, device)
    softmax_score, kv = (t.cpu() for t in kvcomp_intermediates(dev_case))
    g = torch.Generator().manual_seed(7)
    d_cmp_kv = torch.randn(softmax_score.shape[:-2] + softmax_score.shape[-1:], generator=g).to(io)
    out_a, grads_a, cache_a = run_kvcomp(dev_case, d_cmp_kv.to(device))
    if device != "cpu":  # results come back to the host, and were produced on the device
        assert out_a.device.type == device and cache_a.device.type == device
        out_a, cache_a = out_a.cpu(), cache_a.cpu()
        grads_a = {n: (v.cpu() if v is not None else None) for n, v in grads_a.items()}

    # 1. Spec 7.2 three-way on the backward outputs, B and C differentiating the small-ops forward at
    #    kvcomp's intermediates (upstream's main check). For fp32 io, where B is fp32 arithmetic like A
    #    and the ratios are a coin toss around 1, d_x / d_wkv / d_wgate are held to 1e-5 of the truth
    #    instead; d_ape is fp32 for every io dtype and passes the three-way with a wide margin.
    pinned = (softmax_score, kv)
    _, grads_c, _ = reference_grads(case, d_cmp_kv, torch.float64, pinned=pinned)
    _, grads_b, _ = reference_grads(case, d_cmp_kv, torch.float32, round_grad_to=io, pinned=pinned)
    report = {}
    for n in GRAD_NAMES:
        key = "fp32" if n == "d_ape" else dtype
        if key == "fp32" and n != "d_ape":
            assert_close_to_truth(grads_a[n], grads_c[n])
            continue
        out_dt = IO_DTYPES[key]
        report[n] = three_way(grads_a[n], grads_b[n].to(out_dt), grads_c[n].to(out_dt), key)
    failed = {n: r.summary() for n, r in report.items() if not r.passed}
    assert not failed, failed

    # 2. Against plain autograd through the float64 small-ops forward (nothing shared with kvcomp).
    out_t, grads_t, cache_t = reference_grads(case, d_cmp_kv, torch.float64)
    if dtype == "fp32":
        assert_close_to_truth(out_a, out_t)
        for n in GRAD_NAMES:
            assert_close_to_truth(grads_a[n], grads_t[n])
    else:
        # cmp_kv: the correctly rounded truth, give or take one io ulp (fp32 projection noise can flip
        # a rounding), plus fp32-level error at the tensor's scale for cancelled sums.
        slack = io_ulp(out_t, dtype) + 2.0**-18 * out_t.abs().max()
        assert bool(((out_a.double() - out_t).abs() <= slack).all())
        for n in ("d_x", "d_wkv", "d_wgate"):
            r = two_way(grads_a[n], grads_t[n].to(io), dtype)
            assert r.passed, (n, r.summary())
        assert_close_to_truth(grads_a["d_ape"], grads_t["d_ape"])

    # 3. The state cache: written slots hold the fp32 projections (+ ape on the score half); every
    #    other slot is untouched, bit for bit.
    written = (case.state_cache != cache_t).any(dim=-1)
    assert torch.equal(cache_a[~written], case.state_cache[~written])
    assert_close_to_truth(cache_a[written], cache_t[written])

    if name == "bsh_c2_no_blocks":
        assert all(not grads_a[n].any() for n in GRAD_NAMES)


def test_only_some_inputs_require_grad():
    """The intermediates are kept when any of x, wkv, wgate, ape requires grad (upstream looks at x
    only); each gradient equals the one of the full run."""
    case = make_case(lens=[14, 9], th=True, r=4, coff=2, start_pos=[5, 2], seed=3)
    d = torch.randn(run_kvcomp(case, None, (False,) * 4)[0].shape)
    _, full, _ = run_kvcomp(case, d)
    for i, n in enumerate(GRAD_NAMES):
        requires = tuple(j == i for j in range(4))
        _, grads, _ = run_kvcomp(case, d, requires)
        assert torch.equal(grads[n], full[n]), n
        assert all(grads[m] is None for m in GRAD_NAMES if m != n)


def _count_saved(fn):
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fn()
    return out, saved


def test_no_grad_keeps_nothing():
    case = make_case(lens=[12, 12], r=4, coff=2, start_pos=[1, 4], seed=4)
    x = case.x.clone().requires_grad_()

    def call():
        return kt.compressor(x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs())

    with torch.no_grad():
        out, saved = _count_saved(call)
    assert out.grad_fn is None and not saved
    out_g, saved_g = _count_saved(call)
    assert out_g.grad_fn is not None
    # x, wkv, wgate, softmax_score, kv (+ start_pos) are what the backward needs.
    assert any(t.dtype == torch.float32 and t.dim() == 4 for t in saved_g)
    assert torch.equal(out, out_g.detach())
    # Nothing requires grad: no graph either, even with grad mode on.
    out_n = kt.compressor(
        case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
    )
    assert out_n.grad_fn is None


def test_state_cache_updated_in_place_and_strided_dim0():
    case = make_case(lens=[11, 7], r=4, coff=2, start_pos=[3, 9], seed=5)
    cache = case.state_cache.clone()
    ptr, version = cache.data_ptr(), cache._version
    out = kt.compressor(case.x, case.wkv, case.wgate, cache, case.ape, 4, **case.kwargs())
    assert cache.data_ptr() == ptr and cache._version > version
    assert not torch.equal(cache, case.state_cache)
    # The same cache as every other block of a larger buffer: dim 0 strided, dims 1-2 contiguous.
    big = torch.full((2 * cache.shape[0],) + tuple(cache.shape[1:]), 123.0)
    strided = big[::2]
    strided.copy_(case.state_cache)
    out_s = kt.compressor(case.x, case.wkv, case.wgate, strided, case.ape, 4, **case.kwargs())
    assert torch.equal(out_s, out) and torch.equal(strided, cache)
    assert bool((big[1::2] == 123.0).all())


def test_saved_start_pos_mutation_is_detected():
    """Advancing start_pos in place between forward and backward (a decode loop bug) is reported."""
    case = make_case(lens=[8], r=4, coff=1, start_pos=[4], seed=6)
    x = case.x.clone().requires_grad_()
    out = kt.compressor(x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs())
    case.start_pos += 8
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_grad_of_expanded_upstream_gradient():
    """sum() hands the backward a stride-0 gradient; it must be made contiguous, not rejected."""
    case = make_case(lens=[9, 12], th=True, r=4, coff=2, start_pos=[2, 0], seed=8)
    x = case.x.clone().requires_grad_()
    kt.compressor(
        x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
    ).sum().backward()
    _, grads, _ = reference_grads(case, torch.ones(()), torch.float64)
    assert torch.allclose(x.grad.double(), grads["d_x"], rtol=1e-5, atol=1e-6)


def test_signature_is_upstream():
    params = inspect.signature(kt.compressor).parameters
    assert list(params) == [
        "x",
        "wkv",
        "wgate",
        "state_cache",
        "ape",
        "cmp_ratio",
        "state_block_table",
        "cu_seqlens",
        "seqused",
        "start_pos",
        "coff",
        "cache_mode",
    ]
    assert (
        params["cmp_ratio"].default == 4 and params["coff"].default == 1 and params["cache_mode"].default == 1
    )
    kw = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert kw == ["state_block_table", "cu_seqlens", "seqused", "start_pos", "coff", "cache_mode"]
    doc = kt.compressor.__doc__
    for needle in ("[B, S, H]", "[T, H]", "[block_num, block_size, 2*C]", "[r, C]", "bfloat16", "int32"):
        assert needle in doc


def test_missing_block_table_is_a_clear_error():
    case = make_case(lens=[8], r=4, seed=9)
    with pytest.raises(kvcomp.KvcompError, match="state_block_table") as e:
        kt.compressor(case.x, case.wkv, case.wgate, case.state_cache, case.ape, 4)
    assert e.value.code == 161001


def test_rejected_call_writes_nothing():
    case = make_case(lens=[8, 8], r=4, coff=2, start_pos=[4, 0], seed=10)
    cache = case.state_cache.clone()
    bad = case.wgate[:, :-1].contiguous()  # H mismatch
    with pytest.raises(kvcomp.KvcompError) as e:
        kt.compressor(case.x, case.wkv, bad, cache, case.ape, 4, **case.kwargs())
    assert e.value.code == 561002 and "wgate" in e.value.message
    assert torch.equal(cache, case.state_cache)


def _opcheck_cases():
    bsh = make_case(lens=[9, 12], r=4, coff=2, start_pos=[3, 0], seed=11)
    th = make_case(lens=[9, 12], th=True, r=3, coff=1, start_pos=[1, 5], cache_mode=2, seed=12)
    return {"bsh": bsh, "th": th}


@pytest.mark.parametrize("layout", ["bsh", "th"])
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(layout, device):
    case = on_device(_opcheck_cases()[layout], device)
    k = case.kwargs()
    idx = (k["state_block_table"], k["cu_seqlens"], k["seqused"], k["start_pos"])
    fwd_args = (
        case.x,
        case.wkv,
        case.wgate,
        case.state_cache.clone(),
        case.ape,
        *idx,
        case.cmp_ratio,
        case.coff,
        case.cache_mode,
    )
    for grad_enabled in (False, True):
        torch.library.opcheck(torch.ops.kvcomp.compressor_forward.default, fwd_args + (grad_enabled,))
    cmp_kv, s, kv = torch.ops.kvcomp.compressor_forward(*fwd_args, True)
    bwd_args = (
        torch.randn_like(cmp_kv),
        case.x,
        case.wkv,
        case.wgate,
        s,
        kv,
        *idx[1:],
        case.cmp_ratio,
        case.coff,
    )
    torch.library.opcheck(torch.ops.kvcomp.compressor_backward.default, bwd_args)
    leaves = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    anchor_args = (cmp_kv, *leaves, s, kv, *idx[1:], case.cmp_ratio, case.coff)
    torch.library.opcheck(torch.ops.kvcomp.compressor_grad_anchor.default, anchor_args)


def test_call_without_gradient_skips_the_dispatcher_with_the_same_result():
    """A call that records no gradient, on plain tensors in eager mode, runs the forward's implementation
    without torch.library's dispatch (kvcomp/torch.py: 100-250 us a call): the dispatched operator's
    outputs and cache bits, the cache's version counter bumped. Under a dispatch mode (as under
    torch.compile, test_compile.py) the operator is still dispatched, so the mode sees it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    case = make_case(lens=[13, 9], r=4, coff=2, start_pos=[5, 0], seed=11)
    kw = case.kwargs()
    caches = [case.state_cache.clone() for _ in range(3)]
    assert kt._dispatch_free((case.x, case.wkv, case.wgate, case.ape), caches[0])
    version = caches[0]._version
    with torch.no_grad():
        out = kt.compressor(case.x, case.wkv, case.wgate, caches[0], case.ape, 4, **kw)
    assert caches[0]._version > version
    ref, _, _ = torch.ops.kvcomp.compressor_forward(
        case.x, case.wkv, case.wgate, caches[1], case.ape, kw["state_block_table"], kw["cu_seqlens"],
        kw["seqused"], kw["start_pos"], 4, 2, kw["cache_mode"], False, None
    )
    assert torch.equal(out, ref) and torch.equal(caches[0], caches[1])
    assert not torch.equal(caches[0], case.state_cache)
    with torch.no_grad(), Seen() as mode:
        assert not kt._dispatch_free((case.x,), caches[2])
        out_m = kt.compressor(case.x, case.wkv, case.wgate, caches[2], case.ape, 4, **kw)
    assert any("kvcomp.compressor_forward" in op for op in mode.ops)
    assert torch.equal(out_m, ref) and torch.equal(caches[2], caches[1])
    # A cache that requires a gradient keeps the dispatched path (whatever it does with it).
    assert not kt._dispatch_free((case.x,), caches[2].clone().requires_grad_())
