"""The model modules of kvcomp.nn against eager torch models of the released models' compressors,
written here from their arithmetic (not from kvcomp).

DeepSeek-V4.1 (``DeepseekV41Compressor``): the projections, a softmax over each group of `ratio`
tokens of the gate scores, the pooled row rounded to the io dtype, RMSNorm with fp32 statistics and
an fp32 weight, ``(weight * x_hat).to(dtype)``; an incomplete trailing group gives no row.

DeepSeek-V4 (``DeepseekV4Compressor``, the reference model's ``Compressor``): fp32 projections of
``x.float()`` by the fp32 weights, APE on the scores, overlapping blocks (coff 2) for ratio 4, a
softmax per channel over the block, the pooled row rounded to the io dtype, the same RMSNorm, then
RoPE on the last rope_head_dim channels (a complex64 product at the block's first token's position,
rounded again); prefill and token-by-token decode with the model's per-slot state, and kv_cache.

The modules' outputs are judged by the three-way rule against the float64 truth (the same model
without intermediate roundings, autograd for the gradients), with the eager model in its own
arithmetic as the reference party (V4.1: fp32 projections from io-dtype operands, rounded to the io
dtype as a torch Linear of that dtype gives them; V4: the model's fp32 projections, with weights
that are bf16 values as the checkpoint's are); their gradients are held to that party's error
(largest and mean), at the tensor's scale; the state_dict of the model loads strict."""

from types import SimpleNamespace

import os
import pytest
import torch

import kvcomp
import kvcomp.nn
from kvcomp.compare import dtype_key, three_way
from support import assert_close_to_truth, bits, io_ulp

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


def _judge(out_a, grads_a, out_b, grads_b, out_c, grads_c, dtype):
    """The module (A) against the eager model in its own arithmetic (B), both against the float64 truth
    (C): the output by the three-way rule, the gradients held to B's error."""
    io = IO[dtype]
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
    _judge(out_a, grads_a, out_b, grads_b, out_c, grads_c, dtype)


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


