"""The operators kvcomp registers with torch.library, and the autograd around them.

Three custom operators (schema, kernel through the C++ core, fake kernel giving output shapes, so
torch.compile traces them without graph breaks):

* ``torch.ops.kvcomp.compressor_forward`` (aclnnCompressor): returns (cmp_kv, softmax_score, kv)
  and mutates ``state_cache`` in place, which its schema declares.
* ``torch.ops.kvcomp.compressor_backward`` (aclnnCompressorGrad): returns (d_x, d_wkv, d_wgate,
  d_ape).
* ``torch.ops.kvcomp.compressor_grad_anchor``: returns a copy of cmp_kv; its autograd formula is
  CompressorGrad. PyTorch accepts ``register_autograd`` only on operators that mutate nothing, so the
  gradient cannot sit on compressor_forward itself without hiding the state-cache mutation;
  ``forward_with_gradient`` calls the forward on detached inputs and this operator on the originals.

Each operator's argument list is written once, below (``FORWARD``, ``BACKWARD``, ``ANCHOR``): the
schemas, the kernels, the fake kernels, the autograd context and the NPU stand-in's upstream
schemas (kvcomp.npu_compat) all derive from it.

The options that change the arithmetic (``precision``, ``profile``) are arguments of the operators.
``forward_with_gradient`` resolves them when the forward runs (from its own arguments, else the
defaults of ``kvcomp.set_default_options`` in force then) and the anchor hands them to the
backward: a change of the defaults between a forward and its ``.backward()`` does not change the
gradient, and a compiled graph holds them as constants. An operator called directly with
``precision`` / ``profile`` None uses the defaults in force at that call.

A call that records no gradient, in eager mode on plain tensors, runs the forward operator's
implementation without the dispatcher (``_dispatch_free``): torch.library's Python-level dispatch of a
mutating custom operator costs 100-250 us a call (docs/python.md), as much as a one-token decode
call's own work on small models. It bumps ``state_cache``'s version counter as the dispatched
operator does. Under torch.compile, a torch function or dispatch mode, functorch transforms or tensor
subclasses the operator is dispatched as before, so those still see it.
"""

import collections
from typing import Optional

import torch
from torch import Tensor

from . import _functional
from ._errors import NULL_POINTER, KvcompError

_REQUIRED = object()


class Signature:
    """One operator's arguments, in order: (name, schema type, default or _REQUIRED) each."""

    def __init__(self, op, params, returns, mutates=()):
        self.op = op
        self.params = tuple(params)
        self.names = tuple(p[0] for p in self.params)
        defaults = [p[2] for p in self.params if p[2] is not _REQUIRED]
        self.Args = collections.namedtuple(op + "_args", self.names, defaults=defaults)
        self.returns = returns
        self.mutates = tuple(mutates)

    def bind(self, args, kwargs):
        """The call's arguments by name (defaults filled in)."""
        return self.Args(*args, **kwargs)

    def schema(self, name="", count=None, rename=None):
        """The schema string of the first ``count`` arguments (all by default), ``rename`` mapping
        argument names to other ones (the upstream operators' names)."""
        rename = rename or {}
        parts = []
        for n, t, d in self.params[:count]:
            if n in self.mutates:
                t = t + "(a!)"
            s = f"{t} {rename.get(n, n)}"
            if d is not _REQUIRED:
                s += "=" + ("None" if d is None else repr(d) if isinstance(d, (bool, int, float)) else f'"{d}"')
            parts.append(s)
        return f"{name}({', '.join(parts)}) -> {self.returns}"


FORWARD = Signature(
    "compressor_forward",
    [
        ("x", "Tensor", _REQUIRED),
        ("wkv", "Tensor", _REQUIRED),
        ("wgate", "Tensor", _REQUIRED),
        ("state_cache", "Tensor", _REQUIRED),
        ("ape", "Tensor", _REQUIRED),
        ("state_block_table", "Tensor?", _REQUIRED),
        ("cu_seqlens", "Tensor?", _REQUIRED),
        ("seqused", "Tensor?", _REQUIRED),
        ("start_pos", "Tensor?", _REQUIRED),
        ("cmp_ratio", "int", _REQUIRED),
        ("coff", "int", _REQUIRED),
        ("cache_mode", "int", _REQUIRED),
        ("grad_enabled", "bool", _REQUIRED),
        ("prepared_weights", "Tensor?", None),
        ("profile", "str?", None),
        ("row_stable", "bool", True),
    ],
    "(Tensor, Tensor, Tensor)",
    mutates=("state_cache",),
)
# The upstream operator's arguments: the first ones of FORWARD (kvcomp.npu_compat).
FORWARD_UPSTREAM = 13

