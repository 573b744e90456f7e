"""One rank of the context-parallel test (test_context_parallel.py): builds every case from its seed,
runs kvcomp.distributed.cp_compressor on this rank's tokens (forward, then backward under autograd),
and saves what it got; the test compares the ranks' results with the single-process call."""

import datetime
import json
import os
import sys

import torch
import torch.distributed as dist

import kvcomp.distributed as kd
import kvcomp.nn
from cp_common import epilogue_of, local_part, make_cp_case
from spawn import end_worker
from support import on_device


def main():
    rank, world, port, out_dir, cases_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
    device = os.environ.get("CP_TEST_DEVICE", "cpu")
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group("nccl" if device != "cpu" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.set_num_threads(1)
    with open(cases_file) as f:
        cases = json.load(f)
    results = {}
    for name, spec in cases.items():
        case = on_device(make_cp_case(spec), device)
        x_loc = local_part(case, spec, rank, world).clone().requires_grad_(spec.get("grad", True))
        params = [t.clone().requires_grad_(spec.get("grad", True)) for t in (case.wkv, case.wgate, case.ape)]
        norm_w, cos, sin = epilogue_of(case, spec)
        if spec.get("epilogue"):
            if spec["epilogue"].get("no_ape"):
                params[2] = None
            norm_w = norm_w.to(case.x.device).requires_grad_(spec.get("grad", True)) if norm_w is not None else None
            cos = cos.to(case.x.device) if cos is not None else None
            sin = sin.to(case.x.device) if sin is not None else None
        if spec.get("master"):  # fp32 master weights holding the case's bf16 weights exactly
            params[:2] = [t.detach().float().requires_grad_(spec.get("grad", True)) for t in params[:2]]
        kw = dict(split=spec["split"], cu_seqlens=case.cu_seqlens, seqused=case.seqused, start_pos=case.start_pos,
                  coff=case.coff, state_cache=case.state_cache if spec.get("cache", True) else None,
                  state_block_table=case.state_block_table if spec.get("cache", True) else None,
                  cache_mode=case.cache_mode, timeout=30, weight_grads=spec.get("weight_grads", "auto"))
        if spec.get("epilogue"):
            kw.update(norm_weight=norm_w, rope_cos=cos, rope_sin=sin)
        r = case.cmp_ratio
        if rank == 1 and spec.get("bad_r_on_rank1"):
            r = spec["bad_r_on_rank1"]
        if rank == 1 and spec.get("meta_ape_on_rank1"):
            params[2] = params[2].detach().to("meta")
        module = None
        if spec.get("module"):
            # kvcomp.nn.Compressor with fp32 masters holding the case's bf16 weights (exactly), maybe in DDP.
            module = kvcomp.nn.Compressor(case.x.shape[-1], case.wkv.shape[0] // case.coff, r, case.coff,
                                          cp_group=dist.group.WORLD, cp_split=spec["split"])
            with torch.no_grad():
                module.wkv.copy_(case.wkv.float())
                module.wgate.copy_(case.wgate.float())
                module.ape.copy_(case.ape)
            if spec.get("ddp"):
                module = torch.nn.parallel.DistributedDataParallel(module)
        if spec.get("module") == "v4":
            # kvcomp.nn.DeepseekV4Compressor's training rows with the case's weights (bf16 values in
            # fp32 parameters), its norm weight and its rope tables as freqs_cis.
            D = case.wkv.shape[0] // case.coff
            module = kvcomp.nn.DeepseekV4Compressor(None, case.cmp_ratio, D, dim=case.x.shape[-1],
                                                    rope_head_dim=2 * cos.shape[1], norm_eps=1e-6)
            with torch.no_grad():
                module.wkv.weight.copy_(case.wkv.float())
                module.wgate.weight.copy_(case.wgate.float())
                module.ape.copy_(case.ape)
                module.norm.weight.copy_(norm_w)
            module.freqs_cis = torch.complex(cos, sin)
        try:
            if spec.get("module") == "v4":
                out = module.train_rows(x_loc, case.cu_seqlens, cp_group=dist.group.WORLD, cp_split=spec["split"])
            elif module is not None:
                out = module(x_loc, cu_seqlens=case.cu_seqlens, seqused=case.seqused, start_pos=case.start_pos,
                             state_cache=kw["state_cache"], state_block_table=kw["state_block_table"],
                             cache_mode=case.cache_mode, timeout=30)
            else:
                out = kd.cp_compressor(x_loc, *params, r, **kw)
            owned = kd.cp_owned_blocks(x_loc, case.wkv, case.cmp_ratio, split=spec["split"],
                                       cu_seqlens=case.cu_seqlens, seqused=case.seqused,
                                       start_pos=case.start_pos, coff=case.coff, timeout=30)
            res = {"out": out.detach(), "owned": owned.cpu()}
            if spec.get("grad", True):
                g = torch.Generator().manual_seed(1000 + rank)
                w = torch.randn(out.shape, generator=g).to(out.dtype).to(out.device)
                res["upstream"] = w
                (out.float() * w.float()).sum().backward()
                if spec.get("module") == "v4":
                    res.update(d_x=x_loc.grad, d_wkv=module.wkv.weight.grad, d_wgate=module.wgate.weight.grad,
                               d_ape=module.ape.grad, d_norm_weight=module.norm.weight.grad)
                elif module is not None:
                    # Without DDP each rank has its partial sums; DDP leaves total / world on every
                    # rank. Either way the test sums what the ranks report.
                    m = module.module if spec.get("ddp") else module
                    params = [p.grad for p in (m.wkv, m.wgate, m.ape)]
                    res.update(d_x=x_loc.grad, d_wkv=params[0], d_wgate=params[1], d_ape=params[2])
                else:
                    res.update(d_x=x_loc.grad, d_wkv=params[0].grad, d_wgate=params[1].grad,
                               d_ape=params[2].grad if params[2] is not None else None)
                    if norm_w is not None:
                        res["d_norm_weight"] = norm_w.grad
        except Exception as e:  # the test checks the sentence
            res = {"error": f"{type(e).__name__}: {e}"}
        results[name] = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in res.items()}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    end_worker()


if __name__ == "__main__":
    main()
