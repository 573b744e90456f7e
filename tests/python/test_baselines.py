"""bench/torch_baselines.py: its vectorised small-ops forward agrees, values and gradients, with the
independent per-batch implementation of support.py, and its main prints one table row per case with
positive finite times. The inductor run compiles C++ (~10-20 s on 2 cores per case): it is skipped
with KVCOMP_SKIP_INDUCTOR=1."""

import importlib.util
import json
import math
import os

import pytest
import torch
from support import make_case, reference_forward

_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench", "torch_baselines.py")
_spec = importlib.util.spec_from_file_location("torch_baselines", _SCRIPT)
tb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tb)

SKIP_INDUCTOR = os.environ.get("KVCOMP_SKIP_INDUCTOR") == "1"

# (r, coff, sequences, tokens per sequence)
SHAPES = [
    (4, 2, 1, 64),
    (4, 1, 3, 32),
    (3, 2, 2, 24),
    (8, 1, 2, 64),
    (16, 2, 4, 64),
    (128, 1, 2, 128),
    (4, 2, 2, 4),  # one block per sequence: only placeholder "prev" rows
]


def _both(case, dtype, ref_dtype, th, num_seqs):
    """(ours, reference): cmp_kv and the four gradients for one upstream gradient."""
    g = torch.Generator().manual_seed(7)
    leaves = [t.detach().to(dtype).requires_grad_() for t in (case.x, case.wkv, case.wgate)]
    leaves.append(case.ape.detach().to(torch.float64 if dtype == torch.float64 else torch.float32).requires_grad_())
    out = tb.vectorised_forward(*leaves, case.cmp_ratio, case.coff, num_seqs if th else None)
    d_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
    ours = [out.detach(), *torch.autograd.grad(out, leaves, d_out.to(out.dtype))]

    ref_leaves = [t.detach().to(ref_dtype).requires_grad_() for t in leaves]
    x, wkv, wgate, ape = ref_leaves
    ref, _ = reference_forward(x, wkv, wgate, case.state_cache, ape, case.cmp_ratio, **case.kwargs())
    theirs = [ref.detach(), *torch.autograd.grad(ref, ref_leaves, d_out.to(ref.dtype))]
    assert ours[0].shape == theirs[0].shape
    return ours, theirs


@pytest.mark.parametrize("th", [False, True], ids=["bsh", "th"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"r{s[0]}c{s[1]}n{s[2]}L{s[3]}" for s in SHAPES])
@pytest.mark.parametrize("dtype", ["fp64", "fp32", "bf16"])
def test_matches_reference(shape, th, dtype):
    r, coff, n, L = shape
    # BSH: B = n sequences of S = L. TH: n sequences of L tokens. start_pos 0, no seqused; the cache
    # (mode 1, random contents) is never read at start_pos 0, and writes go to a copy.
    case = make_case(lens=[L] * n, H=64, D=16, r=r, coff=coff, th=th, seed=r * 100 + coff * 10 + n)
    io = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    ref_dtype = torch.float32 if dtype == "fp32" else torch.float64
    ours, theirs = _both(case, io, ref_dtype, th, n)
    tol = {"fp64": (1e-12, 1e-12), "fp32": (2e-5, 2e-5), "bf16": (3e-2, 3e-2)}[dtype]
    for name, a, b in zip(("cmp_kv", "d_x", "d_wkv", "d_wgate", "d_ape"), ours, theirs):
        a, b = a.double(), b.double()
        if dtype == "bf16":
            # bf16 io: ours projects in bf16, the reference in float64; compare relative to the scale.
            err = (a - b).abs().max() / b.abs().max().clamp_min(1e-30)
            assert err < tol[0], f"{name}: relative max error {err:.3g}"
        else:
            torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1], msg=lambda m, n=name: f"{n}: {m}")


def test_first_block_prev_rows_have_no_weight():
    """coff = 2: the first block's prev half (placeholders) must not influence anything."""
    case = make_case(lens=[8], H=16, D=4, r=4, coff=2)
    x = case.x.clone().requires_grad_()
    out = tb.vectorised_forward(x, case.wkv, case.wgate, case.ape, 4, 2)
    (d_x,) = torch.autograd.grad(out[0, 0].sum(), x)
    # block 0 uses only tokens 0..3 (its own); its "prev" rows are placeholders
    assert torch.all(d_x[0, 4:] == 0)
    assert torch.all(torch.isfinite(d_x))


def test_rejects_unsupported_shapes():
    x = torch.randn(1, 6, 8)
    w = torch.randn(4, 8)
    with pytest.raises(ValueError):
        tb.vectorised_forward(x, w, w, torch.randn(4, 4), 4, 1)  # S not a multiple of r
    with pytest.raises(ValueError):
        tb.vectorised_forward(torch.randn(12, 8), w, w, torch.randn(4, 4), 4, 1, 5)  # 5 does not divide T


def _parse_rows(text):
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 11 and cells[0] in tb.CASES:
            rows.append(cells)
    return rows


