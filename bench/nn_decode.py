"""Decode steps through kvcomp.nn.Compressor under torch.no_grad(): the module keeping its cast and
prepared weights between calls (the default) against casting and preparing them on every call
(forget_prepared_weights() before each), in one process. One sequence token per call, every sequence
closing a block, paged cache; fp32 parameters as the module holds them, bf16 (or fp16) io.
docs/performance.md has the figures.

    python3 bench/nn_decode.py [--hidden 4096] [--batches 1 64] [--threads 2] [--repeat 10] [--io fp16]
"""

import argparse
import time

import torch

import kvcomp
import kvcomp.nn

PRESETS = {"C4A": (512, 4), "C4Li": (128, 4), "C128A": (512, 128)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--presets", nargs="+", default=["C4A", "C128A"], choices=sorted(PRESETS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--io", default="bf16", choices=["bf16", "fp16"], help="dtype of x (and so of the call)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    kvcomp.set_default_options(num_threads=a.threads)
    print(f"kvcomp {kvcomp.__version__}, products {kvcomp.product_kernels()}, {a.threads} threads, "
          f"H={a.hidden}, {a.io} io, best of {a.repeat}")
    io = torch.bfloat16 if a.io == "bf16" else torch.float16
    for name in a.presets:
        D, r = PRESETS[name]
        torch.manual_seed(0)
        m = kvcomp.nn.Compressor(a.hidden, D, r)
        for B in a.batches:
            x = torch.randn(B, 1, a.hidden).to(io)
            bs = 128
            cols = (1024 + r) // bs + 1
            cache = torch.zeros(B * cols + 1, bs, 2 * m.coff * D)
            table = torch.arange(1, B * cols + 1, dtype=torch.int32).reshape(B, cols)
            sp = torch.full((B,), 1024 + r - 1, dtype=torch.int32)  # the token closes a block

            def call():
                with torch.no_grad():
                    return m(x, state_cache=cache, state_block_table=table, start_pos=sp)

            best = {}
            for mode in ("per call", "kept"):
                times = []
                for _ in range(a.repeat + 2):
                    if mode == "per call":
                        m.forget_prepared_weights()
                    t = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - t)
                best[mode] = min(times[2:]) * 1e3
            print(f"{name:6s} B={B:<4d} cast + prepare per call {best['per call']:8.3f} ms   kept {best['kept']:8.3f} ms"
                  f"   ({best['per call'] / best['kept']:.1f}x)")


if __name__ == "__main__":
    main()
