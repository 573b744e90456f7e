"""The operator's model-level epilogue (RMSNorm over D, RoPE on the last rd channels) and its calls
without APE, through kvcomp's functional calls and kvcomp._ops.model_compressor, against an eager torch
model written here: the forward in the model's arithmetic (DeepSeek-V4's compressor: the pooled row
rounded to the io dtype, fp32 RMSNorm ``(w * x_hat).to(dtype)``, a complex64 rotation rounded again),
the gradients against float64 autograd of the same model without roundings."""

import math

import pytest
import torch

import kvcomp
from kvcomp import _ops
from kvcomp._errors import KvcompError

IO = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
H, D, R, EPS = 48, 40, 4, 1e-6


def _table(positions, pairs):
    pos = torch.arange(positions, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(pairs, dtype=torch.float64) / pairs)
    return torch.cos(pos * freq).float(), torch.sin(pos * freq).float()


def _case(io, seed=0, B=2, S=23):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, H, generator=g).to(io)
    wkv = (torch.randn(D, H, generator=g) / math.sqrt(H)).to(io)
    wgate = (torch.randn(D, H, generator=g) / math.sqrt(H)).to(io)
    ape = 0.1 * torch.randn(R, D, generator=g)
    w = 1 + 0.25 * torch.randn(D, generator=g)
    return x, wkv, wgate, ape, w


def _state(x):
    cache = torch.zeros(1, R, 2 * D)
    table = torch.zeros(x.shape[0], -(-x.shape[1] // R), dtype=torch.int32)
    return cache, table


def _forward(x, wkv, wgate, ape, grad=False, **epilogue):
    cache, table = _state(x)
    return kvcomp.compressor_forward(x, wkv, wgate, cache, ape, R, state_block_table=table, grad_enabled=grad,
                                     **epilogue)


def _rotate(y, cos, sin):
    """The model's rotation: the last 2 * pairs channels as adjacent complex pairs, in complex64."""
    pairs = cos.shape[1]
    head, tail = y[..., : y.shape[-1] - 2 * pairs], y[..., y.shape[-1] - 2 * pairs:]
    rows = tail.shape[-2]
    z = torch.view_as_complex(tail.float().reshape(*tail.shape[:-1], pairs, 2).contiguous())
    f = torch.complex(cos[0:rows * R:R], sin[0:rows * R:R])  # block k at position k * R
    out = torch.view_as_real(z * f).reshape(tail.shape).to(y.dtype)
    return torch.cat([head, out], -1)


def _eager_epilogue(pooled, w, cos=None, sin=None):
    y = pooled
    if w is not None:
        h = pooled.float()
        y = (w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS))).to(pooled.dtype)
    return _rotate(y, cos, sin) if cos is not None else y


