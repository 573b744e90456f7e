"""PyTorch operator: ``kvcomp.torch.compressor``, a drop-in for ``cann_ops_transformer.compressor``.

A script written for the NPU runs on CPU tensors by changing only its import::

    import kvcomp.torch as cann_ops_transformer   # was: import cann_ops_transformer

A script that cannot be edited (``import cann_ops_transformer.ops``, ``torch.ops.cann_ops_transformer.*``)
runs after ``install_cann_ops_transformer()``, an explicit opt-in (kvcomp.npu_compat).

Three custom operators are registered with torch.library (schema, CPU kernel through the C++ core,
fake kernel giving output shapes, so torch.compile traces them without graph breaks):

* ``torch.ops.kvcomp.compressor_forward`` (aclnnCompressor): returns (cmp_kv, softmax_score, kv)
  and mutates ``state_cache`` in place, which its schema declares (``mutates_args``).
* ``torch.ops.kvcomp.compressor_backward`` (aclnnCompressorGrad): returns (d_x, d_wkv, d_wgate,
  d_ape).
* ``torch.ops.kvcomp.compressor_grad_anchor``: returns a copy of cmp_kv; its ``register_autograd``
  formula is CompressorGrad. PyTorch accepts ``register_autograd`` only on operators that mutate
  nothing, so the gradient cannot sit on compressor_forward itself without hiding the state-cache
  mutation (as upstream does, spec 10 item 14); ``compressor`` calls the forward on detached inputs
  and this operator on the originals.

A call that records no gradient, in eager mode on plain tensors, runs the forward operator's
implementation without the dispatcher (``_dispatch_free``): torch.library's Python-level dispatch of a
mutating custom operator costs 100-250 us a call (docs/python.md), as much as a one-token decode
call's own work on small models. It bumps ``state_cache``'s version counter as the dispatched
operator does. Under torch.compile, a torch function or dispatch mode, functorch transforms or tensor
subclasses the operator is dispatched as before, so those still see it.
"""

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _functional
from ._errors import NULL_POINTER, KvcompError

__all__ = ["compressor", "install_cann_ops_transformer"]


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


@torch.library.custom_op("kvcomp::compressor_forward", mutates_args=("state_cache",))
def compressor_forward_op(
    x: Tensor,
    wkv: Tensor,
    wgate: Tensor,
    state_cache: Tensor,
    ape: Tensor,
    state_block_table: Optional[Tensor],
    cu_seqlens: Optional[Tensor],
    seqused: Optional[Tensor],
    start_pos: Optional[Tensor],
    cmp_ratio: int,
    coff: int,
    cache_mode: int,
    grad_enabled: bool,
    prepared_weights: Optional[Tensor] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """aclnnCompressor as a PyTorch operator (the counterpart of upstream ``_compressor_forward``).

    Returns (cmp_kv, softmax_score, kv); without ``grad_enabled`` the last two are empty fp32
    tensors of shape [0]. ``state_cache`` is updated in place. Shapes: see ``compressor``.
    """
    return _forward(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                    cmp_ratio, coff, cache_mode, grad_enabled, prepared_weights)


def _forward(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
             cache_mode, grad_enabled, prepared_weights, empties=True):
    """The implementation of compressor_forward_op, dispatched or called directly (_dispatch_free).
    Without grad_enabled the intermediates are empty [0] tensors, or None when not ``empties`` (a
    caller that drops them; 1.7 us each)."""
    cmp_kv, softmax_score, kv = _functional.compressor_forward(
        x,
        wkv,
        wgate,
        state_cache,
        ape,
        cmp_ratio,
        state_block_table=state_block_table,
        cu_seqlens=cu_seqlens,
        seqused=seqused,
        start_pos=start_pos,
        coff=coff,
        cache_mode=cache_mode,
        grad_enabled=grad_enabled,
        prepared_weights=prepared_weights,
    )
    if not grad_enabled and empties:
        softmax_score = x.new_empty((0,), dtype=torch.float32)
        kv = x.new_empty((0,), dtype=torch.float32)
    return cmp_kv, softmax_score, kv


try:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _in_dispatch_mode
except ImportError:  # a torch without it: always dispatch
    _in_dispatch_mode = None

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)


