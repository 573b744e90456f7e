"""Decode-sized forward calls against the float64 oracle (support.reference_forward): B from 1 to 256
sequences of 1 to 4 tokens, start_pos at every offset modulo r (so calls where no sequence, some or
every sequence closes a block), paged and ring caches, BSH and TH, C4A-like (r = 4, coff = 2) and
C128A-like (r = 128, coff = 1) blocks. Each call is judged like the torch-operator sweep: cmp_kv within
one io ulp of the correctly rounded truth (plus fp32-level error at the tensor's scale), written cache
slots within 1e-5 of the truth's scale and every other slot untouched, bit for bit; with row stability and
without it (row_stable=False, decode-bound serving: the products take the rows as they are). ctest runs
this file with the machine's own products and again with every product fp32 (KVCOMP_PRODUCTS=f32)."""

import pytest
import torch

import kvcomp.torch as kt
from support import assert_close_to_truth, bits, io_ulp, make_case, reference_forward

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
@pytest.mark.parametrize(
    "B,tokens,row_stable",
    # Without row stability the few-row paths (1 to 8 rows, and 64) and a call past the rows kernels.
    [(1, 1, True), (7, 1, True), (64, 1, True), (256, 1, True), (8, 2, True), (8, 3, True), (16, 4, True),
     (1, 1, False), (7, 1, False), (64, 1, False), (8, 3, False)])
def test_decode_against_the_oracle(r, coff, cache_mode, th, B, tokens, row_stable):
    offsets = range(r) if B == 1 and r <= 8 else [0, r - tokens, r - 1]
    for offset in offsets:
        sp = _starts(B, r, 1000 if r < 128 else 1024, offset)
        case = make_case(lens=[tokens] * B, H=H, D=D, r=r, coff=coff, start_pos=sp, th=th,
                         cache_mode=cache_mode, dtype="bf16", seed=B * 131 + tokens * 7 + offset)
        cache = case.state_cache.clone()
        kw = case.kwargs()
        with torch.no_grad():
            out, _, _ = kt.forward_with_gradient(
                case.x, case.wkv, case.wgate, cache, case.ape, kw["state_block_table"], kw.get("cu_seqlens"),
                kw.get("seqused"), kw.get("start_pos"), r, coff, cache_mode, False, row_stable=row_stable)
        _check(case, out, cache)


@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("r,coff,cache_mode,th", [(4, 2, 1, False), (128, 1, 2, True)])
def test_prepared_weights_against_the_oracle(dtype, r, coff, cache_mode, th, B):
    """A server prepares its weights once (kvcomp.prepare_weights) and names them in every decode
    call: the oracle's results, and bitwise those of the same call without them (B = 1: one token,
    which reads the blob's decode panels where it has them, src/cpu/products/onednn_f32.hpp)."""
    import kvcomp

    for offset in [0, r - 1]:
        sp = _starts(B, r, 1000 if r < 128 else 1024, offset)
        case = make_case(lens=[1] * B, H=H, D=D, r=r, coff=coff, start_pos=sp, th=th,
                         cache_mode=cache_mode, dtype=dtype, seed=77 + offset)
        blob = kvcomp.prepare_weights(case.wkv, case.wgate)
        assert blob.dtype == torch.uint8 and blob.dim() == 1 and blob.numel() >= 64
        cache, plain_cache = case.state_cache.clone(), case.state_cache.clone()
        kw = case.kwargs()
        with torch.no_grad():
            out, _, _ = kt.forward_with_gradient(
                case.x, case.wkv, case.wgate, cache, case.ape, kw["state_block_table"], kw.get("cu_seqlens"),
                kw.get("seqused"), kw.get("start_pos"), r, coff, cache_mode, False, prepared_weights=blob)
            plain = kt.compressor(case.x, case.wkv, case.wgate, plain_cache, case.ape, r, **kw)
        assert torch.equal(bits(out), bits(plain))
        assert torch.equal(cache, plain_cache)
        if dtype == "bf16":
            _check(case, out, cache)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("Dh,coff", [(32, 2), (150, 2), (40, 1)])
