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
"""

import math
from typing import Optional

import torch

from . import distributed as _cp
from . import _ops as _kt
from ._errors import INVALID_PARAM, NULL_POINTER, KvcompError
from ._functional import prepare_weights as _prepare_weights

__all__ = ["Compressor", "DeepseekV41Compressor"]


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
        """(wkv, wgate, prepared blob or None) in x's dtype for a one-process call on the parameters
        ``wkv_p`` and ``wgate_p`` (this module's, read once by the caller): kept between calls that record
        no gradient, else cast per call (so autograd reaches the parameters)."""
        records_grad = torch.is_grad_enabled() and (wkv_p.requires_grad or wgate_p.requires_grad)
        if records_grad or torch.compiler.is_compiling():
            return wkv_p.to(x.dtype), wgate_p.to(x.dtype), None
        # The parameter objects themselves (held, so that no other tensor can take their memory while
        # the copy is kept), their storage and version counters; inference mode makes inference
        # tensors, kept apart from the others.
        key = (x.dtype, x.device, torch.is_inference_mode_enabled(), wkv_p.data_ptr(), wkv_p._version,
               wgate_p.data_ptr(), wgate_p._version)
        # One read of self._prepared and one write: calls from several threads each use a whole
        # tuple (at worst two of them make one each).
        p = self._prepared
        if p is None or p[0] is not wkv_p or p[1] is not wgate_p or p[2] != key:
            self._prepared = p = None  # the old copy goes before the new one is made
            with torch.no_grad():
                wkv = wkv_p.to(x.dtype).contiguous()
                wgate = wgate_p.to(x.dtype).contiguous()
                blob = _prepare_weights(wkv, wgate) if x.device.type == "cpu" else None
            p = (wkv_p, wgate_p, key, wkv, wgate, blob)
            self._prepared = p
        return p[3:]

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


def _scratch_state(x, cu_seqlens, ratio, width):
    """A one-block state cache that is never written (every block-table entry 0) and its table, for a
    stateless call: no row comes from before the sequences, and the tail tokens are not kept."""
    rows = x.shape[1] if x.dim() == 3 else x.shape[0]
    batches = x.shape[0] if x.dim() == 3 else (cu_seqlens.shape[0] - 1 if cu_seqlens is not None else 0)
    cache = x.new_zeros((1, ratio, width), dtype=torch.float32)
    table = torch.zeros((max(batches, 0), max(1, -(-rows // ratio))), dtype=torch.int32, device=x.device)
    return cache, table


class _NormWeight(torch.nn.Module):
    """Holds RMSNorm's weight as ``norm.weight`` (the model's state_dict key), fp32, initialised to one."""

    def __init__(self, dim, eps, device=None):
        super().__init__()
        self.eps = float(eps)
        self.weight = torch.nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32))


def _rms_norm(rows, weight, eps):
    """The model's RMSNorm over the last dim: fp32 statistics, ``(weight * x_hat).to(rows.dtype)``."""
    x = rows.float()
    x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x_hat).to(rows.dtype)


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
    order). Ratio 1 passes the operator a zero gate, whose softmax over one token is exactly 1: the
    pooled row is the projection row, bit for bit (the gate's product is computed and unused; a later
    release skips it).

    Args:
        hidden_size: H.
        head_dim: D.
        ratio: tokens per compressed row (the model uses 1 and 2; any ratio >= 1 here).
        eps: RMSNorm's epsilon.
        device, dtype: of the projections' weights (default fp32; norm.weight is always fp32).
    """

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, eps: float = 1e-6, *, device=None,
                 dtype=torch.float32):
        super().__init__()
        if int(ratio) < 1:
            raise KvcompError(INVALID_PARAM, f"[kvcomp] ratio (= {ratio}) must be >= 1")
        self.hidden_size, self.head_dim, self.ratio = int(hidden_size), int(head_dim), int(ratio)
        kw = dict(device=device, dtype=dtype)
        self.wkv = torch.nn.Linear(self.hidden_size, self.head_dim, bias=False, **kw)
        self.wgate = torch.nn.Linear(self.hidden_size, self.head_dim, bias=False, **kw) if self.ratio > 1 else None
        self.norm = _NormWeight(self.head_dim, eps, device=device)

    def extra_repr(self):
        return f"hidden_size={self.hidden_size}, head_dim={self.head_dim}, ratio={self.ratio}, eps={self.norm.eps}"

    def pooled(self, x, cu_seqlens=None, *, norm=False):
        """The pooled rows before the RMSNorm (after it, fused into the operator, with ``norm``), in x's
        dtype: BSH ``[B, S // ratio, head_dim]``, TH ``[sum over sequences of len // ratio, head_dim]``
        (``cu_seqlens`` int32 ``[B + 1]``)."""
        r, d = self.ratio, self.head_dim
        wkv = self.wkv.weight.to(x.dtype)
        wgate = self.wgate.weight.to(x.dtype) if self.wgate is not None else torch.zeros_like(wkv)
        if x.dim() == 2 and cu_seqlens is None:
            raise KvcompError(NULL_POINTER, "[kvcomp] cu_seqlens (= None) must be given with TH x [T, H]")
        cache, table = _scratch_state(x, cu_seqlens, r, 2 * d)
        rows = _kt.model_compressor(x, wkv, wgate, None, r, state_cache=cache, state_block_table=table,
                                    cu_seqlens=cu_seqlens, norm_weight=self.norm.weight if norm else None,
                                    norm_eps=self.norm.eps)
        return self._complete_rows(x, rows, cu_seqlens)

    def _complete_rows(self, x, rows, cu_seqlens):
        r = self.ratio
        if x.dim() == 3:
            return rows[:, : x.shape[1] // r]
        # TH: the sequences' rows in order, then zero rows; a sequence of L tokens has L // r of them.
        lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
        return rows[: int((lens // r).sum())]

    def forward(self, x, cu_seqlens=None):
        """The compressed rows of ``x`` (BSH ``[B, S, H]``, or TH ``[T, H]`` with ``cu_seqlens``), normed,
        in x's dtype: BSH ``[B, S // ratio, head_dim]``, TH ``[sum of len // ratio, head_dim]``."""
        return self.pooled(x, cu_seqlens, norm=True)
