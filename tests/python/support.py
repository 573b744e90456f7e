"""Test support: an independent small-ops PyTorch implementation of the Compressor forward, random
cases, and the three reference gradients of spec 7.2.

The forward here is written from docs/semantics.md (blocks, the state cache, the softmax) with
plain differentiable torch ops, so autograd through it gives reference gradients that share nothing
with kvcomp's hand-written backward. It is vectorised per batch (all blocks at once), and small on
purpose: it is only fed test-sized cases.
"""

import dataclasses
from typing import Optional

import torch

import pytest

import kvcomp

IO_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# The devices a test runs on: host memory always; a CUDA device when torch sees one and this build of
# kvcomp has the CUDA backend (otherwise reported as skipped, with the reason).
CUDA_REASON = (
    "torch sees no CUDA device"
    if not torch.cuda.is_available()
    else (None if kvcomp.has_cuda_backend() else "this build of kvcomp has no CUDA backend")
)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(CUDA_REASON is not None, reason=str(CUDA_REASON)))]


def on_device(case, device):
    """The case with every tensor moved to `device` (a copy; the original stays in host memory)."""
    moved = {
        f.name: (v.to(device) if isinstance(v, torch.Tensor) else v)
        for f in dataclasses.fields(case)
        for v in [getattr(case, f.name)]
    }
    return dataclasses.replace(case, **moved)