@pytest.mark.parametrize("B,tokens", [(3, 1), (12, 1), (16, 4), (50, 3), (70, 3)])
def test_raw_weights_give_the_prepared_bits(dtype, Dh, coff, B, tokens):
    """A call without prepared weights of one row tile (decode-sized: 9 to 192 rows on AVX2) widens its
    weights to fp32 column tile by column tile (src/cpu/products/onednn_f32.hpp, gemm_f32_widening), a longer one
    (210 rows) all at once: either gives bitwise the results of the prepared fp32 weights, also where
    C is no multiple of 16 (C = 300: partial 16-column groups, a column tile across wkv and wgate) and
    for 3 rows there (the few-rows kernel on whole groups, sgemm on the rest)."""
    import kvcomp

    r = 4 if coff == 2 else 8
    sp = _starts(B, r, 1000, r - 1)
    case = make_case(lens=[tokens] * B, H=72, D=Dh, r=r, coff=coff, start_pos=sp, dtype=dtype, seed=B + tokens)
    blob = kvcomp.prepare_weights(case.wkv, case.wgate)
    cache, plain_cache = case.state_cache.clone(), case.state_cache.clone()
    kw = case.kwargs()
    with torch.no_grad():
        out, _, _ = kt.forward_with_gradient(
            case.x, case.wkv, case.wgate, cache, case.ape, kw["state_block_table"], None, None, kw["start_pos"], r,
            coff, 1, False, prepared_weights=blob)
        plain = kt.compressor(case.x, case.wkv, case.wgate, plain_cache, case.ape, r, **kw)
    bits = torch.int16 if out.element_size() == 2 else torch.int32
    assert torch.equal(out.view(bits), plain.view(bits)) and torch.equal(cache, plain_cache)
    if dtype == "bf16":
        _check(case, plain, plain_cache)


def test_prepared_weights_of_other_weights_are_refused():
    import kvcomp

    case = make_case(lens=[1] * 4, H=H, D=D, r=4, coff=2, start_pos=[1003] * 4, dtype="fp16", seed=5)
    other = kvcomp.prepare_weights(case.wkv[:-1], case.wgate[:-1])
    cache = case.state_cache.clone()
    kw = case.kwargs()

    def call(blob):  # the operator itself, as torch.compile sees it
        return torch.ops.kvcomp.compressor_forward(
            case.x, case.wkv, case.wgate, cache, case.ape, kw["state_block_table"], None, None,
            kw["start_pos"], 4, 2, 1, False, blob)

    with pytest.raises(kvcomp.KvcompError) as e:
        call(other)
    assert e.value.code == 161002 and "like this call's" in str(e.value)
    assert torch.equal(cache, case.state_cache)  # nothing written
    with pytest.raises(kvcomp.KvcompError) as e:  # not a blob at all
        call(case.ape)
    assert e.value.code == 161002 and "uint8" in str(e.value)
    out, _, _ = call(kvcomp.prepare_weights(case.wkv, case.wgate))  # its own weights: taken
    assert out.shape == (4, 1, D)

    # numpy arrays through the functional call take them too
    arrays = {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in kw.items() if v is not None}
    w32, g32 = case.wkv.float().numpy(), case.wgate.float().numpy()
    blob = kvcomp.prepare_weights(w32, g32)
    assert blob.dtype.name == "uint8"
    c1, c2 = case.state_cache.numpy().copy(), case.state_cache.numpy().copy()
    a, _, _ = kvcomp.compressor_forward(case.x.float().numpy(), w32, g32, c1, case.ape.numpy(), 4,
                                        prepared_weights=blob, **arrays)
    b, _, _ = kvcomp.compressor_forward(case.x.float().numpy(), w32, g32, c2, case.ape.numpy(), 4,
                                        **arrays)
    assert (a.view("int32") == b.view("int32")).all() and (c1 == c2).all()
