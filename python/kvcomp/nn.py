"""The compressor as modules that own their weights, so a model file uses kvcomp with one line.

``kvcomp.nn.Compressor``: the bare operator (DeepSeek-V4's projections, block softmax and pooling),
single-process or context-parallel::

    self.compressor = kvcomp.nn.Compressor(hidden_size=4096, head_dim=512, cmp_ratio=4)   # C4A
    ...
    cmp_kv = self.compressor(x, cu_seqlens=cu)                 # one process
    cmp_kv = self.compressor(x, cp_group=group)                # sequences split over `group`

``kvcomp.nn.DeepseekV41Compressor``: DeepSeek-V4.1's compressor (ratio 1 or 2, no APE, no overlap, then
RMSNorm), with that model's parameter names::

    self.compressor = kvcomp.nn.DeepseekV41Compressor(hidden_size, head_dim, ratio=2, eps=1e-6)

``kvcomp.nn.DeepseekV4Compressor``: a drop-in for DeepSeek-V4's ``Compressor`` (the reference model's
constructor, parameter names, ``kv_cache`` / ``freqs_cis`` attributes, prefill and decode), with the
pooling on kvcomp's operator and RMSNorm and RoPE in torch::

    self.compressor = kvcomp.nn.DeepseekV4Compressor(args, self.compress_ratio, self.head_dim)
"""

import math
from typing import Optional

import torch

from . import distributed as _cp
from . import _ops as _kt
from ._errors import INVALID_PARAM, NULL_POINTER, KvcompError
from ._functional import prepare_weights as _prepare_weights

__all__ = ["Compressor", "DeepseekV41Compressor", "DeepseekV4Compressor"]


