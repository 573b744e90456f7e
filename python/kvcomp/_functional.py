"""Functional calls of the two operators on torch tensors or numpy arrays.

The C++ core works on caller-owned memory, so this layer allocates the outputs
(of the caller's array kind) and passes views through DLPack / the buffer
protocol: contiguous CPU inputs are never copied, bf16 torch tensors included.
"""

import sys
import threading

import numpy as np

from . import _C
from ._errors import INVALID_PARAM, KvcompError

_PROFILES = ("extended", "aclnn")
_PRECISIONS = ("precise", "npu_parity")

_defaults_lock = threading.Lock()
_defaults = {"profile": "extended", "precision": "precise", "num_threads": 0}


def set_default_options(profile=None, precision=None, num_threads=None):
    """Sets the options used when a call does not pass its own.

    They also apply to ``kvcomp.torch.compressor``, whose signature is the
    upstream one and so has no room for them.

    Args:
        profile: ``"extended"`` (default: any D, H >= 1, 1 <= cmp_ratio <= 1024,
            fp32 io allowed) or ``"aclnn"`` (exactly the NPU's ranges).
        precision: ``"precise"`` (default; the backward keeps d_new_kv /
            d_new_score in fp32) or ``"npu_parity"`` (rounds them to the io
            dtype first, as the NPU kernel does).
        num_threads: OpenMP threads, 0 for OpenMP's default. Results never
            depend on it.

    Returns:
        The previous defaults as a dict (pass it back with ``**`` to restore).
    """
    with _defaults_lock:
        previous = dict(_defaults)
        if profile is not None:
            _check_choice("profile", profile, _PROFILES)
            _defaults["profile"] = profile
        if precision is not None:
            _check_choice("precision", precision, _PRECISIONS)
            _defaults["precision"] = precision
        if num_threads is not None:
            if int(num_threads) < 0:
                raise KvcompError(INVALID_PARAM, f"[kvcomp] num_threads (= {num_threads}) must be >= 0")
            _defaults["num_threads"] = int(num_threads)
    return previous


def get_default_options():
    """The options used when a call passes none (see set_default_options)."""
    with _defaults_lock:
        return dict(_defaults)


def _check_choice(name, value, choices):
    if value not in choices:
        raise KvcompError(INVALID_PARAM, f"[kvcomp] {name} (= {value!r}) must be one of {', '.join(choices)}")


def _options(profile, precision, num_threads):
    d = get_default_options()
    return (
        d["profile"] if profile is None else profile,
        d["precision"] if precision is None else precision,
        d["num_threads"] if num_threads is None else int(num_threads),
    )


def _is_torch(a):
    torch = sys.modules.get("torch")  # no torch import for numpy-only users
    return torch is not None and isinstance(a, torch.Tensor)


def _check_device(a, name):
    """Host memory or a CUDA device: the core checks that a call's tensors agree and that this build
    runs there (a CUDA tensor is never copied to the host)."""
    if a.device.type not in ("cpu", "cuda"):
        raise KvcompError(
            INVALID_PARAM,
            f"[kvcomp] {name} (= a tensor on {a.device}) must be a CPU tensor or on a CUDA device; use .cpu()",
        )


def _plain(a):
    """A torch tensor as the core takes it: detached if it requires grad (DLPack refuses those; the core
    never records autograd history anyway), contiguous (no copy when it already is)."""
    return (a.detach() if a.requires_grad else a).contiguous()


def _in(a, name):
    """An input view for the core: contiguous memory on its device, no copy when it already is."""
    if a is None:
        return None
    if _is_torch(a):
        if not a.is_cpu:
            _check_device(a, name)
        return _plain(a)
    return np.ascontiguousarray(a)