def _differ(a, b, io):
    """The share of elements that differ, and whether every one is within one io ulp (fp32: 1e-6 of the
    tensor's scale)."""
    a, b = a.double(), b.double()
    if io == torch.float32:
        return 0.0, bool(((a - b).abs() <= 1e-6 * b.abs().max()).all())
    bits = 8 if io == torch.bfloat16 else 11
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(6.1e-5))) - bits + 1)
    return float((a != b).double().mean()), bool(((a - b).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("norm,pairs", [(True, 0), (False, 8), (True, 8), (True, 20)])
def test_forward_is_the_models_arithmetic(dtype, norm, pairs):
    io = IO[dtype]
    x, wkv, wgate, ape, w = _case(io)
    cos, sin = _table(64, pairs) if pairs else (None, None)
    plain = _forward(x, wkv, wgate, ape)[0]
    out = _forward(x, wkv, wgate, ape, grad=True, norm_weight=w if norm else None, rope_cos=cos, rope_sin=sin)
    assert len(out) == 4
    assert torch.equal(out[3], plain)  # `pooled`: the rows without the epilogue, bit for bit
    want = _eager_epilogue(plain, w if norm else None, cos, sin)
    share, close = _differ(out[0], want, io)
    assert close and share <= 0.03, (share, close)


def _eager_truth(x, wkv, wgate, ape, w, cos, sin):
    """The whole call in float64 with no rounding (coff 1): projections, + ape, a softmax over each block
    of R tokens per channel, the pooled sum, RMSNorm, the rotation."""
    B, S, _ = x.shape
    n = S // R * R
    kv = x[:, :n] @ wkv.t()
    score = x[:, :n] @ wgate.t() + (ape.repeat(n // R, 1) if ape is not None else 0)
    p = torch.softmax(score.reshape(B, n // R, R, D), dim=2)
    pooled = (p * kv.reshape(B, n // R, R, D)).sum(2)
    y = w * (pooled * torch.rsqrt(pooled.pow(2).mean(-1, keepdim=True) + EPS))
    pairs = cos.shape[1]
    head, tail = y[..., : D - 2 * pairs], y[..., D - 2 * pairs:]
    a, b = tail[..., 0::2], tail[..., 1::2]
    c, s = cos[0:(n // R) * R:R].double(), sin[0:(n // R) * R:R].double()
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).reshape(tail.shape)
    return torch.cat([head, rot], -1)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("with_ape", [True, False])
def test_gradients_against_float64(dtype, with_ape):
    io = IO[dtype]
    x, wkv, wgate, ape, w = _case(io, seed=3, S=24)
    cos, sin = _table(64, 8)
    leaves = {"x": x, "wkv": wkv, "wgate": wgate, "norm_weight": w}
    if with_ape:
        leaves["ape"] = ape
    got = {k: v.detach().clone().requires_grad_() for k, v in leaves.items()}
    cache, table = _state(x)
    out = _ops.model_compressor(got["x"], got["wkv"], got["wgate"], got.get("ape"), R, state_cache=cache,
                                state_block_table=table, norm_weight=got["norm_weight"], rope_cos=cos, rope_sin=sin)
    d = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out.backward(d.to(io))
    truth = {k: v.detach().double().requires_grad_() for k, v in leaves.items()}
    y = _eager_truth(truth["x"], truth["wkv"], truth["wgate"], truth.get("ape"), truth["norm_weight"], cos, sin)
    y.backward(d.to(io).double())
    assert torch.allclose(out.double(), y.detach(), rtol=0, atol=(2**-7 if io != torch.float32 else 1e-5) * 4)
    tol = 2**-6 if io != torch.float32 else 1e-5
    for k in leaves:
        g, t = got[k].grad.double(), truth[k].grad
        err = (g - t).abs().max() / t.abs().max()
        assert err <= tol, (k, float(err))


def test_norm_weight_gradient_is_the_same_for_every_thread_count():
    x, wkv, wgate, ape, w = _case(torch.bfloat16, seed=7, B=3, S=61)
    cos, sin = _table(64, 8)
    grads = []
    saved = kvcomp.get_default_options()
    try:
        for threads in (1, 2, 3):
            kvcomp.set_default_options(num_threads=threads)
            nw = w.clone().requires_grad_()
            xs = x.clone().requires_grad_()
            cache, table = _state(x)
            out = _ops.model_compressor(xs, wkv, wgate, ape, R, state_cache=cache, state_block_table=table,
                                        norm_weight=nw, rope_cos=cos, rope_sin=sin)
            out.backward(torch.ones_like(out))
            grads.append((nw.grad, xs.grad))
    finally:
        kvcomp.set_default_options(num_threads=saved["num_threads"])
    for g in grads[1:]:
        assert torch.equal(g[0], grads[0][0]) and torch.equal(g[1], grads[0][1])


def test_no_ape_is_the_zero_bias():
    x, wkv, wgate, ape, w = _case(torch.bfloat16, seed=9)
    zero = _forward(x, wkv, wgate, torch.zeros_like(ape), grad=True)
    none = _forward(x, wkv, wgate, None, grad=True)
    for a, b in zip(zero, none):
        assert torch.equal(a, b)
    g = kvcomp.compressor_grad(x, wkv, wgate, none[0], none[1], none[2], R, with_ape=False)
    g0 = kvcomp.compressor_grad(x, wkv, wgate, none[0], none[1], none[2], R)
    assert g[3] is None
    for a, b in zip(g[:3], g0[:3]):
        assert torch.equal(a, b)
    with pytest.raises(KvcompError) as e:
        _forward(x, wkv, wgate, None, profile="aclnn")
    assert e.value.code == 161001


@pytest.mark.parametrize(
    "change,code,words",
    [
        (dict(rope_cos=_table(8, 8)[0], rope_sin=_table(8, 8)[1]), 161002, "must cover position"),
        (dict(rope_cos=_table(64, 8)[0], rope_sin=None), 161001, "rope_sin"),
        (dict(rope_cos=_table(64, 21)[0], rope_sin=_table(64, 21)[1]), 561002, "rd <= D"),
        (dict(norm_weight=torch.ones(D - 1)), 561002, "norm_weight"),
        (dict(norm_weight=torch.ones(D), norm_eps=0.0), 161002, "norm_eps"),
        (dict(norm_weight=torch.ones(D), norm_eps=float("nan")), 161002, "norm_eps"),
        (dict(norm_weight=torch.ones(D, dtype=torch.float64)), 161002, "norm_weight"),
        (dict(norm_weight=torch.ones(D), profile="aclnn"), 161002, "aclnn"),
    ],
)
def test_hostile_epilogue_arguments(change, code, words):
    x, wkv, wgate, ape, _ = _case(torch.bfloat16, seed=11)
    cache, table = _state(x)
    before = cache.clone()
    with pytest.raises(KvcompError) as e:
        kvcomp.compressor_forward(x, wkv, wgate, cache, ape, R, state_block_table=table, grad_enabled=True,
                                  **change)
    assert e.value.code == code, e.value
    assert words in str(e.value), e.value
    assert torch.equal(cache, before)  # nothing written


def _op_args(x, wkv, wgate, ape, w, cos, sin, grad):
    cache, table = _state(x)
    return (x, wkv, wgate, cache, ape, table, None, None, None, R, 1, 1, grad, w, EPS, cos, sin)


@pytest.mark.parametrize("with_ape", [True, False])
@pytest.mark.parametrize("norm,pairs", [(True, 8), (False, 8), (True, 0)])
def test_opcheck_of_the_model_operators(with_ape, norm, pairs):
    """torch.library.opcheck (schema, fake tensors, autograd registration) on the three operators of the
    model-level call, with and without APE, norm and rotation."""
    x, wkv, wgate, ape, w = _case(torch.bfloat16, seed=21, S=18)
    cos, sin = _table(32, pairs) if pairs else (None, None)
    ape = ape if with_ape else None
    w = w if norm else None
    for grad in (False, True):
        torch.library.opcheck(torch.ops.kvcomp.model_compressor_forward.default,
                              _op_args(x, wkv, wgate, ape, w, cos, sin, grad))
    cmp_kv, s, kv, pooled = torch.ops.kvcomp.model_compressor_forward(*_op_args(x, wkv, wgate, ape, w, cos, sin, True))
    assert pooled.shape == cmp_kv.shape
    bwd = (torch.randn_like(cmp_kv), x, wkv, wgate, s, kv, None, None, None, R, 1, with_ape, pooled, w, EPS, cos, sin)
    torch.library.opcheck(torch.ops.kvcomp.model_compressor_backward.default, bwd)
    d = torch.ops.kvcomp.model_compressor_backward(*bwd)
    assert d[3].shape == ((R, D) if with_ape else (0,))
    assert d[4].shape == ((D,) if norm else (0,))
    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, wkv, wgate, ape)]
    nw = w.clone().requires_grad_() if w is not None else None
    anchor = (cmp_kv, *leaves, s, kv, None, None, None, R, 1, pooled, nw, EPS, cos, sin)
    torch.library.opcheck(torch.ops.kvcomp.model_compressor_grad_anchor.default, anchor)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_training_step_is_the_eager_one(backend):
    """torch.compile(fullgraph=True) traces the model-level call (one graph, no break) and gives the eager
    call's outputs and, through the autograd it traced, its gradients, bit for bit."""
    if backend == "inductor" and __import__("os").environ.get("KVCOMP_SKIP_INDUCTOR"):
        pytest.skip("KVCOMP_SKIP_INDUCTOR set")
    x, wkv, wgate, ape, w = _case(torch.bfloat16, seed=23, S=21)
    cos, sin = _table(32, 8)
    d = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)

    def step(xs, wk, wg, nw):
        cache, table = _state(xs)
        return _ops.model_compressor(xs, wk, wg, None, R, state_cache=cache, state_block_table=table, norm_weight=nw,
                                     rope_cos=cos, rope_sin=sin)

    results = []
    for fn in (step, torch.compile(step, backend=backend, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, wkv, wgate, w)]
        out = fn(*leaves)
        (out.float() * d.float()).sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_model_operators_without_a_gate():
    """DeepSeek-V4.1's ratio 1: ``wgate`` None (cmp_ratio 1, coff 1): opcheck of the three operators, an
    empty d_wgate, rows within one rounding of the fp32 projection, gradients of the projection alone,
    and the call compiled (fullgraph) bitwise the eager one."""
    x, wkv, _, _, w = _case(torch.bfloat16, seed=31, S=9)
    cache, table = _state(x)
    args = (x, wkv, None, cache, None, table, None, None, None, 1, 1, 1, True, w, EPS, None, None)
    torch.library.opcheck(torch.ops.kvcomp.model_compressor_forward.default, args)
    cmp_kv, s, kv, pooled = torch.ops.kvcomp.model_compressor_forward(*args)
    want = (x.float() @ wkv.float().t()).to(torch.bfloat16)
    assert ((pooled.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()
    bwd = (torch.randn_like(cmp_kv), x, wkv, None, s, kv, None, None, None, 1, 1, False, pooled, w, EPS, None, None)
    torch.library.opcheck(torch.ops.kvcomp.model_compressor_backward.default, bwd)
    d = torch.ops.kvcomp.model_compressor_backward(*bwd)
    assert d[2].shape == (0,) and d[3].shape == (0,) and d[4].shape == (D,)
    anchor = (cmp_kv, x.clone().requires_grad_(), wkv.clone().requires_grad_(), None, None, s, kv, None, None,
              None, 1, 1, pooled, w.clone().requires_grad_(), EPS, None, None)
    torch.library.opcheck(torch.ops.kvcomp.model_compressor_grad_anchor.default, anchor)

    # The gradients: those of norm(x wkv^T) in float64, at kvcomp's own rounded rows.
    g = torch.randn(cmp_kv.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)

    def step(xs, wk, nw):
        c, t = _state(xs)
        return _ops.model_compressor(xs, wk, None, None, 1, state_cache=c, state_block_table=t, norm_weight=nw,
                                     norm_eps=EPS)

    results = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in (x, wkv, w)]
        out = fn(*leaves)
        out.backward(g)
        results.append((out, *(t.grad for t in leaves)))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    out, dx, dwkv, dw = results[0]
    p = pooled.double()
    rstd = (p.pow(2).mean(-1, keepdim=True) + EPS).rsqrt()
    dy = g.double()
    d_norm_weight = (dy * p * rstd).sum((0, 1))
    dxhat = dy * w.double()
    dp = rstd * (dxhat - p * rstd.pow(2) * (dxhat * p).mean(-1, keepdim=True))
    want_dx = dp @ wkv.double()
    want_dwkv = dp.reshape(-1, D).t() @ x.double().reshape(-1, H)
    for got, exp in ((dx, want_dx), (dwkv, want_dwkv), (dw, d_norm_weight)):
        assert (got.double() - exp).abs().max() <= 2**-7 * exp.abs().max(), (got, exp)

    # Anywhere else a gate is required, with a sentence.
    with pytest.raises(KvcompError, match="cmp_ratio = 1 and coff = 1"):
        _forward(x, wkv, None, None, grad=False)
