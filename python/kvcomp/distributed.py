"""Context parallelism: the compressor on sequences split over the ranks of a torch.distributed group.

``cp_compressor`` is ``kvcomp.torch.compressor`` for a rank that holds only part of every sequence.
Blocks stay aligned on global positions; every compressed row is computed once, by its **owner**: the
rank that holds the block's last token (position ``k*r + r - 1``). The rows a block needs from
earlier ranks (at most ``coff*r - 1`` tokens of ``x``, the halo) arrive by point-to-point calls; a small
local call projects them into a scratch state cache, from which the main local call (on this rank's
rows of ``x`` as they are, no copy) reads them as chunked prefill reads its cache. In the backward the
owner sends the block's ``(d_cmp_kv row, softmax_score, kv)`` to every rank that holds one of its
tokens, and each rank runs the backward of every block that touches its tokens itself (with a gradient
the forward's main call already runs on, in zero rows, to the end of those blocks, so its softmax_score
and kv serve the backward as they are): each token's ``d_new_kv`` / ``d_new_score`` row is then
complete where the token lives, and its ``d_x`` row comes out of one product, exactly as in the
single-process call (the local calls are row-stable: ``Options::row_stable``, which a context-parallel
call never turns off). So ``cmp_kv`` and ``d_x`` equal the single-process call bit for bit; ``d_wkv``,
``d_wgate``, ``d_ape`` are this rank's partial sums (sum them over the group: DDP's all-reduce, or
``all_reduce_gradients``).

Layouts (``split``):

* ``"contiguous"``: BSH ``x`` ``[B, S_k, H]``: rank k holds tokens ``[S_0 + .. + S_{k-1}, .. + S_k)`` of
  every batch row (sizes may differ per rank, 0 included); TH ``x`` ``[T_k, H]``: rank k holds rows
  ``[T_0 + .. + T_{k-1}, .. + T_k)`` of the packed token stream described by the global
  ``cu_seqlens`` (a sequence may span any number of ranks; ``sum(T_k) == cu_seqlens[-1]``).
* ``"load_balanced"`` (causal attention's split): every sequence is cut into ``2W`` equal chunks and
  rank k holds chunks ``k`` and ``2W-1-k``, in that order. BSH: ``S_k = 2c`` on every rank; TH: every
  length a multiple of ``2W``, rank k's rows are, sequence after sequence, its two chunks.

``cu_seqlens``, ``seqused`` and ``start_pos`` are global (the same tensors on every rank).
docs/distributed.md has the launch, the owner rule, the communication volume and the figures.
"""

from typing import Optional

import torch
import torch.distributed as dist

from . import _ops  # registers torch.ops.kvcomp.*
from ._cp_exchange import (
    _Call,
    _assemble,
    _call_rows,
    _concat_rows,
    _gather,
    _group_device,
    _out_index,
    _rows_tensor,
    _scratch_cache,
    _th_args,
    _timeout,
    _wait,
)
from ._cp_plan import (
    _WEIGHT_GRADS,
    SPLITS,
    _check_agreement,
    _describe,
    _global_layout,
    _halo_parts,
    _local_checks,
    _Plan,
    _trailing,
    output_rows,
)
from ._errors import INVALID_PARAM, NULL_POINTER, RUNTIME_ERROR, error

__all__ = [
    "SPLITS",
    "all_reduce_gradients",
    "cp_compressor",
    "cp_owned_blocks",
    "cp_output_rows",
]


