"""Data parallel with torch.distributed (gloo, 2 processes on 127.0.0.1, launched here with a time
limit): DistributedDataParallel around kvcomp.torch.compressor, each rank on half of the batch. After
the all-reduce, the weight and ape gradients equal the single-process gradients of the full batch
(divided by 2: DDP averages)."""

import os

import pytest
import torch
import torch.distributed as dist

from dp_common import CompressorLayer, make_dp_case, shard_kwargs
from spawn import free_port, run_workers

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_worker.py")
TIMEOUT_S = 120


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_gloo_two_process_data_parallel(tmp_path):
    out_file = tmp_path / "grads.pt"
    port = free_port()
    run_workers(WORKER, [[rank, 2, port, out_file] for rank in range(2)], TIMEOUT_S)
    dp_grads = torch.load(out_file)

    case, weights = make_dp_case()
    model = CompressorLayer(case)
    out = model(case.x, case.state_cache.clone(), **shard_kwargs(case, 0, case.x.shape[0]))
    (out * weights).sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(dp_grads[name], p.grad / 2, rtol=1e-5, atol=1e-6), name
