#!/usr/bin/env python3
"""Compare tensors saved from an NPU run of Compressor / CompressorGrad with kvcomp's results.

CASE_DIR holds one file per tensor, named after the operator parameters, each a torch.save file
(<name>.pt) or a numpy file (<name>.npy), plus meta.json, e.g. {"cmp_ratio": 4, "coff": 2,
"cache_mode": 1, "dtype": "bf16"}:

  inputs   x, wkv, wgate, [cu_seqlens], [seqused], [start_pos]
           forward: ape, state_cache (as it was BEFORE the call), state_block_table
           backward: d_cmp_kv, and softmax_score / kv (the NPU forward's intermediates)
  NPU out  forward: cmp_kv, [softmax_score], [kv], [state_cache_out] (the cache after the call)
           backward: d_x, d_wkv, d_wgate, d_ape

Whatever is present is checked: the forward if x, ape, state_cache, state_block_table and cmp_kv are
there, the backward if d_cmp_kv, softmax_score, kv and d_x are. bf16 tensors saved with numpy
(which has no bfloat16) may be stored as uint16/int16 bit patterns or as float32.

Report, per output (spec section 7):
  backward  three-way (7.2) with A = the NPU, B = kvcomp with precision "npu_parity" (d_new staged in
            the io dtype, as the NPU kernel does: the role of upstream's "same" golden), C = kvcomp
            "precise" (fp32 staging, float64 block math: the stand-in for the float64 truth, exact to
            fp32 before the io rounding). kvcomp runs on the NPU's own softmax_score / kv, so forward
            differences do not leak into the backward check. d_ape (fp32; both kvcomp modes compute
            it alike) is checked two-way (7.1) against C.
  forward   two-way (7.1) against kvcomp on valid rows (padding rows are unwritten on the NPU);
            the state cache two-way on the slots kvcomp wrote, exact elsewhere.

Exit status 0 when every check passes, 1 otherwise.

  python3 examples/python/compare_npu.py CASE_DIR
  python3 examples/python/compare_npu.py --self-test    # fabricates an "NPU run" and checks it
"""

import argparse
import json
import pathlib
import sys
import tempfile

import numpy as np
import torch

import kvcomp
from kvcomp.compare import report, three_way, two_way, valid_rows

IO = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_NAMES = ("state_block_table", "cu_seqlens", "seqused", "start_pos")
FP32_NAMES = ("state_cache", "state_cache_out", "ape", "softmax_score", "kv", "d_ape")


def load(case_dir, name, io_dtype):
    """The tensor `name` from CASE_DIR (.pt or .npy) as a CPU torch tensor of the operator's dtype,
    or None when absent."""
    for suffix in (".pt", ".npy"):
        path = case_dir / (name + suffix)
        if path.exists():
            break
    else:
        return None
    if path.suffix == ".pt":
        t = torch.load(path, map_location="cpu", weights_only=True)
    else:
        a = np.load(path)
        if io_dtype == torch.bfloat16 and a.dtype in (np.uint16, np.int16):
            t = torch.from_numpy(a.astype(np.int16, copy=False)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a))
    if name in INT_NAMES:
        return t.to(torch.int32).contiguous()
    return t.to(torch.float32 if name in FP32_NAMES else io_dtype).contiguous()


def check(case_dir):
    meta = json.loads((case_dir / "meta.json").read_text())
    io_key = meta.get("dtype", "bf16")
    io = IO[io_key]
    r, coff, cache_mode = (
        int(meta.get("cmp_ratio", 4)),
        int(meta.get("coff", 1)),
        int(meta.get("cache_mode", 1)),
    )
    t = {
        n: load(case_dir, n, io)
        for n in (
            "x",
            "wkv",
            "wgate",
            "cu_seqlens",
            "seqused",
            "start_pos",
            "ape",
            "state_cache",
            "state_block_table",
            "d_cmp_kv",
            "softmax_score",
            "kv",
            "cmp_kv",
            "state_cache_out",
            "d_x",
            "d_wkv",
            "d_wgate",
            "d_ape",
        )
    }
    seq = {n: t[n] for n in ("cu_seqlens", "seqused", "start_pos")}
    results = {}
    valid = valid_rows(tuple(t["x"].shape), r, **seq)

    if all(t[n] is not None for n in ("ape", "state_cache", "state_block_table", "cmp_kv")):
        cache = t["state_cache"].clone()
        cmp_kv, s, k = kvcomp.compressor_forward(
            t["x"],
            t["wkv"],
            t["wgate"],
            cache,
            t["ape"],
            r,
            state_block_table=t["state_block_table"],
            coff=coff,
            cache_mode=cache_mode,
            grad_enabled=True,
            **seq,
        )
        results["cmp_kv[valid]"] = two_way(t["cmp_kv"][valid], cmp_kv[valid], io_key)
        for n, mine in (("softmax_score", s), ("kv", k)):
            if t[n] is not None:
                results[f"{n}[valid]"] = two_way(t[n][valid], mine[valid], "fp32")
        if t["state_cache_out"] is not None:
            written = (cache != t["state_cache"]).any(dim=-1)
            results["state_cache written slots"] = two_way(
                t["state_cache_out"][written], cache[written], io_key
            )
            results["state_cache other slots"] = two_way(
                t["state_cache_out"][~written], cache[~written], "fp32", pct_thd=0.0, rtol=0.0, atol=0.0
            )

    if all(t[n] is not None for n in ("d_cmp_kv", "softmax_score", "kv", "d_x")):
        args = (t["x"], t["wkv"], t["wgate"], t["d_cmp_kv"], t["softmax_score"], t["kv"], r)
        truth = kvcomp.compressor_grad(*args, coff=coff, precision="precise", **seq)
        same = kvcomp.compressor_grad(*args, coff=coff, precision="npu_parity", **seq)
        for i, n in enumerate(("d_x", "d_wkv", "d_wgate")):
            if t[n] is not None:
                results[n] = three_way(t[n], same[i], truth[i], io_key)
        if t["d_ape"] is not None:
            results["d_ape"] = two_way(t["d_ape"], truth[3], "fp32")

    if not results:
        sys.exit(f"{case_dir}: found neither a forward nor a backward case (see --help)")
    shape = tuple(t["x"].shape)
    print(f"{case_dir}: cmp_ratio {r}, coff {coff}, cache_mode {cache_mode}, io {io_key}, x {shape}")
    print(report(results))
    return all(res.passed for res in results.values())