class Compressor(torch.nn.Module):
    """Owns ``wkv``, ``wgate`` ``[coff*head_dim, hidden_size]`` and ``ape`` ``[cmp_ratio, coff*head_dim]``.

    Initialised as DeepSeek-V4's reference model declares them: fp32 parameters (the checkpoint's bf16
    weights are loaded into fp32 there), ``coff = 2`` (overlapping blocks) exactly when
    ``cmp_ratio == 4``, the two projections initialised as ``torch.nn.Linear`` initialises its weight
    (Kaiming-uniform), ``ape`` zero. ``forward`` casts the weights to the io dtype of ``x`` inside the
    call, so autograd reaches the fp32 parameters (the mixed-precision pattern of NPU training
    clients). The operator's attributes are module attributes: ``cmp_ratio``, ``coff``, ``head_dim``,
    ``hidden_size``, and for context parallelism ``cp_group`` / ``cp_split`` (defaults for ``forward``).

    Serving: a call that records no gradient (``torch.no_grad()``, ``torch.inference_mode()``, or
    parameters that do not require one), in eager mode, on one process, reuses the weights cast to
    the io dtype and prepared for the CPU forward's products (``kvcomp.prepare_weights``) from the
    previous such call, instead of casting and converting 2 x coff*head_dim x hidden_size weights
    each time; the result is bitwise the same. They are made again when a parameter changes in a way
    torch records (optimizer steps, ``load_state_dict``, any in-place op on the parameter: its
    version counter, and its storage) or the io dtype changes. A change written through
    ``param.data`` is not recorded by torch: call ``forget_prepared_weights()`` after one. The kept
    copy costs memory (fp32 products: the io-dtype weights plus an fp32 copy, and on AVX2 CPUs bf16
    decode panels for one-token calls); that method frees it.

    Args:
        hidden_size: H.
        head_dim: D (C4A / C128A: 512, C4Li: 128).
        cmp_ratio: r (4 or 128 in the reference model; any r >= 1 here).
        coff: 1 or 2; default ``2 if cmp_ratio == 4 else 1``.
        cp_group: a torch.distributed group to split sequences over by default (None: one process).
        cp_split: ``"contiguous"`` or ``"load_balanced"`` (kvcomp.distributed).
        device, dtype: of the parameters (default fp32).
    """

    def __init__(self, hidden_size: int, head_dim: int, cmp_ratio: int = 4, coff: Optional[int] = None, *,
                 cp_group=None, cp_split: str = "contiguous", device=None, dtype=torch.float32):
        super().__init__()
        self.hidden_size, self.head_dim, self.cmp_ratio = int(hidden_size), int(head_dim), int(cmp_ratio)
        self.coff = (2 if self.cmp_ratio == 4 else 1) if coff is None else int(coff)
        self.cp_group, self.cp_split = cp_group, cp_split
        c = self.coff * self.head_dim
        kw = dict(device=device, dtype=dtype)
        self.wkv = torch.nn.Parameter(torch.empty(c, self.hidden_size, **kw))
        self.wgate = torch.nn.Parameter(torch.empty(c, self.hidden_size, **kw))
        self.ape = torch.nn.Parameter(torch.empty(self.cmp_ratio, c, **kw))
        self._prepared = None  # (params, key, wkv, wgate, blob) of the last call without gradient
        self.reset_parameters()

    def forget_prepared_weights(self):
        """Drops the weights kept for calls without gradient (see the class doc); the next such call
        makes them again."""
        self._prepared = None

    def _weights_for(self, x, wkv_p, wgate_p):
        """(wkv, wgate, prepared blob or None) in x's dtype for a one-process call: ``_kept_weights``."""
        return _kept_weights(self, x, wkv_p, wgate_p)

    def reset_parameters(self):
        for w in (self.wkv, self.wgate):
            torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
        torch.nn.init.zeros_(self.ape)

    def extra_repr(self):
        cp = f", cp_split={self.cp_split!r}" if self.cp_group is not None else ""
        return (f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, cmp_ratio={self.cmp_ratio}, "
                f"coff={self.coff}{cp}")

    def forward(self, x, *, cu_seqlens=None, seqused=None, start_pos=None, state_cache=None, state_block_table=None,
                cache_mode: int = 1, cp_group=None, cp_split: Optional[str] = None, timeout: Optional[float] = None):
        """cmp_kv of ``x`` (BSH ``[B, S, H]`` or TH ``[T, H]`` with ``cu_seqlens``), in ``x``'s dtype.

        One process (no ``cp_group`` here or at construction): ``kvcomp.torch.compressor``; without a
        ``state_cache`` the call is stateless (a one-block scratch cache that is never written, as NPU
        training clients do), so no row may come from before the sequence: ``start_pos`` must then be
        None. Context-parallel: ``x`` is this
        rank's part, ``cu_seqlens`` / ``seqused`` / ``start_pos`` are global, and the result holds the
        blocks this rank owns (``kvcomp.distributed.cp_compressor``).
        """
        group = cp_group if cp_group is not None else self.cp_group
        # The parameters, read once: each attribute read of one goes through Module.__getattr__ (about
        # 0.8 us; a decode call of a small layer takes tens of microseconds in all).
        params = self._parameters
        if "wkv" in params and "wgate" in params and "ape" in params:
            wkv_p, wgate_p, ape_p = params["wkv"], params["wgate"], params["ape"]
        else:  # e.g. torch.nn.utils.parametrize made one of them a property
            wkv_p, wgate_p, ape_p = self.wkv, self.wgate, self.ape
        ape = ape_p if ape_p.dtype == torch.float32 else ape_p.to(torch.float32)  # .to: 2 us even as a no-op
        if group is not None:
            # fp32 parameters go in as they are: the call casts them and returns fp32 partial sums of
            # their gradients (CPU), so the all-reduced gradient is rounded once.
            master = wkv_p.dtype == torch.float32 and wgate_p.dtype == torch.float32
            wkv, wgate = (wkv_p, wgate_p) if master else (wkv_p.to(x.dtype), wgate_p.to(x.dtype))
            return _cp.cp_compressor(x, wkv, wgate, ape, self.cmp_ratio, group=group,
                                     split=cp_split or self.cp_split, cu_seqlens=cu_seqlens, seqused=seqused,
                                     start_pos=start_pos, coff=self.coff, state_cache=state_cache,
                                     state_block_table=state_block_table, cache_mode=cache_mode, timeout=timeout)
        if state_cache is None:
            if start_pos is not None:
                raise KvcompError(NULL_POINTER, "[kvcomp] state_cache (= None) must be given with start_pos: the "
                                                "rows before start_pos come from it")
            state_cache, state_block_table = _scratch_state(x, cu_seqlens, self.cmp_ratio,
                                                            2 * self.coff * self.head_dim)
            cache_mode = 1
        wkv, wgate, blob = self._weights_for(x, wkv_p, wgate_p)
        if blob is None:
            return _kt.compressor(x, wkv, wgate, state_cache, ape, self.cmp_ratio,
                                  state_block_table=state_block_table, cu_seqlens=cu_seqlens, seqused=seqused,
                                  start_pos=start_pos, coff=self.coff, cache_mode=cache_mode)
        if state_block_table is None:  # the refusal kvcomp.torch.compressor gives
            return _kt.compressor(x, wkv, wgate, state_cache, ape, self.cmp_ratio)
        # _empties=False: no empty intermediates where the call skips the dispatcher (they are dropped here)
        return _kt.forward_with_gradient(x, wkv, wgate, state_cache, ape, state_block_table, cu_seqlens, seqused,
                                         start_pos, self.cmp_ratio, self.coff, cache_mode, False,
                                         prepared_weights=blob, _empties=False)[0]