class _CPCompressor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wkv, wgate, ape, norm_weight, call, needs_grad):
        ctx.w_dtype = wkv.dtype
        ctx.has_ape = ape is not None
        ctx.norm_dtype = norm_weight.dtype if norm_weight is not None else None
        ctx.P = None
        ep = call.epilogue
        # fp32 (exact): the product with the normalised row is fp32 either way, and the local d_norm_weight
        # stays unrounded until the group's total.
        norm_weight = norm_weight.float() if norm_weight is not None else None
        plan, me, dev, D, r, coff = call.plan, call.plan.rank, call.device, call.D, call.plan.r, call.plan.coff
        xf = x.reshape(-1, x.shape[-1])
        seqs = call.local[me]
        wkv, wgate = wkv.to(x.dtype), wgate.to(x.dtype)  # fp32 master weights: cast here (no-op otherwise)
        # The halo rows: x rows of earlier tokens that this rank's first owned blocks read.
        index_parts = _halo_parts(plan, seqs)
        sends = {}
        for k in range(plan.world):
            if k != me:
                segs = [(a, n) for kk, a, n in _halo_parts(plan, call.local[k]) if kk == me]
                sends[k] = xf.index_select(0, _rows_tensor(segs, dev))
        recv_counts = {k: sum(n for kk, _, n in index_parts if kk == k) for k in range(plan.world) if k != me}
        recvs, sent = call.exchange(sends, recv_counts, xf.shape[1], xf.dtype,
                                    "exchange of the rows before each block")
        cmp_kv = torch.zeros(call.out_shape, dtype=x.dtype, device=dev)
        out_idx = _out_index(call)
        S = K = x_loc = None
        if seqs:
            cache, table = _scratch_cache(call, seqs)
            halo = [i for i, s in enumerate(seqs) if s.halo_lo < s.lo]
            if halo:
                # The halo call writes the halo rows' kv and score (APE included) into the scratch
                # cache, where the main call reads them as it would read a state cache: the same fp32
                # values the single call computes for those rows (row-stable products).
                cu, sp = _th_args([seqs[i].lo - seqs[i].halo_lo for i in halo],
                                  [seqs[i].start - (seqs[i].lo - seqs[i].halo_lo) for i in halo], dev)
                sel = torch.tensor(halo, dtype=torch.int64, device=dev)
                torch.ops.kvcomp.model_compressor_forward(_assemble(index_parts, xf, recvs, me), wkv, wgate, cache,
                                                          ape, table.index_select(0, sel), cu, None, sp, r, coff, 1,
                                                          False, profile=call.profile)
            x_loc = _call_rows(seqs, xf)
            cu, sp = _th_args([s.hi - s.lo for s in seqs], [s.start for s in seqs], dev)
            # The epilogue (RMSNorm, RoPE) runs on every row of the local call, at its global position:
            # row-local arithmetic, so the owned rows are the single call's bit for bit.
            cmp_loc, S, K, P = torch.ops.kvcomp.model_compressor_forward(
                x_loc, wkv, wgate, cache, ape, table, cu, None, sp, r, coff, 1, needs_grad, *_epilogue_args(ep, norm_weight),
                profile=call.profile)
            ctx.P = P if ep is not None else None
            if len(call.owned):
                cmp_kv.view(-1, D).index_copy_(0, out_idx, cmp_loc.index_select(0, call.own_rows))
        sent()
        ctx.call = call
        ctx.out_idx = out_idx
        if needs_grad:
            # softmax_score / kv stay attributes: the backward overwrites their rows of blocks past the
            # pieces with the owners' (autograd would refuse saved tensors changed in place).
            ctx.S, ctx.K = S, K
            ctx.save_for_backward(x, wkv, wgate, x_loc, norm_weight)
        return cmp_kv

    @staticmethod
    def backward(ctx, d_cmp):
        call = ctx.call
        plan, me, dev, D, r, coff = call.plan, call.plan.rank, call.device, call.D, call.plan.r, call.plan.coff
        x, wkv, wgate, x_loc, norm_weight = ctx.saved_tensors
        S, K = ctx.S, ctx.K
        ep = call.epilogue
        P = ctx.P
        xf = x.reshape(-1, x.shape[-1])
        n_own = len(call.owned)
        cr = coff * r
        # With the epilogue the pooled row travels with its block too (io values, exact in fp32).
        width = D + 2 * cr * D + (D if ep is not None else 0)
        dc_own = d_cmp.reshape(-1, D).index_select(0, ctx.out_idx) if n_own else d_cmp.new_zeros((0, D))

        # The blocks this rank owns that reach into later ranks' tokens go to those ranks, packed as fp32
        # [d_cmp_kv row | softmax_score | kv] (d_cmp_kv goes back to the io dtype exactly).
        sends = {}
        for k in range(plan.world):
            if k == me:
                continue
            blocks = _trailing(plan, call.local[k], me)
            if blocks:
                ids = torch.tensor([call.owned_index[(b, j)] for b, j, _ in blocks], dtype=torch.int64, device=dev)
                rows = call.own_rows.index_select(0, ids)
                pieces = [dc_own.index_select(0, ids).float(), S.index_select(0, rows).reshape(len(blocks), -1),
                          K.index_select(0, rows).reshape(len(blocks), -1)]
                if ep is not None:
                    pieces.append(P.index_select(0, rows).float())
                sends[k] = torch.cat(pieces, dim=1)
        seqs = call.local[me]
        need = {k: _trailing(plan, seqs, k) for k in range(plan.world) if k != me}
        recvs, sent = call.exchange(sends, {k: len(v) for k, v in need.items()}, width, torch.float32,
                                    "exchange of the blocks' gradients")
        w_dt = ctx.w_dtype
        if not seqs:
            sent()
            d_wkv, d_wgate = torch.zeros_like(wkv, dtype=torch.float32), torch.zeros_like(wgate, dtype=torch.float32)
            d_ape = torch.zeros((r, wkv.shape[0]), dtype=torch.float64, device=dev) if ctx.has_ape else None
            d_norm = torch.zeros((D,), dtype=torch.float64, device=dev) if ep is not None and ep.norm else None
            return ((torch.zeros_like(x),) + _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt, d_norm, ctx.norm_dtype)
                    + (None, None))
        dc = torch.zeros((S.shape[0], D), dtype=x.dtype, device=dev)
        if n_own:
            dc.index_copy_(0, call.own_rows, dc_own)
        for k, buf in recvs.items():
            rows = torch.tensor([row for _, _, row in need[k]], dtype=torch.int64, device=dev)
            dc.index_copy_(0, rows, buf[:, :D].to(x.dtype))
            S.index_copy_(0, rows, buf[:, D:D + cr * D].view(-1, cr, D))
            K.index_copy_(0, rows, buf[:, D + cr * D:D + 2 * cr * D].view(-1, cr, D))
            if P is not None:
                P.index_copy_(0, rows, buf[:, D + 2 * cr * D:].to(P.dtype))
        mine = _trailing(plan, seqs, me)  # a piece followed by this rank's next one (load_balanced)
        if mine:
            rows = torch.tensor([row for _, _, row in mine], dtype=torch.int64, device=dev)
            src = call.own_rows.index_select(
                0, torch.tensor([call.owned_index[(b, j)] for b, j, _ in mine], dtype=torch.int64, device=dev))
            for t in (dc, S, K) + ((P,) if P is not None else ()):
                t.index_copy_(0, rows, t.index_select(0, src))
        cu, sp = _th_args([s.hi - s.lo for s in seqs], [s.start for s in seqs], dev)
        # x_loc's zero rows (later ranks' tokens) add nothing to d_wkv / d_wgate; their d_x is dropped.
        # fp32 master weights get fp32 partial sums (the CPU kernels write them unrounded), so the sum
        # over the ranks is rounded once, by the optimizer's dtype, not once per rank.
        fp32_w = (w_dt == torch.float32 or call.reduce_w) and x.dtype != torch.float32 and dev.type == "cpu"
        dx_loc, d_wkv, d_wgate, d_ape_loc, d_norm_loc = torch.ops.kvcomp.model_compressor_backward(
            dc, x_loc, wkv, wgate, S, K, cu, None, sp, r, coff, ctx.has_ape, P, *_epilogue_args(ep, norm_weight),
            fp32_weight_grads=fp32_w, float64_d_ape=dev.type == "cpu", precision=call.precision, profile=call.profile)
        d_x = _place_rows([(s.row0, s.tok, s.own_hi - s.lo) for s in seqs], dx_loc, xf)
        # With the epilogue, the pooling's gradient of a row is the epilogue's backward of dc (float64).
        blocks = {row: j for k in need for _, j, row in need[k]}
        blocks.update({row: j for _, j, row in mine})
        pooled_grad = (lambda rows: _epilogue_backward_rows(call, norm_weight, dc, P, rows, blocks)[0]) \
            if ep is not None else None
        d_ape = _without_other_tokens(call, seqs, d_ape_loc, dc, S, K, pooled_grad) if ctx.has_ape else None
        d_norm = None
        if ep is not None and ep.norm:
            # The local call summed every row it holds; the rows of other owners' blocks (and this
            # rank's own blocks copied past a piece) are counted where they are owned.
            d_norm = d_norm_loc.double() - _epilogue_backward_rows(call, norm_weight, dc, P, sorted(blocks),
                                                                   blocks)[1]
        sent()
        return ((d_x.view(x.shape),) + _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt, d_norm, ctx.norm_dtype)
                + (None, None))


