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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_serving_keeps_its_prepared_weights_until_a_parameter_changes(dtype):
    """Calls without gradient reuse the weights cast and prepared by the first one (bitwise the result
    of a cast per call), and make them again after each change torch records."""
    torch.manual_seed(1)
    m = kvcomp.nn.Compressor(64, 16, 4)
    x = torch.randn(3, 4, 64).to(dtype)
    cache = torch.zeros(8, 4, 64)
    table = torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)
    sp = torch.tensor([0, 1, 3], dtype=torch.int32)

    def by_hand():  # the operator on weights cast now
        c = torch.zeros(8, 4, 64)
        return kt.compressor(x, m.wkv.detach().to(dtype), m.wgate.detach().to(dtype), c, m.ape.detach(), 4,
                             state_block_table=table, start_pos=sp, coff=2)

    def serve():
        with torch.no_grad():
            cache.zero_()
            return m(x, state_cache=cache, state_block_table=table, start_pos=sp)

    out = serve()
    kept = m._prepared
    assert kept is not None and torch.equal(out, by_hand())
    assert torch.equal(serve(), out) and m._prepared is kept  # reused, not made again
    with torch.no_grad():
        m.wkv.mul_(-1)  # an in-place change: the version counter moves
    out2 = serve()
    assert m._prepared is not kept and torch.equal(out2, by_hand()) and not torch.equal(out2, out)
    kept = m._prepared
    m.load_state_dict({k: v * 0.5 for k, v in m.state_dict().items()})
    out3 = serve()
    assert m._prepared is not kept and torch.equal(out3, by_hand())
    m.wgate = torch.nn.Parameter(torch.randn_like(m.wgate))  # a new parameter object
    assert torch.equal(serve(), by_hand())
    with torch.inference_mode():
        assert torch.equal(m(x, state_cache=cache.zero_(), state_block_table=table, start_pos=sp), by_hand())
    # A call that records a gradient casts per call and reaches the parameters.
    m.forget_prepared_weights()
    out4 = m(x, state_cache=torch.zeros(8, 4, 64), state_block_table=table, start_pos=sp)
    assert m._prepared is None and out4.requires_grad
    out4.float().sum().backward()
    assert m.wkv.grad is not None


def test_serving_from_several_threads():
    """Threads serving through one module (kvcomp releases the GIL, so the calls overlap), the weights
    changed between rounds: every call gives the result of the current weights, the first calls of a
    round racing to make the kept copy again."""
    import threading

    torch.manual_seed(2)
    m = kvcomp.nn.Compressor(64, 16, 4)
    x = torch.randn(2, 4, 64).bfloat16()
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    sp = torch.tensor([0, 3], dtype=torch.int32)
    errors = []

    def serve(expected, start):
        try:
            start.wait(timeout=60)
            for _ in range(20):
                with torch.no_grad():
                    out = m(x, state_cache=torch.zeros(5, 4, 64), state_block_table=table, start_pos=sp)
                assert torch.equal(out, expected)
        except Exception as e:  # reported below, in the test's thread
            errors.append(e)

    for _ in range(3):
        with torch.no_grad():
            m.wkv.mul_(-1)  # between rounds: every thread's first call finds the kept copy stale
        expected = kt.compressor(x, m.wkv.detach().bfloat16(), m.wgate.detach().bfloat16(), torch.zeros(5, 4, 64),
                                 m.ape.detach(), 4, state_block_table=table, start_pos=sp, coff=2)
        start = threading.Barrier(4)
        threads = [threading.Thread(target=serve, args=(expected, start)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors[0]


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16])
def test_parametrized_and_16_bit_parameters(param_dtype):
    """The module reads its parameters once per call from its parameter dict, and through the attributes
    where torch.nn.utils.parametrize made one a property: the result is the operator's on the
    weights the attributes give, with and without gradient, for fp32 and bf16 parameters (ape cast
    to fp32)."""
    from torch.nn.utils import parametrize

    class Twice(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    torch.manual_seed(4)
    m = kvcomp.nn.Compressor(32, 8, 4, dtype=param_dtype)
    with torch.no_grad():
        m.ape.normal_()
    x = torch.randn(2, 8, 32).bfloat16()
    cache = torch.zeros(1, 4, 32)
    table = torch.zeros(2, 3, dtype=torch.int32)

    def by_hand():
        return kt.compressor(x, m.wkv.detach().bfloat16(), m.wgate.detach().bfloat16(), cache, m.ape.detach().float(),
                             4, state_block_table=table, coff=2)

    plain = by_hand()
    parametrize.register_parametrization(m, "wkv", Twice())
    assert "wkv" not in m._parameters
    want = by_hand()
    assert not torch.equal(want, plain)
    with torch.no_grad():
        assert torch.equal(m(x), want)
    out = m(x)
    out.float().sum().backward()
    assert torch.equal(out, want) and m.parametrizations.wkv.original.grad is not None


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
