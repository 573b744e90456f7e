"""Context-parallel overhead: kvcomp.distributed.cp_compressor forward + backward on each rank's part
of the sequences, against the single call forward + backward on the same number of tokens alone, both
timed in the same processes (gloo on 127.0.0.1, one thread per rank). Prints the ratio and the bytes
each rank sends. docs/distributed.md has the figures.

    python3 bench/cp_overhead.py [--world 2] [--tokens 16384] [--hidden 4096] [--preset C4A] [--reps 3]
                                 [--weights bf16|fp32]
"""

import argparse
import datetime
import os
import socket
import subprocess
import sys
import time

PRESETS = {"C4A": (512, 4, 2), "C4Li": (128, 4, 2), "C128A": (512, 128, 1)}


def worker(rank, args):
    import torch
    import torch.distributed as dist

    import kvcomp
    import kvcomp.distributed as kd
    import kvcomp.torch as kt

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=args.world,
                            timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    kvcomp.set_default_options(num_threads=1)
    D, r, coff = PRESETS[args.preset]
    H, n = args.hidden, args.tokens
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(1, n, H, generator=g).bfloat16()
    w_dt = torch.float32 if args.weights == "fp32" else torch.bfloat16  # fp32: master weights, cast inside
    wkv = (torch.randn(coff * D, H, generator=g) / H**0.5).bfloat16().to(w_dt)
    wgate = (torch.randn(coff * D, H, generator=g) / H**0.5).bfloat16().to(w_dt)
    ape = torch.randn(r, coff * D, generator=g)

    def local():
        xx, w1, w2, a = (t.clone().requires_grad_() for t in (x, wkv, wgate, ape))
        w1, w2 = w1.bfloat16(), w2.bfloat16()  # the single call takes io weights (a cast, as a module does)
        cache = torch.zeros(1, r, 2 * coff * D)
        table = torch.zeros(1, -(-n // r), dtype=torch.int32)
        out = kt.compressor(xx, w1, w2, cache, a, r, state_block_table=table, coff=coff)
        out.float().sum().backward()

    def cp():
        xx, w1, w2, a = (t.clone().requires_grad_() for t in (x, wkv, wgate, ape))
        out = kd.cp_compressor(xx, w1, w2, a, r, coff=coff, timeout=600)
        out.float().sum().backward()

    times = {"local": [], "cp": []}
    for _ in range(args.reps):
        for name, f in (("local", local), ("cp", cp)):
            dist.barrier()
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    lo, c = min(times["local"]), min(times["cp"])
    # A context-parallel step ends together on every rank (the blocks' exchange, the gradients'
    # all-reduce), so it cannot beat the slowest rank's own local call: compare with that too.
    slowest = torch.tensor([lo], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    slowest = float(slowest)
    halo = min(n, coff * r - 1) * H * 2 if rank + 1 < args.world else 0
    blocks = (coff if rank > 0 else 0) * (D + 2 * coff * r * D) * 4
    print(f"rank {rank}: local fwd+bwd {lo * 1e3:.0f} ms (slowest rank {slowest * 1e3:.0f} ms), context-parallel "
          f"{c * 1e3:.0f} ms, overhead {100 * (c / lo - 1):+.1f} % ({100 * (c / slowest - 1):+.1f} % of the "
          f"slowest), weights {args.weights}, sends at most {halo} B forward, {blocks} B backward", flush=True)
    dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--preset", default="C4A", choices=sorted(PRESETS))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--weights", default="bf16", choices=["bf16", "fp32"],
                   help="bf16 (weight_grads 'reduced') or fp32 master weights ('partial')")
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    if args.rank >= 0:
        return worker(args.rank, args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(k), "--port", str(port)] +
                              [a for a in sys.argv[1:]], env=env) for k in range(args.world)]
    rc = [pr.wait(timeout=3600) for pr in procs]
    sys.exit(max(rc))


if __name__ == "__main__":
    main()
