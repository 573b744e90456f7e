"""The CPU's matrix-product kernels (src/cpu/products/onednn_bf16.hpp). Where the CPU has bf16 dot-product units
(AMX-BF16, AVX512-BF16) the products of bf16 calls run on them through oneDNN's matmul by default: the
forward projections, the npu_parity backward (d_new is bf16 already) where the units outrun fp32 (AMX,
AMD's AVX512-BF16; not Intel's without AMX), and the precise backward as hi + lo bf16 parts where that is
faster than fp32 (AMX); KVCOMP_PRODUCTS=bf16 asks for all of them;
KVCOMP_PRODUCTS=f32 or KVCOMP_ISA below avx512 keeps every product fp32. kvcomp.product_kernels() names
what runs. Each path is checked for determinism across thread counts and, at a realistic H, against the
float64 truth with the fp32 path's result or the fp32 golden as the B party; ctest also runs the
torch-operator sweep, the row-stability checks and the functional suite with KVCOMP_PRODUCTS=f32 and =bf16.
Each setting needs its own process (the choice is made once); without bf16 units the tests of the bf16
path report themselves skipped."""

import os
import subprocess
import sys

import pytest
import torch

import kvcomp

from kvcomp.compare import fp32_projection
from support import make_case, reference_forward


def _cpuinfo(key):
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == key:
                    return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


FLAGS = set(_cpuinfo("flags"))
AMD = _cpuinfo("vendor_id") == ["AuthenticAMD"]
HAS_BF16_UNITS = bool(FLAGS & {"amx_bf16", "avx512_bf16"})


def _child(code, *args, **env):
    e = dict(os.environ)
    # The child sees the machine as /proc/cpuinfo describes it (FLAGS): no caps inherited from the caller.
    for k in ("KVCOMP_PRODUCTS", "KVCOMP_ISA", "KVCOMP_KERNELS", "KVCOMP_VERBOSE", "DNNL_MAX_CPU_ISA",
              "ONEDNN_MAX_CPU_ISA"):
        e.pop(k, None)
    e.update(env)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), e.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", code, *args], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


_NAME = "import kvcomp; print(kvcomp.product_kernels())"


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
@pytest.mark.parametrize("env", [{}, {"KVCOMP_PRODUCTS": ""}, {"KVCOMP_PRODUCTS": "auto"}])
def test_bf16_units_are_used_where_the_cpu_has_them(env):
    name = _child(_NAME, **env)
    assert name.startswith("bf16 (") and " + f32 (dnnl_sgemm)" in name, name
    if "amx_bf16" in FLAGS:  # AMX: bf16 at ~3x the fp32 rate, so the precise backward splits d_new
        assert "amx" in name and "precise as hi+lo" in name, name
    elif AMD:  # AVX512-BF16 on Zen 4: ~1.5x, so npu_parity on the units, two bf16 products slower than fp32
        assert "precise in f32" in name, name
    else:  # Intel's AVX512-BF16 without AMX: below the fp32 rate, so the backward keeps fp32 products
        assert "backward in f32" in name, name


