"""The model-level compressor's targets (docs/performance.md): the epilogue's cost inside kvcomp's
forward + backward, and kvcomp.nn's DeepSeek-V4 / V4.1 modules against eager torch models of the
models' compressors (the ones tests/python/test_models.py holds them to), one training step each
(forward + backward under autograd), ratios measured in one run.

    OMP_NUM_THREADS=2 python3 bench/models.py                  # H 4096, D 512, T 4096, bf16 x, fp32 weights
    python3 bench/models.py --tokens 1024 --hidden 1024 --repeat 2   # a quick look

Each figure is the median of --repeat timed steps after one warm-up; the CPU is printed first.
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import kvcomp
import kvcomp.nn
from kvcomp import _ops

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "python"))
from test_models import EagerV4, EagerV41, _freqs_cis  # noqa: E402  (the tests' eager models)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def timed(step, repeat):
    step()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def training_step(call, leaves, x, grad_out):
    def step():
        for t in leaves:
            t.grad = None
        out = call(x)
        out.backward(grad_out)

    return step


def epilogue_overhead(args, T, H, D, r, coff):
    """kvcomp's forward + backward of a C4A-like call, bare and with RMSNorm + RoPE (rd 64)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, T, H, generator=g).to(torch.bfloat16).requires_grad_()
    wkv = (torch.randn(coff * D, H, generator=g) / H**0.5).to(torch.bfloat16).requires_grad_()
    wgate = (torch.randn(coff * D, H, generator=g) / H**0.5).to(torch.bfloat16).requires_grad_()
    ape = torch.zeros(r, coff * D).requires_grad_()
    norm = torch.ones(D).requires_grad_()
    freqs = _freqs_cis(64, T)
    cos, sin = freqs.real.contiguous(), freqs.imag.contiguous()
    cache = torch.zeros(1, coff * r, 2 * coff * D)
    table = torch.zeros(1, -(-T // (coff * r)), dtype=torch.int32)
    d = torch.randn(1, T // r, D, generator=g).to(torch.bfloat16)

    def call(epilogue):
        kw = dict(norm_weight=norm, rope_cos=cos, rope_sin=sin) if epilogue else {}
        return lambda xs: _ops.model_compressor(xs, wkv, wgate, ape, r, state_cache=cache, state_block_table=table,
                                                coff=coff, **kw)

    leaves = [x, wkv, wgate, ape, norm]
    bare = training_step(call(False), leaves, x, d)
    fused = training_step(call(True), leaves, x, d)
    bare()  # warm-up
    fused()
    times = {bare: [], fused: []}
    for _ in range(args.repeat):  # interleaved, so drift hits both
        for step in (bare, fused):
            t0 = time.perf_counter()
            step()
            times[step].append(time.perf_counter() - t0)
    return statistics.median(times[bare]), statistics.median(times[fused])


def v4_step(args, T, H, D, r, rd):
    torch.manual_seed(1)
    ref = EagerV4(H, D, rd, r, max_batch_size=1)
    with torch.no_grad():
        for w in (ref.wkv.weight, ref.wgate.weight):
            w.copy_(w.to(torch.bfloat16).float())
    mod = kvcomp.nn.DeepseekV4Compressor(None, r, D, dim=H, rope_head_dim=rd, max_batch_size=1)
    mod.load_state_dict(ref.state_dict(), strict=True)
    ref.freqs_cis = mod.freqs_cis = _freqs_cis(rd, T)
    x = torch.randn(1, T, H).to(torch.bfloat16).requires_grad_()
    d = torch.randn(1, T // r, D).to(torch.bfloat16)
    t_ref = timed(training_step(lambda s: ref.rows(s), list(ref.parameters()) + [x], x, d), args.repeat)
    t_mod = timed(training_step(lambda s: mod.train_rows(s), list(mod.parameters()) + [x], x, d), args.repeat)
    return t_ref, t_mod


def v41_step(args, T, H, D, r):
    torch.manual_seed(2)
    ref = EagerV41(H, D, r)
    mod = kvcomp.nn.DeepseekV41Compressor(H, D, r)
    mod.load_state_dict(ref.state_dict(), strict=True)
    x = torch.randn(1, T, H).to(torch.bfloat16).requires_grad_()
    d = torch.randn(1, T // r, D).to(torch.bfloat16)
    t_ref = timed(training_step(lambda s: ref(s), list(ref.parameters()) + [x], x, d), args.repeat)
    t_mod = timed(training_step(lambda s: mod(s), list(mod.parameters()) + [x], x, d), args.repeat)
    # One projection product, forward and backward (d_x and d_w), in fp32 as kvcomp's fp32 products run
    # it on a CPU without bf16 units (torch's bf16 matmul there is far slower than its fp32 one).
    w = mod.wkv.weight.detach().float().requires_grad_()
    xf = x.detach().float().requires_grad_()
    d1 = torch.randn(1, T, D)
    t_proj = timed(training_step(lambda s: s @ w.t(), [w, xf], xf, d1), args.repeat)
    return t_ref, t_mod, t_proj


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--head-dim", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    kvcomp.set_default_options(num_threads=a.threads)
    T, H, D = a.tokens, a.hidden, a.head_dim
    print(f"CPU: {cpu_name()}; {a.threads} threads; T {T}, H {H}, D {D}; bf16 x; {kvcomp.product_kernels()}")
    rows = []
    t_bare, t_fused = epilogue_overhead(a, T, H, D, 4, 2)
    rows.append(("epilogue (RMSNorm + RoPE 64) in kvcomp's fwd + bwd, C4A", t_fused, t_bare, "<= 1.03"))
    t_ref, t_mod = v4_step(a, T, H, D, 4, 64)
    rows.append(("DeepseekV4Compressor ratio 4: kvcomp / the model's (fp32 projections)", t_mod, t_ref,
                 "<= 0.5 (bf16 units), <= 1.0 (none)"))
    t_ref, t_mod = v4_step(a, T, H, D, 128, 64)
    rows.append(("DeepseekV4Compressor ratio 128: kvcomp / the model's", t_mod, t_ref, "as above"))
    t_ref, t_mod, _ = v41_step(a, T, H, D, 2)
    rows.append(("DeepseekV41Compressor ratio 2: kvcomp / eager", t_mod, t_ref, "as above"))
    t_ref, t_mod, t_proj = v41_step(a, T, H, D, 1)
    rows.append(("DeepseekV41Compressor ratio 1: kvcomp / eager", t_mod, t_ref, "as above"))
    rows.append(("DeepseekV41Compressor ratio 1: kvcomp / one fp32 projection product", t_mod, t_proj, "<= 1.05"))
    print(f"{'what':<72} {'ms':>9} {'vs ms':>9} {'ratio':>6}  target")
    for what, t, base, target in rows:
        print(f"{what:<72} {1e3 * t:9.1f} {1e3 * base:9.1f} {t / base:6.2f}  {target}")


if __name__ == "__main__":
    main()
