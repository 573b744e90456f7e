"""PyTorch operator: ``kvcomp.torch.compressor``, a drop-in for ``cann_ops_transformer.compressor``.

A script written for the NPU runs on CPU tensors by changing only its import::

    import kvcomp.torch as cann_ops_transformer   # was: import cann_ops_transformer

A script that cannot be edited (``import cann_ops_transformer.ops``, ``torch.ops.cann_ops_transformer.*``)
runs after ``install_cann_ops_transformer()``, an explicit opt-in (kvcomp.npu_compat).

Importing this module registers kvcomp's operators with torch.library (``torch.ops.kvcomp.
compressor_forward``, ``compressor_backward``, ``compressor_grad_anchor``; kvcomp._ops has their
schemas and how the gradient is attached). ``forward_with_gradient`` is the same call as ``compressor``
with the intermediates returned, prepared weights, and the precision / profile as arguments.
"""

from ._ops import _dispatch_free, compressor, forward_with_gradient  # noqa: F401
from .npu_compat import install_cann_ops_transformer

__all__ = ["compressor", "forward_with_gradient", "install_cann_ops_transformer"]
