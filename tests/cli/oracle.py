"""Independent numpy oracle for the Compressor / CompressorGrad operator pair.

Written from the spec (sections 1.8, 2.9, 6.2) and nothing else, so that it
can be held against both kvcomp and its own C++ float64 reference without
sharing their mistakes. The verdict rules of spec 7 that judge the results
are not part of the oracle: they are the package's (python/kvcomp/compare.py,
loaded by tests/support/verdict_rules.py), held to the same table as the C++
ones (tests/precision).

Two modes:
  "high"  float64 everywhere, final outputs rounded to the io dtype (the "C"
          truth of spec 7.2);
  "same"  float32 everywhere with plain formulas; the backward rounds
          d_new_kv / d_new_score to the io dtype before the final matrix
          products; the forward flushes exp results below FLT_MIN to zero
          (the "B" golden of spec 6.2 / 6.3).

Everything is vectorised over blocks (and over batches), so a case with
~100k tokens takes well under a second.

Array conventions: io tensors (x, wkv, wgate, d_cmp_kv) are passed as float32
arrays that already hold io-dtype values (see round_io); the others are float32.
Outputs in an io dtype are returned as float32 arrays holding io-dtype values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FLT_MIN = np.float32(np.finfo(np.float32).tiny)

# --------------------------------------------------------------------------
# dtype helpers
# --------------------------------------------------------------------------


def bf16_bits(a) -> np.ndarray:
    """float32 (or anything castable) -> bf16 bit patterns (uint16), round to nearest even."""
    f = np.ascontiguousarray(np.asarray(a, dtype=np.float32))
    u = f.view(np.uint32)
    rounded = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    out = rounded.astype(np.uint16)
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((u[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)  # keep sign, quiet NaN
    return out


def bf16_to_f32(bits) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32."""
    b = np.asarray(bits, dtype=np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bf16(a) -> np.ndarray:
    return bf16_to_f32(bf16_bits(a))


def round_fp16(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def _f64_to_f32_for_bf16(a64: np.ndarray) -> np.ndarray:
    """float64 -> float32 such that a later bf16 round-to-nearest-even of the result equals the
    correctly rounded bf16 of the float64 value (no double rounding): when the float32 rounding lands
    exactly on a bf16 midpoint that the float64 value is not on, step one float32 ulp back towards it."""
    r32 = a64.astype(np.float32)
    low = r32.view(np.uint32) & np.uint32(0xFFFF)
    tie = (low == 0x8000) & np.isfinite(a64) & (r32.astype(np.float64) != a64)
    if tie.any():
        r32 = r32.copy()
        towards = np.where(a64[tie] > r32[tie], np.inf, -np.inf).astype(np.float32)
        r32[tie] = np.nextafter(r32[tie], towards)
    return r32


def round_io(a, io_dtype: str) -> np.ndarray:
    """Round to the io dtype with a single rounding (float64 inputs are not rounded to float32 first);
    returns float32 holding io-dtype values."""
    a = np.asarray(a)
    if io_dtype == "bf16":
        if a.dtype == np.float64:
            return round_bf16(_f64_to_f32_for_bf16(a))
        return round_bf16(a.astype(np.float32))
    if io_dtype == "fp16":
        # numpy converts float64 -> float16 directly (one rounding)
        return a.astype(np.float16).astype(np.float32)
    if io_dtype == "fp32":
        return a.astype(np.float32)
    raise ValueError(f"unknown io dtype {io_dtype!r}")


# --------------------------------------------------------------------------
# block plan (spec 0.2, 1.4, 1.5, 1.7, 2.1)
# --------------------------------------------------------------------------


@dataclass
class Plan:
    layout: str  # "BSH" | "TH"
    B: int
    rows: int  # token rows of x (B*S or T)
    r: int
    coff: int
    D: int
    sp: np.ndarray  # [B] start positions
    U: np.ndarray  # [B] used lengths
    L: np.ndarray  # [B] lengths
    base: np.ndarray  # [B] flat row of token 0
    limit: np.ndarray  # [B]
    nb: np.ndarray  # [B] number of compressed blocks
    out_lead: tuple  # leading dims of cmp_kv
    out_rows: int  # prod(out_lead)
    # per block [N]
    blk_b: np.ndarray
    blk_i: np.ndarray
    blk_k: np.ndarray
    blk_out: np.ndarray  # flat output row
    # per block row [N, coff*r]
    pos: np.ndarray  # global position
    half: np.ndarray  # column half c (coff=2: 0 prev, 1 cur; coff=1: 0)
    slot: np.ndarray  # t, the slot in the block (= pos mod r)
    src: np.ndarray  # 0 placeholder (p<0), 1 cache (0<=p<sp), 2 fresh token
    tok: np.ndarray  # flat token row for fresh rows (-1 otherwise)

    @property
    def N(self) -> int:
        return int(self.blk_b.size)

    @property
    def C(self) -> int:
        return self.coff * self.D

    def valid_mask(self) -> np.ndarray:
        """Boolean mask over the leading dims of cmp_kv: True on rows that hold a block."""
        m = np.zeros(self.out_rows, dtype=bool)
        m[self.blk_out] = True
        return m.reshape(self.out_lead)


def make_plan(x_shape, *, cmp_ratio: int, coff: int, D: int, cu_seqlens=None, seqused=None,
              start_pos=None) -> Plan:
    r = int(cmp_ratio)
    if len(x_shape) == 3:
        layout = "BSH"
        B, S = int(x_shape[0]), int(x_shape[1])
        L = np.full(B, S, dtype=np.int64)
        base = np.arange(B, dtype=np.int64) * S
        rows = B * S
        sr = (S + r - 1) // r
        out_lead = (B, sr)
    elif len(x_shape) == 2:
        layout = "TH"
        cu = np.asarray(cu_seqlens, dtype=np.int64)
        B = cu.size - 1
        T = int(x_shape[0])
        assert cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) >= 0)
        L = np.diff(cu)
        base = cu[:-1].copy()
        rows = T
        out_lead = (min(T, T // r + B),)
    else:
        raise ValueError("x must have rank 2 or 3")
    sp = np.zeros(B, np.int64) if start_pos is None else np.asarray(start_pos, np.int64).copy()
    U = L.copy() if seqused is None else np.asarray(seqused, np.int64).copy()
    assert sp.shape == (B,) and U.shape == (B,)
    assert np.all(sp >= 0) and np.all(U >= 0) and np.all(U <= L)

    limit = (sp + U) // r * r
    nb = np.where(limit > sp, (limit - sp + r - 1) // r, 0)
    N = int(nb.sum())
    blk_b = np.repeat(np.arange(B, dtype=np.int64), nb)
    first = np.cumsum(nb) - nb
    blk_i = np.arange(N, dtype=np.int64) - np.repeat(first, nb)
    blk_k = sp[blk_b] // r + blk_i
    if layout == "BSH":
        blk_out = blk_b * out_lead[1] + blk_i
    else:
        blk_out = np.arange(N, dtype=np.int64)
    out_rows = int(np.prod(out_lead))
    assert N == 0 or blk_out.max() < out_rows

    cr = coff * r
    j = np.arange(cr, dtype=np.int64)
    t = j // coff
    c = j % coff
    # coff=2: c=0 is the prev half (previous aligned block), c=1 the cur half.
    pos = blk_k[:, None] * r + t[None, :] - (coff - 1 - c[None, :]) * r
    spb = sp[blk_b][:, None]
    src = np.where(pos < 0, 0, np.where(pos < spb, 1, 2)).astype(np.int8)
    tok = np.where(src == 2, base[blk_b][:, None] + pos - spb, -1)
    half = np.broadcast_to(c, pos.shape).copy()
    slot = np.broadcast_to(t, pos.shape).copy()
    return Plan(layout=layout, B=B, rows=rows, r=r, coff=coff, D=int(D), sp=sp, U=U, L=L, base=base,
                limit=limit, nb=nb, out_lead=out_lead, out_rows=out_rows, blk_b=blk_b, blk_i=blk_i,
                blk_k=blk_k, blk_out=blk_out, pos=pos, half=half, slot=slot, src=src, tok=tok)


# --------------------------------------------------------------------------
# forward (spec 1.8)
# --------------------------------------------------------------------------


def _matmul_f32_sequential(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """X [rows, H] @ W[C, H]^T in float32, summed over H in order with separately rounded products
    (elementwise numpy ops only: the same bits on every machine)."""
    X = np.asarray(X, np.float32)
    W = np.asarray(W, np.float32)
    out = np.zeros((X.shape[0], W.shape[0]), np.float32)
    for h in range(X.shape[1]):
        out += X[:, h:h + 1] * W[None, :, h]
    return out


def _cache_blocks(block_table, cache_mode: int, b: np.ndarray, p: np.ndarray, bs: int) -> np.ndarray:
    table = np.asarray(block_table, dtype=np.int64)
    if cache_mode == 1:
        return table[b, p // bs]
    if cache_mode == 2:
        return table[b]
    raise ValueError("cache_mode must be 1 or 2")


def forward(x, wkv, wgate, ape, state_cache, block_table, *, cmp_ratio: int, coff: int, cache_mode: int,
            cu_seqlens=None, seqused=None, start_pos=None, io_dtype: str = "bf16", mode: str = "high"):
    """Compressor forward. Returns a dict with
    cmp_kv        [lead..., D]           io-dtype values (float32); padding rows 0
    softmax_score [lead..., coff*r, D]   float32; padding rows 0
    kv            [lead..., coff*r, D]   float32; padding rows 0
    state_cache   [bn, bs, 2C]           float32, updated
    written       [bn, bs]               bool, slots written by this call
    valid         [lead...]              bool, rows holding a block
    plan          the Plan
    """
    dt = {"high": np.float64, "same": np.float32}[mode]
    x = np.asarray(x)
    H = x.shape[-1]
    C = wkv.shape[0]
    D = C // coff
    r = int(cmp_ratio)
    plan = make_plan(x.shape, cmp_ratio=r, coff=coff, D=D, cu_seqlens=cu_seqlens, seqused=seqused,
                     start_pos=start_pos)
    X = x.reshape(plan.rows, H).astype(dt)
    if mode == "high":
        new_kv = X @ np.asarray(wkv).astype(dt).T  # [rows, C]
        new_score = X @ np.asarray(wgate).astype(dt).T
    else:
        # fp32 accumulation in a fixed order, so that the golden does not depend on the BLAS build
        new_kv = _matmul_f32_sequential(X, np.asarray(wkv).astype(dt))
        new_score = _matmul_f32_sequential(X, np.asarray(wgate).astype(dt))
    ape_d = np.asarray(ape).astype(dt)  # [r, C]

    cache_in = np.asarray(state_cache, np.float32)
    bn, bs, W = cache_in.shape
    assert W == 2 * C
    cache_d = cache_in.astype(dt)

    # ---- assemble the blocks from the cache as it was on entry (reads touch only p < sp,
    # writes only p >= sp; the cases never alias the two).
    N, cr = plan.pos.shape
    K = np.zeros((N, cr, D), dt)
    Z = np.full((N, cr, D), -np.inf, dt)
    nkv3 = new_kv.reshape(plan.rows, coff, D)
    nsc3 = new_score.reshape(plan.rows, coff, D)
    ape3 = ape_d.reshape(r, coff, D)
    fresh = plan.src == 2
    if fresh.any():
        tk, hc, ts = plan.tok[fresh], plan.half[fresh], plan.slot[fresh]
        K[fresh] = nkv3[tk, hc]
        Z[fresh] = nsc3[tk, hc] + ape3[ts, hc]
    cached = plan.src == 1
    if cached.any():
        bb = np.broadcast_to(plan.blk_b[:, None], plan.pos.shape)[cached]
        pp = plan.pos[cached]
        blk = _cache_blocks(block_table, cache_mode, bb, pp, bs)
        off = pp % bs
        c5 = cache_d.reshape(bn, bs, 2, coff, D)
        hc = plan.half[cached]
        K[cached] = c5[blk, off, 0, hc]
        Z[cached] = c5[blk, off, 1, hc]

    # ---- column softmax over the coff*r rows, reduction
    if N:
        m = Z.max(axis=1, keepdims=True)
        assert np.all(np.isfinite(m)), "a block without any real row"
        e = np.exp(Z - m)
        if mode == "same":
            e[e < FLT_MIN] = 0
        Ssm = e / e.sum(axis=1, keepdims=True)
        cmp = (Ssm * K).sum(axis=1)
    else:
        Ssm = np.zeros((0, cr, D), dt)
        cmp = np.zeros((0, D), dt)

    cmp_kv = np.zeros((plan.out_rows, D), np.float32)
    score_out = np.zeros((plan.out_rows, cr, D), np.float32)
    kv_out = np.zeros((plan.out_rows, cr, D), np.float32)
    cmp_kv[plan.blk_out] = round_io(cmp, io_dtype)
    score_out[plan.blk_out] = Ssm.astype(np.float32)
    kv_out[plan.blk_out] = K.astype(np.float32)

    # ---- state-cache writes (spec 1.3)
    cache_out = cache_d.copy()
    written = np.zeros((bn, bs), dtype=bool)
    Ub = plan.U
    tb = np.repeat(np.arange(plan.B, dtype=np.int64), Ub)
    ts = np.arange(tb.size, dtype=np.int64) - np.repeat(np.cumsum(Ub) - Ub, Ub)
    tp = plan.sp[tb] + ts
    if cache_mode == 2:
        keep = tp >= plan.limit[tb] - (coff - 1) * r
        tb, ts, tp = tb[keep], ts[keep], tp[keep]
    if tb.size:
        blk = _cache_blocks(block_table, cache_mode, tb, tp, bs)
        if cache_mode == 1:
            keep = blk != 0  # block id 0: do not update
            tb, ts, tp, blk = tb[keep], ts[keep], tp[keep], blk[keep]
        off = tp % bs
        rowi = plan.base[tb] + ts
        # every written slot must be distinct, or the case is ill-formed
        flat = blk * bs + off
        assert np.unique(flat).size == flat.size, "two tokens write the same cache slot"
        cache_out[blk, off, :C] = new_kv[rowi]
        cache_out[blk, off, C:] = new_score[rowi] + ape_d[tp % r]
        written[blk, off] = True

    lead = plan.out_lead
    return {
        "cmp_kv": cmp_kv.reshape(*lead, D),
        "softmax_score": score_out.reshape(*lead, cr, D),
        "kv": kv_out.reshape(*lead, cr, D),
        "state_cache": cache_out.astype(np.float32),
        "written": written,
        "valid": plan.valid_mask(),
        "plan": plan,
        "raw": {"cmp": cmp, "S": Ssm, "K": K, "new_kv": new_kv, "new_score": new_score},
    }


# --------------------------------------------------------------------------
# backward (spec 2.9; "same" golden per 6.2)
# --------------------------------------------------------------------------


def backward(x, wkv, wgate, d_cmp_kv, softmax_score, kv, *, cmp_ratio: int, coff: int, cu_seqlens=None,
             seqused=None, start_pos=None, io_dtype: str = "bf16", mode: str = "high"):
    """CompressorGrad. Returns dict d_x (shape of x), d_wkv, d_wgate ([C, H]) as io-dtype values in
    float32, d_ape ([r, C]) float32, and the plan."""
    dt = {"high": np.float64, "same": np.float32}[mode]
    x = np.asarray(x)
    H = x.shape[-1]
    C = wkv.shape[0]
    D = C // coff
    r = int(cmp_ratio)
    cr = coff * r
    plan = make_plan(x.shape, cmp_ratio=r, coff=coff, D=D, cu_seqlens=cu_seqlens, seqused=seqused,
                     start_pos=start_pos)
    X = x.reshape(plan.rows, H).astype(dt)
    dC_all = np.asarray(d_cmp_kv).reshape(plan.out_rows, D)
    S_all = np.asarray(softmax_score).reshape(plan.out_rows, cr, D)
    K_all = np.asarray(kv).reshape(plan.out_rows, cr, D)
    # only the rows holding a block are read
    dC = dC_all[plan.blk_out].astype(dt)[:, None, :]  # [N, 1, D]
    S = S_all[plan.blk_out].astype(dt)
    K = K_all[plan.blk_out].astype(dt)

    dK = dC * S
    if mode == "high":
        w = (S * K).sum(axis=1, keepdims=True)
        dZ = S * dC * (K - w)
    else:  # textbook fp32 softmax backward, as the plain-op golden does
        dSp = dC * K
        dZ = S * (dSp - (S * dSp).sum(axis=1, keepdims=True))

    kept = plan.src == 2  # cache rows and placeholders get no gradient
    dK = np.where(kept[..., None], dK, 0)
    dZ = np.where(kept[..., None], dZ, 0)

    d_new_kv = np.zeros((plan.rows, coff, D), dt)
    d_new_score = np.zeros((plan.rows, coff, D), dt)
    if kept.any():
        tk, hc = plan.tok[kept], plan.half[kept]
        flat = tk * coff + hc
        assert np.unique(flat).size == flat.size, "a (token, half) cell got two contributions"
        d_new_kv[tk, hc] = dK[kept]
        d_new_score[tk, hc] = dZ[kept]
    # interleaved row j = t*coff + c is d_ape viewed as [coff*r, D] row j
    N = plan.N
    d_ape = dZ.reshape(N, r, coff, D).sum(axis=0).reshape(r, C) if N else np.zeros((r, C), dt)

    dnk = d_new_kv.reshape(plan.rows, C)
    dns = d_new_score.reshape(plan.rows, C)
    if mode == "same":
        dnk = round_io(dnk, io_dtype)
        dns = round_io(dns, io_dtype)
    Wkv = np.asarray(wkv).astype(dt)
    Wg = np.asarray(wgate).astype(dt)
    d_x = dnk @ Wkv + dns @ Wg
    d_wkv = dnk.T @ X
    d_wgate = dns.T @ X
    return {
        "d_x": round_io(d_x, io_dtype).reshape(x.shape),
        "d_wkv": round_io(d_wkv, io_dtype),
        "d_wgate": round_io(d_wgate, io_dtype),
        "d_ape": d_ape.astype(np.float32),
        "plan": plan,
        "raw": {"d_x": d_x, "d_wkv": d_wkv, "d_wgate": d_wgate, "d_ape": d_ape},
    }
