"""kvcomp.compressor_forward / kvcomp.compressor_grad on numpy arrays and torch tensors: output kinds,
dtypes and shapes, in-place state cache, agreement between the two array kinds, options, and the
errors (kvcomp.KvcompError with the aclnn code and the validation sentence)."""

import pickle

import numpy as np
import pytest
import torch

import kvcomp
from support import make_case, reference_grads


def np_args(case):
    """The case as numpy arrays (fp16 / fp32 io; numpy has no bfloat16)."""
    k = case.kwargs()
    conv = lambda t: None if t is None else t.numpy()  # noqa: E731
    return (
        case.x.numpy(),
        case.wkv.numpy(),
        case.wgate.numpy(),
        case.state_cache.numpy().copy(),
        case.ape.numpy(),
    ), {
        n: conv(v) if n in ("state_block_table", "cu_seqlens", "seqused", "start_pos") else v
        for n, v in k.items()
    }


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
@pytest.mark.parametrize("th", [False, True])
def test_numpy_in_numpy_out_matches_torch(dtype, th):
    case = make_case(lens=[13, 9], th=th, r=4, coff=2, start_pos=[5, 2], dtype=dtype, seed=1)
    args, kw = np_args(case)
    cmp_np, s_np, k_np = kvcomp.compressor_forward(*args, case.cmp_ratio, grad_enabled=True, **kw)
    assert all(isinstance(a, np.ndarray) for a in (cmp_np, s_np, k_np))
    assert cmp_np.dtype == args[0].dtype and s_np.dtype == np.float32 and k_np.dtype == np.float32

    cache_t = case.state_cache.clone()
    cmp_t, s_t, k_t = kvcomp.compressor_forward(
        case.x, case.wkv, case.wgate, cache_t, case.ape, case.cmp_ratio, grad_enabled=True, **case.kwargs()
    )
    assert all(isinstance(a, torch.Tensor) for a in (cmp_t, s_t, k_t))
    # Same core, same inputs: bitwise the same results, and the numpy cache was updated in place too.
    assert np.array_equal(cmp_np, cmp_t.numpy()) and np.array_equal(s_np, s_t.numpy())
    assert np.array_equal(k_np, k_t.numpy()) and np.array_equal(args[3], cache_t.numpy())
    assert not np.array_equal(args[3], case.state_cache.numpy())

    d = np.random.default_rng(0).standard_normal(cmp_np.shape).astype(cmp_np.dtype)
    gkw = {n: kw[n] for n in ("cu_seqlens", "seqused", "start_pos", "coff")}
    grads_np = kvcomp.compressor_grad(args[0], args[1], args[2], d, s_np, k_np, case.cmp_ratio, **gkw)
    grads_t = kvcomp.compressor_grad(
        case.x,
        case.wkv,
        case.wgate,
        torch.from_numpy(d),
        s_t,
        k_t,
        case.cmp_ratio,
        cu_seqlens=case.cu_seqlens,
        seqused=case.seqused,
        start_pos=case.start_pos,
        coff=case.coff,
    )
    for a, b, like in zip(grads_np, grads_t, (args[0], args[1], args[2], args[4])):
        assert isinstance(a, np.ndarray) and a.shape == like.shape and a.dtype == like.dtype
        assert np.array_equal(a, b.numpy())


def test_bf16_torch_values_and_kinds():
    case = make_case(lens=[12, 12], r=4, coff=1, start_pos=[0, 3], dtype="bf16", seed=2)
    cmp_kv, s, k = kvcomp.compressor_forward(
        case.x,
        case.wkv,
        case.wgate,
        case.state_cache.clone(),
        case.ape,
        4,
        grad_enabled=True,
        **case.kwargs()
    )
    assert cmp_kv.dtype == torch.bfloat16 and cmp_kv.shape == (2, 3, 8)
    assert s.shape == k.shape == (2, 3, 4, 8) and s.dtype == torch.float32
    d = torch.randn(cmp_kv.shape).to(torch.bfloat16)
    d_x, d_wkv, d_wgate, d_ape = kvcomp.compressor_grad(
        case.x, case.wkv, case.wgate, d, s, k, 4, start_pos=case.start_pos
    )
    assert (d_x.dtype, d_wkv.dtype, d_wgate.dtype, d_ape.dtype) == (torch.bfloat16,) * 3 + (torch.float32,)
    assert d_ape.shape == (4, 8)
    out_t, grads_t, _ = reference_grads(case, d, torch.float64)
    assert torch.allclose(cmp_kv.double(), out_t, rtol=2**-7, atol=1e-3)
    assert torch.allclose(d_ape.double(), grads_t["d_ape"], rtol=1e-4, atol=1e-5)