def _dl(a):
    """What the core's binding is handed for ``a``: a CPU torch tensor as a DLPack capsule
    (``torch.utils.dlpack.to_dlpack``, one C call), anything else as it is. nanobind takes either, but
    exports a tensor through ``Tensor.__dlpack__``, whose argument checks in Python cost 3-5 us a
    tensor: about 25 us of a forward call's nine (docs/python.md). CUDA tensors keep ``__dlpack__``,
    which orders the export on the stream the call is queued on."""
    if _is_torch(a) and a.is_cpu:
        return sys.modules["torch"].utils.dlpack.to_dlpack(a)
    return a


def _arg(a, name):
    """``_dl(_in(a, name))`` in one step, with a fast path for what nearly every call passes: a CPU
    torch tensor (1.0-1.5 us instead of 4.5 us a tensor; a decode call hands over a dozen)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor) and a.is_cpu:
        return torch.utils.dlpack.to_dlpack(_plain(a))
    return _dl(_in(a, name))


def _cpu_torch_capsules(tensors):
    """What the core's binding is handed for ``tensors`` when every one is a CPU torch tensor or None:
    DLPack capsules of contiguous views (no copy when already contiguous), None kept; or None when
    any is something else, which then takes the general path (_arg, _dl). About half the cost of _arg
    a tensor: a forward hands over up to a dozen."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor, to_dlpack = torch.Tensor, torch.utils.dlpack.to_dlpack
    out = []
    for a in tensors:
        if a is None:
            out.append(None)
        elif isinstance(a, tensor) and a.is_cpu:
            out.append(to_dlpack(_plain(a)))
        else:
            return None
    return out


def _inout(a, name):
    """The state cache: written in place, so it is never copied (dim 0 may be strided)."""
    if _is_torch(a):
        _check_device(a, name)
        return a.detach() if a.requires_grad else a
    if not isinstance(a, np.ndarray):
        raise KvcompError(
            INVALID_PARAM, f"[kvcomp] {name} (= {type(a).__name__}) must be a torch tensor or numpy array"
        )
    if not a.flags.writeable:
        raise KvcompError(INVALID_PARAM, f"[kvcomp] {name} (= a read-only array) must be writable")
    return a


def _empty(like, shape, fp32=False):
    """An uninitialised output of the same kind as `like` (the core writes every element)."""
    if _is_torch(like):
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=torch.float32 if fp32 else like.dtype, device=like.device)
    return np.empty(shape, dtype=np.float32 if fp32 else like.dtype)


def _stream(xs):
    """The CUDA stream a call on ``xs`` is queued on: torch's current stream of its device (0, the
    default stream, for host memory and numpy)."""
    if _is_torch(xs) and xs.device.type == "cuda":
        return sys.modules["torch"].cuda.current_stream(xs.device).cuda_stream
    return 0


def _dims(a):
    return tuple(a.shape)  # ints for numpy and torch (torch.Size is a tuple of ints)


def compressed_leading_shape(x_shape, cu_seqlens_len, cmp_ratio):
    """Leading dims of cmp_kv / softmax_score / kv: BSH (B, ceil(S/r)), TH (min(T, T//r + B),), by the
    core's own formulas (kvcomp::compressed_rows_bsh / compressed_rows_th).

    Invalid inputs give some shape; the core then rejects the call with its own sentence.
    """
    r = max(int(cmp_ratio), 1)
    if len(x_shape) == 3:
        return (x_shape[0], _C.compressed_rows_bsh(x_shape[1], r))
    if len(x_shape) == 2:
        return (_C.compressed_rows_th(x_shape[0], max(cu_seqlens_len - 1, 0), r),)
    return (0,)


def _width(wkv, coff):
    shape = _dims(wkv)
    return shape[0] // int(coff) if len(shape) == 2 and int(coff) > 0 else 0


