"""The options that change a gradient's arithmetic (precision, profile) are the ones in force when the
forward runs: kvcomp.torch.compressor, kvcomp.nn and cp_compressor capture them then and hand them to
the backward operator as arguments of its schema, so a set_default_options call between a forward and
its .backward() (or from another thread) does not change the gradient, and a compiled graph holds them
as constants instead of reading a global at run time."""

import threading

import pytest
import torch

import kvcomp
import kvcomp.torch as kt
from kvcomp import _ops
from support import make_case


@pytest.fixture(autouse=True)
def _restore_defaults():
    previous = kvcomp.get_default_options()
    yield
    kvcomp.set_default_options(**previous)


def _case():
    # bf16: npu_parity rounds d_new to bf16 before the products, precise does not, so the two modes'
    # gradients differ in their bits (checked below: the test could tell them apart).
    return make_case(lens=[23, 17], th=True, r=4, coff=2, start_pos=[3, 9], H=64, D=32, dtype="bf16", seed=7)


def _forward(case):
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    out = kt.compressor(*leaves[:3], case.state_cache.clone(), leaves[3], case.cmp_ratio, **case.kwargs())
    return out, leaves


def _grads(out, leaves, d):
    out.backward(d)
    return [t.grad.clone() for t in leaves]


def _same(a, b):
    return all(torch.equal(u.view(torch.int16) if u.dtype == torch.bfloat16 else u,
                           v.view(torch.int16) if v.dtype == torch.bfloat16 else v) for u, v in zip(a, b))


@pytest.mark.parametrize("first,second", [("precise", "npu_parity"), ("npu_parity", "precise")])
def test_precision_changed_between_forward_and_backward_does_not_change_the_gradient(first, second):
    case = _case()
    d = torch.randn(_forward(case)[0].shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    want = {}
    for p in ("precise", "npu_parity"):
        kvcomp.set_default_options(precision=p)
        want[p] = _grads(*_forward(case), d)
    assert not _same(want["precise"], want["npu_parity"]), "the two modes must differ for this test to mean anything"

    kvcomp.set_default_options(precision=first)
    out, leaves = _forward(case)
    kvcomp.set_default_options(precision=second)  # after the forward, before the backward
    assert _same(_grads(out, leaves, d), want[first])


def test_precision_changed_by_another_thread_does_not_change_the_gradient():
    case = _case()
    kvcomp.set_default_options(precision="precise")
    out, leaves = _forward(case)
    d = torch.ones(out.shape, dtype=torch.bfloat16)
    want = _grads(*_forward(case), d)
    t = threading.Thread(target=kvcomp.set_default_options, kwargs={"precision": "npu_parity"})
    t.start()
    t.join()
    assert _same(_grads(out, leaves, d), want)


def test_forward_with_gradient_takes_the_precision_as_an_argument():
    case = _case()
    kvcomp.set_default_options(precision="precise")
    d = torch.ones(_forward(case)[0].shape, dtype=torch.bfloat16)
    kvcomp.set_default_options(precision="npu_parity")
    want = _grads(*_forward(case), d)
    kvcomp.set_default_options(precision="precise")
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    k = case.kwargs()
    out, _, _ = kt.forward_with_gradient(
        *leaves[:3], case.state_cache.clone(), leaves[3], k["state_block_table"], k["cu_seqlens"], k["seqused"],
        k["start_pos"], case.cmp_ratio, k["coff"], k["cache_mode"], False, precision="npu_parity")
    assert _same(_grads(out, leaves, d), want)


def test_the_backward_operator_takes_precision_and_profile_in_its_schema():
    schema = str(torch.ops.kvcomp.compressor_backward.default._schema)
    assert 'str? precision=None' in schema and 'str? profile=None' in schema, schema
    anchor = str(torch.ops.kvcomp.compressor_grad_anchor.default._schema)
    assert 'str? precision=None' in anchor, anchor


def test_a_bad_precision_argument_is_refused():
    case = _case()
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    k = case.kwargs()
    out, _, _ = kt.forward_with_gradient(
        *leaves[:3], case.state_cache.clone(), leaves[3], k["state_block_table"], k["cu_seqlens"], k["seqused"],
        k["start_pos"], case.cmp_ratio, k["coff"], k["cache_mode"], False, precision="fast")
    with pytest.raises(kvcomp.KvcompError, match="precision"):
        out.sum().backward()


def test_signatures_are_written_once():
    """The upstream stand-in's schemas are the first arguments of kvcomp's own operators."""
    import kvcomp.npu_compat as nc

    assert nc._FORWARD_SCHEMA.startswith("_compressor_forward(Tensor x, Tensor wkv, Tensor wgate, Tensor(a!) "
                                         "state_cache")
    assert nc._FORWARD_SCHEMA.endswith("bool grad_enabled) -> (Tensor, Tensor, Tensor)")
    assert nc._BACKWARD_SCHEMA.startswith("_compressor_backward(Tensor dout, Tensor x")
    assert nc._BACKWARD_SCHEMA.endswith("int cmp_ratio, int coff) -> (Tensor, Tensor, Tensor, Tensor)")
    assert _ops.FORWARD.names[: _ops.FORWARD_UPSTREAM][-1] == "grad_enabled"


def test_compiled_backward_uses_the_precision_of_its_forward():
    case = _case()
    d = torch.ones(_forward(case)[0].shape, dtype=torch.bfloat16)
    kvcomp.set_default_options(precision="npu_parity")
    want = _grads(*_forward(case), d)

    torch._dynamo.reset()
    k = case.kwargs()

    def f(x, wkv, wgate, cache, ape):
        return kt.compressor(x, wkv, wgate, cache, ape, case.cmp_ratio, **k)

    g = torch.compile(f, fullgraph=True)
    leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    out = g(*leaves[:3], case.state_cache.clone(), leaves[3])
    kvcomp.set_default_options(precision="precise")
    assert _same(_grads(out, leaves, d), want)
