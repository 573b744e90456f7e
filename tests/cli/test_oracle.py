"""Tests of the independent numpy oracle (oracle.py) itself: the spec's worked example, its bf16
rounding, and its backward as the derivative of its forward; and the verdict rules on data it rounds."""

from __future__ import annotations

import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "support"))
import oracle as O  # noqa: E402
from verdict_rules import compare  # noqa: E402




def test_oracle_worked_example():
    """Spec 2.8: B=1, start_pos=5, seqused=10, r=4, coff=2 (TH, T=10)."""
    p = O.make_plan((10, 8), cmp_ratio=4, coff=2, D=2, cu_seqlens=[0, 10], seqused=[10], start_pos=[5])
    assert p.nb.tolist() == [2] and p.out_lead == (3,) and p.blk_k.tolist() == [1, 2]
    assert p.pos.tolist() == [[0, 4, 1, 5, 2, 6, 3, 7], [4, 8, 5, 9, 6, 10, 7, 11]]
    assert p.src.tolist() == [[1, 1, 1, 2, 1, 2, 1, 2], [1, 2, 2, 2, 2, 2, 2, 2]]
    assert p.tok.tolist() == [[-1, -1, -1, 0, -1, 1, -1, 2], [-1, 3, 0, 4, 1, 5, 2, 6]]
    assert p.valid_mask().tolist() == [True, True, False]
    q = O.make_plan((1, 12, 8), cmp_ratio=4, coff=1, D=8, seqused=[10], start_pos=[5])
    assert q.out_lead == (1, 3) and q.pos.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]


def test_oracle_bf16_rounding():
    v = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8), 3.4e38, 3.39e38,
                  np.inf, -0.0, 2 ** -130], np.float32)
    bits = O.bf16_bits(v)
    assert bits.tolist() == [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0xBF80, 0x7F80, 0x7F7F, 0x7F80, 0x8000, 0x0008]
    assert np.array_equal(O.round_bf16(v[:5]), np.array([1.0, 1.0, 1 + 2 ** -6, 1 + 2 ** -7, -1.0], np.float32))
    assert np.isnan(O.bf16_to_f32(O.bf16_bits(np.float32(np.nan))))


def test_oracle_criteria():
    """The verdict rules on bf16 data rounded by the oracle (verdict_table.txt has the edge cases)."""
    rng = np.random.default_rng(3)
    c = O.round_bf16(rng.standard_normal(1000))
    b = O.round_bf16(c * (1 + 1e-3 * rng.standard_normal(1000)))
    assert compare.three_way(c, b, c, "bf16").passed
    assert compare.three_way(b, b, c, "bf16").passed
    assert not compare.three_way(O.round_bf16(c * 1.05), b, c, "bf16").passed
    assert not compare.three_way(np.where(np.arange(1000) == 5, np.nan, c), b, c, "bf16").passed
    assert compare.two_way(b, c, "bf16").passed
    assert not compare.two_way(c * 1.02, c, "bf16").passed


@pytest.mark.parametrize("layout,coff,r,cache_mode", [("TH", 2, 3, 1), ("BSH", 2, 4, 2), ("TH", 1, 4, 2),
                                                      ("BSH", 1, 3, 1), ("TH", 2, 2, 2)])
def test_oracle_backward_is_gradient_of_forward(layout, coff, r, cache_mode):
    """Central differences of loss = sum(cmp * dC) through the float64 forward match the backward."""
    rng = np.random.default_rng(zlib.crc32(f"fd{layout}{coff}{r}{cache_mode}".encode()))
    H, D = 4, 3
    C = coff * D
    if layout == "TH":
        lens = [7, 0, 11, 2, 13]
        cu = np.concatenate([[0], np.cumsum(lens)])
        xs, B, L = (int(cu[-1]), H), len(lens), max(lens)
    else:
        B, S = 3, 10
        lens, cu, xs, L = [S] * B, None, (B, S, H), S
    sp = rng.integers(0, 3 * r, B)
    su = np.array([rng.integers(n // 2, n + 1) for n in lens])
    x = rng.standard_normal(xs)
    wkv, wg = rng.standard_normal((C, H)) / 2, rng.standard_normal((C, H)) / 2
    ape = rng.standard_normal((r, C))
    if cache_mode == 1:
        bs = 4
        cols = -(-(int(sp.max()) + L) // bs)
        bt = (1 + np.arange(B * cols)).reshape(B, cols)
        bt[rng.random(bt.shape) < 0.3] = 0
        bn = B * cols + 1
    else:
        bs = coff * r + L - 1
        bt, bn = rng.permutation(B), B + 1
    sc = rng.uniform(-2, 2, (bn, bs, 2 * C)).astype(np.float32)
    kw = dict(cmp_ratio=r, coff=coff, cu_seqlens=cu, seqused=su, start_pos=sp, io_dtype="fp32")
    f = O.forward(x, wkv, wg, ape, sc, bt, cache_mode=cache_mode, **kw)
    pl = f["plan"]
    assert pl.N >= 3
    dC = rng.standard_normal((pl.out_rows, D))
    Sf = np.zeros((pl.out_rows, coff * r, D))
    Kf = np.zeros_like(Sf)
    Sf[pl.blk_out], Kf[pl.blk_out] = f["raw"]["S"], f["raw"]["K"]
    g = O.backward(x, wkv, wg, dC, Sf, Kf, **kw)["raw"]

    def loss(args):
        ff = O.forward(*args, sc, bt, cache_mode=cache_mode, **kw)
        return float((ff["raw"]["cmp"] * dC[pl.blk_out]).sum())

    base = [x, wkv, wg, ape]
    for idx, grad in enumerate([g["d_x"], g["d_wkv"], g["d_wgate"], g["d_ape"]]):
        arr = base[idx]
        num = np.zeros(arr.size)
        for e in range(arr.size):
            h = 1e-6
            p, m = arr.copy().ravel(), arr.copy().ravel()
            p[e] += h
            m[e] -= h
            ap, am = list(base), list(base)
            ap[idx], am[idx] = p.reshape(arr.shape), m.reshape(arr.shape)
            num[e] = (loss(ap) - loss(am)) / (2 * h)
        err = np.abs(num - np.ravel(grad)).max() / max(np.abs(num).max(), 1e-12)
        assert err < 1e-7, (idx, err)