def compressor_forward(
    x,
    wkv,
    wgate,
    state_cache,
    ape,
    cmp_ratio=4,
    *,
    state_block_table=None,
    cu_seqlens=None,
    seqused=None,
    start_pos=None,
    coff=1,
    cache_mode=1,
    grad_enabled=False,
    profile=None,
    precision=None,
    num_threads=None,
    prepared_weights=None,
    row_stable=True,
    norm_weight=None,
    norm_eps=1e-6,
    rope_cos=None,
    rope_sin=None,
):
    """The Compressor forward (aclnnCompressor) on torch tensors or numpy arrays.

    Shapes (D head dim, C = coff*D, r = cmp_ratio, io = bf16 | fp16 | fp32):
        x                  io      BSH [B, S, H] or TH [T, H] (then cu_seqlens is required)
        wkv, wgate         io      [C, H]; wgate None: no gate projection (DeepSeek-V4.1's ratio 1:
                                   cmp_ratio 1 and coff 1 only; extended profile), each row is its
                                   token's projection row
        state_cache        fp32    [block_num, block_size, 2*C], updated in place (dim 0 may be strided)
        ape                fp32    [r, C]; None: no APE term (DeepSeek-V4.1; extended profile)
        state_block_table  int32   cache_mode 1: [B, ceil(Smax/block_size)]; cache_mode 2: [B]. Required.
        cu_seqlens         int32   [B+1] (TH only)
        seqused, start_pos int32   [B], optional (whole sequences / all zero)
        prepared_weights   uint8   optional: ``prepare_weights(wkv, wgate)`` of these weights (CPU);
                                   skips converting / packing them in this call, same results

    ``row_stable`` (default True): every token's outputs have the bits they have in any other call
    holding that token (chunked prefill, context parallelism). False lets decode-sized CPU calls skip
    the padding that guarantees it (faster; still deterministic); the CUDA backend ignores it.

    The model-level epilogue (DeepSeek-V4's compressor; extended profile; on x's device), opt-in:
        norm_weight        fp32 or io [D]: RMSNorm over D after the pooling, epsilon ``norm_eps``
        rope_cos, rope_sin fp32 [positions, rd/2]: RoPE on the last rd channels, each row at its block's
                           first token's global position (k * cmp_ratio for block k)
    In the model's arithmetic: the pooled row rounded to the io dtype, the RMSNorm's result and the
    rotation's each rounded again (docs/semantics.md). With an epilogue the result has a fourth
    element: ``pooled``, the rows before the epilogue (io, cmp_kv's shape) that the backward takes,
    when ``grad_enabled``, else None.

    Returns:
        (cmp_kv, softmax_score, kv) of the kind of ``x`` (torch tensor or numpy array):
        cmp_kv io BSH [B, ceil(S/r), D] / TH [min(T, T//r + B), D]; softmax_score and kv fp32
        [..., coff*r, D] (kv is the raw assembled block, rows interleaved prev0, cur0, ... when
        coff = 2), or None when ``grad_enabled`` is false. Padding rows are zero.

    Raises:
        KvcompError: the call was rejected (``.code`` is the aclnn status); nothing was written.
    """
    opts = _options(profile, precision, num_threads)
    xs, cu = _in(x, "x"), _in(cu_seqlens, "cu_seqlens")
    lead = compressed_leading_shape(
        _dims(xs), _dims(cu)[0] if cu is not None and cu.ndim == 1 else 0, cmp_ratio
    )
    d = _width(wkv, coff)
    cmp_kv = _empty(xs, lead + (d,))
    softmax_score = kv = pooled = None
    epilogue = norm_weight is not None or rope_cos is not None or rope_sin is not None
    if grad_enabled:
        block = (max(int(coff), 0) * max(int(cmp_ratio), 0), d)
        softmax_score = _empty(xs, lead + block, fp32=True)
        kv = _empty(xs, lead + block, fp32=True)
        if epilogue:
            pooled = _empty(xs, lead + (d,))
    # The state cache is written in place: never copied (dim 0 may be strided), so not in the fast path.
    handed = _cpu_torch_capsules(
        (xs, wkv, wgate, ape, state_block_table, cu, seqused, start_pos, cmp_kv, softmax_score, kv, prepared_weights)
    ) or (
        _dl(xs), _arg(wkv, "wkv"), _arg(wgate, "wgate"), _arg(ape, "ape"),
        _arg(state_block_table, "state_block_table"), _dl(cu), _arg(seqused, "seqused"),
        _arg(start_pos, "start_pos"), _dl(cmp_kv), _dl(softmax_score), _dl(kv),
        _arg(prepared_weights, "prepared_weights"),
    )
    x_, wkv_, wgate_, ape_, table_, cu_, seqused_, start_pos_, cmp_kv_, softmax_score_, kv_, prepared_ = handed
    _C.forward(
        x_,
        wkv_,
        wgate_,
        _dl(_inout(state_cache, "state_cache")),
        ape_,
        table_,
        cu_,
        seqused_,
        start_pos_,
        int(cmp_ratio),
        int(coff),
        int(cache_mode),
        cmp_kv_,
        softmax_score_,
        kv_,
        *opts,
        stream=_stream(xs),
        prepared_weights=prepared_,
        row_stable=bool(row_stable),
        **(_epilogue_args(norm_weight, norm_eps, rope_cos, rope_sin) if epilogue else {}),
        **({"pooled": _dl(pooled)} if pooled is not None else {}),
    )
    if epilogue:
        return cmp_kv, softmax_score, kv, pooled
    return cmp_kv, softmax_score, kv