def _kept_weights(owner, x, wkv_p, wgate_p):
    """(wkv, wgate, prepared blob or None) in x's dtype for a one-process call on the parameters
    ``wkv_p`` and ``wgate_p`` of the module ``owner`` (read once by the caller): kept in
    ``owner._prepared`` between calls that record no gradient, else cast per call (so autograd reaches
    the parameters). ``wgate_p`` None (a call without a gate): wgate and the blob are None (a blob
    holds both projections)."""
    gate = wgate_p is not None
    records_grad = torch.is_grad_enabled() and (wkv_p.requires_grad or (gate and wgate_p.requires_grad))
    if records_grad or torch.compiler.is_compiling():
        return wkv_p.to(x.dtype), wgate_p.to(x.dtype) if gate else None, None
    # The parameter objects themselves (held, so that no other tensor can take their memory while
    # the copy is kept), their storage and version counters; inference mode makes inference
    # tensors, kept apart from the others.
    key = (x.dtype, x.device, torch.is_inference_mode_enabled(), wkv_p.data_ptr(), wkv_p._version,
           wgate_p.data_ptr() if gate else 0, wgate_p._version if gate else 0)
    # One read of owner._prepared and one write: calls from several threads each use a whole
    # tuple (at worst two of them make one each).
    p = owner._prepared
    if p is None or p[0] is not wkv_p or p[1] is not wgate_p or p[2] != key:
        owner._prepared = p = None  # the old copy goes before the new one is made
        with torch.no_grad():
            wkv = wkv_p.to(x.dtype).contiguous()
            wgate = wgate_p.to(x.dtype).contiguous() if gate else None
            blob = _prepare_weights(wkv, wgate) if gate and x.device.type == "cpu" else None
        p = (wkv_p, wgate_p, key, wkv, wgate, blob)
        owner._prepared = p
    return p[3:]


