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
single-process call (the products are row-stable, ``src/cpu/gemm.hpp``, unless the process runs with
``KVCOMP_ROW_STABLE=0``). So ``cmp_kv`` and ``d_x`` equal the single-process call bit for bit; ``d_wkv``, ``d_wgate``, ``d_ape`` are this rank's partial sums (sum them over the group: DDP's
all-reduce, or ``all_reduce_gradients``).

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

import bisect
import dataclasses
import datetime
import os
from typing import List, Optional

import torch
import torch.distributed as dist

from . import _functional
from . import torch as _kvcomp_torch  # noqa: F401  (registers torch.ops.kvcomp.*)
from ._errors import INVALID_PARAM, NULL_POINTER, RUNTIME_ERROR, SHAPE_ERROR, KvcompError

__all__ = [
    "SPLITS",
    "all_reduce_gradients",
    "cp_compressor",
    "cp_owned_blocks",
    "cp_output_rows",
]

SPLITS = ("contiguous", "load_balanced")
_WEIGHT_GRADS = ("auto", "partial", "reduced")
_DEFAULT_TIMEOUT_S = float(os.environ.get("KVCOMP_CP_TIMEOUT_S", "300"))
_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_DEVICE_TYPES = {"cpu": 0, "cuda": 1}

# The descriptor every rank contributes before any data moves: (name in sentences, field).
_FIELDS = [
    "group size",
    "layout (x.dim())",
    "split",
    "cmp_ratio",
    "coff",
    "head dim D",
    "wkv rows",
    "hidden size H",
    "batch count B",
    "io dtype",
    "weight dtype (io or fp32)",
    "weight_grads",
    "cu_seqlens / seqused / start_pos values",
    "need for a gradient",
    "precision",
    "state_cache presence",
    "cache_mode",
    "device problem",
    "local rows",
]
_F = {name: i for i, name in enumerate(_FIELDS)}
# Fields that may differ between ranks.
_PER_RANK = {"local rows", "device problem"}


def _err(code, msg):
    return KvcompError(code, "[kvcomp] " + msg)


def _timeout(timeout):
    return datetime.timedelta(seconds=_DEFAULT_TIMEOUT_S if timeout is None else float(timeout))


def _wait(works, timeout, what):
    for w in works:
        try:
            ok = w.wait(timeout=timeout)
        except RuntimeError as e:  # gloo raises on timeout, and on a peer that left
            raise _err(
                RUNTIME_ERROR,
                f"context-parallel {what} (= not complete after {timeout.total_seconds():g} s: {e}) must be "
                "joined by every rank of the group with the same call; a rank that refused its inputs "
                "raised its own error",
            ) from e
        if ok is False:
            raise _err(
                RUNTIME_ERROR,
                f"context-parallel {what} (= not complete after {timeout.total_seconds():g} s) must be "
                "joined by every rank of the group with the same call",
            )


def _group_device(group):
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device()), "cuda", backend
    if "gloo" in backend and "nccl" not in backend:
        return torch.device("cpu"), "cpu", backend
    return torch.device("cpu"), None, backend  # mixed: both kinds served


def _index_hash(tensors):
    h = 1469598103934665603
    for t in tensors:
        vals = [] if t is None else [int(v) for v in t.reshape(-1).tolist()]
        h = (h * 1099511628211 + len(vals) + 7) % (1 << 61)
        for i, v in enumerate(vals):
            h = (h * 1099511628211 + (v + 3) * (i + 1)) % (1 << 61)
    return h


@dataclasses.dataclass
class _Piece:
    rank: int
    b: int
    lo: int  # token range [lo, hi) of sequence b (token s has position start_pos[b] + s)
    hi: int
    row0: int  # local flat row of token lo on `rank`


@dataclasses.dataclass
class _Seq:  # one sequence of a local TH call
    b: int
    lo: int  # first token of the call's sequence
    hi: int  # end (exclusive)
    own_lo: int  # this rank's tokens inside [lo, hi): [own_lo, own_hi)
    own_hi: int
    row0: int
    j_first: int  # first block of the local call (global block index)
    j_last: int
    start_local: int  # start_pos of the local call (global position minus a multiple of r)


@dataclasses.dataclass
class _Local:  # one sequence of a rank's local calls (the forward's and the backward's are the same)
    b: int
    lo: int  # the piece's first token: the call's sequence starts there
    hi: int  # the call's end (exclusive); tokens [own_hi, hi) belong to later ranks: zero rows
    own_hi: int
    row0: int  # local row of token lo
    j_first: int  # the call's blocks: [j_first, j_own] close in the piece (this rank owns them),
    j_own: int  # (j_own, j_last] close after it (their owners send them for the backward)
    j_last: int
    halo_lo: int  # the first owned block reads tokens [halo_lo, lo) too: the halo call's rows
    start: int  # start_pos of the call (the global position of lo minus a multiple of r)
    row: int = 0  # the call's first output row
    tok: int = 0  # the call's first row of x