def _epilogue_args(norm_weight, norm_eps, rope_cos, rope_sin):
    """The epilogue's keyword arguments of the core's binding."""
    return {
        "norm_weight": _arg(norm_weight, "norm_weight"),
        "norm_eps": float(norm_eps),
        "rope_cos": _arg(rope_cos, "rope_cos"),
        "rope_sin": _arg(rope_sin, "rope_sin"),
    }


def prepare_weights(wkv, wgate, *, num_threads=None):
    """wkv and wgate in the form the CPU forward's products read them, once for many calls.

    A CPU forward call first converts its weights to fp32 (fp32 products: CPUs without bf16 units,
    fp16 / fp32 io, ``KVCOMP_PRODUCTS=f32``) or packs them (AMX): 2 * C * H weights read and written
    per call, more than a decode call's products cost. Pass the result as ``prepared_weights=`` to
    ``compressor_forward`` / ``kvcomp.torch.compressor`` and the call skips that step, with bitwise
    the same results (a call of more than one row tile on fp32 products may still transpose the
    blob's fp32 rows, where oneDNN's sgemm runs faster from there with the same bits).

    The result is a snapshot: prepare again after the weights change (a stale one gives the old
    weights' results). It belongs to this process's product kernels (``product_kernels()``) and to
    weights of this shape and dtype; any other call refuses it. Where the products read the weights
    in place it is a 64-byte header that changes nothing.

    Returns:
        A 1-D uint8 host array of the kind of ``wkv`` (torch tensor or numpy array).
    """
    ws, gs = _in(wkv, "wkv"), _in(wgate, "wgate")
    n = _C.prepared_weights_size(_dl(ws), _dl(gs))
    if _is_torch(ws):
        blob = sys.modules["torch"].empty((n,), dtype=sys.modules["torch"].uint8)
    else:
        blob = np.empty((n,), dtype=np.uint8)
    threads = _options(None, None, num_threads)[2]
    _C.prepare_weights(_dl(ws), _dl(gs), _dl(blob), threads)
    return blob