class _RoundGrad(torch.autograd.Function):
    """Identity whose backward rounds the gradient to an io dtype: the "same" golden of spec 6.2
    stages d_new_kv / d_new_score in the io dtype before the matrix products, as the NPU does."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.to(ctx.dtype).to(g.dtype), None


class _Pin(torch.autograd.Function):
    """Forward: the given value (an intermediate exported by the operator under test); backward: the
    gradient flows on to the small-ops value it stands for."""

    @staticmethod
    def forward(ctx, computed, given):
        return given.to(computed.dtype)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _PinnedSoftmax(torch.autograd.Function):
    """Softmax over dim 1 whose forward value is the given softmax_score; the backward is the softmax
    backward at that value, dZ = S * (g - sum(S * g))."""

    @staticmethod
    def forward(ctx, z, given):
        s = given.to(z.dtype)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return s * (g - (s * g).sum(dim=1, keepdim=True)), None


def reference_forward(
    x,
    wkv,
    wgate,
    state_cache,
    ape,
    cmp_ratio,
    *,
    state_block_table,
    cu_seqlens=None,
    seqused=None,
    start_pos=None,
    coff=1,
    cache_mode=1,
    round_grad_to=None,
    pinned=None
):
    """Compressor forward with small differentiable ops in the dtype of `x` (float64 or float32).

    Returns (cmp_kv, new_state_cache): cmp_kv is differentiable wrt x, wkv, wgate, ape; the state
    cache is a detached updated copy (the input is not modified).

    pinned=(softmax_score, kv), in the operator's output layout, replaces the block weights and kv
    rows by those values while gradients still flow through the small ops: the backward goldens of
    upstream's main check, which differentiate at the forward intermediates of the run under test
    (spec 7.3 pathway 1), so that the fp32 rounding of the forward projections is common to A, B, C.
    """
    r = cmp_ratio
    dt = x.dtype
    H = x.shape[-1]
    C = wkv.shape[0]
    D = C // coff
    bsh = x.dim() == 3
    if bsh:
        B, S = x.shape[0], x.shape[1]
        bases = [b * S for b in range(B)]
        lens = [S] * B
    else:
        cu = [int(v) for v in cu_seqlens.tolist()]
        B = len(cu) - 1
        bases = cu[:-1]
        lens = [cu[b + 1] - cu[b] for b in range(B)]
    sps = [int(v) for v in start_pos.tolist()] if start_pos is not None else [0] * B
    used = [int(v) for v in seqused.tolist()] if seqused is not None else lens
    table = state_block_table.tolist()
    bs = state_cache.shape[1]

    X = x.reshape(-1, H)
    new_kv = X @ wkv.to(dt).t()  # spec 1.1
    new_score = X @ wgate.to(dt).t()
    if round_grad_to is not None:
        new_kv = _RoundGrad.apply(new_kv, round_grad_to)
        new_score = _RoundGrad.apply(new_score, round_grad_to)
    ape = ape.to(dt)
    old_cache = state_cache.to(dt)
    new_cache = state_cache.detach().clone()

    def slot(b, p):
        blk = table[b][p // bs] if cache_mode == 1 else table[b]
        return blk, p % bs

    per_batch = []
    row0 = 0  # TH: first output row of batch b
    for b in range(B):
        sp, U, base = sps[b], used[b], bases[b]
        pos = torch.arange(sp, sp + U)
        kv_b = new_kv[base : base + U]
        score_b = new_score[base : base + U] + ape[pos % r]  # spec 1.2
        limit = (sp + U) // r * r
        # Spec 1.3 writes: mode 1 every used token (block id 0: skipped), mode 2 only the tail plus,
        # for coff = 2, the last complete block.
        for s in range(U):
            p = sp + s
            if cache_mode == 2 and p < limit - (coff - 1) * r:
                continue
            blk, off = slot(b, p)
            if cache_mode == 1 and blk == 0:
                continue
            new_cache[blk, off, :C] = kv_b[s].detach().to(new_cache.dtype)
            new_cache[blk, off, C:] = score_b[s].detach().to(new_cache.dtype)
        k0 = sp // r
        nb = max(limit // r - k0, 0)
        if nb == 0:
            per_batch.append(new_kv.new_zeros((0, D)))
            continue
        # One row per position from the first block's "prev" half to the last compressed position:
        # placeholders (p < 0: kv 0, score -inf), cache rows (p < sp), fresh tokens (p >= sp).
        p_lo = k0 * r - (coff - 1) * r
        kv_rows, score_rows = [], []
        if p_lo < 0:
            kv_rows.append(new_kv.new_zeros((-p_lo, C)))
            score_rows.append(new_kv.new_full((-p_lo, C), float("-inf")))
        for p in range(max(p_lo, 0), sp):
            blk, off = slot(b, p)
            kv_rows.append(old_cache[blk, off, :C].unsqueeze(0))
            score_rows.append(old_cache[blk, off, C:].unsqueeze(0))
        kv_rows.append(kv_b[: limit - sp])
        score_rows.append(score_b[: limit - sp])
        V_kv, V_score = torch.cat(kv_rows), torch.cat(score_rows)

        def blocks(V):
            # Block i spans positions [p_lo + i*r, p_lo + (i+coff)*r); half c takes columns
            # [c*D, (c+1)*D) of its r positions; rows interleave (prev t, cur t) (spec 1.5).
            W = torch.stack([V[i * r : (i + coff) * r] for i in range(nb)]).view(nb, coff, r, C)
            halves = [W[:, c, :, c * D : (c + 1) * D] for c in range(coff)]
            return torch.stack(halves, dim=2).reshape(nb, coff * r, D)

        K, Z = blocks(V_kv), blocks(V_score)
        if pinned is None:
            weights = torch.softmax(Z, dim=1)  # spec 1.6, per column over the block's rows
        else:
            rows_b = (b, slice(0, nb)) if bsh else (slice(row0, row0 + nb),)
            weights = _PinnedSoftmax.apply(Z, pinned[0][rows_b])
            K = _Pin.apply(K, pinned[1][rows_b])
        row0 += nb
        per_batch.append((weights * K).sum(dim=1))

    # Spec 1.7 placement; padding rows are zero.
    if bsh:
        rows = -(-x.shape[1] // r)
        out = torch.stack([torch.cat([o, o.new_zeros((rows - o.shape[0], D))]) for o in per_batch])
    else:
        T = x.shape[0]
        rows = min(T, T // r + B)
        packed = torch.cat(per_batch)
        out = torch.cat([packed, packed.new_zeros((rows - packed.shape[0], D))])
    return out, new_cache


@dataclasses.dataclass
class Case:
    """One operator call: io tensors (in the io dtype), fp32 state, int32 index tensors."""

    x: torch.Tensor
    wkv: torch.Tensor
    wgate: torch.Tensor
    state_cache: torch.Tensor
    ape: torch.Tensor
    state_block_table: torch.Tensor
    cmp_ratio: int
    coff: int
    cache_mode: int
    cu_seqlens: Optional[torch.Tensor] = None
    seqused: Optional[torch.Tensor] = None
    start_pos: Optional[torch.Tensor] = None

    def kwargs(self):
        return dict(
            state_block_table=self.state_block_table,
            cu_seqlens=self.cu_seqlens,
            seqused=self.seqused,
            start_pos=self.start_pos,
            coff=self.coff,
            cache_mode=self.cache_mode,
        )


def make_case(
    *,
    lens,
    H=24,
    D=8,
    r=4,
    coff=1,
    start_pos=None,
    seqused=None,
    th=False,
    cache_mode=1,
    dtype="fp32",
    zero_ids=0.0,
    seed=0,
    S=None
):
    """A random case. `lens` are the sequence lengths (BSH: padded to S = max(lens) unless given, and
    lens then only set seqused when `seqused` is None); `zero_ids` is the fraction of paged block-table
    entries set to 0 ("do not write")."""
    g = torch.Generator().manual_seed(seed)
    io = IO_DTYPES[dtype]
    B = len(lens)
    C = coff * D
    if th:
        T = sum(lens)
        x = torch.randn(T, H, generator=g)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
        max_len = max(lens) if lens else 0
    else:
        S = max(lens) if S is None else S
        x = torch.randn(B, S, H, generator=g)
        cu = None
        max_len = S
        if seqused is None and any(L != S for L in lens):
            seqused = list(lens)
    sp = list(start_pos) if start_pos is not None else [0] * B
    # Weights scaled so that scores are O(1) and softmaxes neither flat nor one-hot.
    wkv = torch.randn(C, H, generator=g) / H**0.5
    wgate = torch.randn(C, H, generator=g) / H**0.5
    ape = 0.5 * torch.randn(r, C, generator=g)
    if cache_mode == 1:
        bs = 8
        cols = -(-(max(sp) + max_len) // bs) if B else 1
        ids = torch.arange(1, B * cols + 1, dtype=torch.int32).reshape(B, cols)
        if zero_ids > 0:
            ids[torch.rand(B, cols, generator=g) < zero_ids] = 0
        table, block_num = ids, B * cols + 1
    else:
        bs = coff * r + max_len - 1 + 3
        table = torch.arange(1, B + 1, dtype=torch.int32)
        block_num = B + 1
    state = torch.randn(block_num, bs, 2 * C, generator=g)
    return Case(
        x=x.to(io),
        wkv=wkv.to(io),
        wgate=wgate.to(io),
        state_cache=state,
        ape=ape,
        state_block_table=table,
        cmp_ratio=r,
        coff=coff,
        cache_mode=cache_mode,
        cu_seqlens=cu,
        seqused=None if seqused is None else torch.tensor(seqused, dtype=torch.int32),
        start_pos=None if start_pos is None else torch.tensor(sp, dtype=torch.int32),
    )


GRAD_NAMES = ("d_x", "d_wkv", "d_wgate", "d_ape")


def reference_grads(case, d_cmp_kv, compute_dtype, round_grad_to=None, pinned=None):
    """(cmp_kv, grads dict, new state cache) of the small-ops forward in `compute_dtype`, autograd
    with upstream gradient d_cmp_kv. Gradients stay in compute_dtype (not rounded)."""
    leaves = [t.detach().to(compute_dtype).requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    x, wkv, wgate, ape = leaves
    out, cache = reference_forward(
        x,
        wkv,
        wgate,
        case.state_cache,
        ape,
        case.cmp_ratio,
        round_grad_to=round_grad_to,
        pinned=pinned,
        **case.kwargs()
    )
    loss = (out * d_cmp_kv.to(compute_dtype)).sum()
    # With no compressed block nothing depends on the leaves; the zero term gives them zero gradients.
    loss = loss + sum(0.0 * t.sum() for t in leaves)
    loss.backward()
    return out.detach(), dict(zip(GRAD_NAMES, (t.grad for t in leaves))), cache


def forward_op_args(case, cache):
    """The positional arguments of the forward op (torch.ops.kvcomp.compressor_forward, and the
    upstream schema's _compressor_forward) before grad_enabled, with `cache` as the state cache."""
    k = case.kwargs()
    return (
        case.x,
        case.wkv,
        case.wgate,
        cache,
        case.ape,
        k["state_block_table"],
        k["cu_seqlens"],
        k["seqused"],
        k["start_pos"],
        case.cmp_ratio,
        case.coff,
        case.cache_mode,
    )


def kvcomp_intermediates(case):
    """softmax_score, kv of the forward operator (deterministic: the same the autograd run saves), the
    intermediates at which spec 7.3 pathway 1 differentiates the goldens (reference_grads(pinned=))."""
    import kvcomp.torch  # noqa: F401  (registers torch.ops.kvcomp)

    args = forward_op_args(case, case.state_cache.clone())
    _, softmax_score, kv = torch.ops.kvcomp.compressor_forward(*args, True)
    return softmax_score, kv


def assert_close_to_truth(a, truth, rel=1e-5, what=""):
    """|a - truth| <= rel * max|truth| everywhere: agreement relative to the output's scale (an element
    that is a cancelled sum has no meaningful relative error of its own). `what` names it in the
    failure message."""
    scale = max(truth.abs().max().item(), 1e-30) if truth.numel() else 1.0
    err = (a.double() - truth.double()).abs().max().item() if truth.numel() else 0.0
    assert err <= rel * scale, f"{what} max error {err:.3g} > {rel:g} x scale {scale:.3g}"


def io_ulp(t, dtype):
    """One unit in the last place of the io dtype at each element's magnitude."""
    frac, emin = {"bf16": (7, -126), "fp16": (10, -14)}[dtype]
    e = torch.floor(torch.log2(t.abs().clamp_min(2.0**emin))).clamp_min(emin)
    return torch.exp2(e - frac)


def bits(t):
    """A tensor's bit patterns (int16 or int32), so that comparisons tell -0 from +0 and NaNs apart
    (torch.equal does neither)."""
    t = torch.as_tensor(t).contiguous()
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])