BACKWARD = Signature(
    "compressor_backward",
    [
        ("d_cmp_kv", "Tensor", _REQUIRED),
        ("x", "Tensor", _REQUIRED),
        ("wkv", "Tensor", _REQUIRED),
        ("wgate", "Tensor", _REQUIRED),
        ("softmax_score", "Tensor", _REQUIRED),
        ("kv", "Tensor", _REQUIRED),
        ("cu_seqlens", "Tensor?", _REQUIRED),
        ("seqused", "Tensor?", _REQUIRED),
        ("start_pos", "Tensor?", _REQUIRED),
        ("cmp_ratio", "int", _REQUIRED),
        ("coff", "int", _REQUIRED),
        ("fp32_weight_grads", "bool", False),
        ("float64_d_ape", "bool", False),
        ("precision", "str?", None),
        ("profile", "str?", None),
        ("row_stable", "bool", True),
    ],
    "(Tensor, Tensor, Tensor, Tensor)",
)
BACKWARD_UPSTREAM = 11

# The anchor: cmp_kv, then the backward's inputs that the forward knows, then what the forward
# resolved for the backward.
ANCHOR = Signature(
    "compressor_grad_anchor",
    [
        ("cmp_kv", "Tensor", _REQUIRED),
        ("x", "Tensor", _REQUIRED),
        ("wkv", "Tensor", _REQUIRED),
        ("wgate", "Tensor", _REQUIRED),
        ("ape", "Tensor", _REQUIRED),
        ("softmax_score", "Tensor", _REQUIRED),
        ("kv", "Tensor", _REQUIRED),
        ("cu_seqlens", "Tensor?", _REQUIRED),
        ("seqused", "Tensor?", _REQUIRED),
        ("start_pos", "Tensor?", _REQUIRED),
        ("cmp_ratio", "int", _REQUIRED),
        ("coff", "int", _REQUIRED),
        ("precision", "str?", None),
        ("profile", "str?", None),
        ("row_stable", "bool", True),
    ],
    "Tensor",
)
# The anchor's inputs that receive a gradient, by name.
_DIFFERENTIABLE = ("x", "wkv", "wgate", "ape")


