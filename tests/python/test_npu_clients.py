"""NPU training clients run unchanged on kvcomp: kvcomp.torch.install_cann_ops_transformer() (opt-in)
makes `import cann_ops_transformer.ops` and torch.ops.cann_ops_transformer.* resolve to kvcomp.

The client is a MindSpeed-LLM-style stateless prefill adapter written here from the description of
its call pattern (one-block fp32 state cache of block_size cmp_ratio, an all-zero block table so that
nothing is written, fp32 master weights cast to bf16 inside, BSH with seqused = S and start_pos = 0,
TND with cu_seqlens and the first sum(len // r) rows kept). It is judged against autograd through the
float64 small-ops implementation (support.reference_forward), forward and all four gradients. Also:
the refusal when a real cann_ops_transformer is present, that importing kvcomp installs nothing
(fresh interpreters), the launcher, and the upstream torch.ops names (schemas, opcheck, autograd,
torch.compile fullgraph)."""

import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch
from torch import nn

import kvcomp
import kvcomp.npu_compat as npu_compat
import kvcomp.torch as kt
from kvcomp.compare import two_way
from support import (DEVICES, assert_close_to_truth, forward_op_args, io_ulp, make_case, on_device,
                     reference_forward)

PKG = "cann_ops_transformer"


def _ours(name):
    return name == PKG or name.startswith(PKG + ".")


@pytest.fixture
def clean_modules():
    """No cann_ops_transformer module during the test, and none left behind by it."""
    saved = {k: v for k, v in sys.modules.items() if _ours(k)}
    for k in saved:
        del sys.modules[k]
    yield
    for k in [k for k in sys.modules if _ours(k)]:
        del sys.modules[k]
    sys.modules.update(saved)


@pytest.fixture
def stand_in(clean_modules):
    return kt.install_cann_ops_transformer()


# ---------------------------------------------------------------------------------------------------
# A MindSpeed-style client: fused compressor path, stateless prefill.