@pytest.mark.skipif("amx_bf16" not in FLAGS, reason="this CPU has no AMX-BF16")
def test_amx_products_run_on_kvcomps_kernel_unless_switched_off():
    """On AMX every bf16 product runs on kvcomp's own AMX kernel (src/cpu/products/amx.hpp); KVCOMP_KERNELS=-amx
    gives oneDNN's AMX kernels back, and so does capping oneDNN below AMX."""
    assert _child(_NAME).startswith("bf16 (kvcomp amx_bf16, precise as hi+lo)")
    for env in ({"KVCOMP_KERNELS": "-amx"}, {"DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}):
        name = _child(_NAME, **env)
        assert name.startswith("bf16 (") and "kvcomp amx_bf16" not in name, (env, name)
    assert "amx" in _child(_NAME, KVCOMP_KERNELS="-amx")


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
def test_bf16_everywhere_on_request():
    assert "precise as hi+lo" in _child(_NAME, KVCOMP_PRODUCTS="bf16")


# oneDNN runs its AVX2 sgemm kernels (no AVX-512 core set), so decode-sized projections run on
# kvcomp's own AVX2 kernel (src/cpu/products/rows.hpp) unless KVCOMP_ISA=scalar caps kvcomp's kernels; where
# it runs its AVX-512 sgemm they do too, in the order probed per shape.
AVX512_CORE = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= FLAGS
AVX2_SGEMM = {"avx2", "fma"} <= FLAGS and not AVX512_CORE
_F32 = "f32 (dnnl_sgemm)"
_ROWS = "; 1-8 rows: kvcomp avx2, order probed per shape" if AVX512_CORE else "; 1-8 rows: kvcomp avx2"
_F32_ROWS = _F32 + _ROWS


@pytest.mark.skipif(HAS_BF16_UNITS, reason="this CPU has bf16 units")
def test_fp32_products_without_bf16_units():
    assert _child(_NAME) == (_F32_ROWS if {"avx2", "fma"} <= FLAGS else _F32)


@pytest.mark.parametrize("env", [{"KVCOMP_PRODUCTS": "f32"}, {"KVCOMP_ISA": "avx2"}, {"KVCOMP_ISA": "scalar"}])
def test_caps_keep_fp32(env):
    rows_kernel = {"avx2", "fma"} <= FLAGS and env.get("KVCOMP_ISA") != "scalar"
    assert _child(_NAME, **env) == (_F32_ROWS if rows_kernel else _F32)


@pytest.mark.skipif(not AVX2_SGEMM, reason="oneDNN runs no AVX2 sgemm here (no own rows kernel to leave out)")
def test_prepared_weights_serve_with_and_without_the_rows_kernel():
    """A blob prepared where the rows kernel is off (KVCOMP_ISA=scalar) is accepted where it runs, and
    gives the result of a blob prepared there: the kernel reads the same fp32 rows."""
    code = ("import torch, kvcomp; g = torch.Generator().manual_seed(4); "
            "w = (torch.randn(2, 32, 64, generator=g) / 8).bfloat16(); "
            "print(kvcomp.prepare_weights(w[0], w[1]).numpy().tobytes().hex())")
    assert _child(_NAME, KVCOMP_ISA="scalar") == _F32
    foreign = torch.frombuffer(bytearray.fromhex(_child(code, KVCOMP_ISA="scalar")), dtype=torch.uint8)
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(2, 32, 64, generator=g) / 8).bfloat16()
    own = kvcomp.prepare_weights(w[0], w[1])
    x = torch.randn(1, 3, 64, generator=g).bfloat16()
    ape = torch.randn(4, 32, generator=g)
    outs = []
    for blob in (foreign, own):
        cache = torch.zeros(2, 8, 64)
        table = torch.tensor([[1]], dtype=torch.int32)
        out = kvcomp.compressor_forward(x, w[0], w[1], cache, ape, 4, state_block_table=table, coff=2,
                                        start_pos=torch.tensor([1], dtype=torch.int32), prepared_weights=blob)[0]
        outs.append((out, cache))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def _weights_and_blobs(C, Hs, seed):
    """bf16 weights [2, C, Hs] drawn from `seed`, the generator after them, and the weights' blob prepared
    in a child process with KVCOMP_KERNELS=-panels ("lean") and here ("own")."""
    code = (f"import torch, kvcomp; g = torch.Generator().manual_seed({seed}); "
            f"w = (torch.randn(2, {C}, {Hs}, generator=g) / 8).bfloat16(); "
            "print(kvcomp.prepare_weights(w[0], w[1]).numpy().tobytes().hex())")
    lean = torch.frombuffer(bytearray.fromhex(_child(code, KVCOMP_KERNELS="-panels")), dtype=torch.uint8)
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(2, C, Hs, generator=g) / 8).bfloat16()
    return g, w, lean, kvcomp.prepare_weights(w[0], w[1])


def _blob_served_elsewhere(C, Hs, seed, path, tail, **env):
    """Runs, in a child process with `env`, a one-token call on the weights of _weights_and_blobs(C, Hs,
    seed) without a blob and with the blob stored at `path`; prints whether both give the same bits,
    then `tail` (an expression)."""
    check = (f"import torch, kvcomp; g = torch.Generator().manual_seed({seed}); "
             f"w = (torch.randn(2, {C}, {Hs}, generator=g) / 8).bfloat16(); "
             f"blob = torch.frombuffer(bytearray(open({str(path)!r}, 'rb').read()), dtype=torch.uint8); "
             f"x = torch.randn(1, 1, {Hs}, generator=g).bfloat16(); ape = torch.randn(4, {C}, generator=g); "
             f"outs = [kvcomp.compressor_forward(x, w[0], w[1], torch.zeros(2, 8, {2 * C}), ape, 4, "
             "state_block_table=torch.tensor([[1]], dtype=torch.int32), coff=1, "
             "start_pos=torch.tensor([3], dtype=torch.int32), prepared_weights=b)[0] for b in (None, blob)]; "
             f"print(torch.equal(outs[0], outs[1]), {tail})")
    return _child(check, **env)