def _positive(cell):
    v = float(cell)
    return math.isfinite(v) and v > 0


def _run_main(capsys, extra):
    argv = ["--device", "cpu", "--tokens", "256", "--hidden", "64", "--head-dim", "16", "--repeat", "1"]
    results = tb.main(argv + ["--warmup", "0"] + extra)
    text = capsys.readouterr().out
    return results, _parse_rows(text), text


def test_main_prints_a_row_per_case(capsys, tmp_path):
    out_json = tmp_path / "baselines.json"
    results, rows, text = _run_main(capsys, ["--no-compile", "--th", "2", "--json", str(out_json)])
    assert [(r[0], r[1]) for r in rows] == [(c, lay) for c in tb.CASES for lay in ("BSH", "TH/2")], text
    for cells in rows:
        assert cells[2] == "256"
        for i in (3, 4, 5, 6, 9):  # products fwd, bwd, TFLOP/s, eager, eager / products
            assert _positive(cells[i]), text
        assert cells[7] == "n/a" and cells[10] == "n/a"  # --no-compile
        # kvcomp runs on cpu when the package is importable (it is, under pytest here)
        assert cells[8] != "n/a", text
        assert _positive(cells[8]), text
    for res in results:
        # kvcomp's own forward is an independent implementation: bf16 outputs agree to bf16 rounding
        assert res["kvcomp_max_abs_diff_vs_eager"] < 0.05
    assert len(json.loads(out_json.read_text())["results"]) == 6


@pytest.mark.skipif(SKIP_INDUCTOR, reason="KVCOMP_SKIP_INDUCTOR=1")
def test_main_compiled_variant(capsys):
    results, rows, text = _run_main(capsys, ["--cases", "C4A"])
    assert len(rows) == 1, text
    assert _positive(rows[0][7]) and _positive(rows[0][10]), text
    assert results[0]["compiled_max_abs_diff_vs_eager"] < 0.05


def test_cpu_variants_are_timed_in_rounds():
    """On a CPU every round runs each variant once, in turn (warm-up rounds first); a variant that raises
    is dropped with a note and gets no time, the others go on."""
    calls, failures = [], []

    def variant(key, fail_on=None):
        def run():
            calls.append(key)
            if len(calls) == fail_on:
                raise RuntimeError("refused")

        return run

    fns = {"a": variant("a"), "b": variant("b", fail_on=5), "c": variant("c")}
    times = tb.time_all_ms(fns, torch.device("cpu"), 1, 3, lambda k, e: failures.append((k, str(e))))
    assert calls == ["a", "b", "c", "a", "b", "c", "a", "c", "a", "c"]
    assert failures == [("b", "refused")]
    assert times["b"] is None and times["a"] >= 0 and times["c"] >= 0


def test_main_phases(capsys, tmp_path):
    """--phases (CPU): each kvcomp variant runs --repeat more steps with kvcomp's phase clock on; the
    results hold every operator phase per step, one forward and one backward call per step, phases and
    the rest summing to the step, and the table prints those sums."""
    out_json = tmp_path / "baselines.json"
    results, _, text = _run_main(capsys, ["--no-compile", "--cases", "C4Li", "--phases", "--json", str(out_json)])
    (res,) = results
    lines = [line for line in text.splitlines() if line.startswith("| C4Li | BSH | 256 | ")]
    for key, variant in (("kvcomp", "precise"), ("kvcomp_parity", "npu_parity")):
        p = res[f"{key}_phases"]
        steps = p["steps"]
        assert steps >= 1 and p["calls"] == {"forward": steps, "backward": steps}, p
        assert [ph["op"] for ph in p["phases"]] == ["forward"] * 6 + ["backward"] * 7, p
        assert all(ph["ms"] >= 0 for ph in p["phases"]) and p["step_ms"] > 0, p
        inside = sum(ph["ms"] for ph in p["phases"])
        assert 0 < inside <= p["step_ms"] and abs(inside + p["outside_ms"] - p["step_ms"]) < 1e-9, p
        fwd = sum(ph["ms"] for ph in p["phases"] if ph["op"] == "forward")
        prod = sum(ph["ms"] for ph in p["phases"] if ph["phase"].endswith("products"))
        (row,) = [line for line in lines if line.split("|")[4].strip() == variant]
        cells = [c.strip() for c in row.split("|")[5:10]]
        assert abs(float(cells[0]) - p["step_ms"]) <= 0.051 and abs(float(cells[1]) - fwd) <= 0.051, row
        assert abs(float(cells[3]) - prod) <= 0.051 and abs(float(cells[4]) - p["outside_ms"]) <= 0.051, row
    assert "kvcomp_phases" in json.loads(out_json.read_text())["results"][0]
    # Without --phases: no profile.
    results, _, text = _run_main(capsys, ["--no-compile", "--cases", "C4Li"])
    assert "kvcomp_phases" not in results[0] and "Where a kvcomp step" not in text