def _scratch_state(x, cu_seqlens, ratio, width):
    """A one-block state cache that is never written (every block-table entry 0) and its table, for a
    stateless call: no row comes from before the sequences, and the tail tokens are not kept."""
    rows = x.shape[1] if x.dim() == 3 else x.shape[0]
    batches = x.shape[0] if x.dim() == 3 else (cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 0)
    cache = x.new_zeros((1, ratio, width), dtype=torch.float32)
    table = torch.zeros((max(batches, 0), max(1, -(-rows // ratio))), dtype=torch.int32, device=x.device)
    return cache, table


def _complete_rows(x, rows, cu_seqlens, ratio):
    """The operator's output ``rows`` cut to the complete blocks' rows: BSH ``[B, S // ratio, D]``; TH
    the sequences' rows in order (a sequence of L tokens has L // ratio of them), the zero rows after
    them dropped."""
    if x.dim() == 3:
        return rows[:, : x.shape[1] // ratio]
    return rows[: int(((cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64) // ratio).sum())]


def _prefill_table(x, ratio, coff, keep, slots=None):
    """The paged block table of a prefill of BSH ``x`` into a decode state whose batch slot s owns
    blocks ``1 + s*coff + j`` (j < coff), batch row b in slot ``slots[b]`` (default b): the positions
    from ``keep`` on (what later decode calls read) go to the slot's blocks, the others to block 0 (not
    written)."""
    bsz, seqlen = x.shape[0], x.shape[1]
    col = torch.arange(-(-seqlen // ratio), dtype=torch.int32, device=x.device)
    slot = (torch.arange(bsz, dtype=torch.int32, device=x.device) if slots is None else slots)[:, None]
    return torch.where(col * ratio >= keep, 1 + slot * coff + col % coff, torch.zeros_like(col)).to(torch.int32)


def _decode_indices(x, start_pos, slots=None):
    """start_pos and the ring block table of a one-token decode step of BSH ``x``: int32 ``[bsz]`` each.
    ``start_pos`` an int (every sequence's) or an int tensor ``[bsz]``; batch row b in batch slot
    ``slots[b]`` (int32 ``[bsz]``; default b)."""
    bsz = x.shape[0]
    if isinstance(start_pos, torch.Tensor):
        pos = start_pos.to(device=x.device, dtype=torch.int32)
    else:
        pos = torch.full((bsz,), start_pos, dtype=torch.int32, device=x.device)
    table = slots if slots is not None else torch.arange(bsz, dtype=torch.int32, device=x.device)
    return pos, table


class _NormWeight(torch.nn.Module):
    """Holds RMSNorm's weight as ``norm.weight`` (the model's state_dict key), fp32, initialised to one."""

    def __init__(self, dim, eps, device=None):
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))


class DeepseekV41Compressor(torch.nn.Module):
    """DeepSeek-V4.1's compressor: each group of ``ratio`` consecutive tokens of a sequence pooled into
    one row (per channel, a softmax over the group of the gate scores weighs the group's projections;
    ratio 1 is the projection itself, with no gate), the row rounded to the io dtype, then RMSNorm over
    ``head_dim`` (fp32 statistics, fp32 weight, ``(weight * x_hat).to(dtype)``). No positional bias, no
    overlap between groups, no RoPE (the attention applies it). An incomplete trailing group gives no
    row.

    Parameters and state_dict keys as the model names them: ``wkv.weight`` ``[head_dim, hidden_size]``,
    ``wgate.weight`` (ratio > 1 only) and ``norm.weight`` ``[head_dim]`` (fp32), so
    ``load_state_dict(model_compressor.state_dict(), strict=True)`` works. The projections and pooling
    run on kvcomp's operator (coff 1, cmp_ratio = ratio, no APE), with the weights cast to the io
    dtype of ``x`` inside the call so that autograd reaches fp32 parameters; the RMSNorm is the
    operator's epilogue (forward and backward fused, ``norm.weight``'s gradient summed in a fixed
    order). Ratio 1 calls the operator without a gate (``wgate`` None): no gate product at all, the
    pooled row is the projection row.

    Calls without gradient (inference, serving) keep the weights cast to x's dtype, and with a gate
    prepared for the products (``kvcomp.prepare_weights``), until a parameter changes;
    ``forget_prepared_weights()`` drops them.

    Serving: with ``max_batch_size`` > 0 the module keeps each sequence's pending tokens (the open
    group: at most ``ratio - 1`` tokens) in kvcomp's state cache, the buffer ``state_cache`` (fp32,
    not in the state_dict), and ``forward(x, start_pos=...)`` prefills and decodes token by token (see
    ``forward``).

    Args:
        hidden_size: H.
        head_dim: D.
        ratio: tokens per compressed row (the model uses 1 and 2; any ratio >= 1 here).
        eps: RMSNorm's epsilon.
        max_batch_size: batch slots of the decode state (0, the default: stateless calls only).
        device, dtype: of the projections' weights (default fp32; norm.weight is always fp32).
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float = 1e-6, *, max_batch_size: int = 0,
                 device=None, dtype=torch.float32):
        super().__init__()
        if int(ratio) < 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] ratio (= {ratio}) must be >= 1")
        if int(max_batch_size) < 0:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] max_batch_size (= {max_batch_size}) must be >= 0")
        self.hidden_size, self.head_dim, self.ratio = int(hidden_size), int(head_dim), int(ratio)
        self.max_batch_size = int(max_batch_size)
        kw = dict(device=device, dtype=dtype)
        self.wkv = torch.nn.Linear(self.hidden_size, self.head_dim, bias=False, **kw)
        self.wgate = torch.nn.Linear(self.hidden_size, self.head_dim, bias=False, **kw) if self.ratio > 1 else None
        self.norm = _NormWeight(self.head_dim, eps, device=device)
        self._prepared = None  # the weights kept for calls without gradient (_kept_weights)
        # Decode state (max_batch_size > 0): block 0 is never written (block id 0 = do not write),
        # block 1 + b holds batch slot b's pending tokens (positions of its open group); the same rows
        # seen as one ring block of `ratio` slots per batch slot are the decode calls' cache.
        self.register_buffer("state_cache", torch.zeros((1 + self.max_batch_size, self.ratio, 2 * self.head_dim),
                                                        device=device, dtype=torch.float32)
                             if self.max_batch_size else None, persistent=False)

    def extra_repr(self):
        return (f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, ratio={self.ratio}, eps={self.norm.eps}"
                + (f", max_batch_size={self.max_batch_size}" if self.max_batch_size else ""))

    def forget_prepared_weights(self):
        """Drops the weights kept for calls without gradient (as ``kvcomp.nn.Compressor``'s)."""
        self._prepared = None

    def _gate(self, x):
        """(wkv, wgate or None, prepared blob or None) in x's dtype: kept between calls without gradient
        (``_kept_weights``), so a decode step does not cast the fp32 weights again."""
        return _kept_weights(self, x, self.wkv.weight, self.wgate.weight if self.wgate is not None else None)

    def pooled(self, x, cu_seqlens=None, *, norm=False):
        """The pooled rows before the RMSNorm (after it, fused into the operator, with ``norm``), in x's
        dtype: BSH ``[B, S // ratio, head_dim]``, TH ``[sum over sequences of len // ratio, head_dim]``
        (``cu_seqlens`` int32 ``[B + 1]``)."""
        r, d = self.ratio, self.head_dim
        wkv, wgate, blob = self._gate(x)
        if x.dim() == 2 and cu_seqlens is None:
            raise KvcompError(NULL_POINTER, "[kvcomp] cu_seqlens (= None) must be given with TH x [T, H]")
        cache, table = _scratch_state(x, cu_seqlens, r, 2 * d)
        rows = _kt.model_compressor(x, wkv, wgate, None, r, state_cache=cache, state_block_table=table,
                                    cu_seqlens=cu_seqlens, norm_weight=self.norm.weight if norm else None,
                                    norm_eps=self.norm.eps, prepared_weights=blob)
        return _complete_rows(x, rows, cu_seqlens, r)

    def forward(self, x, cu_seqlens=None, *, start_pos=None, slots=None):
        """The compressed rows of ``x`` (BSH ``[B, S, H]``, or TH ``[T, H]`` with ``cu_seqlens``), normed,
        in x's dtype: BSH ``[B, S // ratio, head_dim]``, TH ``[sum of len // ratio, head_dim]``.

        With ``start_pos`` (needs ``max_batch_size``), the serving form on the module's decode state,
        batch row b in batch slot ``slots[b]`` (``slots``: int ``[B]``, distinct, each in ``[0,
        max_batch_size)``; default: slot b):

        * ``start_pos == 0`` (an int): a prefill of BSH ``x`` (each sequence from its first token),
          returning the same rows and keeping each sequence's pending tokens (its open group) in its slot.
        * ``start_pos > 0`` (an int): one decode step (``S == 1``, the token at position ``start_pos`` of
          every sequence): the rows ``[B, 1, head_dim]`` of the groups it closes, or None when it closes
          none.
        * ``start_pos`` an int tensor ``[B]``: one decode step with each sequence at its own position
          (continuous batching; ``S == 1``; a position 0 starts a sequence). Returns ``[B, 1,
          head_dim]``: row b is the row of the group that token closes where ``(start_pos[b] + 1) %
          ratio == 0``, zero elsewhere.

        The rows of a decode loop are those of one call on the whole sequences, bit for bit."""
        if start_pos is None:
            if slots is not None:
                raise KvcompError(INVALID_PARAM, "[kvcomp] slots (= given) must come with start_pos (the serving "
                                                 "form): a stateless call has no batch slots")
            return self.pooled(x, cu_seqlens, norm=True)
        return self._serve(x, start_pos, slots)

    def _slots(self, x, slots):
        """Batch row b's batch slot: int32 ``[B]``, checked; None (slot b) when not given."""
        bsz = x.shape[0]
        if slots is None:
            return None
        s = torch.as_tensor(slots, device=x.device)
        if s.dim() != 1 or s.shape[0] != bsz or s.is_floating_point() or s.is_complex():
            raise KvcompError(INVALID_PARAM, f"[kvcomp] slots (shape {tuple(s.shape)}, dtype {s.dtype}) must be "
                                             f"an int tensor [B] (= [{bsz}])")
        values = s.tolist()
        if any(v < 0 or v >= self.max_batch_size for v in values) or len(set(values)) != len(values):
            raise KvcompError(INVALID_PARAM, f"[kvcomp] slots (= {values}) must be distinct and in [0, "
                                             f"max_batch_size (= {self.max_batch_size}))")
        return s.to(torch.int32)

    def _serve(self, x, start_pos, slots):
        r, d = self.ratio, self.head_dim
        if self.state_cache is None:
            raise KvcompError(INVALID_PARAM, "[kvcomp] max_batch_size (= 0) must be > 0 for calls with start_pos "
                                             "(the decode state holds one sequence per batch slot)")
        if x.dim() != 3:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.dim() (= {x.dim()}) must be 3 (BSH) with start_pos")
        bsz, seqlen, _ = x.shape
        if bsz > self.max_batch_size:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.shape[0] (= {bsz}) must be <= max_batch_size (= "
                                             f"{self.max_batch_size})")
        per_sequence = isinstance(start_pos, torch.Tensor)
        if per_sequence:
            if start_pos.dim() != 1 or start_pos.shape[0] != bsz or start_pos.is_floating_point():
                raise KvcompError(INVALID_PARAM, f"[kvcomp] start_pos (shape {tuple(start_pos.shape)}, dtype "
                                                 f"{start_pos.dtype}) must be an int or an int tensor [B] (= [{bsz}])")
            shown = start_pos.tolist()
            low = min(shown, default=0)
        else:
            start_pos = int(start_pos)
            shown = low = start_pos
        if low < 0:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] start_pos (= {shown}) must be >= 0")
        if (per_sequence or start_pos > 0) and seqlen != 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.shape[1] (= {seqlen}) must be 1 when start_pos (= "
                                             f"{shown}) is a decode step: decode takes one token per call")
        slot = self._slots(x, slots)
        wkv, wgate, blob = self._gate(x)
        common = dict(norm_weight=self.norm.weight, norm_eps=self.norm.eps, prepared_weights=blob)
        if not per_sequence and start_pos == 0:
            # Paged view: the open group's positions (from cutoff on) go to the slot's block.
            cutoff = seqlen - seqlen % r
            table = _prefill_table(x, r, 1, cutoff, slot)
            rows = _kt.model_compressor(x, wkv, wgate, None, r, state_cache=self.state_cache,
                                        state_block_table=table, **common)
            return rows[:, : cutoff // r]
        ring = self.state_cache[1:].view(self.max_batch_size, r, 2 * d)
        pos, table = _decode_indices(x, start_pos, slot)
        rows = _kt.model_compressor(x, wkv, wgate, None, r, state_cache=ring, state_block_table=table, start_pos=pos,
                                    cache_mode=2, **common)
        if per_sequence:
            return rows
        return rows if (start_pos + 1) % r == 0 else None


_UNSET = object()


class DeepseekV4Compressor(torch.nn.Module):
    """DeepSeek-V4's compressor (the reference model's ``Compressor``), a drop-in for it::

        self.compressor = kvcomp.nn.DeepseekV4Compressor(args, self.compress_ratio, self.head_dim)

    Per block of ``compress_ratio`` tokens (blocks aligned on positions 0, r, 2r, ...): projections
    ``kv = x wkv^T``, ``score = x wgate^T + ape[pos % r]``, per channel a softmax of the scores over the
    block's tokens (with ``coff = 2``, exactly when the ratio is 4, the block also holds the previous
    block's tokens in the first ``head_dim`` channels), the pooled row ``sum(softmax * kv)`` rounded to
    the io dtype; then RMSNorm over ``head_dim`` (fp32 statistics and weight, ``(weight *
    x_hat).to(dtype)``) and RoPE on the last ``rope_head_dim`` channels at the position of the block's
    first token (``freqs_cis[k * r]`` for block k). The projections, the softmax and the pooling run on
    kvcomp's operator (deterministic, bitwise the same for any thread count), with the weights cast to
    the io dtype of ``x`` inside the call so that autograd reaches the fp32 parameters: exact where the
    io dtype holds the weights (the checkpoint's bf16 values in bf16 io), a rounding of the weights
    otherwise (the model multiplies the fp32 weights). The RMSNorm and RoPE are the operator's epilogue
    (forward and backward fused into the call, ``norm.weight``'s gradient summed in a fixed order; the
    mean of squares taken in float64, so a row may differ from the model's fp32 mean by one io ulp).

    Not here: the FP8 simulation of the non-RoPE channels and the FP4 simulation (the model's
    quantisation steps, applied by the caller if wanted), and the indexer's Hadamard rotation
    (``rotate=True`` is refused).

    Parameters and state_dict keys are the model's: ``ape`` fp32 ``[r, coff*head_dim]``, ``wkv.weight``
    and ``wgate.weight`` ``[coff*head_dim, dim]``, ``norm.weight`` fp32 ``[head_dim]``, so
    ``load_state_dict(model_compressor.state_dict(), strict=True)`` works both ways. The model's
    attention assigns ``kv_cache`` (``[max_batch_size, max_seq_len // r, head_dim]``, written by
    ``forward``; None: nothing written) and ``freqs_cis`` (complex64 ``[max_seq_len, rope_head_dim / 2]``,
    required). The decode state is the buffer ``state_cache`` (fp32, kvcomp's state cache: one ring
    block of ``coff*r`` slots per batch slot after a reserved block 0; not in the state_dict).

    ``forward(x, start_pos)``: the model's call. ``start_pos == 0`` is a prefill of ``x`` BSH ``[bsz,
    seqlen, dim]``, ``bsz <= max_batch_size``: returns the rows of the complete blocks ``[bsz, seqlen //
    r, head_dim]`` (None when there is none), with autograd to ``x`` and every parameter, writes them to
    ``kv_cache[:bsz, :seqlen // r]`` and keeps the tokens later decode calls need in the state of batch
    slots ``[0, bsz)``. ``start_pos > 0`` is one decode step (``seqlen == 1``): returns the row
    ``[bsz, 1, head_dim]`` of the block the token closes (written to ``kv_cache[:bsz, start_pos // r]``)
    or None. ``train_rows(x, cu_seqlens)`` is the stateless form for training (BSH or TH).

    Args:
        args: an object with ``dim``, ``rope_head_dim``, ``norm_eps``, ``max_batch_size`` (the model's
            ModelArgs), or None; the keywords of the same names override it. ``norm_eps`` defaults to
            1e-6, ``max_batch_size`` to 1.
        compress_ratio: r (4 and 128 in the model; any r >= 1 here).
        head_dim: D (512 for the attention's compressor, 128 for the indexer's).
        rotate: must be False.
        device, dtype: of the projections' weights (default fp32; ``ape`` and ``norm.weight`` are fp32).
    """

    def __init__(self, args=None, compress_ratio: int = 4, head_dim: int = 512, rotate: bool = False, *,
                 dim=None, rope_head_dim=None, norm_eps=None, max_batch_size=None, device=None,
                 dtype=torch.float32):
        super().__init__()
        if rotate:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] rotate (= {rotate}) must be False: the Hadamard rotation "
                                             "of the indexer's compressor is not supported")

        def setting(name, given, default=_UNSET):
            value = given if given is not None else getattr(args, name, None)
            if value is None:
                if default is _UNSET:
                    raise KvcompError(NULL_POINTER, f"[kvcomp] {name} (= None) must be given, in args or as a "
                                                    "keyword")
                value = default
            return value

        self.dim = int(setting("dim", dim))
        self.rope_head_dim = int(setting("rope_head_dim", rope_head_dim))
        eps = float(setting("norm_eps", norm_eps, 1e-6))
        self.max_batch_size = int(setting("max_batch_size", max_batch_size, 1))
        self.head_dim, self.compress_ratio, self.rotate = int(head_dim), int(compress_ratio), False
        if self.compress_ratio < 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] compress_ratio (= {compress_ratio}) must be >= 1")
        if self.rope_head_dim % 2 or not 0 <= self.rope_head_dim <= self.head_dim:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] rope_head_dim (= {self.rope_head_dim}) must be even and "
                                             f"in [0, head_dim (= {self.head_dim})]")
        if self.max_batch_size < 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] max_batch_size (= {self.max_batch_size}) must be >= 1")
        self.nope_head_dim = self.head_dim - self.rope_head_dim
        self.overlap = self.compress_ratio == 4
        self.coff = 2 if self.overlap else 1
        r, c = self.compress_ratio, self.coff * self.head_dim
        kw = dict(device=device, dtype=dtype)
        self.ape = torch.nn.Parameter(torch.zeros(r, c, device=device, dtype=torch.float32))
        self.wkv = torch.nn.Linear(self.dim, c, bias=False, **kw)
        self.wgate = torch.nn.Linear(self.dim, c, bias=False, **kw)
        self.norm = _NormWeight(self.head_dim, eps, device=device)
        # Paged view: block 0 is never written (block id 0 = do not write), block 1 + b*coff + j holds
        # the positions p of batch slot b with (p // r) % coff == j. The same rows seen as one ring block
        # of coff*r slots per batch slot (slot p % (coff*r)) are the decode calls' cache (_ring_state).
        self.register_buffer("state_cache", torch.zeros((1 + self.max_batch_size * self.coff, r, 2 * c),
                                                        device=device, dtype=torch.float32), persistent=False)
        self.kv_cache = None
        self.freqs_cis = None
        self._prepared = None  # the weights kept for calls without gradient (_kept_weights)
        self._rope = None  # freqs_cis as contiguous cos and sin tables (_rope_tables)

    def extra_repr(self):
        return (f"dim={self.dim}, head_dim={self.head_dim}, rope_head_dim={self.rope_head_dim}, "
                f"compress_ratio={self.compress_ratio}, coff={self.coff}, norm_eps={self.norm.eps}, "
                f"max_batch_size={self.max_batch_size}")

    def forget_prepared_weights(self):
        """Drops the weights kept for calls without gradient (as ``kvcomp.nn.Compressor``'s)."""
        self._prepared = None

    def _ring_state(self):
        r, c = self.compress_ratio, self.coff * self.head_dim
        return self.state_cache[1:].view(self.max_batch_size, self.coff * r, 2 * c)

    def _rows(self, x, state, table, *, cu_seqlens=None, start_pos=None, cache_mode=1):
        """kvcomp's operator on ``x`` with the epilogue (RMSNorm, then RoPE at each row's block-first-token
        position): the rows in x's dtype (``kvcomp.torch.compressor``'s layout)."""
        wkv_p, wgate_p, ape = self.wkv.weight, self.wgate.weight, self.ape
        if ape.dtype != torch.float32:
            ape = ape.to(torch.float32)
        wkv, wgate, blob = _kept_weights(self, x, wkv_p, wgate_p)
        cos, sin = self._rope_tables()
        return _kt.model_compressor(x, wkv, wgate, ape, self.compress_ratio, state_cache=state,
                                    state_block_table=table, cu_seqlens=cu_seqlens, start_pos=start_pos,
                                    coff=self.coff, cache_mode=cache_mode, norm_weight=self.norm.weight,
                                    norm_eps=self.norm.eps, rope_cos=cos, rope_sin=sin, prepared_weights=blob)

    def _rope_tables(self):
        """(cos, sin) fp32 ``[max_seq_len, rope_head_dim / 2]``, contiguous, of ``freqs_cis`` (kept while
        the same tensor, unchanged, is assigned); (None, None) when rope_head_dim is 0."""
        if self.freqs_cis is None:
            raise KvcompError(NULL_POINTER, "[kvcomp] freqs_cis (= None) must be assigned before the first call "
                                            "(complex64 [max_seq_len, rope_head_dim / 2], as the model's "
                                            "attention does)")
        f = self.freqs_cis
        if self.rope_head_dim == 0:
            return None, None
        if f.dim() != 2 or not f.is_complex() or f.shape[1] != self.rope_head_dim // 2:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] freqs_cis (= {f.dtype} {list(f.shape)}) must be complex "
                                             f"[max_seq_len, rope_head_dim / 2 (= {self.rope_head_dim // 2})]")
        if torch.compiler.is_compiling():  # traced into the graph; nothing kept
            return f.real.float().contiguous(), f.imag.float().contiguous()
        key = (f, f._version, f.data_ptr())
        kept = self._rope
        if kept is None or kept[0][0] is not f or kept[0][1:] != key[1:]:
            with torch.no_grad():
                kept = (key, f.real.float().contiguous(), f.imag.float().contiguous())
            self._rope = kept
        return kept[1], kept[2]

    def forward(self, x, start_pos: int = 0):
        """The model's ``Compressor.forward`` (see the class doc): the new rows, normed and rotated, or
        None when no block closes."""
        if x.dim() != 3:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.dim() (= {x.dim()}) must be 3 (BSH [bsz, seqlen, dim]); "
                                             "train_rows takes TH")
        bsz, seqlen, _ = x.shape
        start_pos = int(start_pos)
        if bsz > self.max_batch_size:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.shape[0] (= {bsz}) must be <= max_batch_size (= "
                                             f"{self.max_batch_size}): the decode state holds one sequence per "
                                             "batch slot")
        if start_pos < 0:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] start_pos (= {start_pos}) must be >= 0")
        if start_pos == 0:
            return self._prefill(x)
        if seqlen != 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] x.shape[1] (= {seqlen}) must be 1 when start_pos (= "
                                             f"{start_pos}) > 0: decode takes one token per call")
        return self._decode(x, start_pos)

    def _prefill(self, x):
        bsz, seqlen, _ = x.shape
        r, coff = self.compress_ratio, self.coff
        self._rope_tables()  # refuses a missing freqs_cis first
        if seqlen == 0:
            return None
        cutoff = seqlen - seqlen % r
        # Later decode calls read positions from `keep` on: the tail and, with coff 2, the last
        # complete block; those are written (paged view), the rest goes to block 0 (not written).
        keep = max(0, cutoff - (coff - 1) * r)
        rows = self._rows(x, self.state_cache, _prefill_table(x, r, coff, keep))
        if cutoff == 0:
            return None
        out = rows[:, : cutoff // r]
        if self.kv_cache is not None:
            with torch.no_grad():
                self.kv_cache[:bsz, : cutoff // r] = out
        return out

    def _decode(self, x, start_pos):
        bsz = x.shape[0]
        r = self.compress_ratio
        pos, table = _decode_indices(x, start_pos)
        out = self._rows(x, self._ring_state(), table, start_pos=pos, cache_mode=2)
        if (start_pos + 1) % r:
            return None
        if self.kv_cache is not None:
            with torch.no_grad():
                self.kv_cache[:bsz, start_pos // r] = out[:, 0]
        return out

    def train_rows(self, x, cu_seqlens=None, *, cp_group=None, cp_split: str = "contiguous"):
        """Stateless: the rows of every complete block of each sequence, normed and rotated (block k of
        a sequence at position k*r), in x's dtype, with autograd to ``x`` and every parameter; no state
        or kv_cache is read or written, any batch size. BSH ``x`` ``[B, S, dim]`` -> ``[B, S // r,
        head_dim]``; TH ``x`` ``[T, dim]`` with ``cu_seqlens`` (int32 ``[B + 1]``) -> ``[sum of len // r,
        head_dim]``, the sequences' rows in order.

        With ``cp_group`` (a torch.distributed group), ``x`` is this rank's part of every sequence and
        the call is ``kvcomp.distributed.cp_compressor`` with the epilogue (``cp_split``, global
        ``cu_seqlens``): it returns the rows this rank owns, in cp_compressor's layout
        (``kvcomp.distributed.cp_owned_blocks`` says which), bit for bit the single call's; the
        weights' gradients are this rank's partial sums (fp32), ``ape``'s and ``norm.weight``'s the
        group's totals on its rank 0."""
        r = self.compress_ratio
        cos, sin = self._rope_tables()
        if cp_group is not None:
            return _cp.cp_compressor(x, self.wkv.weight, self.wgate.weight, self.ape, r, group=cp_group,
                                     split=cp_split, cu_seqlens=cu_seqlens, coff=self.coff,
                                     norm_weight=self.norm.weight, norm_eps=self.norm.eps, rope_cos=cos,
                                     rope_sin=sin)
        if x.dim() == 2 and cu_seqlens is None:
            raise KvcompError(NULL_POINTER, "[kvcomp] cu_seqlens (= None) must be given with TH x [T, dim]")
        cache, table = _scratch_state(x, cu_seqlens if x.dim() == 2 else None, r, 2 * self.coff * self.head_dim)
        rows = self._rows(x, cache, table, cu_seqlens=cu_seqlens if x.dim() == 2 else None)
        return _complete_rows(x, rows, cu_seqlens, r)