@pytest.mark.skipif(not AVX2_SGEMM, reason="oneDNN runs no AVX2 sgemm here (no decode panels)")
def test_prepared_weights_serve_with_and_without_decode_panels(tmp_path):
    """Here a blob of bf16 weights also holds them as decode panels for one-token calls (2 * C * H bf16
    more); KVCOMP_KERNELS=-panels leaves them out. Either blob serves either process, with the bits of
    the call without a blob."""
    C, Hs = 48, 1003
    g, w, lean, own = _weights_and_blobs(C, Hs, 5)
    assert own.numel() - lean.numel() == 2 * C * Hs * 2
    x = torch.randn(1, 1, Hs, generator=g).bfloat16()
    ape = torch.randn(4, C, generator=g)
    outs = []
    for blob in (None, lean, own):
        cache = torch.zeros(2, 8, 2 * C)
        table = torch.tensor([[1]], dtype=torch.int32)
        out = kvcomp.compressor_forward(x, w[0], w[1], cache, ape, 4, state_block_table=table, coff=1,
                                        start_pos=torch.tensor([3], dtype=torch.int32), prepared_weights=blob)[0]
        outs.append((out, cache))
    for out, cache in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(cache, outs[0][1])
    # The other way round: this process's blob (with panels) in a process without them.
    path = tmp_path / "blob.bin"
    path.write_bytes(own.numpy().tobytes())
    same, total = _blob_served_elsewhere(C, Hs, 5, path, "outs[0].float().sum().item()",
                                         KVCOMP_KERNELS="-panels").split()
    assert same == "True" and float(total) == outs[0][0].float().sum().item()


@pytest.mark.skipif("kvcomp avx512_bf16" not in kvcomp.product_kernels(),
                    reason="no AVX512-BF16 rows kernel here (no AVX-512 decode panels)")
