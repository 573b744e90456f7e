"""Context parallelism, the split plan: which tokens each rank holds, which rank owns each compressed row,
and the local calls every rank runs, computed identically on every rank from the descriptors they
gather (kvcomp.distributed has the rules; docs/distributed.md the owner rule and the figures). Pure
arithmetic on shapes and index values: nothing here communicates."""

import bisect
import dataclasses

import torch

from ._errors import INVALID_PARAM, NULL_POINTER, SHAPE_ERROR, error

SPLITS = ("contiguous", "load_balanced")


_WEIGHT_GRADS = ("auto", "partial", "reduced")


_DTYPES = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}


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
    "APE / norm / rope tables",
    "norm_eps",
    "rope table positions",
]


_F = {name: i for i, name in enumerate(_FIELDS)}


# Fields that may differ between ranks.
_PER_RANK = {"local rows", "device problem"}


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

    def __init__(self, rank, world, bsh, split, counts, B, lens, sp, used, r, coff, global_positions=False):
        self.rank, self.world, self.bsh, self.split = rank, world, bsh, split
        # The local calls' start_pos: the global position itself (the epilogue's RoPE reads it), or one
        # less a multiple of r that keeps the scratch cache's block table two columns wide.
        self.global_positions = global_positions
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
            shift = 0 if g < coff * r or self.global_positions else (g // r - coff) * r
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


def _halo_parts(plan, seqs):
    """[(rank, first row, count)] holding the halo rows of `seqs`, sequence after sequence."""
    return [part for s in seqs if s.halo_lo < s.lo for part in plan.segments(s.b, s.halo_lo, s.lo)]


def _trailing(plan, local, owner):
    """[(b, j, row of the local call)] of the blocks of `local` past their pieces that `owner` owns."""
    return [(s.b, j, s.row + j - s.j_first) for s in local for j in range(s.j_own + 1, s.j_last + 1)
            if plan.owner(s.b, j) == owner]


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
              world, dev_problem, weight_grads, precision, epilogue=(1, 0, 0)):
    d = [0] * len(_FIELDS)
    d[_F["APE / norm / rope tables"]], d[_F["norm_eps"]], d[_F["rope table positions"]] = epilogue
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
    d[_F["precision"]] = 1 if precision == "npu_parity" else 0
    d[_F["state_cache presence"]] = int(state_cache is not None)
    d[_F["cache_mode"]] = int(cache_mode)
    d[_F["device problem"]] = dev_problem
    d[_F["local rows"]] = x.shape[1] if x.dim() == 3 else x.shape[0]
    return d


def _check_agreement(descs, dev_type, backend):
    world = len(descs)
    for k, d in enumerate(descs):
        if d[_F["device problem"]]:
            why = ("must all be on the device of x" if d[_F["device problem"]] == 1 else
                   f"must be on a {dev_type} device: the group's backend is {backend}")
            raise error(INVALID_PARAM, f"the tensors of rank {k} (= refused on that rank before any data moved) {why}")
    for name in _FIELDS:
        if name in _PER_RANK:
            continue
        vals = [d[_F[name]] for d in descs]
        if len(set(vals)) > 1:
            seen = ", ".join(f"{v} on rank {k}" for k, v in enumerate(vals))
            raise error(SHAPE_ERROR if name != "split" else INVALID_PARAM,
                       f"{name} (= {seen}) must be the same on every rank of the context-parallel group")
    if descs[0][_F["group size"]] != world:
        raise error(INVALID_PARAM, f"group size (= {descs[0][_F['group size']]}) must be {world}")


def _global_layout(descs, x, split, cu_seqlens, seqused, start_pos):
    world = len(descs)
    counts = [d[_F["local rows"]] for d in descs]
    bsh = x.dim() == 3
    if bsh:
        B = x.shape[0]
        if split == "load_balanced" and (len(set(counts)) > 1 or counts[0] % 2):
            raise error(SHAPE_ERROR, f"S per rank (= {counts}) must be one even number on every rank with the "
                                    "load_balanced split (two chunks of S/2 tokens each)")
        lens = [sum(counts)] * B
    else:
        if cu_seqlens is None:
            raise error(NULL_POINTER, "cu_seqlens (= None) must be given with TH x: the global int32 [B+1] prefix sums")
        cu = [int(v) for v in cu_seqlens.tolist()]
        B = len(cu) - 1
        lens = [cu[b + 1] - cu[b] for b in range(B)]
        if any(n < 0 for n in lens) or (cu and cu[0] != 0):
            raise error(INVALID_PARAM, f"cu_seqlens (= {cu}) must start at 0 and never decrease")
        if split == "contiguous" and sum(counts) != cu[-1]:
            raise error(SHAPE_ERROR, f"the ranks' token rows (= {counts}, {sum(counts)} in all) must add up to "
                                    f"cu_seqlens[-1] (= {cu[-1]}) with the contiguous split")
        if split == "load_balanced":
            bad = [n for n in lens if n % (2 * world)]
            if bad:
                raise error(SHAPE_ERROR, f"sequence lengths (= {bad}) must be multiples of 2 x group size (= "
                                        f"{2 * world}) with the load_balanced split")
            if any(c != cu[-1] // world for c in counts):
                raise error(SHAPE_ERROR, f"the ranks' token rows (= {counts}) must each be cu_seqlens[-1] / group "
                                        f"size (= {cu[-1] // world}) with the load_balanced split")
    sp = [0] * B if start_pos is None else [int(v) for v in start_pos.reshape(-1).tolist()]
    used = list(lens) if seqused is None else [int(v) for v in seqused.reshape(-1).tolist()]
    if len(sp) != B or len(used) != B:
        raise error(SHAPE_ERROR, f"start_pos / seqused (= {len(sp)} / {len(used)} values) must have B (= {B}) values")
    for b in range(B):
        if sp[b] < 0:
            raise error(INVALID_PARAM, f"start_pos[{b}] (= {sp[b]}) must be >= 0")
        if not 0 <= used[b] <= lens[b]:
            raise error(INVALID_PARAM, f"seqused[{b}] (= {used[b]}) must be in [0, {lens[b]}] (the global length)")
    return bsh, counts, B, lens, sp, used


def output_rows(x, cmp_ratio, split="contiguous", batches=None):
    """Leading shape of this rank's cp_compressor output (from shapes only): BSH ``[B, ceil(S_k/r)]``
    (load_balanced: ``[B, 2*ceil(S_k/2/r)]``); TH ``[min(T_k, T_k//r + B)]`` (load_balanced: ``+ 2B``)."""
    r = cmp_ratio
    if x.dim() == 3:
        n = x.shape[1]
        return (x.shape[0], 2 * (-(-(n // 2) // r)) if split == "load_balanced" else -(-n // r))
    n = x.shape[0]
    return (min(n, n // r + (2 * batches if split == "load_balanced" else batches)),)
