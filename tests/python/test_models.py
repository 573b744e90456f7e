"""kvcomp.nn.DeepseekV41Compressor against an eager torch model of DeepSeek-V4.1's compressor written
here from its arithmetic (not from kvcomp): the projections, a softmax over each group of `ratio` tokens
of the gate scores, the pooled row rounded to the io dtype, RMSNorm with fp32 statistics and an fp32
weight, ``(weight * x_hat).to(dtype)``; an incomplete trailing group gives no row.

The module's output is judged by the three-way rule against the float64 truth (the same model without
intermediate roundings, autograd for the gradients), with the eager model in its own arithmetic (fp32
projections from io-dtype operands, rounded to the io dtype as a torch Linear of that dtype gives
them) as the reference party; its gradients are held to that party's error (largest and mean), at
the tensor's scale; the state_dict of the model loads strict."""

import pytest
import torch

import kvcomp
import kvcomp.nn
from kvcomp.compare import dtype_key, three_way
from support import assert_close_to_truth

IO = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class EagerV41(torch.nn.Module):
    """DeepSeek-V4.1's compressor in plain torch ops. ``exact``: every step in float64 with no rounding
    between (the truth); else the model's arithmetic in the io dtype of x."""

    def __init__(self, hidden_size, head_dim, ratio, eps=1e-6):
        super().__init__()
        self.ratio, self.eps = ratio, eps
        self.wkv = torch.nn.Linear(hidden_size, head_dim, bias=False)
        if ratio > 1:
            self.wgate = torch.nn.Linear(hidden_size, head_dim, bias=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(head_dim))

    def _pool(self, x, exact):
        """x [n, H] of one sequence: its rows [n // ratio, D]."""
        r = self.ratio
        n = x.shape[0] // r * r
        x = x[:n]
        if exact:
            kv = x.double() @ self.wkv.weight.double().t()
        else:
            kv = (x.float() @ self.wkv.weight.to(x.dtype).float().t()).to(x.dtype)
        if r == 1:
            return kv
        if exact:
            score = x.double() @ self.wgate.weight.double().t()
        else:
            score = (x.float() @ self.wgate.weight.to(x.dtype).float().t()).to(x.dtype).float()
        d = kv.shape[-1]
        kv_g = kv.reshape(n // r, r, d)
        p = torch.softmax(score.reshape(n // r, r, d), dim=1)
        pooled = (kv_g.to(p.dtype) * p).sum(1)
        return pooled if exact else pooled.to(x.dtype)

    def forward(self, x, cu_seqlens=None, exact=False):
        if x.dim() == 3:
            pooled = torch.stack([self._pool(x[b], exact) for b in range(x.shape[0])])
        else:
            cu = cu_seqlens.tolist()
            pooled = torch.cat([self._pool(x[cu[b]:cu[b + 1]], exact) for b in range(len(cu) - 1)])
        h = pooled.double() if exact else pooled.float()
        x_hat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.norm.weight.double() if exact else self.norm.weight
        return w * x_hat if exact else (w * x_hat).to(x.dtype)


def _models(H, D, ratio, seed):
    torch.manual_seed(seed)
    ref = EagerV41(H, D, ratio)
    with torch.no_grad():
        ref.norm.weight.copy_(1 + 0.25 * torch.randn(D))
    mod = kvcomp.nn.DeepseekV41Compressor(H, D, ratio, eps=ref.eps)
    mod.load_state_dict(ref.state_dict(), strict=True)
    return ref, mod


def _inputs(th, lens, H, io, seed):
    g = torch.Generator().manual_seed(seed)
    if th:
        x = torch.randn(sum(lens), H, generator=g).to(io)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        return x, cu
    return torch.randn(len(lens), lens[0], H, generator=g).to(io), None


def _run(model, x, cu, exact=False, kvcomp_module=False):
    xs = (x.double() if exact else x).detach().requires_grad_()
    params = list(model.parameters())
    for p in params:
        p.grad = None
    out = model(xs, cu) if kvcomp_module else model(xs, cu, exact=exact)
    g = torch.Generator().manual_seed(99)
    d = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(d.to(out.dtype))
    grads = {"x": xs.grad, **{n: p.grad for n, p in model.named_parameters()}}
    return out.detach(), grads


CASES = {
    "bsh_r2": dict(th=False, lens=[9, 9], ratio=2),
    "bsh_r1": dict(th=False, lens=[7, 7, 7], ratio=1),
    "th_r2_ragged": dict(th=True, lens=[5, 1, 12, 0, 3], ratio=2),
    "th_r1": dict(th=True, lens=[4, 9], ratio=1),
    "bsh_r3_any_ratio": dict(th=False, lens=[11, 11], ratio=3),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_v41_module_against_the_model(name, dtype):
    c = CASES[name]
    H, D = 64, 32
    io = IO[dtype]
    ref, mod = _models(H, D, c["ratio"], seed=len(name))
    x, cu = _inputs(c["th"], c["lens"], H, io, seed=7)
    out_a, grads_a = _run(mod, x, cu, kvcomp_module=True)
    out_b, grads_b = _run(ref, x, cu)
    out_c, grads_c = _run(ref, x, cu, exact=True)
    rows = sum(n // c["ratio"] for n in c["lens"])
    assert out_a.shape == ((rows, D) if c["th"] else (len(c["lens"]), c["lens"][0] // c["ratio"], D))
    assert out_a.dtype == io
    assert set(grads_a) == set(grads_c)
    if dtype == "fp32":  # A and B are both fp32 arithmetic: each within fp32 noise of the truth
        assert_close_to_truth(out_a, out_c)
        for n in grads_a:
            assert_close_to_truth(grads_a[n], grads_c[n])
        return
    # Every output is held at the io dtype's precision: the pooled rows, and so the norm's input, the
    # outputs and every gradient that flows through them, carry the io dtype's rounding.
    key = dtype_key(io)
    r = three_way(out_a, out_b, out_c.to(io), key)
    assert r.passed, ("out", r.summary())
    # The gradients: the truth differentiates the unrounded model, A and B the rounded one at their own
    # (different) rounded points, so an element that is a cancelled sum can be far off in relative terms
    # for either: A's largest error is held to B's, at the tensor's scale, plus one io ulp of that scale.
    ulp = {"bf16": 2.0**-8, "fp16": 2.0**-11}[dtype]
    for n in grads_a:
        c = grads_c[n].double()
        scale = max(c.abs().max().item(), 1e-30)
        err_a = (grads_a[n].double() - c).abs().max().item()
        err_b = (grads_b[n].double() - c).abs().max().item()
        assert err_a <= 2 * err_b + ulp * scale, (n, err_a, err_b, scale)
        assert (grads_a[n].double() - c).abs().mean().item() <= 2 * (grads_b[n].double() - c).abs().mean().item() + 1e-12, n


def test_v41_parameters_and_state_dict():
    m2 = kvcomp.nn.DeepseekV41Compressor(64, 32, 2)
    assert set(m2.state_dict()) == {"wkv.weight", "wgate.weight", "norm.weight"}
    m1 = kvcomp.nn.DeepseekV41Compressor(64, 32, 1)
    assert set(m1.state_dict()) == {"wkv.weight", "norm.weight"}  # ratio 1 has no gate
    assert m1.norm.weight.dtype == torch.float32 and m1.wkv.weight.shape == (32, 64)
    with pytest.raises(RuntimeError):  # the model of another ratio does not load
        m1.load_state_dict(m2.state_dict(), strict=True)
    with pytest.raises(kvcomp.KvcompError, match="ratio"):
        kvcomp.nn.DeepseekV41Compressor(64, 32, 0)


def test_v41_ratio_one_rows_are_the_projection_rows():
    """Ratio 1: the pooled row is the projection row itself (the softmax over one token is 1)."""
    _, mod = _models(64, 32, 1, seed=3)
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    with torch.no_grad():
        pooled = mod.pooled(x)
        want = (x.float() @ mod.wkv.weight.to(torch.bfloat16).float().t()).to(torch.bfloat16)
    assert pooled.shape == (2, 5, 32)
    # One rounding of an fp32 sum either way: equal up to the order of the sums (one bf16 ulp).
    assert ((pooled.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-6).all()


def test_v41_is_the_same_for_every_thread_count():
    _, mod = _models(64, 32, 2, seed=4)
    x = torch.randn(3, 10, 64).to(torch.bfloat16)
    outs = []
    for t in (1, 2, 3):
        previous = kvcomp.set_default_options(num_threads=t)
        try:
            out, grads = _run(mod, x, None, kvcomp_module=True)
        finally:
            kvcomp.set_default_options(**previous)
        outs.append([out.view(torch.int16)] + [g.clone() for g in grads.values()])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_v41_norm_is_the_models_arithmetic(dtype):
    """Given the pooled rows, the output is the model's RMSNorm bit for bit: fp32 statistics,
    ``(weight * x_hat).to(dtype)``, not the ``x_hat.to(dtype) * weight`` of some ports (which rounds
    differently, checked here to differ on these rows)."""
    io = IO[dtype]
    ref, mod = _models(64, 32, 2, seed=5)
    x = torch.randn(4, 16, 64).to(io)
    with torch.no_grad():
        out = mod(x)
        p = mod.pooled(x).float()
        x_hat = p * torch.rsqrt(p.pow(2).mean(-1, keepdim=True) + mod.norm.eps)
        want = (mod.norm.weight * x_hat).to(io)
        other = x_hat.to(io) * mod.norm.weight.to(io)
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(want.view(torch.int16), other.view(torch.int16))