def test_prepared_bf16_weights_serve_with_and_without_avx512_panels(tmp_path):
    """On AVX512-BF16 a blob of bf16 weights holds them pre-transposed for the rows kernel (per 16 columns
    and pair of a K block, 64 bytes; at H = 1003 two blocks of 502 and 501, 251 + 251 pairs);
    KVCOMP_KERNELS=-panels leaves them out. Either blob serves, also where the kernel is off
    (KVCOMP_KERNELS=-rows), with the bits of the call without a blob: 1 to 8 tokens (1-8 rows) and
    9 to 70 (the kernel on the panels, beyond 64 in tiles of rows)."""
    C, Hs = 48, 1003
    g, w, lean, own = _weights_and_blobs(C, Hs, 6)
    assert lean.numel() == 64
    assert own.numel() == 64 + 2 * (C // 16) * (251 + 251) * 64
    path = tmp_path / "blob.bin"
    path.write_bytes(own.numpy().tobytes())
    for tokens in (1, 3, 8, 9, 70):
        x = torch.randn(tokens, 1, Hs, generator=g).bfloat16()
        ape = torch.randn(4, C, generator=g)
        outs = []
        for blob in (None, lean, own):
            cache = torch.zeros(1 + tokens, 8, 2 * C)
            table = torch.arange(1, tokens + 1, dtype=torch.int32)[:, None]
            out = kvcomp.compressor_forward(x, w[0], w[1], cache, ape, 4, state_block_table=table, coff=1,
                                            start_pos=torch.full((tokens,), 3, dtype=torch.int32),
                                            prepared_weights=blob)[0]
            outs.append((out, cache))
        for out, cache in outs[1:]:
            assert torch.equal(out, outs[0][0]) and torch.equal(cache, outs[0][1]), tokens
    # This process's blob (with panels) where the kernel is off.
    out = _blob_served_elsewhere(C, Hs, 6, path, "kvcomp.product_kernels()", KVCOMP_KERNELS="-rows")
    assert out.startswith("True ") and "kvcomp avx512_bf16" not in out, out


# One forward call per token count on seeded bf16 weights [80, 1003] (five 16-column groups, two K
# blocks of odd lengths), coff = 2, r = 4, BSH [1, T, H] from position 0, with grad_enabled (softmax_score
# and kv too); prints per count a digest of every output's bytes and the cache's. `threads`: the call's
# num_threads.
_LONG_CALLS = """
import hashlib, torch, kvcomp
def digests(threads):
    g = torch.Generator().manual_seed(9)
    C, Hs = 80, 1003
    w = (torch.randn(2, C, Hs, generator=g) / 8).bfloat16()
    ape = torch.randn(4, C, generator=g)
    out = []
    for t in (127, 128, 300, 1030):
        x = torch.randn(1, t, Hs, generator=g).bfloat16()
        n = (t + 7) // 8
        cache = torch.zeros(1 + n, 8, 2 * C)
        table = torch.arange(1, 1 + n, dtype=torch.int32)[None]
        res = kvcomp.compressor_forward(x, w[0], w[1], cache, ape, 4, state_block_table=table, coff=2,
                                        grad_enabled=True, num_threads=threads)
        h = hashlib.sha256()
        for a in (*res, cache):
            h.update(a.contiguous().view(torch.uint8).numpy().tobytes())
        out.append(h.hexdigest()[:16])
    return " ".join(out)
"""


@pytest.mark.skipif("kvcomp avx512_bf16" not in kvcomp.product_kernels(),
                    reason="no AVX512-BF16 rows kernel here (no AVX-512 decode panels)")
def test_long_bf16_calls_write_panels_with_the_bits_of_onednn():
    """A bf16 call of 128 tokens or more without prepared weights writes the weights' AVX-512 panels
    itself and runs kvcomp's kernel on them: every output and the cache bitwise as oneDNN's jit gemm
    gives them (the kernel off, KVCOMP_KERNELS=-rows, or no panels, -panels), at 127
    tokens (no panels), 128, 300 and 1030 (two chunks of rows), on 1 and 2 threads."""
    ns = {}
    exec(_LONG_CALLS, ns)
    own = ns["digests"](2)
    assert ns["digests"](1) == own
    assert len(set(own.split())) == 4  # four different calls
    for env in ({"KVCOMP_KERNELS": "-rows"}, {"KVCOMP_KERNELS": "-panels"}):
        assert _child(_LONG_CALLS + "print(digests(2))", **env) == own, env


def test_rows_switch_off_keeps_sgemm_alone():
    """KVCOMP_KERNELS=-rows: kvcomp's rows kernels are neither used nor named."""
    assert _child(_NAME, KVCOMP_KERNELS="-rows", KVCOMP_PRODUCTS="f32") == _F32


def test_unknown_kernel_switch_is_reported_and_ignored():
    e = dict(os.environ, KVCOMP_KERNELS="-rows,+fast,amx", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    e.pop("KVCOMP_PRODUCTS", None)
    out = subprocess.run([sys.executable, "-c", _NAME], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert "KVCOMP_KERNELS entry (= +fast) must be +name or -name" in out.stderr, out.stderr
    assert "KVCOMP_KERNELS entry (= amx) must be +name or -name" in out.stderr, out.stderr
    assert "kvcomp avx2" not in out.stdout  # the valid entry still applies


def test_unknown_value_is_reported_and_ignored():
    e = dict(os.environ, KVCOMP_PRODUCTS="fp8", PYTHONPATH=os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _NAME], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and "KVCOMP_PRODUCTS (= fp8) must be auto, bf16 or f32" in out.stderr


_THREADS = r"""
import hashlib, sys, torch, kvcomp, kvcomp.torch as kt
from support import make_case
row_stable = sys.argv[1] == "1"
case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=256, D=32, dtype="bf16", seed=9)
# A decode call of 90 rows: one thread runs it in 64-row tiles, two and three in 2-row-padded column tiles
# where the kernel allows (src/cpu/forward.cpp): the same bits either way.
dec = make_case(lens=[1] * 90, th=True, r=4, coff=2, start_pos=[1001 + i % 4 for i in range(90)], H=256, D=32,
                dtype="bf16", seed=10)
h = []
for t in (1, 2, 3):
    kvcomp.set_default_options(num_threads=t)
    digest = hashlib.sha256()
    for c in (case, dec):
        cache = c.state_cache.clone()
        k = c.kwargs()
        with torch.no_grad():
            out, _, _ = kt.forward_with_gradient(c.x, c.wkv, c.wgate, cache, c.ape, k["state_block_table"],
                                                 k["cu_seqlens"], k["seqused"], k["start_pos"], 4, 2, 1, False,
                                                 row_stable=row_stable)
        digest.update(out.float().numpy().tobytes())
        digest.update(cache.numpy().tobytes())
    h.append(digest.hexdigest())
print(kvcomp.product_kernels().split(" ")[0], len(set(h)))
"""


@pytest.mark.parametrize("products", ["auto", "bf16", "f32"])
@pytest.mark.parametrize("row_stable", ["1", "0"])
def test_forward_is_the_same_for_every_thread_count(products, row_stable):
    """Also without row stability (row_stable=False, decode-bound serving: the rows as they are, column
    tiles)."""
    kind, distinct = _child(_THREADS, row_stable, KVCOMP_PRODUCTS=products).split()
    assert distinct == "1", kind


_GOLDEN = r"""
import sys, torch
import kvcomp.torch as kt
from support import make_case
case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=1024, D=64, dtype="bf16", seed=11)
with torch.no_grad():
    out = kt.compressor(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs())
torch.save(out, sys.argv[1] if len(sys.argv) > 1 else "out.pt")
"""


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
def test_bf16_forward_accuracy_against_the_truth(tmp_path):
    """cmp_kv of the bf16 path within the fp32-projection bound of the float64 truth, with the fp32 path
    as the golden (each in its own process)."""
    files = {k: tmp_path / f"{k}.pt" for k in ("f32", "bf16")}
    for k, f in files.items():
        _child(_GOLDEN.replace('sys.argv[1] if len(sys.argv) > 1 else "out.pt"', repr(str(f))), KVCOMP_PRODUCTS=k)
    a, b = torch.load(files["bf16"]), torch.load(files["f32"])
    assert not torch.equal(a, b)  # the two paths really differ
    case = make_case(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=1024, D=64, dtype="bf16", seed=11)
    leaves = [t.to(torch.float64) for t in (case.x, case.wkv, case.wgate, case.ape)]
    c, _ = reference_forward(*leaves[:3], case.state_cache, leaves[3], case.cmp_ratio, **case.kwargs())
    res = fp32_projection(a.float(), b.float(), c.to(torch.bfloat16).float(), "bf16")
    assert res.passed, res.summary()


# The backward at a realistic H on each product path: both precision modes, the four gradients for
# 1, 2 and 3 threads (sha256 each), and the gradients of the 2-thread run saved for the parent.
_BACKWARD = r"""
import hashlib, sys, torch, kvcomp, kvcomp.torch as kt
from support import make_case
case = make_case(**CASE)
g = torch.Generator().manual_seed(5)
out = {}
distinct = []
for precision in ("precise", "npu_parity"):
    hashes = set()
    for t in (1, 2, 3):
        kvcomp.set_default_options(num_threads=t, precision=precision)
        leaves = [v.detach().clone().requires_grad_() for v in (case.x, case.wkv, case.wgate, case.ape)]
        y = kt.compressor(leaves[0], leaves[1], leaves[2], case.state_cache.clone(), leaves[3], 4, **case.kwargs())
        if out.get("upstream") is None:
            out["upstream"] = torch.randn(y.shape, generator=g).to(y.dtype)
        y.backward(out["upstream"])
        grads = [v.grad for v in leaves]
        hashes.add(hashlib.sha256(b"".join(q.float().numpy().tobytes() for q in grads)).hexdigest())
        if t == 2:
            out[precision] = grads
    distinct.append(len(hashes))
torch.save(out, sys.argv[1])
print(kvcomp.product_kernels().split(" ")[0], *distinct)
"""


def _backward_run(tmp_path, products, case):
    f = tmp_path / f"bwd_{products}.pt"
    e_code = _BACKWARD.replace("sys.argv[1]", repr(str(f))).replace("**CASE", f"**{case!r}")
    kind, *distinct = _child(e_code, KVCOMP_PRODUCTS=products).split()
    assert distinct == ["1", "1"], (products, kind, distinct)  # the same gradients for 1, 2 and 3 threads
    return kind, torch.load(f)


# A realistic H, and widths whose 2C (26) is a multiple of neither 8 nor 4 (d_new's transposes run 8 x 8
# blocks of bf16 or 4 x 4 of fp32, and the edge columns one by one).
_BACKWARD_CASES = {
    "H1024": dict(lens=[300, 170], th=True, r=4, coff=2, start_pos=[3, 0], H=1024, D=64, dtype="bf16",
                  seed=13),
    "odd_widths": dict(lens=[150, 90], th=True, r=4, coff=1, start_pos=[1, 0], H=200, D=13, dtype="bf16",
                       seed=14),
}


@pytest.mark.skipif(not HAS_BF16_UNITS, reason="this CPU has neither AMX-BF16 nor AVX512-BF16")
@pytest.mark.parametrize("shape", sorted(_BACKWARD_CASES))
def test_backward_on_the_bf16_units_against_the_truth(tmp_path, shape):
    """Both precision modes with every product on the bf16 units (KVCOMP_PRODUCTS=bf16: npu_parity one
    bf16 product per GEMM, precise hi + lo parts) against the float64 truth (spec 7.2 three-way), the
    fp32 golden as B; npu_parity also within the two-party rule of the fp32 golden, as the NPU."""
    from kvcomp.compare import three_way, two_way
    from support import reference_grads

    kind, ours = _backward_run(tmp_path, "bf16", _BACKWARD_CASES[shape])
    assert kind == "bf16", kind
    _, f32 = _backward_run(tmp_path, "f32", _BACKWARD_CASES[shape])
    case = make_case(**_BACKWARD_CASES[shape])
    up = ours["upstream"]
    _, grads_c, _ = reference_grads(case, up, torch.float64)
    _, grads_b, _ = reference_grads(case, up, torch.float32, round_grad_to=case.x.dtype)
    names = ("d_x", "d_wkv", "d_wgate", "d_ape")
    for precision in ("precise", "npu_parity"):
        for i, n in enumerate(names):
            dt, key = (torch.float32, "fp32") if n == "d_ape" else (torch.bfloat16, "bf16")
            for path, grads in (("bf16", ours), ("f32", f32)):  # the fp32 path too (its own transpose)
                a, c = grads[precision][i].to(dt), grads_c[n].to(dt)
                rep = three_way(a, grads_b[n].to(dt), c, key)
                assert rep.passed, (path, precision, n, rep.summary())
                if precision == "npu_parity" and n != "d_ape":
                    tw = two_way(a, grads_b[n].to(dt), key)
                    assert tw.passed, (path, n, tw.summary())
        # the two paths really differ (else this test would check the fp32 path twice); at the small
        # shape their gradients, rounded to bf16, may coincide
        if shape == "H1024":
            assert not torch.equal(ours[precision][0], f32[precision][0]), precision


_VERBOSE = r"""
import torch, kvcomp, kvcomp.torch as kt
from support import make_case
case = make_case(lens=[5, 3], th=True, r=4, coff=2, start_pos=[3, 9], H=64, D=32, dtype="bf16", seed=3)
leaves = [t.detach().clone().requires_grad_() for t in (case.x, case.wkv, case.wgate, case.ape)]
out = kt.compressor(*leaves[:3], case.state_cache.clone(), leaves[3], 4, **case.kwargs())
out.sum().backward()
"""


def _verbose_child(**env):
    e = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                                   os.environ.get("PYTHONPATH")])))
    for k in ("KVCOMP_PRODUCTS", "KVCOMP_ISA", "KVCOMP_KERNELS", "KVCOMP_VERBOSE"):
        e.pop(k, None)
    e.update(env)
    out = subprocess.run([sys.executable, "-c", _VERBOSE], env=e, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_verbose_reports_each_planned_call():
    """KVCOMP_VERBOSE=1: every planned CPU call says what its products run on and why the kernels
    preferred to them were not taken; without it, nothing."""
    assert "[kvcomp]" not in _verbose_child()
    err = _verbose_child(KVCOMP_VERBOSE="1")
    assert "[kvcomp] forward plan: 8 rows, H 64, 2 x 64 projection columns, bf16 io" in err, err
    assert "[kvcomp] backward plan: 8 rows" in err and "path: " in err, err
    assert "chunks of 8 rows: " in err, err
    if HAS_BF16_UNITS:
        assert "products: bf16 (" in err, err
    else:  # no bf16 units: the report says why the products are fp32
        assert "products: fp32 (dnnl_sgemm); bf16 units not taken: " in err, err
    f32 = _verbose_child(KVCOMP_VERBOSE="1", KVCOMP_PRODUCTS="f32")
    assert "bf16 units not taken: KVCOMP_PRODUCTS=f32" in f32, f32
    assert "path: f32\n" in f32 or "path: f32;" in f32, f32
