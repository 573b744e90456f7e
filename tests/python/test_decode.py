"""Decode-sized forward calls against the float64 oracle (support.reference_forward): B from 1 to 256
sequences of 1 to 4 tokens, start_pos at every offset modulo r (so calls where no sequence, some or
every sequence closes a block), paged and ring caches, BSH and TH, C4A-like (r = 4, coff = 2) and
C128A-like (r = 128, coff = 1) blocks. Each call is judged like the torch-operator sweep: cmp_kv within
one io ulp of the correctly rounded truth (plus fp32-level error at the tensor's scale), written cache
slots within 1e-5 of the truth's scale and every other slot untouched, bit for bit. ctest runs this file
with the machine's own products and again with every product fp32 (KVCOMP_PRODUCTS=f32)."""

import pytest
import torch

import kvcomp.torch as kt
from support import make_case, reference_forward
from test_torch_op import assert_close_to_truth, io_ulp

H, D = 256, 32


def _starts(B, r, base, offset):
    """start_pos per sequence: past `base`, offsets modulo r spread over the batch (B = 1: `offset`)."""
    return [base + (offset + 5 * b) % r for b in range(B)]


def _check(case, out, cache):
    truth, cache_t = reference_forward(
        case.x.double(), case.wkv.double(), case.wgate.double(), case.state_cache, case.ape.double(),
        case.cmp_ratio, **case.kwargs()
    )
    slack = io_ulp(truth, "bf16") + 2.0**-18 * truth.abs().max()
    assert bool(((out.double() - truth).abs() <= slack).all()), float((out.double() - truth).abs().max())
    written = (case.state_cache != cache_t).any(dim=-1)
    assert torch.equal(cache[~written], case.state_cache[~written])
    assert_close_to_truth(cache[written], cache_t[written])


@pytest.mark.parametrize("r,coff", [(4, 2), (128, 1)])
@pytest.mark.parametrize("cache_mode", [1, 2])
@pytest.mark.parametrize("th", [False, True])
@pytest.mark.parametrize("B,tokens", [(1, 1), (7, 1), (64, 1), (256, 1), (8, 2), (8, 3), (16, 4)])
def test_decode_against_the_oracle(r, coff, cache_mode, th, B, tokens):
    offsets = range(r) if B == 1 and r <= 8 else [0, r - tokens, r - 1]
    for offset in offsets:
        sp = _starts(B, r, 1000 if r < 128 else 1024, offset)
        case = make_case(lens=[tokens] * B, H=H, D=D, r=r, coff=coff, start_pos=sp, th=th,
                         cache_mode=cache_mode, dtype="bf16", seed=B * 131 + tokens * 7 + offset)
        cache = case.state_cache.clone()
        with torch.no_grad():
            out = kt.compressor(case.x, case.wkv, case.wgate, cache, case.ape, r, **case.kwargs())
        _check(case, out, cache)