def _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt, d_norm=None, norm_dtype=None):
    """(d_wkv, d_wgate, d_ape, d_norm_weight) as the call returns them. d_ape (small: r x C) and
    d_norm_weight ([D]) are always the group's totals, summed in float64 and rounded once, on its rank 0
    (zeros elsewhere; None without APE / norm); d_wkv and d_wgate are this rank's partial sums, or
    (weight_grads "reduced") the group's totals on its rank 0, likewise."""
    smalls = [t for t in (d_ape, d_norm) if t is not None]
    works = [dist.all_reduce(t, group=call.group, async_op=True) for t in smalls]
    flat = None
    if call.reduce_w:
        flat = torch.cat([d_wkv.reshape(-1).float(), d_wgate.reshape(-1).float()])
        works.append(dist.all_reduce(flat, group=call.group, async_op=True))
    _wait(works, call.timeout, "all-reduce of the weight gradients")
    if call.plan.rank != 0:
        for t in smalls:
            t.zero_()
        if flat is not None:
            flat.zero_()
    if flat is not None:
        n = d_wkv.numel()
        d_wkv, d_wgate = flat[:n].view(d_wkv.shape), flat[n:].view(d_wgate.shape)
    return (d_wkv.to(w_dt), d_wgate.to(w_dt), None if d_ape is None else d_ape.to(torch.float32),
            None if d_norm is None else d_norm.to(norm_dtype))


