"""One rank of test_distributed.py: DistributedDataParallel over gloo on 127.0.0.1, each rank
running kvcomp.torch.compressor on its half of the batch. Rank 0 saves the all-reduced gradients.

Usage: dp_worker.py RANK WORLD_SIZE PORT OUT_FILE
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from dp_common import CompressorLayer, make_dp_case, shard_kwargs  # noqa: E402
from spawn import end_worker  # noqa: E402


def main():
    rank, world, port, out_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    case, weights = make_dp_case()
    model = torch.nn.parallel.DistributedDataParallel(CompressorLayer(case))
    per_rank = case.x.shape[0] // world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out = model(case.x[lo:hi], case.state_cache.clone(), **shard_kwargs(case, lo, hi))
    (out * weights[lo:hi]).sum().backward()  # DDP all-reduces (averages) the gradients here
    if rank == 0:
        torch.save({n: p.grad for n, p in model.module.named_parameters()}, out_file)
    end_worker()


if __name__ == "__main__":
    main()