class StatelessPrefillCompressor(nn.Module):
    """The client under test, written from the description of MindSpeed-LLM's fused path.

    fp32 master weights (wkv, wgate [coff*D, H]; ape [r, coff*D]) are cast to the activations' dtype
    in forward, so autograd reaches the fp32 parameters. One fp32 cache block of block_size
    cmp_ratio is shared by every call and batch; the block table is all zeros ("do not write") and
    start_pos is 0, so the operator neither reads nor writes the cache.
    """

    def __init__(self, hidden, head_dim, cmp_ratio, coff, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        c = coff * head_dim
        self.cmp_ratio, self.coff = cmp_ratio, coff
        self.wkv = nn.Parameter(torch.randn(c, hidden, generator=g) / hidden**0.5)
        self.wgate = nn.Parameter(torch.randn(c, hidden, generator=g) / hidden**0.5)
        self.ape = nn.Parameter(0.5 * torch.randn(cmp_ratio, c, generator=g))
        self.register_buffer("state_cache", torch.zeros(1, cmp_ratio, 2 * c))

    def forward(self, x, cu_seqlens=None):
        import cann_ops_transformer.ops as custom_ops  # the client's own import, unedited

        r = self.cmp_ratio
        wkv, wgate = self.wkv.to(x.dtype), self.wgate.to(x.dtype)
        dev = x.device
        if cu_seqlens is None:  # BSH [B, S, H]
            batch, seq = x.shape[0], x.shape[1]
            seqused = torch.full((batch,), seq, dtype=torch.int32, device=dev)
        else:  # TND [T, H]: a table as wide as T covers every sequence
            batch, seq = cu_seqlens.numel() - 1, x.shape[0]
            seqused = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        table = torch.zeros(batch, -(-seq // r), dtype=torch.int32, device=dev)
        start_pos = torch.zeros(batch, dtype=torch.int32, device=dev)
        cmp_kv = custom_ops.compressor(
            x,
            wkv,
            wgate,
            self.state_cache,
            self.ape,
            r,
            state_block_table=table,
            cu_seqlens=cu_seqlens,
            seqused=seqused,
            start_pos=start_pos,
            coff=self.coff,
            cache_mode=1,
        )
        if cu_seqlens is None:
            return cmp_kv
        return cmp_kv[: int((seqused // r).sum())]  # the valid rows, packed first


CLIENT_CASES = {
    "bsh_c4a_ragged": dict(lens=[10, 10], r=4, coff=2),
    "bsh_c4a_shorter_than_r": dict(lens=[3, 3], r=4, coff=2),
    "bsh_c128a": dict(lens=[300], r=128, coff=1),
    "tnd_c4a_ragged_short": dict(lens=[13, 3, 8], r=4, coff=2, th=True),
    "tnd_c128a_ragged_short": dict(lens=[300, 100, 129], r=128, coff=1, th=True),
}
H, D = 64, 16


def _client_inputs(lens, th, seed):
    g = torch.Generator().manual_seed(seed)
    if th:
        x = torch.randn(sum(lens), H, generator=g)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        return x.to(torch.bfloat16), cu
    return torch.randn(len(lens), lens[0], H, generator=g).to(torch.bfloat16), None


def _oracle(model, x, cu_seqlens, d_out):
    """cmp_kv and the gradients wrt x and the three fp32 masters, from autograd through the float64
    small-ops forward at the values the operator sees (x; the bf16-rounded weights; ape)."""
    r, coff = model.cmp_ratio, model.coff
    x64 = x.detach().cpu().double().requires_grad_()
    wkv64 = model.wkv.detach().cpu().to(torch.bfloat16).double().requires_grad_()
    wgate64 = model.wgate.detach().cpu().to(torch.bfloat16).double().requires_grad_()
    ape64 = model.ape.detach().cpu().double().requires_grad_()
    if cu_seqlens is None:
        batch, seq = x.shape[0], x.shape[1]
        seqused = torch.full((batch,), seq, dtype=torch.int32)
    else:
        batch, seq = cu_seqlens.numel() - 1, x.shape[0]
        seqused = cu_seqlens[1:] - cu_seqlens[:-1]
    out, _ = reference_forward(
        x64,
        wkv64,
        wgate64,
        torch.zeros(1, r, 2 * wkv64.shape[0], dtype=torch.float64),
        ape64,
        r,
        state_block_table=torch.zeros(batch, -(-seq // r), dtype=torch.int32),
        cu_seqlens=cu_seqlens,
        seqused=seqused,
        start_pos=torch.zeros(batch, dtype=torch.int32),
        coff=coff,
        cache_mode=1,
    )
    if cu_seqlens is not None:
        out = out[: int((seqused // r).sum())]
    leaves = (x64, wkv64, wgate64, ape64)
    ((out * d_out).sum() + sum(0.0 * t.sum() for t in leaves)).backward()
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("name", list(CLIENT_CASES))
@pytest.mark.parametrize("device", DEVICES)
def test_mindspeed_style_client_against_float64(stand_in, name, device):
    spec = CLIENT_CASES[name]
    seed = zlib.crc32(name.encode()) % 1000
    model = StatelessPrefillCompressor(H, D, spec["r"], spec["coff"], seed=seed)
    x, cu = _client_inputs(spec["lens"], spec.get("th", False), seed=seed + 1)
    with torch.no_grad():
        probe = model(x, cu)
    d_out = torch.randn(probe.shape, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).double()

    model_dev = model.to(device)
    x_dev = x.to(device).requires_grad_()
    out = model_dev(x_dev, None if cu is None else cu.to(device))
    (out.double() * d_out.to(device)).sum().backward()
    out_t, (gx, gwkv, gwgate, gape) = _oracle(model, x, cu, d_out)

    # cmp_kv: the correctly rounded truth give or take one bf16 ulp (fp32 projection noise can flip a
    # rounding), plus fp32-level error at the tensor's scale for cancelled sums (as test_torch_op).
    out = out.detach().cpu()
    assert out.shape == out_t.shape and out.dtype == torch.bfloat16
    slack = io_ulp(out_t, "bf16") + 2.0**-18 * out_t.abs().max()
    assert bool(((out.double() - out_t).abs() <= slack).all())
    # The gradients reach the fp32 masters (through the bf16 casts) and the bf16 activations.
    for p in (model.wkv, model.wgate, model.ape):
        assert p.grad is not None and p.grad.dtype == torch.float32
    assert x_dev.grad.dtype == torch.bfloat16
    for grad_name, a, e in (
        ("d_x", x_dev.grad, gx),
        ("d_wkv", model.wkv.grad, gwkv),
        ("d_wgate", model.wgate.grad, gwgate),
    ):
        r = two_way(a.cpu().to(torch.bfloat16), e.to(torch.bfloat16), "bf16")
        assert r.passed, (grad_name, r.summary())
    assert_close_to_truth(model.ape.grad.cpu(), gape)
    if name == "bsh_c4a_shorter_than_r":  # no complete block: zero output, zero gradients
        assert not out.any() and not x_dev.grad.any() and not model.wkv.grad.any()
    # The shared one-block cache is never written.
    assert not model.state_cache.any()


def test_shared_cache_is_neither_read_nor_written(stand_in):
    """A NaN-filled cache block changes nothing (not read) and stays NaN (not written), with and
    without autograd, over repeated calls in both layouts."""
    model = StatelessPrefillCompressor(H, D, 4, 2, seed=3)
    for lens, th in (([9, 9], False), ([11, 2, 6], True)):
        x, cu = _client_inputs(lens, th, seed=4)
        with torch.no_grad():
            clean = model(x, cu)
        model.state_cache.fill_(float("nan"))
        with torch.no_grad():
            assert torch.equal(model(x, cu), clean)
        xg = x.clone().requires_grad_()
        out = model(xg, cu)
        out.float().sum().backward()
        assert torch.equal(out.detach(), clean) and bool(torch.isfinite(xg.grad).all())
        assert bool(model.state_cache.isnan().all())
        model.state_cache.zero_()


# ---------------------------------------------------------------------------------------------------
# The module layout, opt-in, and the refusal.


def test_module_layout(stand_in):
    import cann_ops_transformer
    import cann_ops_transformer.ops as custom_ops
    from cann_ops_transformer import ops
    from cann_ops_transformer.ops import compressor

    assert stand_in is cann_ops_transformer and ops is custom_ops
    assert cann_ops_transformer.compressor is kt.compressor and compressor is kt.compressor
    params = inspect.signature(custom_ops.compressor).parameters
    assert list(params)[:6] == ["x", "wkv", "wgate", "state_cache", "ape", "cmp_ratio"]
    kw = {n: p.default for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert kw == dict(
        state_block_table=None, cu_seqlens=None, seqused=None, start_pos=None, coff=1, cache_mode=1
    )
    assert params["cmp_ratio"].default == 4
    # Idempotent: the same module objects.
    assert kt.install_cann_ops_transformer() is cann_ops_transformer
    assert sys.modules[PKG + ".ops"] is custom_ops
    # Anything else of the NPU package is reported as missing, in kvcomp's words.
    with pytest.raises(AttributeError, match=r"\[kvcomp\] cann_ops_transformer.ops.npu_other"):
        custom_ops.npu_other
    with pytest.raises(ModuleNotFoundError):
        import cann_ops_transformer.not_there  # noqa: F401
    # A client that probes for the package finds it.
    assert importlib.util.find_spec(PKG) is not None


def test_missing_block_table_is_the_kvcomp_error(stand_in):
    """An unset state_block_table is refused as on the Ascend 950 (kvcomp needs it too)."""
    import cann_ops_transformer.ops as custom_ops

    case = make_case(lens=[8], r=4, seed=9)
    with pytest.raises(kvcomp.KvcompError, match="state_block_table") as e:
        custom_ops.compressor(case.x, case.wkv, case.wgate, case.state_cache, case.ape, 4)
    assert e.value.code == 161001


def _fake_package(root, body):
    pkg = root / PKG
    pkg.mkdir()
    (pkg / "__init__.py").write_text(body)
    return pkg


def test_refuses_an_installed_package(clean_modules, tmp_path, monkeypatch):
    pkg = _fake_package(tmp_path, "raise AssertionError('kvcomp must not import the real package')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(kvcomp.KvcompError) as e:
        kt.install_cann_ops_transformer()
    msg = e.value.message
    assert e.value.code == 161002
    assert msg.startswith("[kvcomp] the installed package cann_ops_transformer (= ")
    assert str(pkg) in msg and "pip uninstall cann_ops_transformer" in msg
    assert "do not call kvcomp.torch.install_cann_ops_transformer()" in msg
    assert PKG not in sys.modules and PKG + ".ops" not in sys.modules


def test_refuses_an_imported_package(clean_modules, tmp_path, monkeypatch):
    pkg = _fake_package(tmp_path, "REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import cann_ops_transformer as real

    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))  # still refused once imported
    with pytest.raises(kvcomp.KvcompError) as e:
        kt.install_cann_ops_transformer()
    assert e.value.message.startswith("[kvcomp] the imported package cann_ops_transformer (= ")
    assert str(pkg) in e.value.message
    assert sys.modules[PKG] is real and real.REAL and not hasattr(real, "compressor")


def _env():
    """The environment of a fresh interpreter that imports this same kvcomp."""
    here = os.path.dirname(os.path.abspath(__file__))
    paths = [os.path.dirname(os.path.dirname(kvcomp.__file__)), here, os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p), PYTHONDONTWRITEBYTECODE="1")


def _python(args, cwd, env=None):
    proc = subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_importing_kvcomp_installs_nothing(tmp_path):
    script = """
        import importlib.util, sys
        import torch
        import kvcomp, kvcomp.torch, kvcomp.npu_compat, kvcomp.compare
        assert not [m for m in sys.modules if m.split(".")[0] == "cann_ops_transformer"]
        assert importlib.util.find_spec("cann_ops_transformer") is None
        assert not hasattr(torch.ops.cann_ops_transformer, "_compressor_forward")
        try:
            import cann_ops_transformer.ops
        except ModuleNotFoundError:
            print("nothing installed")
        """
    assert _python(["-c", textwrap.dedent(script)], tmp_path).strip() == "nothing installed"


_CLIENT_SCRIPT = """
    import sys
    import torch
    import cann_ops_transformer.ops as custom_ops
    import kvcomp.torch
    import helper_next_to_script  # the script's folder is on sys.path, as with `python SCRIPT`

    kvcomp.torch.install_cann_ops_transformer()  # a second call (launcher, then script) is harmless
    assert custom_ops.compressor is kvcomp.torch.compressor
    assert hasattr(torch.ops.cann_ops_transformer, "_compressor_backward")
    print(__name__, sys.argv[1:])
    """


def test_launcher_runs_an_unedited_script(tmp_path):
    (tmp_path / "helper_next_to_script.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_CLIENT_SCRIPT))
    out = _python(["-m", "kvcomp.npu_compat", str(script), "--use-fused-compressor", "x"], tmp_path.parent)
    assert out.strip() == "__main__ ['--use-fused-compressor', 'x']"


def test_sitecustomize_snippet(tmp_path):
    """The sitecustomize of docs/python.md: opt-in through an environment variable."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        textwrap.dedent(
            """
            import os
            if os.environ.get("KVCOMP_AS_CANN_OPS_TRANSFORMER") == "1":
                import kvcomp.torch
                kvcomp.torch.install_cann_ops_transformer()
            """
        )
    )
    (tmp_path / "helper_next_to_script.py").write_text("")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(_CLIENT_SCRIPT))
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    env["KVCOMP_AS_CANN_OPS_TRANSFORMER"] = "1"
    assert _python([str(script), "a"], tmp_path, env).strip() == "__main__ ['a']"


def test_launcher_main_in_process(clean_modules, tmp_path, monkeypatch, capsys):
    (tmp_path / "client_module.py").write_text(
        "import sys\nimport cann_ops_transformer\nprint('module', __name__, sys.argv[1:])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    assert npu_compat.main(["-m", "client_module", "--flag"]) == 0
    assert capsys.readouterr().out.strip() == "module __main__ ['--flag']"
    assert npu_compat.main([]) == 2 and npu_compat.main(["--help"]) == 0
    assert "usage: python -m kvcomp.npu_compat" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# The upstream torch.ops names.


def _op_cases():
    return {
        "bsh": make_case(lens=[9, 12], r=4, coff=2, start_pos=[3, 0], H=16, D=8, dtype="bf16", seed=41),
        "th": make_case(
            lens=[9, 12], th=True, r=3, coff=1, start_pos=[1, 5], cache_mode=2, H=16, D=8, seed=42
        ),
    }


def _bwd_tail(case):
    k = case.kwargs()
    return (k["cu_seqlens"], k["seqused"], k["start_pos"], case.cmp_ratio, case.coff)


def test_upstream_schemas(stand_in):
    fwd = torch.ops.cann_ops_transformer._compressor_forward.default._schema
    bwd = torch.ops.cann_ops_transformer._compressor_backward.default._schema
    assert [a.name for a in fwd.arguments] == [
        "x",
        "wkv",
        "wgate",
        "state_cache",
        "ape",
        "state_block_table",
        "cu_seqlens",
        "seqused",
        "start_pos",
        "cmp_ratio",
        "coff",
        "cache_mode",
        "grad_enabled",
    ]
    assert len(fwd.returns) == 3
    written = [a.name for a in fwd.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["state_cache"]
    assert [a.name for a in bwd.arguments] == [
        "dout",
        "x",
        "wkv",
        "wgate",
        "softmax_score",
        "kv",
        "cu_seqlens",
        "seqused",
        "start_pos",
        "cmp_ratio",
        "coff",
    ]
    assert len(bwd.returns) == 4 and not any(a.alias_info is not None for a in bwd.arguments)


@pytest.mark.parametrize("layout", ["bsh", "th"])
@pytest.mark.parametrize("device", DEVICES)
def test_upstream_ops_are_kvcomps_kernels_and_pass_opcheck(stand_in, layout, device):
    case = on_device(_op_cases()[layout], device)
    ops = torch.ops.cann_ops_transformer
    cache_a, cache_b = case.state_cache.clone(), case.state_cache.clone()
    cmp_kv, s, kv = ops._compressor_forward(*forward_op_args(case, cache_a), True)
    ref = torch.ops.kvcomp.compressor_forward(*forward_op_args(case, cache_b), True)
    assert all(torch.equal(a, b) for a, b in zip((cmp_kv, s, kv), ref)) and torch.equal(cache_a, cache_b)
    # Without grad_enabled the intermediates keep upstream's shapes (zeros: the NPU leaves them unwritten).
    cmp_kv0, s0, kv0 = ops._compressor_forward(*forward_op_args(case, case.state_cache.clone()), False)
    assert torch.equal(cmp_kv0, cmp_kv) and s0.shape == s.shape and kv0.shape == kv.shape
    assert s0.dtype == kv0.dtype == torch.float32 and not s0.any() and not kv0.any()

    d = torch.randn(cmp_kv.shape, generator=torch.Generator().manual_seed(1)).to(cmp_kv)
    bwd_args = (d, case.x, case.wkv, case.wgate, s, kv) + _bwd_tail(case)
    grads = ops._compressor_backward(*bwd_args)
    assert all(torch.equal(a, b) for a, b in zip(grads, torch.ops.kvcomp.compressor_backward(*bwd_args)))

    for grad_enabled in (False, True):
        fwd_args = forward_op_args(case, case.state_cache.clone()) + (grad_enabled,)
        torch.library.opcheck(ops._compressor_forward.default, fwd_args)
    torch.library.opcheck(ops._compressor_backward.default, bwd_args)

    # Autograd through _compressor_forward, as upstream registers it: the gradients of
    # kvcomp.torch.compressor, whatever grad_enabled says (upstream looks at x only).
    leaves = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
    out = kt.compressor(*leaves[:3], case.state_cache.clone(), leaves[3], case.cmp_ratio, **case.kwargs())
    out.backward(d)
    for grad_enabled in (True, False):
        params = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
        args = list(forward_op_args(case, case.state_cache.clone()))
        args[0:3], args[4] = params[:3], params[3]
        ops._compressor_forward(*args, grad_enabled)[0].backward(d)
        for p, q in zip(params, leaves):
            assert torch.equal(p.grad, q.grad)
    # The explicit backward op gives the same gradients.
    for g, q in zip(grads, leaves):
        assert torch.equal(g, q.grad)


@pytest.mark.parametrize("layout", ["bsh", "th"])
def test_compile_fullgraph_over_the_upstream_ops(stand_in, layout):
    case = _op_cases()[layout]
    ops = torch.ops.cann_ops_transformer
    tail = forward_op_args(case, None)[5:]

    def autograd_step(x, wkv, wgate, ape, cache, target):
        cmp_kv, _, _ = ops._compressor_forward(x, wkv, wgate, cache, ape, *tail, True)
        return ((cmp_kv.float() - target) ** 2).sum()

    def explicit_step(x, wkv, wgate, ape, cache, target):
        cmp_kv, s, kv = ops._compressor_forward(x, wkv, wgate, cache, ape, *tail, True)
        dout = (2 * (cmp_kv.float() - target)).to(cmp_kv.dtype)
        return ops._compressor_backward(dout, x, wkv, wgate, s, kv, *_bwd_tail(case))

    probe = ops._compressor_forward(*forward_op_args(case, case.state_cache.clone()), False)[0]
    target = torch.randn(probe.shape, generator=torch.Generator().manual_seed(3))

    def run_autograd(step):
        params = [t.clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
        cache = case.state_cache.clone()
        loss = step(*params, cache, target)
        loss.backward()
        return [loss.detach(), cache] + [p.grad for p in params]

    def run_explicit(step):
        cache = case.state_cache.clone()
        return [cache] + list(step(case.x, case.wkv, case.wgate, case.ape, cache, target))

    torch._dynamo.reset()
    for run, step in ((run_autograd, autograd_step), (run_explicit, explicit_step)):
        eager = run(step)
        compiled = run(torch.compile(step, backend="aot_eager", fullgraph=True))
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b)  # the same kernels: bitwise; the cache mutation survives too
    # The explicit backward and autograd agree (the step's loss gradient is 2 (cmp_kv - target)).
    auto, explicit = run_autograd(autograd_step), run_explicit(explicit_step)
    for a, b in zip(auto[2:], explicit[1:]):
        assert torch.equal(a, b)
