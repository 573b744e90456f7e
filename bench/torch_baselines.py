#!/usr/bin/env python3
"""PyTorch baselines of the Compressor operator: the anchor table of issue 12, with one command.

    python3 bench/torch_baselines.py                      # cuda if available, else cpu
    python3 bench/torch_baselines.py --tokens 16384 65536 --th 64 --json baselines.json

Per case (C4A, C4Li, C128A) and token count it times, in the same process run:

* products fwd: the operator's own matrix products alone, x @ [Wkv; Wgate]^T (one matmul with the
  concatenated weight, [T, H] x [H, 2C]);
* products bwd: dNew @ [Wkv; Wgate] ([T, 2C] x [2C, H]) and dNew^T @ x ([2C, T] x [T, H]);
* eager fwd+bwd: autograd through ``vectorised_forward`` (below), forward and backward together
  (``torch.autograd.grad`` with a fixed random upstream gradient, so nothing accumulates);
* compiled fwd+bwd: the same with ``vectorised_forward`` under torch.compile (inductor), timed after
  its compile warm-up; reported as n/a, with the reason, when torch.compile is missing or fails;
* kvcomp fwd+bwd: ``kvcomp.torch.compressor`` on the same inputs, where ``import kvcomp.torch`` works
  and kvcomp runs on the device (cpu; cuda when ``kvcomp.has_cuda_backend()`` says this build has
  the CUDA backend), in the precise mode and, for 16-bit io, again in npu_parity mode;
* eager fp32 fwd+bwd (16-bit io): the eager autograd again on fp32 copies of the inputs, the precise
  mode's precision peer. On a CPU the "peers" table then compares kvcomp npu_parity with the eager
  16-bit autograd and kvcomp precise with the eager fp32 one (issue 17's end-to-end targets).

With ``--phases`` (CPU), each kvcomp variant then runs ``--repeat`` more steps with kvcomp's phase clock
on (``kvcomp.set_phase_timing``), and a table shows where a step's time goes: the operators' phases
(forward and backward calls) and the rest of the step outside them (autograd, allocation of the
outputs and gradients, the Python layer, the calls' validation). Those steps run back to back, not in
rounds with the other variants, so their mean can differ from the timed one (the allocator reuses
the previous step's memory).

Each time is the mean over ``--repeat`` runs after ``--warmup`` runs: CUDA events on cuda,
``time.perf_counter`` after a synchronize elsewhere. On a CPU the variants of a case are timed in
rounds (each round runs every variant once, in turn), so that a noisy stretch of a shared machine
slows every side of a ratio alike; on a GPU each variant's runs are timed back to back, between two
events. Before timing a case, each variant's output is
checked for shape and finiteness (the agreement of ``vectorised_forward`` with the independent
per-batch small-ops implementation of the tests is checked by tests/python/test_baselines.py).

The benchmark setting is the issue's: start_pos 0 and no cache rows. ``vectorised_forward`` therefore
neither reads nor writes the state cache (the state-cache write that the operator also performs is
omitted: it moves at most a few rows per sequence), handles no seqused, and takes either BSH
[B, S, H] with S a multiple of r, or TH with equal-length sequences (``num_seqs`` of them, each a
multiple of r long). Within that setting it computes the operator's full output, padding rows
included. kvcomp is given the minimal valid cache: cache_mode 1 (paged), block_size 1024, one fp32
state block, and a block table of zeros (id 0 = do not write), so it reads and writes no cache row
either.
"""

import argparse
import json
import platform
import subprocess
import sys
import time

import torch

# name: (cmp_ratio r, coff, head dim D), as in kvcomp bench and the table.
CASES = {
    "C4A": (4, 2, 512),
    "C4Li": (4, 2, 128),
    "C128A": (128, 1, 512),
}


