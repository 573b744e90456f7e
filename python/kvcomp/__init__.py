"""kvcomp: the Compressor / CompressorGrad operator pair of compressed sparse attention on CPU.

Functional calls (torch tensors or numpy arrays in, the same kind out):
    kvcomp.compressor_forward(...)  -> (cmp_kv, softmax_score, kv)   # aclnnCompressor
    kvcomp.compressor_grad(...)     -> (d_x, d_wkv, d_wgate, d_ape)   # aclnnCompressorGrad

PyTorch operator with autograd (drop-in for cann_ops_transformer.compressor):
    import kvcomp.torch
    cmp_kv = kvcomp.torch.compressor(x, wkv, wgate, state_cache, ape, cmp_ratio, state_block_table=...)

Precision reports (spec 7.1 / 7.2): kvcomp.compare.

Errors raise kvcomp.KvcompError (a RuntimeError) with the aclnn status ``.code`` and a one-sentence
``.message``. docs/python.md has the details.
"""

from . import _C
from ._errors import KvcompError
from ._functional import (
    compressed_leading_shape,
    compressor_forward,
    compressor_grad,
    get_default_options,
    prepare_weights,
    set_default_options,
)

__version__ = _C.version()
kernel_isa = _C.kernel_isa
product_kernels = _C.product_kernels
has_cuda_backend = _C.has_cuda_backend
cuda_device_count = _C.cuda_device_count
release_cached_workspace = _C.release_cached_workspace
set_phase_timing = _C.set_phase_timing
phase_times = _C.phase_times
reset_phase_times = _C.reset_phase_times

__all__ = [
    "KvcompError",
    "compressed_leading_shape",
    "compressor_forward",
    "compressor_grad",
    "cuda_device_count",
    "get_default_options",
    "has_cuda_backend",
    "kernel_isa",
    "phase_times",
    "prepare_weights",
    "product_kernels",
    "release_cached_workspace",
    "reset_phase_times",
    "set_default_options",
    "set_phase_timing",
]