class _Epilogue:
    """A context-parallel call's epilogue: norm (the norm weight is an input of the autograd function),
    its epsilon, and the rope tables (global positions)."""

    def __init__(self, norm, eps, cos, sin):
        self.norm, self.eps, self.cos, self.sin = norm, float(eps), cos, sin


def _epilogue_args(ep, norm_weight):
    """norm_weight, norm_eps, rope_cos, rope_sin of the model operators."""
    if ep is None:
        return None, 1e-6, None, None
    return norm_weight if ep.norm else None, ep.eps, ep.cos, ep.sin


def _epilogue_backward_rows(call, norm_weight, dc, P, rows, blocks):
    """The epilogue's backward, in float64, for the local call's ``rows`` (``blocks``: row -> global
    block j, at position j*r): (the gradient of the pooled rows [n, D], their part of d_norm_weight
    [D]) from the gradient of the epilogue's rows ``dc`` and the pooled rows ``P``; the terms the
    operator computes, for the rows it counts where they are owned."""
    D = call.D
    ep, r = call.epilogue, call.plan.r
    if not rows:
        return dc.new_zeros((0, D), dtype=torch.float64), torch.zeros((D,), dtype=torch.float64, device=call.device)
    sel = torch.tensor(rows, dtype=torch.int64, device=call.device)
    g = dc.index_select(0, sel).double()
    if ep.cos is not None:  # the rotation's inverse
        pos = torch.tensor([blocks[row] for row in rows], dtype=torch.int64, device=call.device) * r
        c, s = ep.cos.index_select(0, pos).double(), ep.sin.index_select(0, pos).double()
        pairs = c.shape[1]
        tail = g[:, D - 2 * pairs:].unflatten(-1, (pairs, 2))
        a, b = tail[..., 0], tail[..., 1]
        g = torch.cat([g[:, : D - 2 * pairs], torch.stack((a * c + b * s, b * c - a * s), -1).flatten(-2)], -1)
    if not ep.norm:
        return g, torch.zeros((D,), dtype=torch.float64, device=call.device)
    h = P.index_select(0, sel).double()
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + ep.eps)
    x_hat = h * rstd
    gw = g * norm_weight.double()
    return rstd * (gw - x_hat * (gw * x_hat).mean(-1, keepdim=True)), (g * x_hat).sum(0)