def vectorised_forward(x, wkv, wgate, ape, cmp_ratio, coff, num_seqs=None):
    """Compressor forward for start_pos 0 and no cache rows, all blocks of all sequences at once.

    x: io dtype, BSH [B, S, H] (S a multiple of r) or TH [T, H] holding ``num_seqs`` sequences of
    T / num_seqs tokens each (a multiple of r). wkv, wgate: [C, H] with C = coff * D (cast to x's
    dtype); ape: [r, C] (usually fp32). Differentiable wrt x, wkv, wgate and ape.

    The projection runs in x's dtype (one matmul with the concatenated weight, as the products
    timed beside it); the score bias, block softmax and pooling run in float32 (float64 when x is
    float64). Returns cmp_kv in x's dtype: BSH [B, S/r, D]; TH [min(T, T//r + num_seqs), D] with the
    rows past the compressed blocks zero (spec 1.7).
    """
    r = cmp_ratio
    H = x.shape[-1]
    C = wkv.shape[0]
    if coff not in (1, 2) or C % coff:
        raise ValueError(f"coff = {coff} with C = {C}: need coff in (1, 2) dividing C")
    D = C // coff
    if x.dim() == 3:
        N, L = x.shape[0], x.shape[1]
    elif x.dim() == 2:
        if num_seqs is None or num_seqs < 1 or x.shape[0] % num_seqs:
            raise ValueError(f"TH x [{x.shape[0]}, H] needs num_seqs >= 1 dividing T, got {num_seqs}")
        N, L = num_seqs, x.shape[0] // num_seqs
    else:
        raise ValueError(f"x must be [B, S, H] or [T, H], got {tuple(x.shape)}")
    if L % r:
        raise ValueError(f"sequence length {L} is not a multiple of cmp_ratio {r}")
    nb = L // r
    cdt = torch.promote_types(x.dtype, torch.float32)

    w = torch.cat([wkv, wgate]).to(x.dtype)  # [2C, H]
    proj = (x.reshape(-1, H) @ w.t()).to(cdt).view(N, nb, r, 2 * C)  # spec 1.1
    kv = proj[..., :C]
    score = proj[..., C:] + ape.to(cdt)  # spec 1.2: pos % r is the row within its block
    if coff == 1:
        K, Z = kv, score  # [N, nb, r, D]
    else:
        # Column half [0, D) of a block's rows belongs to the *next* block ("prev" rows there): shift
        # the blocks by one; the first block of each sequence gets placeholder rows (kv 0, score
        # -inf, so softmax weight exactly 0). Rows interleave (prev t, cur t), spec 1.5.
        def prev_half(t, fill):
            pad = t.new_full((N, 1, r, D), fill)
            return torch.cat([pad, t[:, :-1, :, :D]], dim=1)

        K = torch.stack([prev_half(kv, 0.0), kv[..., D:]], dim=3).view(N, nb, 2 * r, D)
        Z = torch.stack([prev_half(score, float("-inf")), score[..., D:]], dim=3).view(N, nb, 2 * r, D)
    out = (torch.softmax(Z, dim=2) * K).sum(dim=2).to(x.dtype)  # spec 1.6: per column over rows
    if x.dim() == 3:
        return out
    T = x.shape[0]
    rows = min(T, T // r + N)
    out = out.reshape(N * nb, D)
    return torch.cat([out, out.new_zeros((rows - N * nb, D))])


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device, warmup, repeat):
    """Mean milliseconds of fn() over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    _sync(device)
    return (time.perf_counter() - t0) * 1e3 / repeat


def time_all_ms(fns, device, warmup, repeat, failed):
    """Mean milliseconds of each fn of the dict `fns` (key -> fn). On a GPU each is timed on its own
    (time_ms). Elsewhere, after `warmup` rounds, `repeat` timed rounds each run every fn once, in
    turn. A fn that raises is dropped: failed(key, exception) is called and its time is None."""
    times = dict.fromkeys(fns)
    if device.type == "cuda":
        for key, fn in fns.items():
            try:
                times[key] = time_ms(fn, device, warmup, repeat)
            except Exception as e:  # noqa: BLE001 -- reported by the caller, not fatal
                failed(key, e)
        return times
    live = dict(fns)
    total = dict.fromkeys(fns, 0.0)
    for i in range(warmup + repeat):
        for key, fn in list(live.items()):
            t0 = time.perf_counter()
            try:
                fn()
            except Exception as e:  # noqa: BLE001 -- reported by the caller, not fatal
                failed(key, e)
                del live[key]
                continue
            if i >= warmup:
                total[key] += time.perf_counter() - t0
    for key in live:
        times[key] = total[key] * 1e3 / repeat
    return times


def phase_profile(step, repeat):
    """Where a kvcomp step's time goes: `repeat` more steps with kvcomp's phase clock on. Returns the mean
    step time, each operator phase's mean per step (op, phase, ms) in call order, and the rest of the
    step outside the phases (autograd, allocations, the Python layer, validation)."""
    import kvcomp

    kvcomp.reset_phase_times()
    kvcomp.set_phase_timing(True)
    wall = 0.0
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            out, grads = step()
            wall += time.perf_counter() - t0
            del out, grads
    finally:
        kvcomp.set_phase_timing(False)
    totals = kvcomp.phase_times()
    phases = [{"op": p["op"], "phase": p["phase"], "ms": p["seconds"] * 1e3 / repeat} for p in totals]
    calls = {p["op"]: p["calls"] for p in totals}
    step_ms = wall * 1e3 / repeat
    return {"steps": repeat, "calls": calls, "step_ms": step_ms, "phases": phases,
            "outside_ms": step_ms - sum(p["ms"] for p in phases)}


def _kvcomp_status(device):
    """(module or None, note): kvcomp.torch where it can run on `device`."""
    try:
        import kvcomp
        import kvcomp.torch as kt
    except Exception as e:  # noqa: BLE001 -- not built, not on the path, built for another torch
        return None, f"kvcomp: n/a (import failed: {type(e).__name__}: {e})"
    if device.type == "cpu":
        return kt, None
    has_cuda = getattr(kvcomp, "has_cuda_backend", None)
    if device.type == "cuda" and has_cuda is not None and has_cuda():
        return kt, None
    if device.type == "cuda":
        return None, "kvcomp: n/a (this build of kvcomp has no CUDA backend)"
    return None, f"kvcomp: n/a (device {device.type} not supported)"


def _check(name, out, shape):
    if tuple(out.shape) != tuple(shape):
        raise AssertionError(f"{name}: cmp_kv shape {tuple(out.shape)}, expected {tuple(shape)}")
    if not bool(torch.isfinite(out).all()):
        raise AssertionError(f"{name}: cmp_kv has non-finite values")


def _check_grads(name, grads):
    for g, n in zip(grads, ("x", "wkv", "wgate", "ape")):
        if g is None or not bool(torch.isfinite(g).all()):
            raise AssertionError(f"{name}: gradient of {n} missing or non-finite")


def run_case(name, T, num_seqs, args, device, dtype, kt, notes):
    """Times one case; returns its result dict (times in ms, None for a variant not run)."""
    r, coff, D = CASES[name]
    D = args.head_dim or D
    H, C = args.hidden, coff * D
    th = num_seqs is not None
    layout = f"TH/{num_seqs}" if th else "BSH"
    label = f"{name} {layout} T={T}"
    L = T // num_seqs if th else T
    if (th and T % num_seqs) or L % r:
        notes.append(f"{label}: skipped (sequence length {T}/{num_seqs if th else 1} not a multiple of r={r})")
        return None

    gen = torch.Generator(device=device).manual_seed(1234)
    x = torch.randn((T, H) if th else (1, T, H), generator=gen, device=device).to(dtype)
    wkv = (torch.randn(C, H, generator=gen, device=device) / H**0.5).to(dtype)
    wgate = (torch.randn(C, H, generator=gen, device=device) / H**0.5).to(dtype)
    ape = 0.5 * torch.randn(r, C, generator=gen, device=device)
    leaves = [t.requires_grad_() for t in (x, wkv, wgate, ape)]
    out_shape = (min(T, T // r + num_seqs), D) if th else (1, T // r, D)
    g = torch.randn(out_shape, generator=gen, device=device).to(dtype)

    res = {"case": name, "layout": layout, "T": T, "H": H, "D": D, "r": r, "coff": coff}
    res["dtype"] = str(dtype).replace("torch.", "")
    w_cat = torch.cat([wkv, wgate]).detach()
    x2 = x.detach().reshape(T, H)
    d_new = torch.randn(T, 2 * C, generator=gen, device=device).to(dtype)
    timed = {}  # key -> fn, every variant that passed its checks, timed together at the end
    timed["products_fwd"] = lambda: x2 @ w_cat.t()

    def products_bwd():
        d_new @ w_cat
        d_new.t() @ x2

    timed["products_bwd"] = products_bwd

    def step_of(fwd):
        def step():
            out = fwd(x, wkv, wgate, ape, r, coff, num_seqs)
            return out, torch.autograd.grad(out, leaves, g)

        return step

    eager = step_of(vectorised_forward)
    out, grads = eager()
    _check(f"{label} eager", out, out_shape)
    _check_grads(f"{label} eager", grads)
    ref = out.detach().float()
    del out, grads
    timed["eager"] = eager
    if dtype != torch.float32 and not args.no_fp32_peer:
        leaves32 = [t.detach().float().requires_grad_() for t in (x, wkv, wgate, ape)]
        g32 = g.float()

        def eager32():
            out = vectorised_forward(*leaves32[:3], leaves32[3], r, coff, num_seqs)
            return out, torch.autograd.grad(out, leaves32, g32)

        out32, _ = eager32()
        _check(f"{label} eager fp32", out32, out_shape)
        del out32
        timed["eager_fp32"] = eager32

    def note_failure(key, e):
        first = (str(e).strip().splitlines() or [""])[0]
        notes.append(f"{label}: {key} n/a ({type(e).__name__}: {first[:200]})")

    def measure(key, step):
        """Checks a variant's output and gradients and compares it with eager; then it is timed with
        the others. A failure (inductor without a toolchain, a call kvcomp rejects, ...) is a note;
        the run goes on."""
        try:
            out, grads = step()
            _check(f"{label} {key}", out, out_shape)
            _check_grads(f"{label} {key}", grads)
            res[f"{key}_max_abs_diff_vs_eager"] = float((out.detach().float() - ref).abs().max())
            del out, grads
            timed[key] = step
        except Exception as e:  # noqa: BLE001 -- reported, not fatal
            note_failure(key, e)

    if args.no_compile:
        pass
    elif not hasattr(torch, "compile"):
        notes.append(f"{label}: compiled n/a (torch.compile unavailable in torch {torch.__version__})")
    else:
        torch._dynamo.reset()  # one graph per case: never hit the recompile limit
        measure("compiled", step_of(torch.compile(vectorised_forward, backend="inductor", dynamic=False)))

    if kt is not None:
        # Minimal valid paged cache (see the module docstring): nothing is read or written.
        bs = 1024
        state = torch.zeros(1, bs, 2 * C, dtype=torch.float32, device=device)
        table = torch.zeros((num_seqs if th else 1, -(-L // bs)), dtype=torch.int32, device=device)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=device) if th else None

        def kvcomp_fwd(x, wkv, wgate, ape, r, coff, num_seqs):
            return kt.compressor(
                x, wkv, wgate, state, ape, r, state_block_table=table, cu_seqlens=cu, coff=coff, cache_mode=1
            )

        measure("kvcomp", step_of(kvcomp_fwd))
        if dtype != torch.float32:
            import kvcomp

            def in_parity(step):
                def run():
                    previous = kvcomp.set_default_options(precision="npu_parity")
                    try:
                        return step()
                    finally:
                        kvcomp.set_default_options(**previous)

                return run

            measure("kvcomp_parity", in_parity(step_of(kvcomp_fwd)))

    times = time_all_ms(timed, device, args.warmup, args.repeat, note_failure)
    if getattr(args, "phases", False) and device.type == "cpu":
        for key in ("kvcomp", "kvcomp_parity"):
            if times.get(key) is not None:
                res[f"{key}_phases"] = phase_profile(timed[key], args.repeat)
    for key in ("products_fwd", "products_bwd"):
        if times[key] is None:
            raise RuntimeError(f"{label}: the products alone failed")
    for key in ("products_fwd", "products_bwd", "eager", "eager_fp32", "compiled", "kvcomp", "kvcomp_parity"):
        res[f"{key}_ms"] = times.get(key)
    res["products_tflops"] = 3 * 2 * T * H * 2 * C / ((res["products_fwd_ms"] + res["products_bwd_ms"]) * 1e9)
    prod = res["products_fwd_ms"] + res["products_bwd_ms"]
    for k in ("eager", "compiled", "kvcomp"):
        res[f"{k}_over_products"] = None if res[f"{k}_ms"] is None else res[f"{k}_ms"] / prod
    return res


def kt_products():
    """What kvcomp's products run on (kvcomp.product_kernels(); CPU), or n/a."""
    try:
        import kvcomp

        return kvcomp.product_kernels()
    except Exception:  # noqa: BLE001 -- informative only
        return "n/a"