def test_no_intermediates_without_grad_enabled():
    case = make_case(lens=[8], r=4, seed=3)
    cmp_kv, s, k = kvcomp.compressor_forward(
        case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
    )
    assert s is None and k is None and cmp_kv.shape == (1, 2, 8)


def test_non_contiguous_inputs_are_accepted():
    case = make_case(lens=[12], r=4, coff=2, seed=4)
    ref, _, _ = kvcomp.compressor_forward(
        case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
    )
    wkv_t = case.wkv.t().contiguous().t()  # same values, column-major
    assert not wkv_t.is_contiguous()
    out, _, _ = kvcomp.compressor_forward(
        case.x, wkv_t, case.wgate, case.state_cache.clone(), case.ape, 4, **case.kwargs()
    )
    assert torch.equal(out, ref)


def test_every_argument_kind_gives_the_same_bits():
    """The forward hands CPU torch tensors to the core on a fast path (_cpu_torch_capsules) and anything
    else on the general one: tensors that require grad, non-contiguous ones, numpy arrays mixed in, and a
    state cache strided in dim 0 give bitwise the results and the cache writes of plain contiguous
    tensors."""
    case = make_case(lens=[3, 6], r=4, coff=2, start_pos=[5, 10], seed=6)
    kw = case.kwargs()
    ref_cache = case.state_cache.clone()
    ref = kvcomp.compressor_forward(case.x, case.wkv, case.wgate, ref_cache, case.ape, 4, grad_enabled=True, **kw)
    big = torch.full((2 * case.state_cache.shape[0],) + tuple(case.state_cache.shape[1:]), -7.0)
    big[::2] = case.state_cache
    cache = big[::2]  # every other block of a larger cache: strided in dim 0, written in place
    assert not cache.is_contiguous()
    start_pos = torch.stack([kw["start_pos"], kw["start_pos"]], dim=1)[:, 0]  # a strided view
    assert not start_pos.is_contiguous()
    out = kvcomp.compressor_forward(
        case.x.clone().requires_grad_(), case.wkv.t().contiguous().t(), case.wgate, cache,
        case.ape.clone().requires_grad_(), 4, grad_enabled=True,
        **dict(kw, start_pos=start_pos, state_block_table=kw["state_block_table"].numpy()),
    )
    for a, b in zip(out, ref):
        assert type(a) is torch.Tensor and not a.requires_grad and torch.equal(a, b)
    assert torch.equal(cache, ref_cache) and not torch.equal(ref_cache, case.state_cache)
    assert bool((big[1::2] == -7.0).all())  # the blocks between untouched


def test_empty_forward_input():
    """B = 0 is legal for the forward (spec 1.7): empty outputs, state cache untouched."""
    case = make_case(lens=[4], r=4, seed=5)
    cache = case.state_cache.clone()
    x = case.x[:0]
    out, _, _ = kvcomp.compressor_forward(
        x, case.wkv, case.wgate, cache, case.ape, 4, state_block_table=case.state_block_table[:0]
    )
    assert out.shape == (0, 1, 8) and torch.equal(cache, case.state_cache)


