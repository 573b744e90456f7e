"""Context parallelism, the exchange: one call's communication context (the group, its bounded waits,
the point-to-point exchange of rows) and the inputs of the local calls built from the rows that
arrive (the halo rows, the call's rows of x, the scratch state cache, the TH arguments)."""

import datetime
import os

import torch
import torch.distributed as dist

from ._errors import RUNTIME_ERROR, error

_DEFAULT_TIMEOUT_S = float(os.environ.get("KVCOMP_CP_TIMEOUT_S", "300"))


def _timeout(timeout):
    return datetime.timedelta(seconds=_DEFAULT_TIMEOUT_S if timeout is None else float(timeout))


def _wait(works, timeout, what):
    for w in works:
        try:
            ok = w.wait(timeout=timeout)
        except RuntimeError as e:  # gloo raises on timeout, and on a peer that left
            raise error(
                RUNTIME_ERROR,
                f"context-parallel {what} (= not complete after {timeout.total_seconds():g} s: {e}) must be "
                "joined by every rank of the group with the same call; a rank that refused its inputs "
                "raised its own error",
            ) from e
        if ok is False:
            raise error(
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


def _gather(desc, group, world, device, timeout):
    t = torch.tensor(desc, dtype=torch.int64, device=device)
    out = [torch.empty_like(t) for _ in range(world)]
    _wait([dist.all_gather(out, t, group=group, async_op=True)], timeout, "check of the call's arguments")
    return [[int(v) for v in o.tolist()] for o in out]


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
    """The local calls' state cache: per sequence, the blocks of its call's positions from coff*r before
    its halo to its start (the halo's, written by the halo call, and the slots before it, copied from
    the caller's cache for positions before start_pos; two blocks, three at most when the call starts
    at its global position); the calls' other positions map to block 0, which is never written."""
    plan, C = call.plan, call.C
    r, coff = plan.r, plan.coff
    bs = (coff + 1) * r
    spans = []  # per sequence: the first column of its window and its number of blocks
    for s in seqs:
        first = max(0, s.start - (s.lo - s.halo_lo) - coff * r) // bs
        spans.append((first, max(1, -(-s.start // bs) - first)))
    base = [1]
    for _, n in spans:
        base.append(base[-1] + n)
    cache = torch.zeros((base[-1], bs, 2 * C), dtype=torch.float32, device=call.device)
    cols = max(2, max(-(-(s.start + s.hi - s.lo) // bs) for s in seqs))
    table = torch.zeros((len(seqs), cols), dtype=torch.int32)
    for i, (first, n) in enumerate(spans):
        table[i, first:first + n] = torch.arange(base[i], base[i] + n, dtype=torch.int32)
    if call.state_cache is not None:
        for i, s in enumerate(seqs):
            sp = plan.sp[s.b]
            g_start = sp + s.halo_lo
            shift = g_start - (s.start - (s.lo - s.halo_lo))
            for g in range(max(0, g_start - coff * r), min(g_start, sp)):
                loc = g - shift
                cache[base[i] + loc // bs - spans[i][0], loc % bs] = _cache_slot(call, s.b, g)
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