def _fmt(v, ratio=False):
    if v is None:
        return "n/a"
    if ratio:
        return f"{v:.2f}"
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def environment(device):
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": str(device),
        "cuda": torch.version.cuda,
    }
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        try:  # the driver version is not exposed by torch
            q = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", f"--id={device.index}"]
            env["driver"] = subprocess.run(q, check=False, capture_output=True, text=True, timeout=30).stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["device_name"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--hidden", type=int, default=4096, help="H (default 4096)")
    p.add_argument("--head-dim", type=int, default=0, help="override every case's D (0: the case's own)")
    p.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="token counts T")
    p.add_argument("--th", type=int, default=0, help="also a TH case of N equal sequences per T")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    p.add_argument("--no-fp32-peer", action="store_true", help="skip the eager fp32 variant of 16-bit io")
    p.add_argument("--phases", action="store_true",
                   help="CPU: where each kvcomp step's time goes (kvcomp's phase clock, --repeat more steps)")
    p.add_argument("--json", help="also write the results to this file")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    env = environment(device)
    print(
        f"torch {env['torch']}, CUDA {env['cuda'] or 'n/a'}"
        + (f", driver {env['driver']}" if env.get("driver") else "")
        + f", device {env['device']} ({env['device_name']})"
        + (f", {env['threads']} threads" if "threads" in env else "")
        + f"; {args.dtype} io, H = {args.hidden}, start_pos 0, no cache rows; mean of {args.repeat} runs"
        f" after {args.warmup} warm-up" + ("" if device.type == "cuda" else ", the variants of a case in rounds")
    )
    kt, note = _kvcomp_status(device)
    notes = [note] if note else []

    results = []
    for name in args.cases:
        for T in args.tokens:
            for num_seqs in [None] + ([args.th] if args.th else []):
                res = run_case(name, T, num_seqs, args, device, dtype, kt, notes)
                if res is not None:
                    results.append(res)
                if device.type == "cuda":
                    torch.cuda.empty_cache()

    print()
    print(
        "| case | layout | T | products fwd ms | products bwd ms | products TFLOP/s | eager fwd+bwd ms"
        " | compiled fwd+bwd ms | kvcomp fwd+bwd ms | eager / products | compiled / products |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['case']} | {r['layout']} | {r['T']} | {_fmt(r['products_fwd_ms'])} | {_fmt(r['products_bwd_ms'])}"
            f" | {r['products_tflops']:.3g} | {_fmt(r['eager_ms'])} | {_fmt(r['compiled_ms'])} | {_fmt(r['kvcomp_ms'])}"
            f" | {_fmt(r['eager_over_products'], True)} | {_fmt(r['compiled_over_products'], True)} |"
        )
    peers = [r for r in results if r.get("kvcomp_ms") is not None and r.get("eager_fp32_ms") is not None]
    if peers:
        kinds = kt_products()
        print()
        print(f"Peers (kvcomp products: {kinds}): kvcomp npu_parity against the eager {args.dtype} autograd,"
              " kvcomp precise against the eager fp32 autograd (speed-ups > 1: kvcomp faster)")
        print()
        print(
            f"| case | layout | T | eager {args.dtype} ms | kvcomp npu_parity ms | speed-up | eager fp32 ms"
            " | kvcomp precise ms | speed-up |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in peers:
            par = r.get("kvcomp_parity_ms")
            print(
                f"| {r['case']} | {r['layout']} | {r['T']} | {_fmt(r['eager_ms'])} | {_fmt(par)}"
                f" | {_fmt(None if par is None else r['eager_ms'] / par, True)} | {_fmt(r['eager_fp32_ms'])}"
                f" | {_fmt(r['kvcomp_ms'])} | {_fmt(r['eager_fp32_ms'] / r['kvcomp_ms'], True)} |"
            )
    profiled = [(r, key) for r in results for key in ("kvcomp", "kvcomp_parity") if r.get(f"{key}_phases")]
    if profiled:
        print()
        print("Where a kvcomp step's time goes (--phases: kvcomp's phase clock, the mean of"
              f" {args.repeat} more steps; outside: autograd, allocations, Python, validation)")
        print()
        print("| case | layout | T | variant | step ms | forward ms | backward ms | products ms | outside ms |")
        print("|---|---|---:|---|---:|---:|---:|---:|---:|")
        for r, key in profiled:
            p = r[f"{key}_phases"]
            fwd = sum(ph["ms"] for ph in p["phases"] if ph["op"] == "forward")
            bwd = sum(ph["ms"] for ph in p["phases"] if ph["op"] == "backward")
            prod = sum(ph["ms"] for ph in p["phases"] if ph["phase"].endswith("products"))
            variant = "npu_parity" if key == "kvcomp_parity" else "precise"
            print(f"| {r['case']} | {r['layout']} | {r['T']} | {variant} | {p['step_ms']:.1f} | {fwd:.1f} | {bwd:.1f}"
                  f" | {prod:.1f} | {p['outside_ms']:.1f} |")
    for n in notes:
        print(n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "args": vars(args), "results": results, "notes": notes}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
    sys.exit(0)