@pytest.mark.parametrize("ratio,prefill", [(2, 5), (2, 4), (1, 3), (3, 7), (2, 0)])
def test_v41_decode_token_by_token_is_the_whole_sequences_call(ratio, prefill):
    """A prefill (its length not a multiple of the ratio, or none at all), then one token per call on the
    module's decode state: every group's row is the stateless call's on the whole sequences, bit for
    bit, returned by the step whose token closes the group (None from the others); the other batch
    slots' state is left alone."""
    H, D, S = 64, 32, 13
    ref, _ = _models(H, D, ratio, seed=11)
    mod = kvcomp.nn.DeepseekV41Compressor(H, D, ratio, max_batch_size=3)
    mod.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(2, S, H, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.no_grad():
        whole = mod(x)
        got = []
        if prefill:
            got.append(mod(x[:, :prefill], start_pos=0))
        elif ratio > 1:
            mod.state_cache.fill_(float("nan"))  # the first step must not read stale state
        for p in range(prefill, S):
            row = mod(x[:, p:p + 1], start_pos=p) if p > 0 else mod(x[:, :1], start_pos=0)
            if (p + 1) % ratio == 0:
                assert row is not None and row.shape == (2, 1, D), p
                got.append(row)
            else:
                assert row is None or row.shape[1] == 0, p
    rows = torch.cat(got, dim=1)
    assert rows.shape == whole.shape == (2, S // ratio, D)
    assert torch.equal(rows.view(torch.int16), whole.view(torch.int16))


@pytest.mark.parametrize("ratio", [1, 2, 3])
def test_v41_continuous_batching_is_the_whole_sequences_call(ratio):
    """Serving with per-sequence positions and batch slots: sequences prefilled one by one into slots
    of their own, then decoded together with a tensor start_pos (each at its own position, one joining
    at position 0 mid-way, into a slot another sequence left): every group's row is the stateless
    call's on that sequence, bit for bit, at the step whose token closes it (zero rows elsewhere)."""
    H, D = 64, 32
    ref, _ = _models(H, D, ratio, seed=13)
    mod = kvcomp.nn.DeepseekV41Compressor(H, D, ratio, max_batch_size=4)
    mod.load_state_dict(ref.state_dict(), strict=True)
    g = torch.Generator().manual_seed(5)
    lens = {"a": 14, "b": 11, "c": 9}
    seqs = {k: torch.randn(1, n, H, generator=g).to(torch.bfloat16) for k, n in lens.items()}
    prefill = {"a": 5, "b": 2}  # c joins later, from its first token
    slot_of = {"a": 3, "b": 1, "c": 1}  # c reuses b's slot once b is done
    got = {k: [] for k in lens}
    with torch.no_grad():
        whole = {k: mod(x) for k, x in seqs.items()}
        mod.state_cache.fill_(float("nan"))  # no step may read state it did not write
        for k, n in prefill.items():
            got[k].append(mod(seqs[k][:, :n], start_pos=0, slots=torch.tensor([slot_of[k]])))
        pos = dict(prefill)
        while any(pos.get(k, 0) < lens[k] for k in lens):
            live = [k for k in lens if k in pos and pos[k] < lens[k]]
            if "c" not in pos and pos["b"] >= lens["b"]:
                pos["c"] = 0
                live.append("c")
            x = torch.cat([seqs[k][:, pos[k]:pos[k] + 1] for k in live])
            sp = torch.tensor([pos[k] for k in live], dtype=torch.int32)
            rows = mod(x, start_pos=sp, slots=torch.tensor([slot_of[k] for k in live]))
            assert rows.shape == (len(live), 1, D)
            for i, k in enumerate(live):
                if (pos[k] + 1) % ratio == 0:
                    got[k].append(rows[i:i + 1])
                else:
                    assert not rows[i].any(), (k, pos[k])
                pos[k] += 1
    for k in lens:
        mine = torch.cat(got[k], dim=1)
        assert mine.shape == whole[k].shape, k
        assert torch.equal(mine.view(torch.int16), whole[k].view(torch.int16)), k


@pytest.mark.parametrize("ratio", [1, 2])
def test_v41_keeps_its_weights_between_calls_without_gradient(ratio):
    """Calls without gradient keep the weights cast to x's dtype (and, with a gate, prepared for the
    products) until a parameter changes: the same bits as a fresh module's call, made once."""
    _, mod = _models(64, 32, ratio, seed=17)
    x = torch.randn(2, 6, 64).to(torch.bfloat16)
    with torch.no_grad():
        out = mod(x)
        kept = mod._prepared
        assert kept is not None and (kept[-1] is not None) == (ratio > 1)  # a blob only with a gate
        assert torch.equal(mod(x), out) and mod._prepared is kept
        mod.wkv.weight.mul_(0.5)  # in place: the kept copy is stale
        out2 = mod(x)
        assert mod._prepared is not kept
    fresh = kvcomp.nn.DeepseekV41Compressor(64, 32, ratio, eps=mod.norm.eps)
    fresh.load_state_dict(mod.state_dict(), strict=True)
    want = fresh(x)  # with gradient: the weights cast per call, no blob
    assert torch.equal(out2.view(torch.int16), want.detach().view(torch.int16))
    mod.forget_prepared_weights()
    assert mod._prepared is None


def test_v41_decode_rules():
    mod = kvcomp.nn.DeepseekV41Compressor(64, 32, 2)
    x = torch.randn(1, 3, 64)
    with pytest.raises(kvcomp.KvcompError, match="max_batch_size"):
        mod(x, start_pos=0)
    mod = kvcomp.nn.DeepseekV41Compressor(64, 32, 2, max_batch_size=1)
    with pytest.raises(kvcomp.KvcompError, match="max_batch_size"):
        mod(torch.randn(2, 3, 64), start_pos=0)
    with pytest.raises(kvcomp.KvcompError, match="one token"):
        mod(x, start_pos=4)
    with pytest.raises(kvcomp.KvcompError, match="start_pos"):
        mod(x, start_pos=-1)
    one = torch.randn(1, 1, 64)
    with pytest.raises(kvcomp.KvcompError, match="start_pos"):
        mod(one, start_pos=torch.tensor([-1]))
    with pytest.raises(kvcomp.KvcompError, match="int tensor"):
        mod(one, start_pos=torch.tensor([1.0]))
    with pytest.raises(kvcomp.KvcompError, match="one token"):
        mod(x, start_pos=torch.tensor([3]))
    with pytest.raises(kvcomp.KvcompError, match="slots"):
        mod(one, start_pos=3, slots=torch.tensor([1]))  # max_batch_size 1: slot 1 does not exist
    with pytest.raises(kvcomp.KvcompError, match="slots"):
        mod(one, slots=torch.tensor([0]))  # no start_pos: no batch slots
    wide = kvcomp.nn.DeepseekV41Compressor(64, 32, 2, max_batch_size=3)
    with pytest.raises(kvcomp.KvcompError, match="distinct"):
        wide(torch.randn(2, 1, 64), start_pos=3, slots=torch.tensor([2, 2]))
    assert "state_cache" not in mod.state_dict()


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


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V4's compressor: kvcomp.nn.DeepseekV4Compressor against an eager model of the reference
# model's Compressor written here from its arithmetic.


def _freqs_cis(rope_head_dim, max_seq_len, base=10000.0):
    """Plain RoPE frequencies as the model holds them: complex64 [max_seq_len, rope_head_dim / 2]."""
    inv = base ** (-torch.arange(0, rope_head_dim, 2, dtype=torch.float64) / rope_head_dim)
    angle = torch.arange(max_seq_len, dtype=torch.float64)[:, None] * inv
    return torch.polar(torch.ones_like(angle), angle).to(torch.complex64)


class EagerV4(torch.nn.Module):
    """DeepSeek-V4's Compressor in plain torch ops.

    ``rows(x, cu_seqlens, exact)``: the rows of every complete block, stateless; ``exact``: every step
    in float64 with no rounding between (the truth), else the model's arithmetic: fp32 projections of
    ``x.float()`` by the fp32 weights, fp32 softmax and pooling, the row rounded to the io dtype, RMSNorm
    with fp32 statistics and ``(weight * x_hat).to(dtype)``, RoPE as a complex64 product on the rounded
    normed channels, rounded again. ``forward(x, start_pos)``: the model's stateful call in its own
    arithmetic (prefill at start_pos 0, else one decode token), with ``kv_state`` / ``score_state`` per
    batch slot: rows [0, r) the previous block (overlap only), then the block being filled."""

    def __init__(self, dim, head_dim, rope_head_dim, ratio, eps=1e-6, max_batch_size=2):
        super().__init__()
        self.r, self.d, self.rd, self.eps = ratio, head_dim, rope_head_dim, eps
        self.coff = 2 if ratio == 4 else 1
        c = self.coff * head_dim
        self.ape = torch.nn.Parameter(torch.zeros(ratio, c))
        self.wkv = torch.nn.Linear(dim, c, bias=False)
        self.wgate = torch.nn.Linear(dim, c, bias=False)
        self.norm = torch.nn.Module()
        self.norm.weight = torch.nn.Parameter(torch.ones(head_dim))
        self.kv_state = torch.zeros(max_batch_size, self.coff * ratio, c)
        self.score_state = torch.full_like(self.kv_state, float("-inf"))
        self.kv_cache = None
        self.freqs_cis = None

    def _project(self, x, first, exact):
        """kv and score (APE added) of the tokens x [..., n, dim] at positions first, first + 1, ..."""
        t = torch.float64 if exact else torch.float32
        xs = x.to(t)
        kv = xs @ self.wkv.weight.to(t).t()
        pos = torch.arange(first, first + x.shape[-2])
        score = xs @ self.wgate.weight.to(t).t() + self.ape.to(t)[pos % self.r]
        return kv, score

    def _pool_blocks(self, kv, score):
        """[..., n*r, C] of complete blocks from position 0 -> the pooled rows [..., n, D]."""
        r, d = self.r, self.d
        kv, score = kv.unflatten(-2, (-1, r)), score.unflatten(-2, (-1, r))
        if self.coff == 2:
            # Each block: the previous block's first d channels, then its own last d; block 0 has no
            # previous block (kv 0, score -inf: weight 0).
            prev_kv = torch.cat([torch.zeros_like(kv[..., :1, :, :d]), kv[..., :-1, :, :d]], dim=-3)
            prev_score = torch.cat([torch.full_like(score[..., :1, :, :d], float("-inf")), score[..., :-1, :, :d]],
                                   dim=-3)
            kv = torch.cat([prev_kv, kv[..., d:]], dim=-2)
            score = torch.cat([prev_score, score[..., d:]], dim=-2)
        return (kv * torch.softmax(score, dim=-2)).sum(-2)

    def _epilogue(self, pooled, freqs, exact, dtype):
        d, rd = self.d, self.rd
        if exact:
            h = pooled
            y = self.norm.weight.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))
            freqs = freqs.to(torch.complex128)
        else:
            h = pooled.to(dtype).float()
            y = (self.norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps))).to(dtype)
        pairs = torch.view_as_complex(y[..., d - rd:].to(freqs.real.dtype).unflatten(-1, (-1, 2)).contiguous())
        rope = torch.view_as_real(pairs * freqs).flatten(-2)
        return torch.cat([y[..., : d - rd], rope if exact else rope.to(dtype)], dim=-1)

    def rows(self, x, cu_seqlens=None, exact=False):
        if x.dim() == 2:
            cu = cu_seqlens.tolist()
            return torch.cat([self.rows(x[None, cu[b]:cu[b + 1]], exact=exact)[0] for b in range(len(cu) - 1)])
        n = x.shape[1] // self.r
        kv, score = self._project(x[:, : n * self.r], 0, exact)
        return self._epilogue(self._pool_blocks(kv, score), self.freqs_cis[0 : n * self.r : self.r], exact, x.dtype)

    def forward(self, x, start_pos):
        bsz, seqlen, _ = x.shape
        r, d, off = self.r, self.d, (self.coff - 1) * self.r
        kv, score = self._project(x, start_pos, False)
        if start_pos == 0:
            cutoff = seqlen - seqlen % r
            self.kv_state[:bsz], self.score_state[:bsz] = 0.0, float("-inf")
            if self.coff == 2 and cutoff >= r:  # the next block's previous half
                self.kv_state[:bsz, :r] = kv[:, cutoff - r:cutoff]
                self.score_state[:bsz, :r] = score[:, cutoff - r:cutoff]
            self.kv_state[:bsz, off:off + seqlen - cutoff] = kv[:, cutoff:]
            self.score_state[:bsz, off:off + seqlen - cutoff] = score[:, cutoff:]
            if cutoff == 0:
                return None
            out = self._epilogue(self._pool_blocks(kv[:, :cutoff], score[:, :cutoff]), self.freqs_cis[0:cutoff:r],
                                 False, x.dtype)
            self.kv_cache[:bsz, : cutoff // r] = out
            return out
        slot = off + start_pos % r
        self.kv_state[:bsz, slot], self.score_state[:bsz, slot] = kv[:, 0], score[:, 0]
        if (start_pos + 1) % r:
            return None
        if self.coff == 2:
            k = torch.cat([self.kv_state[:bsz, :r, :d], self.kv_state[:bsz, r:, d:]], dim=1)
            s = torch.cat([self.score_state[:bsz, :r, :d], self.score_state[:bsz, r:, d:]], dim=1)
        else:
            k, s = self.kv_state[:bsz], self.score_state[:bsz]
        pooled = (k * torch.softmax(s, dim=1)).sum(1, keepdim=True)
        if self.coff == 2:  # this block becomes the next one's previous half
            self.kv_state[:bsz, :r] = self.kv_state[:bsz, r:].clone()
            self.score_state[:bsz, :r] = self.score_state[:bsz, r:].clone()
        out = self._epilogue(pooled, self.freqs_cis[start_pos + 1 - r][None], False, x.dtype)
        self.kv_cache[:bsz, start_pos // r] = out[:, 0]
        return out


V4_DIM, V4_HEAD_DIM, V4_MAX_SEQ = 64, 32, 256


def _v4_models(ratio, rope_head_dim, seed, max_batch_size=2):
    """The eager model with random parameters (the projections' weights bf16 values, as the checkpoint's
    are) and the kvcomp module loaded from its state_dict, both with the same freqs_cis."""
    torch.manual_seed(seed)
    ref = EagerV4(V4_DIM, V4_HEAD_DIM, rope_head_dim, ratio, max_batch_size=max_batch_size)
    with torch.no_grad():
        for w in (ref.wkv.weight, ref.wgate.weight):
            w.copy_(w.to(torch.bfloat16).float())
        ref.ape.copy_(0.5 * torch.randn(ref.ape.shape))
        ref.norm.weight.copy_(1 + 0.25 * torch.randn(V4_HEAD_DIM))
    args = SimpleNamespace(dim=V4_DIM, rope_head_dim=rope_head_dim, norm_eps=ref.eps, max_batch_size=max_batch_size)
    mod = kvcomp.nn.DeepseekV4Compressor(args, ratio, V4_HEAD_DIM)
    mod.load_state_dict(ref.state_dict(), strict=True)
    ref.freqs_cis = mod.freqs_cis = _freqs_cis(rope_head_dim, V4_MAX_SEQ)
    return ref, mod


def _run_v4(call, params, x):
    """call(x) with x a leaf; the output and the gradients of x and of the named parameters under a
    fixed random output gradient."""
    xs = x.detach().requires_grad_()
    for p in params.values():
        p.grad = None
    out = call(xs)
    d = torch.randn(out.shape, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    out.backward(d.to(out.dtype))
    return out.detach(), {"x": xs.grad, **{n: p.grad for n, p in params.items()}}


V4_CASES = {  # lens: one per sequence (BSH: all equal), none a multiple of the ratio
    "r4_overlap_bsh": dict(ratio=4, rd=8, lens=[23, 23]),
    "r8_bsh": dict(ratio=8, rd=16, lens=[37, 37]),
    "r4_overlap_th_ragged": dict(ratio=4, rd=16, lens=[13, 3, 22], th=True),
    "r16_th": dict(ratio=16, rd=8, lens=[40, 15, 33], th=True),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(V4_CASES))
def test_v4_module_against_the_model(name, dtype):
    """Prefill (BSH through forward(x, 0), TH through train_rows): the rows and the gradients of x,
    ape, wkv.weight, wgate.weight and norm.weight."""
    c = V4_CASES[name]
    io = IO[dtype]
    ref, mod = _v4_models(c["ratio"], c["rd"], seed=len(name))
    x, cu = _inputs(c.get("th", False), c["lens"], V4_DIM, io, seed=7)
    if cu is None:
        out_a, grads_a = _run_v4(lambda t: mod(t, 0), dict(mod.named_parameters()), x)
    else:
        out_a, grads_a = _run_v4(lambda t: mod.train_rows(t, cu), dict(mod.named_parameters()), x)
    out_b, grads_b = _run_v4(lambda t: ref.rows(t, cu), dict(ref.named_parameters()), x)
    out_c, grads_c = _run_v4(lambda t: ref.rows(t, cu, exact=True), dict(ref.named_parameters()), x.double())
    rows = sum(n // c["ratio"] for n in c["lens"])
    bsh_shape = (len(c["lens"]), rows // len(c["lens"]), V4_HEAD_DIM)
    assert out_a.shape == ((rows, V4_HEAD_DIM) if cu is not None else bsh_shape)
    assert out_a.dtype == io
    assert set(grads_a) == {"x", "ape", "wkv.weight", "wgate.weight", "norm.weight"} == set(grads_c)
    assert all(g.dtype == torch.float32 for n, g in grads_a.items() if n != "x")
    _judge(out_a, grads_a, out_b, grads_b, out_c, grads_c, dtype)


V4_DECODE = {  # (ratio, rope_head_dim, prefill length, total length, batch, max_batch_size)
    "r4_overlap": (4, 8, 6, 19, 2, 2),
    "r4_overlap_short_prefill": (4, 16, 3, 13, 3, 3),  # no complete block in the prefill
    "r8_fewer_than_max_batch": (8, 16, 13, 34, 2, 4),
}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(V4_DECODE))
def test_v4_decode_token_by_token(name, dtype):
    """A prefill whose length is not a multiple of the ratio, then one token per call across several
    block ends: the same calls return rows (None elsewhere), the rows and kv_cache follow the model,
    and they are the rows of one prefill of the whole sequences bit for bit. Twice: the second
    sequences reuse the batch slots (their prefill starts them afresh, whatever the state holds)."""
    ratio, rd, first, total, bsz, max_bsz = V4_DECODE[name]
    io = IO[dtype]
    ref, mod = _v4_models(ratio, rd, seed=len(name), max_batch_size=max_bsz)
    cache_rows = V4_MAX_SEQ // ratio
    ref.kv_cache = torch.zeros(max_bsz, cache_rows, V4_HEAD_DIM, dtype=io)
    mod.kv_cache = torch.zeros(max_bsz, cache_rows, V4_HEAD_DIM, dtype=io)
    n = total // ratio
    for seed, prefill in ((3, first), (4, first + ratio - 1)):
        x = torch.randn(bsz, total, V4_DIM, generator=torch.Generator().manual_seed(seed)).to(io)
        got_a, got_b = [], []
        with torch.no_grad():
            calls = [(x[:, :prefill], 0)] + [(x[:, p:p + 1], p) for p in range(prefill, total)]
            for t, p in calls:
                a, b = mod(t, p), ref(t, p)
                assert (a is None) == (b is None), p
                if a is not None:
                    assert a.dtype == io and a.shape[::2] == (bsz, V4_HEAD_DIM)
                    got_a.append(a)
                    got_b.append(b)
            out_a, out_b = torch.cat(got_a, 1), torch.cat(got_b, 1)
            assert out_a.shape == (bsz, n, V4_HEAD_DIM)
            truth = ref.rows(x.double(), exact=True)
            _judge(out_a, {}, out_b, {}, truth, {}, dtype)
            assert torch.equal(bits(mod.kv_cache[:bsz, :n]), bits(out_a))
            assert not mod.kv_cache[:bsz, n:].any() and not mod.kv_cache[bsz:].any()
            _judge(mod.kv_cache[:bsz, :n], {}, ref.kv_cache[:bsz, :n], {}, truth, {}, dtype)
            # Row stability: the decode rows are those of one call on the whole sequences.
            assert torch.equal(bits(mod.train_rows(x)), bits(out_a))


def test_v4_state_dict_both_ways_and_attributes():
    ref, mod = _v4_models(4, 8, seed=1)
    assert set(mod.state_dict()) == {"ape", "wkv.weight", "wgate.weight", "norm.weight"}
    assert "state_cache" in dict(mod.named_buffers())  # the decode state: a buffer, not in the state_dict
    assert mod.ape.shape == (4, 2 * V4_HEAD_DIM) and mod.wkv.weight.shape == (2 * V4_HEAD_DIM, V4_DIM)
    assert all(p.dtype == torch.float32 for p in mod.parameters())
    back = EagerV4(V4_DIM, V4_HEAD_DIM, 8, 4)
    back.load_state_dict(mod.state_dict(), strict=True)
    assert all(torch.equal(back.state_dict()[k], v) for k, v in ref.state_dict().items())
    m128 = kvcomp.nn.DeepseekV4Compressor(dim=V4_DIM, rope_head_dim=8, head_dim=V4_HEAD_DIM, compress_ratio=128)
    assert m128.coff == 1 and not m128.overlap and m128.ape.shape == (128, V4_HEAD_DIM)
    assert m128.kv_cache is None and m128.freqs_cis is None and m128.max_batch_size == 1
    with pytest.raises(RuntimeError):  # a model of the other layout does not load
        m128.load_state_dict(mod.state_dict(), strict=True)


def test_v4_refusals():
    args = SimpleNamespace(dim=V4_DIM, rope_head_dim=8, norm_eps=1e-6, max_batch_size=2)
    with pytest.raises(kvcomp.KvcompError, match="Hadamard") as e:
        kvcomp.nn.DeepseekV4Compressor(args, 4, V4_HEAD_DIM, True)
    assert e.value.code == kvcomp.KvcompError(161002, "").code
    with pytest.raises(kvcomp.KvcompError, match="dim"):
        kvcomp.nn.DeepseekV4Compressor(None, 4, V4_HEAD_DIM, rope_head_dim=8)
    _, mod = _v4_models(4, 8, seed=2)
    x = torch.randn(3, 8, V4_DIM).to(torch.bfloat16)
    with pytest.raises(kvcomp.KvcompError, match="max_batch_size"):
        mod(x, 0)
    with pytest.raises(kvcomp.KvcompError, match="one token"):
        mod(x[:2, :2], 8)
    mod.freqs_cis = None
    with pytest.raises(kvcomp.KvcompError, match="freqs_cis"):
        mod(x[:2], 0)


def test_v4_epilogue_is_the_models_arithmetic():
    """Given the pooled rows, the operator's RMSNorm and RoPE are the model's (fp32 statistics, a
    complex64 product on the rounded normed channels): the same bits but where the mean of squares
    (float64 in kvcomp, an fp32 sum in the model) rounds differently (one io ulp at most). The rows go
    through the operator unchanged: ratio 1, an identity wkv, a zero gate, no APE."""
    ref, mod = _v4_models(4, 16, seed=5)
    pooled = torch.randn(3, 40, V4_HEAD_DIM, dtype=torch.float64)
    freqs = ref.freqs_cis[0:160:4]  # row k of the table: block k's position
    with torch.no_grad():
        for io in (torch.bfloat16, torch.float16):
            rows = pooled.to(io)
            eye = torch.eye(V4_HEAD_DIM, dtype=io)
            cache = torch.zeros(1, 1, 2 * V4_HEAD_DIM)
            table = torch.zeros(3, 40, dtype=torch.int32)
            got = kvcomp._ops.model_compressor(rows, eye, torch.zeros_like(eye), None, 1, state_cache=cache,
                                               state_block_table=table, norm_weight=mod.norm.weight,
                                               norm_eps=mod.norm.eps, rope_cos=freqs.real.contiguous(),
                                               rope_sin=freqs.imag.contiguous())
            want = ref._epilogue(rows, freqs, False, io)
            same = (bits(got) == bits(want)).double().mean().item()
            assert same >= 0.99, same
            ulp = io_ulp(want.float(), dtype_key(io))
            assert ((got.float() - want.float()).abs() <= ulp).all()


def test_v4_is_the_same_for_every_thread_count():
    _, mod = _v4_models(4, 8, seed=4)
    x = torch.randn(2, 21, V4_DIM).to(torch.bfloat16)
    outs = []
    for t in (1, 2, 3):
        previous = kvcomp.set_default_options(num_threads=t)
        try:
            out, grads = _run_v4(lambda s: mod(s, 0), dict(mod.named_parameters()), x)
        finally:
            kvcomp.set_default_options(**previous)
        outs.append([bits(out)] + [g.clone() for g in grads.values()])
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_v4_training_rows_compile_into_one_graph(backend):
    """torch.compile(fullgraph=True) of the stateless training form: one graph (the operator with its
    fused epilogue is a registered operator), the eager module's output and gradients bit for bit."""
    if backend == "inductor" and os.environ.get("KVCOMP_SKIP_INDUCTOR"):
        pytest.skip("KVCOMP_SKIP_INDUCTOR set")
    _, mod = _v4_models(4, 16, seed=8)
    x = torch.randn(2, 19, V4_DIM).to(torch.bfloat16)
    params = dict(mod.named_parameters())
    eager = _run_v4(lambda s: mod.train_rows(s), params, x)
    compiled_fn = torch.compile(mod.train_rows, backend=backend, fullgraph=True)
    compiled = _run_v4(lambda s: compiled_fn(s), params, x)
    assert torch.equal(bits(eager[0]), bits(compiled[0]))
    for name in eager[1]:
        assert torch.equal(eager[1][name], compiled[1][name]), name
