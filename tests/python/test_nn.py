"""kvcomp.nn.Compressor in one process: initialisation, the attributes, agreement with
kvcomp.torch.compressor (bit for bit, the fp32 masters' gradients the upcast bf16 ones), the stateless
default, torch.compile over a training step."""

import math

import pytest
import torch

import kvcomp
import kvcomp.nn
import kvcomp.torch as kt


def test_initialisation_and_attributes():
    m = kvcomp.nn.Compressor(64, 16, 4)
    assert (m.coff, m.cmp_ratio, m.head_dim, m.hidden_size) == (2, 4, 16, 64)
    assert m.wkv.shape == m.wgate.shape == (32, 64) and m.ape.shape == (4, 32)
    assert m.wkv.dtype == torch.float32
    bound = 1 / math.sqrt(64)  # nn.Linear's Kaiming-uniform bound
    assert m.wkv.abs().max() <= bound and m.wkv.abs().max() > bound / 2
    assert not m.ape.any()
    assert kvcomp.nn.Compressor(64, 16, 128).coff == 1
    assert "cmp_ratio=128" in repr(kvcomp.nn.Compressor(64, 16, 128))


@pytest.mark.parametrize("th", [False, True])
def test_equals_the_operator(th):
    torch.manual_seed(0)
    m = kvcomp.nn.Compressor(48, 8, 4)
    with torch.no_grad():
        m.ape.normal_()
    if th:
        x = torch.randn(23, 48).bfloat16()
        kw = dict(cu_seqlens=torch.tensor([0, 9, 23], dtype=torch.int32))
        B, S = 2, 14
    else:
        x = torch.randn(2, 11, 48).bfloat16()
        kw = {}
        B, S = 2, 11
    x1 = x.clone().requires_grad_()
    out = m(x1, **kw)
    w = torch.randn(out.shape).bfloat16()
    (out.float() * w.float()).sum().backward()
    # The same call by hand: bf16 weights, a one-block cache nobody writes.
    x2 = x.clone().requires_grad_()
    wkv = m.wkv.detach().bfloat16().requires_grad_()
    wgate = m.wgate.detach().bfloat16().requires_grad_()
    ape = m.ape.detach().clone().requires_grad_()
    cache = torch.zeros(1, 4, 32)
    table = torch.zeros(B, -(-S // 4) + 1, dtype=torch.int32)
    ref = kt.compressor(x2, wkv, wgate, cache, ape, 4, state_block_table=table, coff=2, **kw)
    (ref.float() * w.float()).sum().backward()
    assert torch.equal(out, ref) and torch.equal(x1.grad, x2.grad)
    assert torch.equal(m.wkv.grad, wkv.grad.float()) and torch.equal(m.wgate.grad, wgate.grad.float())
    assert torch.equal(m.ape.grad, ape.grad)
    assert not cache.any()


def test_start_pos_needs_a_cache():
    m = kvcomp.nn.Compressor(16, 4, 4)
    with pytest.raises(kvcomp.KvcompError, match="state_cache"):
        m(torch.randn(1, 8, 16).bfloat16(), start_pos=torch.tensor([3], dtype=torch.int32))


def test_torch_compile_fullgraph_training_step():
    torch.manual_seed(1)
    m = kvcomp.nn.Compressor(32, 8, 4)
    x = torch.randn(2, 12, 32).bfloat16()
    w = torch.randn(2, 3, 8)

    def step(x):
        return (m(x).float() * w).sum()

    eager = step(x)
    eager.backward()
    g_eager = m.wkv.grad.clone()
    m.zero_grad()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    compiled.backward()
    assert torch.equal(eager, compiled) and torch.equal(g_eager, m.wkv.grad)