class _Plan:
    """Everything a rank needs, computed identically on every rank from the gathered descriptors."""

    def __init__(self, rank, world, bsh, split, counts, B, lens, sp, used, r, coff):
        self.rank, self.world, self.bsh, self.split = rank, world, bsh, split
        self.B, self.lens, self.sp, self.used, self.r, self.coff = B, lens, sp, used, r, coff
        self.counts = counts
        self.pieces = self._pieces(counts)
        self.by_seq = [[] for _ in range(B)]
        for k in range(world):
            for p in self.pieces[k]:
                self.by_seq[p.b].append(p)
        for lst in self.by_seq:
            lst.sort(key=lambda p: p.lo)
        self.starts = [[p.lo for p in lst] for lst in self.by_seq]
        self.fwd = [self._fwd_seqs(k) for k in range(world)]

    # -- the split ---------------------------------------------------------------------------------
    def _pieces(self, counts):
        W, B = self.world, self.B
        out = [[] for _ in range(W)]
        if self.bsh:
            if self.split == "contiguous":
                off = 0
                for k in range(W):
                    for b in range(B):
                        if counts[k]:
                            out[k].append(_Piece(k, b, off, off + counts[k], b * counts[k]))
                    off += counts[k]
            else:
                c = counts[0] // 2
                for k in range(W):
                    for b in range(B):
                        if c:
                            out[k].append(_Piece(k, b, k * c, (k + 1) * c, b * 2 * c))
                            out[k].append(_Piece(k, b, (2 * W - 1 - k) * c, (2 * W - k) * c, b * 2 * c + c))
        else:
            cu = [0]
            for n in self.lens:
                cu.append(cu[-1] + n)
            if self.split == "contiguous":
                offs = [0]
                for n in counts:
                    offs.append(offs[-1] + n)
                for k in range(W):
                    for b in range(B):
                        lo, hi = max(cu[b], offs[k]), min(cu[b + 1], offs[k + 1])
                        if lo < hi:
                            out[k].append(_Piece(k, b, lo - cu[b], hi - cu[b], lo - offs[k]))
            else:
                for k in range(W):
                    row = 0
                    for b in range(B):
                        c = self.lens[b] // (2 * W)
                        if c:
                            out[k].append(_Piece(k, b, k * c, (k + 1) * c, row))
                            out[k].append(_Piece(k, b, (2 * W - 1 - k) * c, (2 * W - k) * c, row + c))
                        row += 2 * c
        return out

    def blocks(self, b):
        """Global block range [j0, j1) of sequence b (spec 1.4)."""
        r, sp, u = self.r, self.sp[b], self.used[b]
        limit = (sp + u) // r * r
        return (sp // r, limit // r) if limit > sp else (0, 0)

    def piece_of(self, b, s):
        i = bisect.bisect_right(self.starts[b], s) - 1
        return self.by_seq[b][i]

    def owner(self, b, j):
        return self.piece_of(b, j * self.r + self.r - 1 - self.sp[b]).rank

    def segments(self, b, lo, hi):
        """[(rank, first local row, count)] holding tokens [lo, hi) of sequence b, in token order."""
        out = []
        s = lo
        while s < hi:
            p = self.piece_of(b, s)
            e = min(hi, p.hi)
            out.append((p.rank, p.row0 + (s - p.lo), e - s))
            s = e
        return out

    # -- the local calls ---------------------------------------------------------------------------
    def _fwd_seqs(self, k):
        """Forward: per piece, the blocks it owns, and the tokens they need (halo first)."""
        r, coff = self.r, self.coff
        seqs = []
        for p in self.pieces[k]:
            j0, j1 = self.blocks(p.b)
            sp = self.sp[p.b]
            ja = max(j0, (sp + p.lo) // r)
            jb = min(j1 - 1, (sp + p.hi) // r - 1)
            if ja > jb:
                continue
            lo = max(0, (ja - coff + 1) * r - sp)
            hi = (jb + 1) * r - sp
            g = sp + lo
            shift = 0 if g - coff * r < 0 else (g // r - coff) * r
            seqs.append(_Seq(p.b, lo, hi, max(lo, p.lo), hi, p.row0 + max(lo, p.lo) - p.lo, g // r, jb, g - shift))
        return seqs

    def local(self, k, grad):
        """Rank k's local calls: per piece, one sequence from its first token on; with a gradient it runs
        on, in zero rows, to the end of the last block that touches the piece (so the backward's blocks
        are the forward's, and the forward's softmax_score / kv serve it without a copy)."""
        r, coff = self.r, self.coff
        seqs, row, tok = [], 0, 0
        for p in self.pieces[k]:
            j0, j1 = self.blocks(p.b)
            sp = self.sp[p.b]
            jf = max(j0, (sp + p.lo) // r)
            jo = min(j1 - 1, (sp + p.hi) // r - 1)
            jl = max(jo, min(j1 - 1, (sp + p.hi - 1) // r + coff - 1)) if grad else jo
            if jf > jl:
                continue
            # The piece's tokens after its last block join the call while they close no other block:
            # the call's rows are then, piece after piece, x's own rows.
            hi = max((jl + 1) * r - sp, min(p.hi, (jl + 2) * r - 1 - sp))
            halo_lo = min(p.lo, max(0, (jf - coff + 1) * r - sp)) if jf <= jo else p.lo
            g = sp + halo_lo
            shift = 0 if g < coff * r else (g // r - coff) * r
            seqs.append(_Local(p.b, p.lo, hi, min(p.hi, hi), p.row0, jf, jo, jl, halo_lo,
                               g - shift + p.lo - halo_lo, row, tok))
            row += jl - jf + 1
            tok += hi - p.lo
        return seqs

    def owned(self, k):
        """[(b, j, local forward row)] of the blocks rank k owns, in output order."""
        out, row = [], 0
        for s in self.fwd[k]:
            for j in range(s.j_first, s.j_last + 1):
                if self.owner(s.b, j) == k and (j + 1) * self.r - 1 - self.sp[s.b] >= s.own_lo:
                    out.append((s.b, j, row))
                row += 1
        return out


def _rows_tensor(segs, device):
    parts = [torch.arange(a, a + n, dtype=torch.int64) for a, n in segs if n > 0]
    return (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)).to(device)


class _Call:
    """One call's plan and communication context."""

    def __init__(self, group, timeout, plan, x, out_shape, D, C, state_cache, state_block_table, cache_mode,
                 needs_grad):
        self.group, self.timeout, self.plan = group, timeout, plan
        self.device = x.device
        self.out_shape, self.D, self.C = out_shape, D, C
        self.state_cache, self.state_block_table, self.cache_mode = state_cache, state_block_table, cache_mode
        me = plan.rank
        self.owned = plan.owned(me)
        self.owned_index = {(b, j): i for i, (b, j, _) in enumerate(self.owned)}
        self.local = [plan.local(k, needs_grad) for k in range(plan.world)]
        # Row of the local call's output for each owned block, in output order.
        rows = [s.row + j - s.j_first for s in self.local[me] for j in range(s.j_first, s.j_own + 1)]
        assert len(rows) == len(self.owned), "kvcomp internal error: the owned blocks of the plan and the call differ"
        self.own_rows = torch.tensor(rows, dtype=torch.int64, device=self.device)

    def peer(self, k):
        return k if self.group is None else dist.get_global_rank(self.group, k)

    def exchange(self, sends, recv_counts, width, dtype, what):
        """sends: {rank: [n, width] tensor}; recv_counts: {rank: n}. Returns ({rank: tensor}, finish):
        the receives are complete; finish() waits for the sends (call it after the local work, so that
        a rank does not wait for a slower peer to take its rows before it computes)."""
        ops, recvs, held = [], {}, []
        for k in sorted(recv_counts):
            if recv_counts[k] > 0:
                buf = torch.empty((recv_counts[k], width), dtype=dtype, device=self.device)
                recvs[k] = buf
                ops.append(dist.P2POp(dist.irecv, buf, self.peer(k), self.group))
        n_recv = len(ops)
        for k in sorted(sends):
            if sends[k].shape[0] > 0:
                held.append(sends[k].contiguous())
                ops.append(dist.P2POp(dist.isend, held[-1], self.peer(k), self.group))
        if not ops:
            return recvs, lambda: None
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # one work for the batch (NCCL): all of it now
            _wait(works, self.timeout, what)
            return recvs, lambda: None
        _wait(works[:n_recv], self.timeout, what)

        def finish():
            _wait(works[n_recv:], self.timeout, what)
            held.clear()

        return recvs, finish


def _halo_parts(plan, seqs):
    """[(rank, first row, count)] holding the halo rows of `seqs`, sequence after sequence."""
    return [part for s in seqs if s.halo_lo < s.lo for part in plan.segments(s.b, s.halo_lo, s.lo)]


def _concat_rows(pieces):
    """One tensor of the given row slices, copied once (a lone slice is returned as it is)."""
    pieces = [p for p in pieces if p.shape[0] > 0]
    if len(pieces) == 1:
        return pieces[0]
    return torch.cat(pieces)


def _assemble(index_parts, local, recvs, me):
    """Rows of `local` and of the received buffers, in the order index_parts gives."""
    pos = {k: 0 for k in recvs}
    pieces = []
    for k, a, n in index_parts:
        if k == me:
            pieces.append(local.narrow(0, a, n))
        else:
            pieces.append(recvs[k].narrow(0, pos[k], n))
            pos[k] += n
    return _concat_rows(pieces)


def _call_rows(seqs, xf):
    """x of the local call: each piece's rows, then zero rows for the later ranks' tokens. A view of x
    when the pieces are x's rows in order (no copy), else one copy."""
    runs = []  # [first row of x, count] or [None, count of zero rows]
    for s in seqs:
        for a, n in ((s.row0, s.own_hi - s.lo), (None, s.hi - s.own_hi)):
            if n == 0:
                continue
            if runs and a is not None and runs[-1][0] is not None and runs[-1][0] + runs[-1][1] == a:
                runs[-1][1] += n
            elif runs and a is None and runs[-1][0] is None:
                runs[-1][1] += n
            else:
                runs.append([a, n])
    if len(runs) == 1 and runs[0][0] is not None:
        return xf.narrow(0, runs[0][0], runs[0][1])
    out = xf.new_empty((sum(n for _, n in runs), xf.shape[1]))
    at = 0
    for a, n in runs:
        if a is None:
            out.narrow(0, at, n).zero_()
        else:
            out.narrow(0, at, n).copy_(xf.narrow(0, a, n))
        at += n
    return out


def _scratch_cache(call, seqs):
    """The local calls' state cache: two blocks per sequence (positions [0, 2*(coff+1)*r) of its
    call: the halo's, written by the halo call, and the slots before it, copied from the caller's cache
    for positions before start_pos); the calls' later positions map to block 0, which is never written."""
    plan, C = call.plan, call.C
    r, coff = plan.r, plan.coff
    bs = (coff + 1) * r
    n = len(seqs)
    cache = torch.zeros((2 * n + 1, bs, 2 * C), dtype=torch.float32, device=call.device)
    cols = max(2, max(-(-(s.start + s.hi - s.lo) // bs) for s in seqs))
    table = torch.zeros((n, cols), dtype=torch.int32)
    table[:, 0] = torch.arange(1, 2 * n, 2, dtype=torch.int32)
    table[:, 1] = torch.arange(2, 2 * n + 1, 2, dtype=torch.int32)
    if call.state_cache is not None:
        for i, s in enumerate(seqs):
            sp = plan.sp[s.b]
            g_start = sp + s.halo_lo
            shift = g_start - (s.start - (s.lo - s.halo_lo))
            for g in range(max(0, g_start - coff * r), min(g_start, sp)):
                loc = g - shift
                cache[2 * i + 1 + loc // bs, loc % bs] = _cache_slot(call, s.b, g)
    return cache, table.to(call.device)


def _cache_slot(call, b, g):
    sc, tab = call.state_cache, call.state_block_table
    bs = sc.shape[1]
    blk = int(tab[b, g // bs]) if call.cache_mode == 1 else int(tab[b])
    return sc[blk, g % bs].to(torch.float32)


def _th_args(lens, starts, device):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return (torch.tensor(cu, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device))


def _out_index(call):
    """Flat row of cmp_kv (viewed [-1, D]) for each owned block."""
    plan = call.plan
    rows = []
    if plan.bsh:
        per = call.out_shape[1]
        count = [0] * plan.B
        for b, _, _ in call.owned:
            rows.append(b * per + count[b])
            count[b] += 1
    else:
        rows = list(range(len(call.owned)))
    return torch.tensor(rows, dtype=torch.int64, device=call.device)


def _trailing(plan, local, owner):
    """[(b, j, row of the local call)] of the blocks of `local` past their pieces that `owner` owns."""
    return [(s.b, j, s.row + j - s.j_first) for s in local for j in range(s.j_own + 1, s.j_last + 1)
            if plan.owner(s.b, j) == owner]


class _CPCompressor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, wkv, wgate, ape, call, needs_grad):
        ctx.w_dtype = wkv.dtype
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
                torch.ops.kvcomp.compressor_forward(_assemble(index_parts, xf, recvs, me), wkv, wgate, cache, ape,
                                                    table.index_select(0, sel), cu, None, sp, r, coff, 1, False)
            x_loc = _call_rows(seqs, xf)
            cu, sp = _th_args([s.hi - s.lo for s in seqs], [s.start for s in seqs], dev)
            cmp_loc, S, K = torch.ops.kvcomp.compressor_forward(
                x_loc, wkv, wgate, cache, ape, table, cu, None, sp, r, coff, 1, needs_grad
            )
            if len(call.owned):
                cmp_kv.view(-1, D).index_copy_(0, out_idx, cmp_loc.index_select(0, call.own_rows))
        sent()
        ctx.call = call
        ctx.out_idx = out_idx
        if needs_grad:
            # softmax_score / kv stay attributes: the backward overwrites their rows of blocks past the
            # pieces with the owners' (autograd would refuse saved tensors changed in place).
            ctx.S, ctx.K = S, K
            ctx.save_for_backward(x, wkv, wgate, x_loc)
        return cmp_kv

    @staticmethod
    def backward(ctx, d_cmp):
        call = ctx.call
        plan, me, dev, D, r, coff = call.plan, call.plan.rank, call.device, call.D, call.plan.r, call.plan.coff
        x, wkv, wgate, x_loc = ctx.saved_tensors
        S, K = ctx.S, ctx.K
        xf = x.reshape(-1, x.shape[-1])
        n_own = len(call.owned)
        cr = coff * r
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
                sends[k] = torch.cat([dc_own.index_select(0, ids).float(),
                                      S.index_select(0, rows).reshape(len(blocks), -1),
                                      K.index_select(0, rows).reshape(len(blocks), -1)], dim=1)
        seqs = call.local[me]
        need = {k: _trailing(plan, seqs, k) for k in range(plan.world) if k != me}
        recvs, sent = call.exchange(sends, {k: len(v) for k, v in need.items()}, D + 2 * cr * D, torch.float32,
                                    "exchange of the blocks' gradients")
        w_dt = ctx.w_dtype
        if not seqs:
            sent()
            d_wkv, d_wgate = torch.zeros_like(wkv, dtype=torch.float32), torch.zeros_like(wgate, dtype=torch.float32)
            d_ape = torch.zeros((r, wkv.shape[0]), dtype=torch.float64, device=dev)
            return (torch.zeros_like(x),) + _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt) + (None, None)
        dc = torch.zeros((S.shape[0], D), dtype=x.dtype, device=dev)
        if n_own:
            dc.index_copy_(0, call.own_rows, dc_own)
        for k, buf in recvs.items():
            rows = torch.tensor([row for _, _, row in need[k]], dtype=torch.int64, device=dev)
            dc.index_copy_(0, rows, buf[:, :D].to(x.dtype))
            S.index_copy_(0, rows, buf[:, D:D + cr * D].view(-1, cr, D))
            K.index_copy_(0, rows, buf[:, D + cr * D:].view(-1, cr, D))
        mine = _trailing(plan, seqs, me)  # a piece followed by this rank's next one (load_balanced)
        if mine:
            rows = torch.tensor([row for _, _, row in mine], dtype=torch.int64, device=dev)
            src = call.own_rows.index_select(
                0, torch.tensor([call.owned_index[(b, j)] for b, j, _ in mine], dtype=torch.int64, device=dev))
            for t in (dc, S, K):
                t.index_copy_(0, rows, t.index_select(0, src))
        cu, sp = _th_args([s.hi - s.lo for s in seqs], [s.start for s in seqs], dev)
        # x_loc's zero rows (later ranks' tokens) add nothing to d_wkv / d_wgate; their d_x is dropped.
        # fp32 master weights get fp32 partial sums (the CPU kernels write them unrounded), so the sum
        # over the ranks is rounded once, by the optimizer's dtype, not once per rank.
        fp32_w = (w_dt == torch.float32 or call.reduce_w) and x.dtype != torch.float32 and dev.type == "cpu"
        dx_loc, d_wkv, d_wgate, d_ape_loc = torch.ops.kvcomp.compressor_backward(
            dc, x_loc, wkv, wgate, S, K, cu, None, sp, r, coff, fp32_w, dev.type == "cpu"
        )
        d_x = _place_rows([(s.row0, s.tok, s.own_hi - s.lo) for s in seqs], dx_loc, xf)
        d_ape = _without_other_tokens(call, seqs, d_ape_loc, dc, S, K)
        sent()
        return (d_x.view(x.shape),) + _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt) + (None, None)


def _weight_grads(call, d_wkv, d_wgate, d_ape, w_dt):
    """(d_wkv, d_wgate, d_ape) as the call returns them. d_ape (small: r x C) is always the group's
    total, summed in float64 and rounded once, on its rank 0 (zeros elsewhere); d_wkv and d_wgate are
    this rank's partial sums, or (weight_grads "reduced") the group's totals on its rank 0, likewise."""
    works = [dist.all_reduce(d_ape, group=call.group, async_op=True)]
    flat = None
    if call.reduce_w:
        flat = torch.cat([d_wkv.reshape(-1).float(), d_wgate.reshape(-1).float()])
        works.append(dist.all_reduce(flat, group=call.group, async_op=True))
    _wait(works, call.timeout, "all-reduce of the weight gradients")
    if call.plan.rank != 0:
        d_ape.zero_()
        if flat is not None:
            flat.zero_()
    if flat is not None:
        n = d_wkv.numel()
        d_wkv, d_wgate = flat[:n].view(d_wkv.shape), flat[n:].view(d_wgate.shape)
    return d_wkv.to(w_dt), d_wgate.to(w_dt), d_ape.to(torch.float32)


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


def _without_other_tokens(call, seqs, d_ape_loc, dc, S, K):
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
    dc64 = dc.index_select(0, sel).float().double()[:, None, :]
    w = (s64 * k64).sum(1, keepdim=True)
    dz = s64 * dc64 * (k64 - w) * torch.stack(masks).to(call.device, torch.float64)[:, :, None]
    return d_ape_loc.double() - dz.sum(0).reshape(r, coff * D)  # float64: rounded by _weight_grads


def _local_checks(x, wkv, wgate, ape, state_cache, dev_type):
    """A problem only this rank can see (tensors on the wrong device), as a code: 0 none, 1 tensors on
    different devices, 2 a device the group's backend does not serve. Nothing is communicated yet."""
    tensors = [t for t in (x, wkv, wgate, ape, state_cache) if t is not None]
    if any(t.device != x.device for t in tensors):
        return 1
    if dev_type is not None and x.device.type != dev_type:
        return 2
    return 0


def _describe(x, wkv, wgate, r, coff, split, cu_seqlens, seqused, start_pos, needs_grad, state_cache, cache_mode,
              world, dev_problem, weight_grads):
    d = [0] * len(_FIELDS)
    d[_F["group size"]] = world
    d[_F["layout (x.dim())"]] = x.dim()
    d[_F["split"]] = SPLITS.index(split) if split in SPLITS else -1
    d[_F["cmp_ratio"]] = int(r)
    d[_F["coff"]] = int(coff)
    d[_F["head dim D"]] = wkv.shape[0] // coff if coff in (1, 2) else -1
    d[_F["wkv rows"]] = wkv.shape[0]
    d[_F["hidden size H"]] = x.shape[-1]
    d[_F["batch count B"]] = x.shape[0] if x.dim() == 3 else (cu_seqlens.numel() - 1 if cu_seqlens is not None else -1)
    d[_F["io dtype"]] = _DTYPES.get(x.dtype, 0)
    d[_F["weight dtype (io or fp32)"]] = _DTYPES.get(wkv.dtype, 0) if wgate.dtype == wkv.dtype else -1
    d[_F["weight_grads"]] = _WEIGHT_GRADS.index(weight_grads) if weight_grads in _WEIGHT_GRADS else -1
    d[_F["cu_seqlens / seqused / start_pos values"]] = _index_hash([cu_seqlens, seqused, start_pos])
    d[_F["need for a gradient"]] = int(needs_grad)
    d[_F["precision"]] = 1 if _functional.get_default_options()["precision"] == "npu_parity" else 0
    d[_F["state_cache presence"]] = int(state_cache is not None)
    d[_F["cache_mode"]] = int(cache_mode)
    d[_F["device problem"]] = dev_problem
    d[_F["local rows"]] = x.shape[1] if x.dim() == 3 else x.shape[0]
    return d


def _gather(desc, group, world, device, timeout):
    t = torch.tensor(desc, dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    _wait([dist.all_gather(out, t, group=group, async_op=True)], timeout, "check of the call's arguments")
    return [[int(v) for v in o.tolist()] for o in out]


def _check_agreement(descs, dev_type, backend):
    world = len(descs)
    for k, d in enumerate(descs):
        if d[_F["device problem"]]:
            why = ("must all be on the device of x" if d[_F["device problem"]] == 1 else
                   f"must be on a {dev_type} device: the group's backend is {backend}")
            raise _err(INVALID_PARAM, f"the tensors of rank {k} (= refused on that rank before any data moved) {why}")
    for name in _FIELDS:
        if name in _PER_RANK:
            continue
        vals = [d[_F[name]] for d in descs]
        if len(set(vals)) > 1:
            seen = ", ".join(f"{v} on rank {k}" for k, v in enumerate(vals))
            raise _err(SHAPE_ERROR if name != "split" else INVALID_PARAM,
                       f"{name} (= {seen}) must be the same on every rank of the context-parallel group")
    if descs[0][_F["group size"]] != world:
        raise _err(INVALID_PARAM, f"group size (= {descs[0][_F['group size']]}) must be {world}")


def _global_layout(descs, x, split, cu_seqlens, seqused, start_pos):
    world = len(descs)
    counts = [d[_F["local rows"]] for d in descs]
    bsh = x.dim() == 3
    if bsh:
        B = x.shape[0]
        if split == "load_balanced" and (len(set(counts)) > 1 or counts[0] % 2):
            raise _err(SHAPE_ERROR, f"S per rank (= {counts}) must be one even number on every rank with the "
                                    "load_balanced split (two chunks of S/2 tokens each)")
        lens = [sum(counts)] * B
    else:
        if cu_seqlens is None:
            raise _err(NULL_POINTER, "cu_seqlens (= None) must be given with TH x: the global int32 [B+1] prefix sums")
        cu = [int(v) for v in cu_seqlens.tolist()]
        B = len(cu) - 1
        lens = [cu[b + 1] - cu[b] for b in range(B)]
        if any(n < 0 for n in lens) or (cu and cu[0] != 0):
            raise _err(INVALID_PARAM, f"cu_seqlens (= {cu}) must start at 0 and never decrease")
        if split == "contiguous" and sum(counts) != cu[-1]:
            raise _err(SHAPE_ERROR, f"the ranks' token rows (= {counts}, {sum(counts)} in all) must add up to "
                                    f"cu_seqlens[-1] (= {cu[-1]}) with the contiguous split")
        if split == "load_balanced":
            bad = [n for n in lens if n % (2 * world)]
            if bad:
                raise _err(SHAPE_ERROR, f"sequence lengths (= {bad}) must be multiples of 2 x group size (= "
                                        f"{2 * world}) with the load_balanced split")
            if any(c != cu[-1] // world for c in counts):
                raise _err(SHAPE_ERROR, f"the ranks' token rows (= {counts}) must each be cu_seqlens[-1] / group "
                                        f"size (= {cu[-1] // world}) with the load_balanced split")
    sp = [0] * B if start_pos is None else [int(v) for v in start_pos.reshape(-1).tolist()]
    used = list(lens) if seqused is None else [int(v) for v in seqused.reshape(-1).tolist()]
    if len(sp) != B or len(used) != B:
        raise _err(SHAPE_ERROR, f"start_pos / seqused (= {len(sp)} / {len(used)} values) must have B (= {B}) values")
    for b in range(B):
        if sp[b] < 0:
            raise _err(INVALID_PARAM, f"start_pos[{b}] (= {sp[b]}) must be >= 0")
        if not 0 <= used[b] <= lens[b]:
            raise _err(INVALID_PARAM, f"seqused[{b}] (= {used[b]}) must be in [0, {lens[b]}] (the global length)")
    return bsh, counts, B, lens, sp, used


def _prepare(x, wkv, wgate, ape, cmp_ratio, group, split, cu_seqlens, seqused, start_pos, coff, state_cache,
             state_block_table, cache_mode, timeout, needs_grad, reads_cache=True, weight_grads="auto"):
    if not dist.is_available() or not dist.is_initialized():
        raise _err(RUNTIME_ERROR, "torch.distributed (= not initialised) must be initialised "
                                  "(torch.distributed.init_process_group) before a context-parallel call")
    if split not in SPLITS:
        raise _err(INVALID_PARAM, f"split (= {split!r}) must be one of {', '.join(SPLITS)}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    device, dev_type, backend = _group_device(group)
    dev_problem = _local_checks(x, wkv, wgate, ape, state_cache, dev_type)
    tmo = _timeout(timeout)
    desc = _describe(x, wkv, wgate, cmp_ratio, coff, split, cu_seqlens, seqused, start_pos, needs_grad,
                     state_cache, cache_mode, world, dev_problem, weight_grads)
    descs = _gather(desc, group, world, device, tmo)
    _check_agreement(descs, dev_type, backend)
    if weight_grads not in _WEIGHT_GRADS:
        raise _err(INVALID_PARAM, f"weight_grads (= {weight_grads!r}) must be one of {', '.join(_WEIGHT_GRADS)}")
    if x.dim() not in (2, 3):
        raise _err(INVALID_PARAM, f"x.dim() (= {x.dim()}) must be 3 (BSH) or 2 (TH)")
    if coff not in (1, 2) or wkv.shape[0] % coff:
        raise _err(INVALID_PARAM, f"coff (= {coff}) must be 1 or 2 and divide wkv.shape[0] (= {wkv.shape[0]})")
    if cmp_ratio < 1:
        raise _err(INVALID_PARAM, f"cmp_ratio (= {cmp_ratio}) must be >= 1")
    if wkv.dtype != wgate.dtype or wkv.dtype not in (x.dtype, torch.float32):
        raise _err(INVALID_PARAM, f"wkv and wgate (= {wkv.dtype}, {wgate.dtype}) must both have the io dtype "
                                  f"{x.dtype} or both be fp32 (master weights)")
    bsh, counts, B, lens, sp, used = _global_layout(descs, x, split, cu_seqlens, seqused, start_pos)
    plan = _Plan(rank, world, bsh, split, counts, B, lens, sp, used, cmp_ratio, coff)
    C = wkv.shape[0]
    D = C // coff
    # Blocks that read positions before start_pos need the caller's state cache.
    if state_cache is None and reads_cache:
        for k in range(world):
            for s in plan.fwd[k]:  # only a sequence's first coff blocks can read before its start
                if s.lo == 0 and any(
                        plan.owner(s.b, j) == k and max(0, (j - coff + 1) * cmp_ratio) < sp[s.b]
                        for j in range(s.j_first, min(s.j_last, s.j_first + coff) + 1)):
                    raise _err(NULL_POINTER, f"state_cache (= None) must be given: sequence {s.b} starts at "
                                             f"start_pos {sp[s.b]} and its first block reads positions before it")
    elif state_cache is not None and state_block_table is None:
        raise _err(NULL_POINTER, "state_block_table (= None) must be given with state_cache")
    out_shape = _output_shape(plan, x, cmp_ratio, D)
    call = _Call(group, tmo, plan, x, out_shape, D, C, state_cache, state_block_table, cache_mode, needs_grad)
    if weight_grads == "auto":
        weight_grads = "partial" if wkv.dtype == torch.float32 else "reduced"
    call.reduce_w = weight_grads == "reduced"
    return call


def _output_shape(plan, x, r, D):
    return tuple(cp_output_rows(x, r, plan.split, plan.B)) + (D,)


def cp_output_rows(x, cmp_ratio, split="contiguous", batches=None):
    """Leading shape of this rank's cp_compressor output (from shapes only): BSH ``[B, ceil(S_k/r)]``
    (load_balanced: ``[B, 2*ceil(S_k/2/r)]``); TH ``[min(T_k, T_k//r + B)]`` (load_balanced: ``+ 2B``)."""
    r = cmp_ratio
    if x.dim() == 3:
        n = x.shape[1]
        return (x.shape[0], 2 * (-(-(n // 2) // r)) if split == "load_balanced" else -(-n // r))
    n = x.shape[0]
    return (min(n, n // r + (2 * batches if split == "load_balanced" else batches)),)


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
):
    """The compressor over sequences split across the ranks of ``group`` (default: the world).

    Args:
        x: this rank's tokens, io dtype: BSH ``[B, S_k, H]`` or TH ``[T_k, H]`` (see the module doc for
            which tokens each split gives a rank).
        wkv, wgate, ape, cmp_ratio, coff: as ``kvcomp.torch.compressor`` (the same on every rank);
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

    Returns:
        The compressed rows this rank owns, io dtype: BSH ``[B, M, D]`` (per batch row, its owned
        blocks in order, then zero rows), TH ``[N, D]`` (sequence after sequence); shapes in
        ``cp_output_rows``, which rows are which in ``cp_owned_blocks``.

    Raises:
        KvcompError: the same sentence on every rank when the ranks disagree (shapes, layout, split,
            cmp_ratio, group size) or a rank's tensors are on the wrong device; nothing was sent.
    """
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, wkv, wgate, ape))
    call = _prepare(x, wkv, wgate, ape, cmp_ratio, group, split, cu_seqlens, seqused, start_pos, coff,
                    state_cache, state_block_table, cache_mode, timeout, needs_grad, weight_grads=weight_grads)
    return _CPCompressor.apply(x, wkv, wgate, ape, call, needs_grad)


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
        raise _err(INVALID_PARAM, f"op (= {op!r}) must be 'sum' or 'mean'")