def _place_rows(spans, dx_loc, xf):
    """d_x of the rank's rows from the local call's: spans (row of x, row of the call, count); rows of x
    outside every span (tail tokens, tokens past seqused) are zero. One copy, or none when the call's
    first rows are exactly x's."""
    T = xf.shape[0]
    if len(spans) == 1 and spans[0][0] == 0 and spans[0][1] == 0 and spans[0][2] == T:
        return dx_loc.narrow(0, 0, T)
    pieces, row = [], 0
    for x_row, loc_row, n in sorted(spans):
        if x_row > row:
            pieces.append(dx_loc.new_zeros((x_row - row, xf.shape[1])))
        pieces.append(dx_loc.narrow(0, loc_row, n))
        row = x_row + n
    if row < T:
        pieces.append(dx_loc.new_zeros((T - row, xf.shape[1])))
    return _concat_rows(pieces) if pieces else torch.zeros_like(xf)


def _without_other_tokens(call, seqs, d_ape_loc, dc, S, K, pooled_grad=None):
    """d_ape of this rank's tokens: the local call's d_ape less the dZ of the rows of other ranks'
    tokens that its blocks past the pieces hold (those ranks count them), in float64 (spec 2.2, 2.5).
    On the CPU the local call's d_ape is its float64 sums, so the difference cancels nothing."""
    plan, D, r, coff = call.plan, call.D, call.plan.r, call.plan.coff
    i = torch.arange(coff * r)
    rel = (i // coff) - (coff - 1 - i % coff) * r  # row i's position relative to j*r
    rows, masks = [], []
    for s in seqs:
        sp = plan.sp[s.b]
        for j in range(s.j_own + 1, s.j_last + 1):  # only these hold tokens past the piece
            ext = (j * r - sp + rel) >= s.own_hi
            if bool(ext.any()):
                rows.append(s.row + j - s.j_first)
                masks.append(ext)
    if not rows:
        return d_ape_loc.double()
    sel = torch.tensor(rows, dtype=torch.int64, device=call.device)
    s64, k64 = S.index_select(0, sel).double(), K.index_select(0, sel).double()
    # The gradient of the pooled rows: dc itself, or (epilogue) its backward through the epilogue.
    dc64 = (pooled_grad(rows) if pooled_grad is not None else dc.index_select(0, sel).float().double())[:, None, :]
    w = (s64 * k64).sum(1, keepdim=True)
    dz = s64 * dc64 * (k64 - w) * torch.stack(masks).to(call.device, torch.float64)[:, :, None]
    return d_ape_loc.double() - dz.sum(0).reshape(r, coff * D)  # float64: rounded by _weight_grads


def _prepare(x, wkv, wgate, ape, cmp_ratio, group, split, cu_seqlens, seqused, start_pos, coff, state_cache,
             state_block_table, cache_mode, timeout, needs_grad, reads_cache=True, weight_grads="auto",
             precision=None, profile=None, epilogue=(None, 1e-6, None, None)):
    """Checks the call on every rank and plans it: the _Call every rank runs. ``precision`` / ``profile``:
    the call's (None: the defaults in force now), kept on the call for its backward."""
    precision, profile = _ops.resolved_options(precision, profile)
    if wgate is None:
        raise error(INVALID_PARAM, "wgate (= None) must be given to a context-parallel call: a call without a "
                                  "gate (cmp_ratio 1) pools no two tokens together, so each rank runs kvcomp's "
                                  "operator on its own tokens, with no exchange")
    if not dist.is_available() or not dist.is_initialized():
        raise error(RUNTIME_ERROR, "torch.distributed (= not initialised) must be initialised "
                                  "(torch.distributed.init_process_group) before a context-parallel call")
    if split not in SPLITS:
        raise error(INVALID_PARAM, f"split (= {split!r}) must be one of {', '.join(SPLITS)}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device, dev_type, backend = _group_device(group)
    dev_problem = _local_checks(x, wkv, wgate, ape, state_cache, dev_type)
    tmo = _timeout(timeout)
    norm_weight, norm_eps, rope_cos, rope_sin = epilogue
    pairs = rope_cos.shape[-1] if rope_cos is not None else 0
    # What every rank must agree on: APE present, norm present, rope pairs, the epsilon's bits.
    ep_code = (int(ape is not None) + 2 * int(norm_weight is not None) + 4 * int(rope_cos is not None)
               + 8 * int(rope_sin is not None) + 16 * pairs)
    desc = _describe(x, wkv, wgate, cmp_ratio, coff, split, cu_seqlens, seqused, start_pos, needs_grad,
                     state_cache, cache_mode, world, dev_problem, weight_grads, precision,
                     (ep_code, _float_bits(norm_eps), rope_cos.shape[0] if rope_cos is not None else 0))
    descs = _gather(desc, group, world, device, tmo)
    _check_agreement(descs, dev_type, backend)
    if weight_grads not in _WEIGHT_GRADS:
        raise error(INVALID_PARAM, f"weight_grads (= {weight_grads!r}) must be one of {', '.join(_WEIGHT_GRADS)}")
    if x.dim() not in (2, 3):
        raise error(INVALID_PARAM, f"x.dim() (= {x.dim()}) must be 3 (BSH) or 2 (TH)")
    if coff not in (1, 2) or wkv.shape[0] % coff:
        raise error(INVALID_PARAM, f"coff (= {coff}) must be 1 or 2 and divide wkv.shape[0] (= {wkv.shape[0]})")
    if cmp_ratio < 1:
        raise error(INVALID_PARAM, f"cmp_ratio (= {cmp_ratio}) must be >= 1")
    if wkv.dtype != wgate.dtype or wkv.dtype not in (x.dtype, torch.float32):
        raise error(INVALID_PARAM, f"wkv and wgate (= {wkv.dtype}, {wgate.dtype}) must both have the io dtype "
                                  f"{x.dtype} or both be fp32 (master weights)")
    bsh, counts, B, lens, sp, used = _global_layout(descs, x, split, cu_seqlens, seqused, start_pos)
    has_epilogue = any(t is not None for t in epilogue[:1] + epilogue[2:])
    plan = _Plan(rank, world, bsh, split, counts, B, lens, sp, used, cmp_ratio, coff, global_positions=has_epilogue)
    C = wkv.shape[0]
    D = C // coff
    # Blocks that read positions before start_pos need the caller's state cache.
    if state_cache is None and reads_cache:
        for k in range(world):
            for s in plan.fwd[k]:  # only a sequence's first coff blocks can read before its start
                if s.lo == 0 and any(
                        plan.owner(s.b, j) == k and max(0, (j - coff + 1) * cmp_ratio) < sp[s.b]
                        for j in range(s.j_first, min(s.j_last, s.j_first + coff) + 1)):
                    raise error(NULL_POINTER, f"state_cache (= None) must be given: sequence {s.b} starts at "
                                             f"start_pos {sp[s.b]} and its first block reads positions before it")
    elif state_cache is not None and state_block_table is None:
        raise error(NULL_POINTER, "state_block_table (= None) must be given with state_cache")
    out_shape = _output_shape(plan, x, cmp_ratio, D)
    call = _Call(group, tmo, plan, x, out_shape, D, C, state_cache, state_block_table, cache_mode, needs_grad)
    if weight_grads == "auto":
        weight_grads = "partial" if wkv.dtype == torch.float32 else "reduced"
    call.reduce_w = weight_grads == "reduced"
    call.precision, call.profile = precision, profile
    call.epilogue = None
    if has_epilogue:
        if (rope_cos is None) != (rope_sin is None):
            raise error(NULL_POINTER, f"rope_cos and rope_sin (= {_given(rope_cos)}, {_given(rope_sin)}) must be "
                                      "given together")
        if rope_cos is not None:
            last = max((sp[b] + used[b] - 1) // cmp_ratio * cmp_ratio for b in range(B)) if B else 0
            if rope_cos.dim() != 2 or rope_cos.shape != rope_sin.shape or rope_cos.shape[0] <= last:
                raise error(INVALID_PARAM, f"rope_cos and rope_sin (= {list(rope_cos.shape)}, {list(rope_sin.shape)}) "
                                           f"must be equal [positions, rd / 2] tables covering position {last} (the "
                                           "last block's first token)")
        call.epilogue = _Epilogue(norm_weight is not None, norm_eps, rope_cos, rope_sin)
    return call


def _given(t):
    return "None" if t is None else "given"


def _float_bits(v):
    import struct

    return struct.unpack("<q", struct.pack("<d", float(v)))[0]


def _output_shape(plan, x, r, D):
    return tuple(cp_output_rows(x, r, plan.split, plan.B)) + (D,)


def cp_output_rows(x, cmp_ratio, split="contiguous", batches=None):
    """Leading shape of this rank's cp_compressor output (from shapes only): BSH ``[B, ceil(S_k/r)]``
    (load_balanced: ``[B, 2*ceil(S_k/2/r)]``); TH ``[min(T_k, T_k//r + B)]`` (load_balanced: ``+ 2B``)."""
    return output_rows(x, cmp_ratio, split, batches)


@torch.compiler.disable  # point-to-point calls and the plan run eagerly; the graph around it compiles
def cp_compressor(
    x,
    wkv,
    wgate,
    ape,
    cmp_ratio: int = 4,
    *,
    group=None,
    split: str = "contiguous",
    cu_seqlens=None,
    seqused=None,
    start_pos=None,
    coff: int = 1,
    state_cache=None,
    state_block_table=None,
    cache_mode: int = 1,
    timeout: Optional[float] = None,
    weight_grads: str = "auto",
    norm_weight=None,
    norm_eps: float = 1e-6,
    rope_cos=None,
    rope_sin=None,
):
    """The compressor over sequences split across the ranks of ``group`` (default: the world).

    Args:
        x: this rank's tokens, io dtype: BSH ``[B, S_k, H]`` or TH ``[T_k, H]`` (see the module doc for
            which tokens each split gives a rank).
        wkv, wgate, ape, cmp_ratio, coff: as ``kvcomp.torch.compressor`` (the same on every rank; ``ape``
            may be None: no APE term, as ``kvcomp.compressor_forward``'s; ``wgate`` may not: a call
            without a gate pools no two tokens, so each rank calls the operator on its own tokens);
            ``wkv`` / ``wgate`` may also both be fp32 master weights with 16-bit ``x``: the call casts
            them to the io dtype, and their gradients are fp32 partial sums, not rounded per rank (CPU;
            on CUDA the io dtype's, widened).
        group: the context-parallel process group (gloo for CPU tensors, NCCL for CUDA tensors).
        split: ``"contiguous"`` or ``"load_balanced"``.
        cu_seqlens: TH only, the global int32 ``[B+1]`` prefix sums (the same on every rank).
        seqused, start_pos: global int32 ``[B]`` (the same on every rank), as in the single call.
        state_cache, state_block_table, cache_mode: read-only here: the slots of positions before
            ``start_pos`` that the first blocks read (needed only when a sequence starts at
            ``start_pos % cmp_ratio != 0``, or with coff = 2 at ``start_pos >= 1``). Nothing is written:
            a context-parallel call is a training step; continue decoding with the single call.
        timeout: seconds any wait on another rank may take (default ``KVCOMP_CP_TIMEOUT_S`` or 300);
            past it every rank raises KvcompError instead of hanging.
        weight_grads: what the gradients of wkv, wgate and ape are on each rank; their sum over the
            group is the gradient either way. ``"partial"``: this rank's tokens' and blocks' sums
            (fp32 for fp32 weights; 16-bit weights get them rounded on each rank). ``"reduced"``: the
            backward sums the ranks' unrounded partials (one all-reduce of the weights' size, fp32,
            and of d_ape, float64) and the group's rank 0 gets the total, rounded once, the others
            zeros. ``"auto"`` (default): ``"partial"`` for fp32 master weights, ``"reduced"`` for
            16-bit weights, so the summed gradient is rounded once in both.
        norm_weight, norm_eps, rope_cos, rope_sin: the model-level epilogue, as
            ``kvcomp.compressor_forward``'s (RMSNorm over D, RoPE on the last rd channels at each row's
            global block-first-token position; the same on every rank). The rows stay the single
            call's bit for bit; ``norm_weight``'s gradient is the group's total on its rank 0 (float64
            sum, rounded once; zeros elsewhere), as ``ape``'s.

    Returns:
        The compressed rows this rank owns, io dtype: BSH ``[B, M, D]`` (per batch row, its owned
        blocks in order, then zero rows), TH ``[N, D]`` (sequence after sequence); shapes in
        ``cp_output_rows``, which rows are which in ``cp_owned_blocks``.

    Raises:
        KvcompError: the same sentence on every rank when the ranks disagree (shapes, layout, split,
            cmp_ratio, group size) or a rank's tensors are on the wrong device; nothing was sent.
    """
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, wkv, wgate, ape, norm_weight))
    call = _prepare(x, wkv, wgate, ape, cmp_ratio, group, split, cu_seqlens, seqused, start_pos, coff,
                    state_cache, state_block_table, cache_mode, timeout, needs_grad, weight_grads=weight_grads,
                    epilogue=(norm_weight, norm_eps, rope_cos, rope_sin))
    return _CPCompressor.apply(x, wkv, wgate, ape, norm_weight, call, needs_grad)


def cp_owned_blocks(x, wkv, cmp_ratio: int = 4, *, group=None, split="contiguous", cu_seqlens=None, seqused=None,
                    start_pos=None, coff: int = 1, timeout: Optional[float] = None) -> torch.Tensor:
    """Which compressed row each output row of ``cp_compressor`` is: int64 ``[rows, 2]`` of
    ``(batch, block index i)``, where ``i`` is the row of that block in the single call's output for the
    batch (``i = k - start_pos // r``); ``(-1, -1)`` for padding rows. A collective, like the call."""
    # The ranks' sizes are all that matters: the same check and plan as the call.
    call = _prepare(x, wkv, wkv, torch.zeros(cmp_ratio, wkv.shape[0], device=x.device), cmp_ratio, group, split,
                    cu_seqlens, seqused, start_pos, coff, None, None, 1, timeout, False, reads_cache=False)
    lead = call.out_shape[:-1]
    out = torch.full((int(torch.tensor(lead).prod()), 2), -1, dtype=torch.int64)
    idx = _out_index(call).cpu()
    for n, (b, j, _) in enumerate(call.owned):
        out[idx[n], 0] = b
        out[idx[n], 1] = j - call.plan.sp[b] // cmp_ratio
    return out.view(*lead, 2)


def all_reduce_gradients(parameters, group=None, op="sum", timeout: Optional[float] = None):
    """Sums (``op="sum"``) or averages (``"mean"``) the ``.grad`` of ``parameters`` over ``group``, with a
    bounded wait. For context parallelism without DDP: d_wkv, d_wgate, d_ape are per-rank partial sums."""
    tmo = _timeout(timeout)
    world = dist.get_world_size(group)
    works, grads = [], []
    for p in parameters:
        if p.grad is None:
            continue
        works.append(dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group, async_op=True))
        grads.append(p.grad)
    _wait(works, tmo, "gradient all-reduce")
    if op == "mean":
        for g in grads:
            g.div_(world)
    elif op != "sum":
        raise error(INVALID_PARAM, f"op (= {op!r}) must be 'sum' or 'mean'")