def test_error_carries_code_and_sentence():
    case = make_case(lens=[8], r=4, seed=6)
    with pytest.raises(kvcomp.KvcompError) as e:
        kvcomp.compressor_forward(
            case.x, case.wkv, case.wgate, case.state_cache, case.ape, 0, **case.kwargs()
        )
    err = e.value
    assert isinstance(err, RuntimeError)
    assert err.code == 161002 and err.code_name == "invalid_param"
    assert err.message.startswith("[kvcomp] cmp_ratio (= 0) must")
    assert "161002" in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert (again.code, again.message) == (err.code, err.message)


@pytest.mark.parametrize(
    "mutate, code, needle",
    [
        (lambda a: a.update(wkv=a["wkv"][:, :-1].contiguous()), 561002, "wkv"),
        (lambda a: a.update(x=a["x"].double()), 161002, "x"),
        (lambda a: a.update(x=a["x"].to("meta")), 161002, "CPU"),
        (lambda a: a.update(state_block_table=None), 161001, "state_block_table"),
        (lambda a: a.update(start_pos=torch.tensor([-1], dtype=torch.int32)), 161002, "start_pos"),
        (lambda a: a.update(start_pos=torch.tensor([1])), 161002, "start_pos"),  # int64, must be int32
        (lambda a: a.update(coff=3), 161002, "coff"),
        (lambda a: a.update(cache_mode=3), 161002, "cache_mode"),
        (lambda a: a.update(state_cache=a["state_cache"].transpose(1, 2)), 161002, "state_cache"),
    ],
)
def test_rejections(mutate, code, needle):
    case = make_case(lens=[8], r=4, start_pos=[0], seed=7)
    a = dict(
        x=case.x,
        wkv=case.wkv,
        wgate=case.wgate,
        state_cache=case.state_cache.clone(),
        ape=case.ape,
        **case.kwargs()
    )
    mutate(a)
    before = case.state_cache.clone()
    with pytest.raises(kvcomp.KvcompError) as e:
        kvcomp.compressor_forward(
            a.pop("x"), a.pop("wkv"), a.pop("wgate"), a.pop("state_cache"), a.pop("ape"), 4, **a
        )
    assert e.value.code == code and needle in e.value.message, str(e.value)
    assert torch.equal(case.state_cache, before)


def test_backward_rejections():
    case = make_case(lens=[8], r=4, seed=8)
    cmp_kv, s, k = kvcomp.compressor_forward(
        case.x,
        case.wkv,
        case.wgate,
        case.state_cache.clone(),
        case.ape,
        4,
        grad_enabled=True,
        **case.kwargs()
    )
    with pytest.raises(kvcomp.KvcompError) as e:  # intermediates of the wrong shape
        kvcomp.compressor_grad(case.x, case.wkv, case.wgate, cmp_kv, s[:, :1], k, 4)
    assert e.value.code in (161002, 561002) and "softmax_score" in e.value.message
    with pytest.raises(kvcomp.KvcompError) as e:  # the backward has no empty-tensor path
        kvcomp.compressor_grad(case.x[:0], case.wkv, case.wgate, cmp_kv[:0], s[:0], k[:0], 4)
    assert e.value.code == 561002