def _leading_shape(x: Tensor, cu_seqlens: Optional[Tensor], cmp_ratio: int):
    """Leading dims of cmp_kv / softmax_score / kv. Written with shape arithmetic only, so that it works
    on symbolic sizes inside torch.compile (no data-dependent value is read)."""
    r = max(cmp_ratio, 1)
    if x.dim() == 3:
        return (x.shape[0], (x.shape[1] + r - 1) // r)
    if x.dim() == 2:
        batches = cu_seqlens.shape[0] - 1 if cu_seqlens is not None and cu_seqlens.dim() == 1 else 0
        return (torch.sym_min(x.shape[0], x.shape[0] // r + batches),)
    return (0,)


def _forward(a, empties=True):
    """The implementation of compressor_forward on its bound arguments ``a``, dispatched or called
    directly (_dispatch_free). Without grad_enabled the intermediates are empty [0] tensors, or None when
    not ``empties`` (a caller that drops them; 1.7 us each)."""
    cmp_kv, softmax_score, kv = _functional.compressor_forward(
        a.x,
        a.wkv,
        a.wgate,
        a.state_cache,
        a.ape,
        a.cmp_ratio,
        state_block_table=a.state_block_table,
        cu_seqlens=a.cu_seqlens,
        seqused=a.seqused,
        start_pos=a.start_pos,
        coff=a.coff,
        cache_mode=a.cache_mode,
        grad_enabled=a.grad_enabled,
        prepared_weights=a.prepared_weights,
        profile=a.profile,
        row_stable=a.row_stable,
    )
    if not a.grad_enabled and empties:
        softmax_score = a.x.new_empty((0,), dtype=torch.float32)
        kv = a.x.new_empty((0,), dtype=torch.float32)
    return cmp_kv, softmax_score, kv


@torch.library.custom_op("kvcomp::compressor_forward", mutates_args=FORWARD.mutates, schema=FORWARD.schema())
def compressor_forward_op(*args, **kwargs):
    """aclnnCompressor as a PyTorch operator (the counterpart of upstream ``_compressor_forward``).

    Returns (cmp_kv, softmax_score, kv); without ``grad_enabled`` the last two are empty fp32
    tensors of shape [0]. ``state_cache`` is updated in place. Shapes: see ``kvcomp.torch.compressor``.
    """
    return _forward(FORWARD.bind(args, kwargs))


@compressor_forward_op.register_fake
def _compressor_forward_fake(*args, **kwargs):
    a = FORWARD.bind(args, kwargs)
    lead = _leading_shape(a.x, a.cu_seqlens, a.cmp_ratio)
    d = a.wkv.shape[0] // a.coff if a.coff > 0 else 0
    cmp_kv = a.x.new_empty(lead + (d,))
    if a.grad_enabled:
        block = lead + (a.coff * a.cmp_ratio, d)
        return cmp_kv, a.x.new_empty(block, dtype=torch.float32), a.x.new_empty(block, dtype=torch.float32)
    return cmp_kv, a.x.new_empty((0,), dtype=torch.float32), a.x.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("kvcomp::compressor_backward", mutates_args=(), schema=BACKWARD.schema())
def compressor_backward_op(*args, **kwargs):
    """aclnnCompressorGrad as a PyTorch operator (the counterpart of upstream ``_compressor_backward``).

    Returns (d_x, d_wkv, d_wgate, d_ape): d_x io shape of x, d_wkv / d_wgate io [coff*D, H] (fp32,
    unrounded, with ``fp32_weight_grads``: CPU tensors only), d_ape fp32 [cmp_ratio, coff*D] (float64
    with ``float64_d_ape``: CPU tensors only).
    """
    a = BACKWARD.bind(args, kwargs)
    return _functional.compressor_grad(
        a.x,
        a.wkv,
        a.wgate,
        a.d_cmp_kv,
        a.softmax_score,
        a.kv,
        a.cmp_ratio,
        cu_seqlens=a.cu_seqlens,
        seqused=a.seqused,
        start_pos=a.start_pos,
        coff=a.coff,
        fp32_weight_grads=a.fp32_weight_grads,
        float64_d_ape=a.float64_d_ape,
        precision=a.precision,
        profile=a.profile,
        row_stable=a.row_stable,
    )


@compressor_backward_op.register_fake
def _compressor_backward_fake(*args, **kwargs):
    a = BACKWARD.bind(args, kwargs)
    w_dt = torch.float32 if a.fp32_weight_grads else a.wkv.dtype
    return (
        a.x.new_empty(a.x.shape),
        a.wkv.new_empty(a.wkv.shape, dtype=w_dt),
        # (an empty [0] tensor for the model operator's call without wgate)
        a.wkv.new_empty(a.wgate.shape if a.wgate is not None else (0,), dtype=w_dt),
        a.wkv.new_empty((a.cmp_ratio, a.wkv.shape[0]), dtype=torch.float64 if a.float64_d_ape else torch.float32),
    )


@torch.library.custom_op("kvcomp::compressor_grad_anchor", mutates_args=(), schema=ANCHOR.schema())
def compressor_grad_anchor_op(*args, **kwargs):
    """Returns a copy of ``cmp_kv`` whose autograd formula is CompressorGrad wrt x, wkv, wgate, ape.

    Why it exists: PyTorch refuses ``register_autograd`` on an operator that mutates an argument, and
    compressor_forward mutates the state cache. So ``forward_with_gradient`` runs compressor_forward on
    detached inputs and attaches the gradient here, with softmax_score / kv from that forward and the
    precision and profile resolved then. (A copy because a custom operator may not return a view of its
    input; cmp_kv is small.)
    """
    return ANCHOR.bind(args, kwargs).cmp_kv.clone()


@compressor_grad_anchor_op.register_fake
def _compressor_grad_anchor_fake(*args, **kwargs):
    cmp_kv = ANCHOR.bind(args, kwargs).cmp_kv
    return cmp_kv.new_empty(cmp_kv.shape)


# What the anchor's context keeps: its tensors (saved, so that autograd's version check reports an
# input changed in place before the backward, start_pos advanced by a decode loop for one) and the
# rest as attributes.
_SAVED = ("x", "wkv", "wgate", "softmax_score", "kv", "cu_seqlens", "seqused", "start_pos")
_KEPT = ("cmp_ratio", "coff", "precision", "profile", "row_stable")


def _anchor_setup_context(ctx, inputs, output):
    a = ANCHOR.bind(inputs, {})
    ctx.save_for_backward(*(getattr(a, n) for n in _SAVED))
    for n in _KEPT:
        setattr(ctx, n, getattr(a, n))


def _anchor_backward(ctx, d_cmp_kv):
    saved = dict(zip(_SAVED, ctx.saved_tensors))
    kept = {n: getattr(ctx, n) for n in _KEPT}
    grads = torch.ops.kvcomp.compressor_backward(
        **{
            n: d_cmp_kv.contiguous() if n == "d_cmp_kv" else saved[n] if n in saved else kept[n]
            for n in BACKWARD.names
            if n in saved or n in kept or n == "d_cmp_kv"
        }
    )
    need = dict(zip(ANCHOR.names, ctx.needs_input_grad))
    by_name = dict(zip(_DIFFERENTIABLE, grads))
    return tuple(by_name[n] if n in by_name and need[n] else None for n in ANCHOR.names)


torch.library.register_autograd("kvcomp::compressor_grad_anchor", _anchor_backward, setup_context=_anchor_setup_context)


try:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode
except ImportError:  # a torch without it: always dispatch
    _in_dispatch_mode = None

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dispatch_free(tensors, state_cache) -> bool:
    """Whether calling _forward directly is what dispatching compressor_forward would do: eager mode,
    no torch function or dispatch mode active, plain tensors outside functorch transforms, and a state
    cache that does not require a gradient (the caller has checked that no gradient is recorded)."""
    if (
        _in_dispatch_mode is None
        or _in_dispatch_mode()
        or torch._C._is_torch_function_mode_enabled()
        or torch.compiler.is_compiling()
    ):
        return False
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for t in tensors:  # a loop, not all(<generator>): 1 us less per call
        if t is not None and (type(t) not in _PLAIN_TENSOR_TYPES or wrapped(t)):
            return False  # anything else (numpy arrays too) meets the operator's schema, as before
    return state_cache is not None and not state_cache.requires_grad


def resolved_options(precision=None, profile=None):
    """(precision, profile): the given ones, else the defaults in force now. The defaults dict is read
    without its lock (one dict read each is atomic), so that torch.compile traces it: the graph then
    holds the values, guarded, instead of a read at run time."""
    d = _functional._defaults
    return (d["precision"] if precision is None else precision, d["profile"] if profile is None else profile)


def forward_with_gradient(
    x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff, cache_mode,
    keep_intermediates, prepared_weights=None, *, precision=None, profile=None, row_stable=True, _empties=True,
):
    """(cmp_kv, softmax_score, kv) of compressor_forward, cmp_kv carrying CompressorGrad whenever any of
    x, wkv, wgate, ape requires a gradient and grad mode is on (the intermediates are then kept; else
    they are kept only when ``keep_intermediates``, and are empty [0] tensors otherwise). Shared by
    ``kvcomp.torch.compressor``, kvcomp.nn and the cann_ops_transformer stand-in (npu_compat).
    ``prepared_weights``: ``kvcomp.prepare_weights(wkv, wgate)`` of these weights, or None.
    ``precision`` / ``profile``: None for the defaults in force now; the backward of this call uses the
    values resolved here, whatever the defaults are when it runs. ``row_stable``:
    ``kvcomp.compressor_forward``'s (the backward runs with the same)."""
    precision, profile = resolved_options(precision, profile)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, wkv, wgate, ape))
    tensors = (x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, prepared_weights)
    if not needs_grad and _dispatch_free(tensors, state_cache):
        # No detach here: _functional takes detached views of its inputs itself.
        a = FORWARD.Args(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                         cmp_ratio, coff, cache_mode, bool(keep_intermediates), prepared_weights, profile,
                         bool(row_stable))
        out = _forward(a, _empties)
        torch.autograd.graph.increment_version(state_cache)  # as the dispatcher does for a mutated argument
        return out
    cmp_kv, softmax_score, kv = torch.ops.kvcomp.compressor_forward(
        x.detach(),
        wkv.detach(),
        wgate.detach(),
        state_cache,
        ape.detach(),
        state_block_table,
        cu_seqlens,
        seqused,
        start_pos,
        cmp_ratio,
        coff,
        cache_mode,
        bool(keep_intermediates or needs_grad),
        prepared_weights,
        profile,
        bool(row_stable),
    )
    if needs_grad:
        cmp_kv = torch.ops.kvcomp.compressor_grad_anchor(
            cmp_kv, x, wkv, wgate, ape, softmax_score, kv, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
            precision, profile, bool(row_stable),
        )
    return cmp_kv, softmax_score, kv


def compressor(
    x: Tensor,
    wkv: Tensor,
    wgate: Tensor,
    state_cache: Tensor,
    ape: Tensor,
    cmp_ratio: int = 4,
    *,
    state_block_table: Optional[Tensor] = None,
    cu_seqlens: Optional[Tensor] = None,
    seqused: Optional[Tensor] = None,
    start_pos: Optional[Tensor] = None,
    coff: int = 1,
    cache_mode: int = 1,
) -> Tensor:
    """KV compression of compressed sparse attention, with autograd (``cann_ops_transformer.compressor``).

    Per batch and per block of ``cmp_ratio`` tokens aligned on the global position ``start_pos + s``:
    ``kv = x @ wkv.T``, ``score = x @ wgate.T + ape[pos % cmp_ratio]``, a softmax over the block's
    rows per column (with ``coff = 2`` the block also holds the previous block's tokens), and
    ``cmp_kv = sum(softmax * kv)``. Tokens a later call needs are written to ``state_cache``; block
    rows before ``start_pos`` are read from it.

    Args (D head dim, C = coff*D, r = cmp_ratio, io = bfloat16 | float16 | float32, all on CPU):
        x: io, BSH ``[B, S, H]`` or TH ``[T, H]`` (TH needs ``cu_seqlens``).
        wkv: io ``[C, H]``; rows ``[0, D)`` are the previous-block ("a") weights when coff = 2.
        wgate: io ``[C, H]``.
        state_cache: float32 ``[block_num, block_size, 2*C]`` (kv state then score state per slot),
            updated in place; dim 0 may be strided. Never receives a gradient.
        ape: float32 ``[r, C]``, positional bias added to the score.
        cmp_ratio: tokens per compressed row, ``r``.
        state_block_table: int32, required (as on the Ascend 950): cache_mode 1 (paged)
            ``[B, ceil((max(start_pos) + S) / block_size)]`` (block id 0 = do not write);
            cache_mode 2 (ring) ``[B]``.
        cu_seqlens: int32 ``[B+1]`` prefix sums of the sequence lengths (TH only).
        seqused: int32 ``[B]`` tokens used per sequence (default: all).
        start_pos: int32 ``[B]`` global position of each sequence's first token (default: 0).
        coff: 1 or 2 (2: overlapping blocks, C4A / C4Li).
        cache_mode: 1 paged, 2 ring.

    Returns:
        cmp_kv: io, BSH ``[B, ceil(S/r), D]`` or TH ``[min(T, T//r + B), D]``; rows past a batch's
        compressed blocks are zero.

    Autograd gives gradients for x, wkv, wgate and ape (aclnnCompressorGrad). The forward keeps the
    fp32 intermediates (two tensors of ``rows x coff*r x D``) whenever any of those four requires a
    gradient and grad mode is on; under ``torch.no_grad()`` nothing is kept. Gradient of cache rows,
    tail tokens and tokens past ``seqused`` is zero.

    Profile / precision / threads: ``kvcomp.set_default_options``, read when the forward runs: the
    backward of this call uses the precision and profile in force at its forward. The default
    profile ``"extended"`` also accepts float32 io and any D, H, 1 <= r <= 1024; ``"aclnn"``
    restricts to the NPU's ranges.

    Raises:
        KvcompError: the call was rejected (``.code`` = aclnn status, ``.message`` = the rule);
            nothing was written, ``state_cache`` included.
    """
    if state_block_table is None:
        raise KvcompError(
            NULL_POINTER,
            "[kvcomp] state_block_table (= None) must be given: the operator needs it, as "
            "aclnnCompressor on the Ascend 950 does (cache_mode 1: int32 [B, blocks per sequence], "
            "0 = do not write; cache_mode 2: int32 [B])",
        )
    cmp_kv, _, _ = forward_with_gradient(
        x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
        cache_mode, False
    )
    return cmp_kv


# The operator with the model-level epilogue (RMSNorm, RoPE) and optional APE: three more operators,
# apart from the three above so that theirs stay the upstream operator's (npu_compat derives the
# upstream schemas from them). The same kernels; arguments that are None mean "not used".
_EPILOGUE_PARAMS = [
    ("norm_weight", "Tensor?", None),
    ("norm_eps", "float", 1e-6),
    ("rope_cos", "Tensor?", None),
    ("rope_sin", "Tensor?", None),
]


def _optional(params, names):
    """``params`` with the schema type of ``names`` made optional."""
    return [(n, t + "?" if n in names and not t.endswith("?") else t, d) for n, t, d in params]


MODEL_FORWARD = Signature(
    "model_compressor_forward",
    _optional(FORWARD.params[:FORWARD_UPSTREAM], ("ape", "wgate")) + _EPILOGUE_PARAMS + list(FORWARD.params[FORWARD_UPSTREAM:]),
    "(Tensor, Tensor, Tensor, Tensor)",
    mutates=("state_cache",),
)
MODEL_BACKWARD = Signature(
    "model_compressor_backward",
    _optional(BACKWARD.params[:BACKWARD_UPSTREAM], ("wgate",))
    + [("with_ape", "bool", True), ("pooled", "Tensor?", None)]
    + _EPILOGUE_PARAMS
    + list(BACKWARD.params[BACKWARD_UPSTREAM:]),
    "(Tensor, Tensor, Tensor, Tensor, Tensor)",
)
MODEL_ANCHOR = Signature(
    "model_compressor_grad_anchor",
    _optional(ANCHOR.params[:12], ("ape", "wgate"))
    + [("pooled", "Tensor?", None)]
    + _EPILOGUE_PARAMS
    + list(ANCHOR.params[12:]),
    "Tensor",
)
_MODEL_DIFFERENTIABLE = ("x", "wkv", "wgate", "ape", "norm_weight")


def _has_epilogue(a):
    return a.norm_weight is not None or a.rope_cos is not None or a.rope_sin is not None


def _model_forward(a):
    """model_compressor_forward on its bound arguments ``a``: (cmp_kv, softmax_score, kv, pooled), the
    ones not computed as empty [0] tensors."""
    out = _functional.compressor_forward(
        a.x, a.wkv, a.wgate, a.state_cache, a.ape, a.cmp_ratio, state_block_table=a.state_block_table,
        cu_seqlens=a.cu_seqlens, seqused=a.seqused, start_pos=a.start_pos, coff=a.coff, cache_mode=a.cache_mode,
        grad_enabled=a.grad_enabled, prepared_weights=a.prepared_weights, profile=a.profile,
        row_stable=a.row_stable, norm_weight=a.norm_weight, norm_eps=a.norm_eps, rope_cos=a.rope_cos,
        rope_sin=a.rope_sin)
    def empty(t, dtype=torch.float32):  # one each: a custom operator's outputs may not alias
        return a.x.new_empty((0,), dtype=dtype) if t is None else t

    cmp_kv, softmax_score, kv = out[:3]
    return cmp_kv, empty(softmax_score), empty(kv), empty(out[3] if len(out) > 3 else None, a.x.dtype)


@torch.library.custom_op("kvcomp::model_compressor_forward", mutates_args=MODEL_FORWARD.mutates,
                         schema=MODEL_FORWARD.schema())
def model_compressor_forward_op(*args, **kwargs):
    """compressor_forward with the model-level epilogue (``norm_weight``, ``norm_eps``, ``rope_cos``,
    ``rope_sin``; see ``kvcomp.compressor_forward``) and ``ape`` optional. Returns (cmp_kv,
    softmax_score, kv, pooled): ``pooled`` (the rows before the epilogue, cmp_kv's shape) with
    ``grad_enabled`` and an epilogue, else an empty [0] tensor of x's dtype; softmax_score and kv as
    compressor_forward's."""
    return _model_forward(MODEL_FORWARD.bind(args, kwargs))


@model_compressor_forward_op.register_fake
def _model_compressor_forward_fake(*args, **kwargs):
    a = MODEL_FORWARD.bind(args, kwargs)
    cmp_kv, softmax_score, kv = _compressor_forward_fake(
        *(getattr(a, n) for n in FORWARD.names[:FORWARD_UPSTREAM]))
    pooled = a.x.new_empty(cmp_kv.shape if a.grad_enabled and _has_epilogue(a) else (0,))
    return cmp_kv, softmax_score, kv, pooled


@torch.library.custom_op("kvcomp::model_compressor_backward", mutates_args=(), schema=MODEL_BACKWARD.schema())
def model_compressor_backward_op(*args, **kwargs):
    """The backward of model_compressor_forward: (d_x, d_wkv, d_wgate, d_ape, d_norm_weight), d_ape an
    empty [0] fp32 tensor without ``with_ape``, d_norm_weight (norm_weight's shape and dtype) an empty
    [0] tensor without ``norm_weight``. ``d_cmp_kv`` is the gradient of the epilogue's rows."""
    a = MODEL_BACKWARD.bind(args, kwargs)
    grads = _functional.compressor_grad(
        a.x, a.wkv, a.wgate, a.d_cmp_kv, a.softmax_score, a.kv, a.cmp_ratio, cu_seqlens=a.cu_seqlens,
        seqused=a.seqused, start_pos=a.start_pos, coff=a.coff, fp32_weight_grads=a.fp32_weight_grads,
        float64_d_ape=a.float64_d_ape, precision=a.precision, profile=a.profile, row_stable=a.row_stable,
        with_ape=a.with_ape, pooled=a.pooled, norm_weight=a.norm_weight, norm_eps=a.norm_eps, rope_cos=a.rope_cos,
        rope_sin=a.rope_sin)
    d_x, d_wkv, d_wgate, d_ape = grads[:4]
    if d_ape is None:
        d_ape = a.x.new_empty((0,), dtype=torch.float32)
    if d_wgate is None:  # a call without wgate
        d_wgate = a.x.new_empty((0,), dtype=d_wkv.dtype)
    d_norm = grads[4] if len(grads) > 4 else a.x.new_empty((0,))
    return d_x, d_wkv, d_wgate, d_ape, d_norm


@model_compressor_backward_op.register_fake
def _model_compressor_backward_fake(*args, **kwargs):
    a = MODEL_BACKWARD.bind(args, kwargs)
    d_x, d_wkv, d_wgate, d_ape = _compressor_backward_fake(*(getattr(a, n) for n in BACKWARD.names[:BACKWARD_UPSTREAM]),
                                                           fp32_weight_grads=a.fp32_weight_grads,
                                                           float64_d_ape=a.float64_d_ape)
    if not a.with_ape:
        d_ape = a.x.new_empty((0,), dtype=torch.float32)
    d_norm = a.norm_weight.new_empty(a.norm_weight.shape) if a.norm_weight is not None else a.x.new_empty((0,))
    return d_x, d_wkv, d_wgate, d_ape, d_norm


@torch.library.custom_op("kvcomp::model_compressor_grad_anchor", mutates_args=(), schema=MODEL_ANCHOR.schema())
def model_compressor_grad_anchor_op(*args, **kwargs):
    """compressor_grad_anchor for model_compressor_forward: a copy of ``cmp_kv`` whose autograd formula
    is model_compressor_backward wrt x, wkv, wgate, ape and norm_weight."""
    return MODEL_ANCHOR.bind(args, kwargs).cmp_kv.clone()


@model_compressor_grad_anchor_op.register_fake
def _model_compressor_grad_anchor_fake(*args, **kwargs):
    cmp_kv = MODEL_ANCHOR.bind(args, kwargs).cmp_kv
    return cmp_kv.new_empty(cmp_kv.shape)


_MODEL_SAVED = ("x", "wkv", "wgate", "softmax_score", "kv", "pooled", "norm_weight", "rope_cos", "rope_sin",
                "cu_seqlens", "seqused", "start_pos")
_MODEL_KEPT = ("cmp_ratio", "coff", "norm_eps", "precision", "profile", "row_stable")


def _model_anchor_setup_context(ctx, inputs, output):
    a = MODEL_ANCHOR.bind(inputs, {})
    ctx.save_for_backward(*(getattr(a, n) for n in _MODEL_SAVED))
    for n in _MODEL_KEPT:
        setattr(ctx, n, getattr(a, n))
    ctx.with_ape = a.ape is not None


def _model_anchor_backward(ctx, d_cmp_kv):
    args = dict(zip(_MODEL_SAVED, ctx.saved_tensors))
    args.update({n: getattr(ctx, n) for n in _MODEL_KEPT})
    grads = torch.ops.kvcomp.model_compressor_backward(d_cmp_kv=d_cmp_kv.contiguous(), with_ape=ctx.with_ape, **args)
    need = dict(zip(MODEL_ANCHOR.names, ctx.needs_input_grad))
    by_name = dict(zip(_MODEL_DIFFERENTIABLE, grads))
    return tuple(by_name[n] if n in by_name and need[n] else None for n in MODEL_ANCHOR.names)


torch.library.register_autograd("kvcomp::model_compressor_grad_anchor", _model_anchor_backward,
                                setup_context=_model_anchor_setup_context)


def model_compressor(x, wkv, wgate, ape, cmp_ratio, *, state_cache, state_block_table, cu_seqlens=None,
                     seqused=None, start_pos=None, coff=1, cache_mode=1, norm_weight=None, norm_eps=1e-6,
                     rope_cos=None, rope_sin=None, prepared_weights=None, precision=None, profile=None,
                     row_stable=True):
    """cmp_kv of the operator with the model-level epilogue (``kvcomp.compressor_forward``'s
    ``norm_weight`` / ``norm_eps`` / ``rope_cos`` / ``rope_sin``) and optional APE (``ape`` None), with
    autograd to x, wkv, wgate, ape and norm_weight (registered operators: torch.compile traces them,
    fullgraph). ``precision`` / ``profile``: None for the defaults in force now, resolved here, at the
    forward. ``prepared_weights``: as for ``forward_with_gradient``."""
    precision, profile = resolved_options(precision, profile)
    differentiable = (x, wkv, wgate, ape, norm_weight)
    needs_grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in differentiable)
    a = MODEL_FORWARD.Args(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                           int(cmp_ratio), int(coff), int(cache_mode), needs_grad, norm_weight, float(norm_eps),
                           rope_cos, rope_sin, prepared_weights, profile, bool(row_stable))
    if not needs_grad and _dispatch_free(differentiable + (state_cache, state_block_table, cu_seqlens, seqused,
                                                           start_pos, rope_cos, rope_sin, prepared_weights),
                                         state_cache):
        cmp_kv = _model_forward(a)[0]
        torch.autograd.graph.increment_version(state_cache)  # as the dispatcher does for a mutated argument
        return cmp_kv
    detached = a._replace(**{n: getattr(a, n).detach() for n in ("x", "wkv", "wgate", "ape", "norm_weight")
                             if getattr(a, n) is not None})
    cmp_kv, softmax_score, kv, pooled = torch.ops.kvcomp.model_compressor_forward(*detached)
    if not needs_grad:
        return cmp_kv
    return torch.ops.kvcomp.model_compressor_grad_anchor(
        cmp_kv, x, wkv, wgate, ape, softmax_score, kv, cu_seqlens, seqused, start_pos, int(cmp_ratio), int(coff),
        pooled if _has_epilogue(a) else None, norm_weight, float(norm_eps), rope_cos, rope_sin,
        precision, profile, bool(row_stable))
