"""Data parallel with torch.distributed (gloo, 2 processes on 127.0.0.1, launched here with a time
limit): DistributedDataParallel around kvcomp.torch.compressor, each rank on half of the batch. After
the all-reduce, the weight and ape gradients equal the single-process gradients of the full batch
(divided by 2: DDP averages)."""

import os
import socket
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import kvcomp

from dp_common import CompressorLayer, make_dp_case, shard_kwargs

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dp_worker.py")
TIMEOUT_S = 120


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="no gloo backend")
def test_gloo_two_process_data_parallel(tmp_path):
    out_file = tmp_path / "grads.pt"
    port = str(_free_port())
    # The workers import kvcomp from where this process found it.
    pythonpath = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(kvcomp.__file__)), os.environ.get("PYTHONPATH")])
    )
    env = dict(os.environ, PYTHONPATH=pythonpath, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(rank), "2", port, str(out_file)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=TIMEOUT_S)
            logs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)
    dp_grads = torch.load(out_file)

    case, weights = make_dp_case()
    model = CompressorLayer(case)
    out = model(case.x, case.state_cache.clone(), **shard_kwargs(case, 0, case.x.shape[0]))
    (out * weights).sum().backward()
    for name, p in model.named_parameters():
        assert torch.allclose(dp_grads[name], p.grad / 2, rtol=1e-5, atol=1e-6), name