def test_options():
    case = make_case(lens=[12], r=4, coff=2, start_pos=[2], dtype="bf16", seed=9)
    args = (case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4)
    with pytest.raises(kvcomp.KvcompError, match="aclnn profile") as e:
        kvcomp.compressor_forward(*args, profile="aclnn", **case.kwargs())
    assert e.value.code == 161002
    with pytest.raises(kvcomp.KvcompError, match="precision"):
        kvcomp.compressor_forward(*args, precision="fast", **case.kwargs())
    cmp_kv, s, k = kvcomp.compressor_forward(*args, grad_enabled=True, num_threads=1, **case.kwargs())
    d = torch.randn(cmp_kv.shape).to(torch.bfloat16)
    gk = dict(start_pos=case.start_pos, coff=2)
    precise = kvcomp.compressor_grad(case.x, case.wkv, case.wgate, d, s, k, 4, **gk)
    parity = kvcomp.compressor_grad(case.x, case.wkv, case.wgate, d, s, k, 4, precision="npu_parity", **gk)
    threads = kvcomp.compressor_grad(case.x, case.wkv, case.wgate, d, s, k, 4, num_threads=2, **gk)
    assert all(torch.equal(a, b) for a, b in zip(precise, threads))  # results never depend on threads
    assert torch.equal(precise[3], parity[3])  # d_ape is computed before any io rounding
    assert not torch.equal(precise[0], parity[0])  # d_x: d_new rounded to bf16 first
    assert torch.allclose(precise[0].float(), parity[0].float(), rtol=0.05, atol=0.02)

    previous = kvcomp.set_default_options(precision="npu_parity")
    try:
        assert kvcomp.get_default_options()["precision"] == "npu_parity"
        assert torch.equal(
            kvcomp.compressor_grad(case.x, case.wkv, case.wgate, d, s, k, 4, **gk)[0], parity[0]
        )
    finally:
        kvcomp.set_default_options(**previous)
    assert kvcomp.get_default_options() == previous
    with pytest.raises(kvcomp.KvcompError):
        kvcomp.set_default_options(profile="npu")


def test_version():
    assert kvcomp.__version__.count(".") == 2


def test_backend_report():
    """What the extension says of the CUDA backend matches how the core was configured (ctest passes
    KVCOMP_EXPECT_CUDA_BACKEND from CMake), and the device count matches torch's where torch sees GPUs."""
    import os

    expected = os.environ.get("KVCOMP_EXPECT_CUDA_BACKEND")
    if expected is None:
        pytest.skip("KVCOMP_EXPECT_CUDA_BACKEND is not set (ctest sets it)")
    assert kvcomp.has_cuda_backend() is (expected == "1")
    if kvcomp.has_cuda_backend() and torch.cuda.is_available():
        assert kvcomp.cuda_device_count() == torch.cuda.device_count()
    if not kvcomp.has_cuda_backend():
        assert kvcomp.cuda_device_count() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device for torch")
def test_cuda_tensors_reach_the_device_rule():
    """CUDA tensors are passed to the core as they are (never copied to the host); a mix with host
    tensors, and a call this build cannot run on the device, are refused in the core's sentences."""
    case = make_case(lens=[8], r=4, start_pos=[0], seed=11)
    kw = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in case.kwargs().items()}
    cache = case.state_cache.cuda()
    with pytest.raises(kvcomp.KvcompError) as e:  # x on the GPU, the weights in host memory
        kvcomp.compressor_forward(case.x.cuda(), case.wkv, case.wgate, cache, case.ape.cuda(), 4, **kw)
    assert e.value.code == 161002 and "must be on the same device as x (cuda:0)" in e.value.message
    if not kvcomp.has_cuda_backend():
        with pytest.raises(kvcomp.KvcompError) as e:
            kvcomp.compressor_forward(
                case.x.cuda(), case.wkv.cuda(), case.wgate.cuda(), cache, case.ape.cuda(), 4, **kw
            )
        assert e.value.code == 161002 and "no CUDA backend" in e.value.message