def compressor_grad(
    x,
    wkv,
    wgate,
    d_cmp_kv,
    softmax_score,
    kv,
    cmp_ratio=4,
    *,
    cu_seqlens=None,
    seqused=None,
    start_pos=None,
    coff=1,
    profile=None,
    precision=None,
    num_threads=None,
    fp32_weight_grads=False,
    float64_d_ape=False,
    row_stable=True,
    with_ape=True,
    pooled=None,
    norm_weight=None,
    norm_eps=1e-6,
    rope_cos=None,
    rope_sin=None,
):
    """The CompressorGrad backward (aclnnCompressorGrad) on torch tensors or numpy arrays.

    Shapes: x, wkv, wgate, cu_seqlens, seqused, start_pos, cmp_ratio, coff exactly as given to the
    forward; d_cmp_kv io, shape of cmp_kv; softmax_score, kv fp32 from the forward
    (``grad_enabled=True``).

    Returns:
        (d_x, d_wkv, d_wgate, d_ape) of the kind of ``x``: d_x io shape of x (zero rows for tokens in
        no compressed block), d_wkv and d_wgate io [C, H] (fp32, unrounded, with
        ``fp32_weight_grads=True``: an extension, CPU only, for fp32 master weights and for partial
        sums reduced before rounding), d_ape fp32 [r, C] (float64, the kernels' sums before their
        rounding to fp32, with ``float64_d_ape=True``: CPU only). No block at all gives four zero
        outputs. ``row_stable``: as for ``compressor_forward`` (pass the forward's).

    ``with_ape=False`` (a forward without APE): d_ape is None, not computed. ``wgate`` None (a forward
    without one): d_wgate is None. With the forward's
    epilogue (``norm_weight``, ``norm_eps``, ``rope_cos``, ``rope_sin`` as given to it, and its
    ``pooled``), ``d_cmp_kv`` is the gradient of the epilogue's rows, and with ``norm_weight`` the
    result has a fifth element, d_norm_weight (``norm_weight``'s shape and dtype), summed over the rows
    in a fixed order.

    Raises:
        KvcompError: the call was rejected (``.code`` is the aclnn status); nothing was written.
    """
    opts = _options(profile, precision, num_threads)
    xs, ws, gs = _in(x, "x"), _in(wkv, "wkv"), _in(wgate, "wgate")
    d_x = _empty(xs, _dims(xs))
    d_wkv = _empty(xs, _dims(ws), fp32=fp32_weight_grads)
    d_wgate = None if gs is None else _empty(xs, _dims(gs), fp32=fp32_weight_grads)
    dape_shape = (max(int(cmp_ratio), 0), _dims(ws)[0] if len(_dims(ws)) == 2 else 0)
    d_ape = _empty(xs, ((2,) if float64_d_ape else ()) + dape_shape, fp32=True) if with_ape else None
    epilogue = norm_weight is not None or rope_cos is not None or rope_sin is not None
    d_norm_weight = None
    if norm_weight is not None:
        nw = _in(norm_weight, "norm_weight")
        d_norm_weight = _empty(nw, _dims(nw))
    _C.backward(
        _dl(xs),
        _dl(ws),
        _dl(gs),
        _arg(d_cmp_kv, "d_cmp_kv"),
        _arg(softmax_score, "softmax_score"),
        _arg(kv, "kv"),
        _arg(cu_seqlens, "cu_seqlens"),
        _arg(seqused, "seqused"),
        _arg(start_pos, "start_pos"),
        int(cmp_ratio),
        int(coff),
        _dl(d_x),
        _dl(d_wkv),
        _dl(d_wgate),
        _dl(d_ape),
        *opts,
        stream=_stream(xs),
        row_stable=bool(row_stable),
        **(_epilogue_args(norm_weight, norm_eps, rope_cos, rope_sin) if epilogue else {}),
        **({"pooled": _arg(pooled, "pooled")} if pooled is not None else {}),
        **({"d_norm_weight": _dl(d_norm_weight)} if d_norm_weight is not None else {}),
    )
    if float64_d_ape and with_ape:  # the core writes the float64 sums as hi + lo fp32 parts
        d_ape = d_ape[0].astype(np.float64) + d_ape[1] if isinstance(d_ape, np.ndarray) else \
            d_ape[0].double() + d_ape[1].double()
    if d_norm_weight is not None:
        return d_x, d_wkv, d_wgate, d_ape, d_norm_weight
    return d_x, d_wkv, d_wgate, d_ape