def fabricate(case_dir, corrupt=False):
    """A synthetic "NPU run": kvcomp's npu_parity results, with the padding rows of cmp_kv filled with
    garbage as the NPU leaves them, saved half as .pt and half as .npy (bf16 as uint16 bits)."""
    g = torch.Generator().manual_seed(0)
    B, S, H, D, r, coff, bs = 2, 13, 64, 16, 4, 2, 8
    C = coff * D
    x = torch.randn(B, S, H, generator=g).to(torch.bfloat16)
    wkv = (torch.randn(C, H, generator=g) / H**0.5).to(torch.bfloat16)
    wgate = (torch.randn(C, H, generator=g) / H**0.5).to(torch.bfloat16)
    ape = torch.randn(r, C, generator=g)
    start_pos = torch.tensor([5, 0], dtype=torch.int32)
    cols = -(-(5 + S) // bs)
    table = torch.arange(1, B * cols + 1, dtype=torch.int32).reshape(B, cols)
    cache = torch.randn(B * cols + 1, bs, 2 * C, generator=g)
    cache_out = cache.clone()
    cmp_kv, s, k = kvcomp.compressor_forward(
        x,
        wkv,
        wgate,
        cache_out,
        ape,
        r,
        state_block_table=table,
        start_pos=start_pos,
        coff=coff,
        grad_enabled=True,
    )
    cmp_kv[~torch.from_numpy(valid_rows(tuple(x.shape), r, start_pos=start_pos))] = 1e4
    d_cmp_kv = torch.randn(cmp_kv.shape, generator=g).to(torch.bfloat16)
    grads = kvcomp.compressor_grad(
        x, wkv, wgate, d_cmp_kv, s, k, r, start_pos=start_pos, coff=coff, precision="npu_parity"
    )
    if corrupt:  # an NPU backward that went wrong: a few d_x rows with 5% error
        grads[0][0, 1:4] *= 1.05
    tensors = dict(
        x=x,
        wkv=wkv,
        wgate=wgate,
        ape=ape,
        start_pos=start_pos,
        state_block_table=table,
        state_cache=cache,
        state_cache_out=cache_out,
        cmp_kv=cmp_kv,
        softmax_score=s,
        kv=k,
        d_cmp_kv=d_cmp_kv,
        **dict(zip(("d_x", "d_wkv", "d_wgate", "d_ape"), grads)),
    )
    for i, (name, value) in enumerate(tensors.items()):
        if i % 2:
            torch.save(value, case_dir / f"{name}.pt")
        else:
            a = value.view(torch.int16).numpy() if value.dtype == torch.bfloat16 else value.numpy()
            np.save(case_dir / f"{name}.npy", a)
    (case_dir / "meta.json").write_text(
        json.dumps({"cmp_ratio": r, "coff": coff, "cache_mode": 1, "dtype": "bf16"})
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("case_dir", nargs="?", type=pathlib.Path, help="folder with meta.json and the tensors")
    p.add_argument(
        "--self-test", action="store_true", help="fabricate an NPU run in a temporary folder and check it"
    )
    p.add_argument(
        "--corrupt", action="store_true", help="with --self-test: corrupt the fabricated d_x (must FAIL)"
    )
    a = p.parse_args()
    if a.self_test:
        with tempfile.TemporaryDirectory() as d:
            fabricate(pathlib.Path(d), corrupt=a.corrupt)
            ok = check(pathlib.Path(d))
    elif a.case_dir is None:
        p.error("give CASE_DIR or --self-test")
    else:
        ok = check(a.case_dir)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
