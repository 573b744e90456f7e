"""Bad inputs through the Python front door end in kvcomp.KvcompError, never in a crash.

On the GPU machine (Ubuntu 24.04, g++ 13, Python 3.12.3, torch 2.11.0+cu130) the interpreter once died
with SIGSEGV inside kvcomp._C.forward during test_functional.py::test_rejections, which took the rest
of the file with it and did not say which input did it. Here every bad call runs in a child
interpreter that reports each case as it finishes; a child killed by a signal fails the test with the
name of the case it was running, and the remaining cases still run (a fresh child per crash).

Each case asserts the status code and a fragment of the sentence, and that the state cache (the one
input the forward writes) is unchanged.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# Run in the child: a registry of named bad calls, each a function returning (expected code, needle,
# callable). Kept as source text so that the child imports nothing from pytest.
CHILD = r'''
import json, sys
import numpy as np
import torch
import kvcomp
from support import make_case

def forward_case(mutate, kind="torch"):
    case = make_case(lens=[8], r=4, start_pos=[0], seed=7)
    a = dict(x=case.x, wkv=case.wkv, wgate=case.wgate, state_cache=case.state_cache.clone(), ape=case.ape,
             **case.kwargs())
    if kind == "numpy":
        a = {k: (v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in a.items()}
    mutate(a)
    cache = a["state_cache"]
    before = cache.clone() if isinstance(cache, torch.Tensor) else np.array(cache, copy=True)
    def call():
        try:
            kvcomp.compressor_forward(a.pop("x"), a.pop("wkv"), a.pop("wgate"), a.pop("state_cache"),
                                      a.pop("ape"), a.pop("cmp_ratio", 4), **a)
        finally:
            same = (torch.equal(cache, before) if isinstance(cache, torch.Tensor)
                    else np.array_equal(cache, before, equal_nan=True))
            if not same:
                raise AssertionError("the state cache changed")
    return call

def backward_case(mutate):
    case = make_case(lens=[8], r=4, seed=8)
    cmp_kv, s, k = kvcomp.compressor_forward(case.x, case.wkv, case.wgate, case.state_cache.clone(),
                                             case.ape, 4, grad_enabled=True, **case.kwargs())
    a = dict(x=case.x, wkv=case.wkv, wgate=case.wgate, d_cmp_kv=cmp_kv, softmax_score=s, kv=k)
    mutate(a)
    return lambda: kvcomp.compressor_grad(a.pop("x"), a.pop("wkv"), a.pop("wgate"), a.pop("d_cmp_kv"),
                                          a.pop("softmax_score"), a.pop("kv"), a.pop("cmp_ratio", 4), **a)

t32 = lambda v: torch.tensor(v, dtype=torch.int32)
CASES = {
    "fwd.wkv_width": (561002, "wkv", forward_case(lambda a: a.update(wkv=a["wkv"][:, :-1].contiguous()))),
    "fwd.x_float64": (161002, "x", forward_case(lambda a: a.update(x=a["x"].double()))),
    "fwd.x_int64": (161002, "x", forward_case(lambda a: a.update(x=a["x"].long()))),
    "fwd.x_bool": (161002, "x", forward_case(lambda a: a.update(x=a["x"] > 0))),
    "fwd.x_complex": (161002, "x", forward_case(lambda a: a.update(x=a["x"].to(torch.complex64)))),
    "fwd.x_meta": (161002, "CPU", forward_case(lambda a: a.update(x=a["x"].to("meta")))),
    "fwd.x_rank4": (161002, "x", forward_case(lambda a: a.update(x=a["x"][None]))),
    "fwd.x_rank0": (161002, "x", forward_case(lambda a: a.update(x=a["x"][0, 0, 0]))),
    # Made contiguous by the Python layer (inputs are copied when they must be), so H and S trade places.
    "fwd.x_transposed": (561002, "shape", forward_case(lambda a: a.update(x=a["x"].transpose(1, 2)))),
    "fwd.no_block_table": (161001, "state_block_table", forward_case(lambda a: a.update(state_block_table=None))),
    "fwd.start_pos_negative": (161002, "start_pos", forward_case(lambda a: a.update(start_pos=t32([-1])))),
    "fwd.start_pos_int64": (161002, "start_pos", forward_case(lambda a: a.update(start_pos=torch.tensor([1])))),
    "fwd.start_pos_float": (161002, "start_pos", forward_case(lambda a: a.update(start_pos=torch.tensor([1.0])))),
    "fwd.start_pos_2d": (161002, "start_pos", forward_case(lambda a: a.update(start_pos=t32([[0]])))),
    "fwd.start_pos_too_long": (561002, "start_pos", forward_case(lambda a: a.update(start_pos=t32([0, 0, 0])))),
    "fwd.block_table_out_of_range": (161002, "state_block_table",
                                     forward_case(lambda a: a.update(state_block_table=a["state_block_table"] + 1000))),
    "fwd.block_table_negative": (161002, "state_block_table",
                                 forward_case(lambda a: a.update(state_block_table=a["state_block_table"] - 1000))),
    "fwd.coff_3": (161002, "coff", forward_case(lambda a: a.update(coff=3))),
    "fwd.coff_0": (161002, "coff", forward_case(lambda a: a.update(coff=0))),
    "fwd.cmp_ratio_0": (161002, "cmp_ratio", forward_case(lambda a: a.update(cmp_ratio=0))),
    "fwd.cmp_ratio_negative": (161002, "cmp_ratio", forward_case(lambda a: a.update(cmp_ratio=-4))),
    "fwd.cmp_ratio_huge": (161002, "cmp_ratio", forward_case(lambda a: a.update(cmp_ratio=1 << 40))),
    "fwd.cache_mode_3": (161002, "cache_mode", forward_case(lambda a: a.update(cache_mode=3))),
    "fwd.cache_transposed": (161002, "state_cache",
                             forward_case(lambda a: a.update(state_cache=a["state_cache"].transpose(1, 2)))),
    "fwd.cache_bf16": (161002, "state_cache",
                       forward_case(lambda a: a.update(state_cache=a["state_cache"].to(torch.bfloat16)))),
    "fwd.ape_wrong_rows": (561002, "ape", forward_case(lambda a: a.update(ape=a["ape"][:1].contiguous()))),
    "fwd.cu_seqlens_with_bsh": (161002, "cu_seqlens", forward_case(lambda a: a.update(cu_seqlens=t32([0, 8])))),
    "fwd.profile_bad": (161002, "profile", forward_case(lambda a: a.update(profile="npu"))),
    "fwd.num_threads_negative": (161002, "num_threads", forward_case(lambda a: a.update(num_threads=-1))),
    "fwd.numpy_float64": (161002, "x", forward_case(lambda a: a.update(x=a["x"].astype(np.float64)), "numpy")),
    "fwd.numpy_int8": (161002, "x", forward_case(lambda a: a.update(x=a["x"].astype(np.int8)), "numpy")),
    "fwd.numpy_cache_fortran": (161002, "state_cache",
                                forward_case(lambda a: a.update(state_cache=np.asfortranarray(a["state_cache"])), "numpy")),
    "fwd.numpy_cache_readonly": (161002, "state_cache",
                                 forward_case(lambda a: a["state_cache"].setflags(write=False), "numpy")),
    "fwd.cache_list": (161002, "state_cache", forward_case(lambda a: a.update(state_cache=[0.0]))),
    "bwd.softmax_score_shape": (None, "softmax_score", backward_case(lambda a: a.update(softmax_score=a["softmax_score"][:, :1]))),
    "bwd.empty": (561002, "", backward_case(lambda a: a.update(x=a["x"][:0], d_cmp_kv=a["d_cmp_kv"][:0],
                                                                softmax_score=a["softmax_score"][:0], kv=a["kv"][:0]))),
    "bwd.kv_float64": (161002, "kv", backward_case(lambda a: a.update(kv=a["kv"].double()))),
    "bwd.d_cmp_kv_meta": (161002, "CPU", backward_case(lambda a: a.update(d_cmp_kv=a["d_cmp_kv"].to("meta")))),
    "bwd.cmp_ratio_0": (161002, "cmp_ratio", backward_case(lambda a: a.update(cmp_ratio=0))),
}

if sys.argv[1] == "--list":
    print(json.dumps({name: [code, needle] for name, (code, needle, _) in CASES.items()}))
    sys.exit(0)
for name in sys.argv[1:]:
    code, needle, call = CASES[name]
    try:
        call()
        result = {"case": name, "error": "no exception"}
    except kvcomp.KvcompError as e:
        result = {"case": name, "code": e.code, "message": e.message}
    except Exception as e:  # a wrong kind of error is reported, not a crash
        result = {"case": name, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(result), flush=True)
'''


def _child(args):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH", "")) if p)
    env["PYTHONFAULTHANDLER"] = "1"  # a crash prints the Python stack of the child
    return subprocess.run([sys.executable, "-c", CHILD] + args, env=env, text=True, capture_output=True,
                          timeout=600)


def _registry():
    """Expected status (None: 161002 or 561002) and sentence fragment per case, from the child."""
    probe = _child(["--list"])
    assert probe.returncode == 0, probe.stderr
    return json.loads(probe.stdout)


def test_every_bad_input_raises_kvcomp_error_with_its_status():
    expected = _registry()
    assert len(expected) >= 35
    results, crashed, todo = {}, {}, sorted(expected)
    while todo:
        proc = _child(todo)
        for line in proc.stdout.splitlines():
            if line.startswith("RESULT "):
                r = json.loads(line[len("RESULT ") :])
                results[r["case"]] = r
        todo = [n for n in todo if n not in results]
        if proc.returncode != 0:
            assert todo, f"the child failed after its last case: {proc.returncode}\n{proc.stderr[-3000:]}"
            crashed[todo[0]] = f"exit status {proc.returncode}\n{proc.stderr[-3000:]}"
            todo = todo[1:]  # a fresh child goes on with the next case
    problems = [f"{n}: crashed the interpreter, {why}" for n, why in crashed.items()]
    for name, r in sorted(results.items()):
        status, needle = expected[name]
        if "error" in r:
            problems.append(f"{name}: {r['error']}")
        elif (r["code"] not in (161002, 561002)) if status is None else (r["code"] != status):
            problems.append(f"{name}: status {r['code']}, expected {status or '161002 or 561002'}: {r['message']}")
        elif needle not in r["message"]:
            problems.append(f"{name}: {needle!r} not in {r['message']!r}")
    assert not problems, "\n".join(problems)