@pytest.mark.parametrize("dtype,precision", [("bf16", "precise"), ("fp16", "precise"), ("bf16", "npu_parity")])
def test_fp32_weight_grads_are_the_unrounded_sums(dtype, precision):
    # fp32_weight_grads=True returns the fp32 accumulators the io outputs are rounded from: rounding
    # them gives the io result bit for bit, and they are closer to the float64 oracle.
    case = make_case(lens=[23, 17], r=4, coff=2, start_pos=[0, 6], dtype=dtype, H=40, seed=21)
    cmp_kv, s, k = kvcomp.compressor_forward(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4,
                                             grad_enabled=True, **case.kwargs())
    d = torch.randn(cmp_kv.shape, generator=torch.Generator().manual_seed(5)).to(case.x.dtype)
    args = (case.x, case.wkv, case.wgate, d, s, k, 4)
    kw = dict(start_pos=case.start_pos, seqused=case.seqused, coff=2, precision=precision)
    io = kvcomp.compressor_grad(*args, **kw)
    wide = kvcomp.compressor_grad(*args, fp32_weight_grads=True, float64_d_ape=True, **kw)
    assert wide[1].dtype == wide[2].dtype == torch.float32 and wide[3].dtype == torch.float64
    assert torch.equal(wide[0], io[0])  # d_x unchanged
    assert torch.equal(wide[3].float(), io[3]) and not torch.equal(wide[3], io[3].double())  # d_ape widened
    _, oracle, _ = reference_grads(case, d, torch.float64)
    for i, name in ((1, "d_wkv"), (2, "d_wgate")):
        assert torch.equal(wide[i].to(case.x.dtype), io[i]), name
        assert not torch.equal(wide[i], io[i].float()), name  # really wider than the io dtype
        err_wide = (wide[i].double() - oracle[name]).abs().sum()
        err_io = (io[i].double() - oracle[name]).abs().sum()
        # precise: the io rounding is most of the error; npu_parity rounds d_new to the io dtype first.
        assert err_wide < (0.5 if precision == "precise" else 1.0) * err_io, (name, float(err_wide), float(err_io))


def test_fp32_weight_grads_rejections():
    case = make_case(lens=[8], r=4, dtype="bf16", D=128, H=1024, seed=8)
    cmp_kv, s, k = kvcomp.compressor_forward(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape, 4,
                                             grad_enabled=True, **case.kwargs())
    kvcomp.compressor_grad(case.x, case.wkv, case.wgate, cmp_kv, s, k, 4, profile="aclnn")  # valid there
    with pytest.raises(kvcomp.KvcompError) as e:  # the NPU's operator has io weight gradients only
        kvcomp.compressor_grad(case.x, case.wkv, case.wgate, cmp_kv, s, k, 4, profile="aclnn",
                               fp32_weight_grads=True)
    assert e.value.code == 161002 and "d_wkv (dtype f32) must have the io dtype bf16 under the aclnn profile" \
        in e.value.message
    with pytest.raises(kvcomp.KvcompError) as e:
        kvcomp.compressor_grad(case.x, case.wkv, case.wgate, cmp_kv, s, k, 4, profile="aclnn", float64_d_ape=True)
    assert e.value.code == 161002 and "d_ape (rank 3) must have rank 2" in e.value.message


def test_phase_clock_times_calls_without_changing_them():
    """kvcomp.set_phase_timing / phase_times: off by default; while on, each operator's calls are counted
    and its phases (in call order) sum to at most the calls' wall time; the results keep their bits."""
    import time

    case = make_case(lens=[300, 200], th=True, r=4, coff=2, start_pos=[5, 2], dtype="bf16", seed=3)

    def forward():
        return kvcomp.compressor_forward(case.x, case.wkv, case.wgate, case.state_cache.clone(), case.ape,
                                         case.cmp_ratio, grad_enabled=True, **case.kwargs())

    kvcomp.reset_phase_times()
    plain = forward()
    assert all(p["calls"] == 0 and p["seconds"] == 0 for p in kvcomp.phase_times())
    kvcomp.set_phase_timing(True)
    try:
        t0 = time.perf_counter()
        timed = forward()
        wall = time.perf_counter() - t0
    finally:
        kvcomp.set_phase_timing(False)
    fwd = [p for p in kvcomp.phase_times() if p["op"] == "forward"]
    assert [p["phase"] for p in fwd] == ["weights", "x rows", "products", "ape", "blocks", "rows"]
    assert all(p["calls"] == 1 and p["seconds"] >= 0 for p in fwd)
    assert 0 < sum(p["seconds"] for p in fwd) <= wall
    assert all(p["calls"] == 0 for p in kvcomp.phase_times() if p["op"] == "backward")
    for a, b in zip(plain, timed):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a,
                           b.view(torch.int16) if b.dtype == torch.bfloat16 else b)
    kvcomp.reset_phase_times()
    assert all(p["calls"] == 0 and p["seconds"] == 0 for p in kvcomp.phase_times())