def _dispatch_free(tensors, state_cache) -> bool:
    """Whether calling _forward directly is what dispatching compressor_forward_op would do: eager mode,
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


@compressor_forward_op.register_fake
def _compressor_forward_fake(
    x,
    wkv,
    wgate,
    state_cache,
    ape,
    state_block_table,
    cu_seqlens,
    seqused,
    start_pos,
    cmp_ratio,
    coff,
    cache_mode,
    grad_enabled,
    prepared_weights=None,
):
    lead = _leading_shape(x, cu_seqlens, cmp_ratio)
    d = wkv.shape[0] // coff if coff > 0 else 0
    cmp_kv = x.new_empty(lead + (d,))
    if grad_enabled:
        block = lead + (coff * cmp_ratio, d)
        return cmp_kv, x.new_empty(block, dtype=torch.float32), x.new_empty(block, dtype=torch.float32)
    return cmp_kv, x.new_empty((0,), dtype=torch.float32), x.new_empty((0,), dtype=torch.float32)


@torch.library.custom_op("kvcomp::compressor_backward", mutates_args=())
def compressor_backward_op(
    d_cmp_kv: Tensor,
    x: Tensor,
    wkv: Tensor,
    wgate: Tensor,
    softmax_score: Tensor,
    kv: Tensor,
    cu_seqlens: Optional[Tensor],
    seqused: Optional[Tensor],
    start_pos: Optional[Tensor],
    cmp_ratio: int,
    coff: int,
    fp32_weight_grads: bool = False,
    float64_d_ape: bool = False,
) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """aclnnCompressorGrad as a PyTorch operator (the counterpart of upstream ``_compressor_backward``).

    Returns (d_x, d_wkv, d_wgate, d_ape): d_x io shape of x, d_wkv / d_wgate io [coff*D, H] (fp32,
    unrounded, with ``fp32_weight_grads``: CPU tensors only), d_ape fp32 [cmp_ratio, coff*D] (float64
    with ``float64_d_ape``: CPU tensors only).
    """
    return _functional.compressor_grad(
        x,
        wkv,
        wgate,
        d_cmp_kv,
        softmax_score,
        kv,
        cmp_ratio,
        cu_seqlens=cu_seqlens,
        seqused=seqused,
        start_pos=start_pos,
        coff=coff,
        fp32_weight_grads=fp32_weight_grads,
        float64_d_ape=float64_d_ape,
    )


@compressor_backward_op.register_fake
def _compressor_backward_fake(
    d_cmp_kv, x, wkv, wgate, softmax_score, kv, cu_seqlens, seqused, start_pos, cmp_ratio, coff,
    fp32_weight_grads=False, float64_d_ape=False,
):
    w_dt = torch.float32 if fp32_weight_grads else wkv.dtype
    return (
        x.new_empty(x.shape),
        wkv.new_empty(wkv.shape, dtype=w_dt),
        wgate.new_empty(wgate.shape, dtype=w_dt),
        wkv.new_empty((cmp_ratio, wkv.shape[0]), dtype=torch.float64 if float64_d_ape else torch.float32),
    )


@torch.library.custom_op("kvcomp::compressor_grad_anchor", mutates_args=())
def compressor_grad_anchor_op(
    cmp_kv: Tensor,
    x: Tensor,
    wkv: Tensor,
    wgate: Tensor,
    ape: Tensor,
    softmax_score: Tensor,
    kv: Tensor,
    cu_seqlens: Optional[Tensor],
    seqused: Optional[Tensor],
    start_pos: Optional[Tensor],
    cmp_ratio: int,
    coff: int,
) -> Tensor:
    """Returns a copy of ``cmp_kv`` whose autograd formula is CompressorGrad wrt x, wkv, wgate, ape.

    Why it exists: PyTorch refuses ``register_autograd`` on an operator that mutates an argument, and
    compressor_forward_op mutates the state cache. So ``compressor`` runs compressor_forward_op on
    detached inputs and attaches the gradient here, with softmax_score / kv from that forward.
    (It is a copy because a custom operator may not return a view of its input; cmp_kv is small.)
    """
    return cmp_kv.clone()


@compressor_grad_anchor_op.register_fake
def _compressor_grad_anchor_fake(
    cmp_kv, x, wkv, wgate, ape, softmax_score, kv, cu_seqlens, seqused, start_pos, cmp_ratio, coff
):
    return cmp_kv.new_empty(cmp_kv.shape)


def _anchor_setup_context(ctx, inputs, output):
    _, x, wkv, wgate, _, softmax_score, kv, cu_seqlens, seqused, start_pos, cmp_ratio, coff = inputs
    # start_pos & co. are saved (not copied): if the caller advances them in place before the
    # backward, autograd's version check reports it instead of a silently wrong gradient.
    ctx.save_for_backward(x, wkv, wgate, softmax_score, kv, cu_seqlens, seqused, start_pos)
    ctx.cmp_ratio = cmp_ratio
    ctx.coff = coff


def _anchor_backward(ctx, d_cmp_kv):
    x, wkv, wgate, softmax_score, kv, cu_seqlens, seqused, start_pos = ctx.saved_tensors
    d_x, d_wkv, d_wgate, d_ape = torch.ops.kvcomp.compressor_backward(
        d_cmp_kv.contiguous(),
        x,
        wkv,
        wgate,
        softmax_score,
        kv,
        cu_seqlens,
        seqused,
        start_pos,
        ctx.cmp_ratio,
        ctx.coff,
    )
    need = ctx.needs_input_grad
    return (
        None,  # cmp_kv: computed from detached inputs, carries no gradient
        d_x if need[1] else None,
        d_wkv if need[2] else None,
        d_wgate if need[3] else None,
        d_ape if need[4] else None,
        None,
        None,
        None,
        None,
        None,
        None,
        None,
    )


torch.library.register_autograd(
    "kvcomp::compressor_grad_anchor", _anchor_backward, setup_context=_anchor_setup_context
)


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

    Profile / precision / threads: ``kvcomp.set_default_options``. The default profile
    ``"extended"`` also accepts float32 io and any D, H, 1 <= r <= 1024; ``"aclnn"`` restricts to
    the NPU's ranges.

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


def forward_with_gradient(
    x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, cmp_ratio, coff, cache_mode,
    keep_intermediates, prepared_weights=None, *, _empties=True,
):
    """(cmp_kv, softmax_score, kv) of compressor_forward_op, cmp_kv carrying CompressorGrad whenever any of
    x, wkv, wgate, ape requires a gradient and grad mode is on (the intermediates are then kept; else
    they are kept only when ``keep_intermediates``, and are empty [0] tensors otherwise). Shared by
    ``compressor`` and the cann_ops_transformer stand-in (npu_compat). ``prepared_weights``:
    ``kvcomp.prepare_weights(wkv, wgate)`` of these weights, or None (``compressor`` keeps the
    upstream signature; a server that prepares its weights calls this, or the operator
    ``torch.ops.kvcomp.compressor_forward``, with them)."""
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (x, wkv, wgate, ape))
    args = (x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos, prepared_weights)
    if not needs_grad and _dispatch_free(args, state_cache):
        # No detach here: _functional takes detached views of its inputs itself.
        out = _forward(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused, start_pos,
                       cmp_ratio, coff, cache_mode, bool(keep_intermediates), prepared_weights, _empties)
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
    )
    if needs_grad:
        cmp_kv = torch.ops.kvcomp.compressor_grad_anchor(
            cmp_kv, x, wkv, wgate, ape, softmax_score, kv, cu_seqlens, seqused, start_pos, cmp_ratio, coff
        )
    return cmp_kv, softmax_score, kv


# Defined after the operators above, which it builds on; importing it installs nothing.
from .npu_compat import install_cann_ops_transformer  # noqa: E402
