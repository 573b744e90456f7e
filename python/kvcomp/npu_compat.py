"""Opt-in stand-in for the NPU package ``cann_ops_transformer``, so NPU training clients run unchanged.

Some clients do not call ``cann_ops_transformer.compressor`` through an import that one can swap:
MindSpeed-LLM's fused compressor path does ``import cann_ops_transformer.ops as custom_ops``, and
graph-mode code names ``torch.ops.cann_ops_transformer._compressor_forward`` directly. After::

    import kvcomp.torch
    kvcomp.torch.install_cann_ops_transformer()

those names resolve to kvcomp:

* modules ``cann_ops_transformer`` and ``cann_ops_transformer.ops`` (in ``sys.modules``), each with
  ``compressor`` (= ``kvcomp.torch.compressor``, the upstream signature and defaults);
* operators ``torch.ops.cann_ops_transformer._compressor_forward`` and ``_compressor_backward`` with
  the upstream schemas (spec section 9), which call the kernels of ``torch.ops.kvcomp.*``.

Nothing happens on ``import kvcomp``: only the call installs them, and it refuses (``KvcompError``)
when a real ``cann_ops_transformer`` is importable or imported, rather than shadow it. Without
editing a script, ``python -m kvcomp.npu_compat train.py ARGS`` installs them and runs it.
"""

import importlib.machinery
import importlib.util
import os
import runpy
import sys
import types

import torch

from . import _ops
from ._errors import INVALID_PARAM, KvcompError

__all__ = ["install_cann_ops_transformer", "main"]

PACKAGE = "cann_ops_transformer"
_MARK = "__kvcomp_stand_in__"  # set on the module objects made here, to tell them from a real package

# Upstream schemas: the first arguments of kvcomp's own operators (kvcomp._ops), whose names and order
# are upstream's, the backward's gradient named ``dout``; state_cache is written in place, which is
# declared here (upstream declares no mutation).
_FORWARD_SCHEMA = _ops.FORWARD.schema("_compressor_forward", _ops.FORWARD_UPSTREAM)
_BACKWARD_SCHEMA = _ops.BACKWARD.schema("_compressor_backward", _ops.BACKWARD_UPSTREAM, {"d_cmp_kv": "dout"})

_library = None  # the torch.library.Library holding the two operators; alive for the process


def _refusal(what, where):
    return KvcompError(
        INVALID_PARAM,
        f"[kvcomp] {what} (= {where}) must not be present for kvcomp to stand in for {PACKAGE}: to run "
        f"on kvcomp, uninstall that package (pip uninstall {PACKAGE}) or start from an environment "
        f"without it; to run on the NPU, do not call kvcomp.torch.install_cann_ops_transformer()",
    )


def _where(module_or_spec):
    origin = getattr(module_or_spec, "origin", None) or getattr(module_or_spec, "__file__", None)
    if origin and origin not in ("namespace", "built-in", "frozen"):
        return origin
    paths = getattr(module_or_spec, "submodule_search_locations", None) or getattr(
        module_or_spec, "__path__", None
    )
    return ", ".join(str(p) for p in paths) if paths else repr(module_or_spec)


def _check_no_real_package():
    """Raises KvcompError when a real cann_ops_transformer is imported or importable."""
    existing = sys.modules.get(PACKAGE)
    if existing is not None:
        if not getattr(existing, _MARK, False):
            raise _refusal(f"the imported package {PACKAGE}", _where(existing))
        return
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None:
        raise _refusal(f"the installed package {PACKAGE}", _where(spec))


def _forward(*args):
    """CompositeImplicitAutograd kernel of _compressor_forward: torch.ops.kvcomp.compressor_forward,
    plus compressor_grad_anchor when a gradient is needed, so that cmp_kv is differentiable (upstream
    registers its autograd on this operator; PyTorch allows that only on operators that mutate
    nothing, and this one writes the state cache, so the gradient comes from the operators it calls).

    A gradient is attached whenever any of x, wkv, wgate, ape requires one and grad mode is on, the
    intermediates kept for it whatever grad_enabled says (upstream keys them on x only). grad_enabled
    decides what is returned: the intermediates, or zeros of the same shape (the NPU leaves them
    unwritten), so the three outputs have upstream's shapes either way.
    """
    a = _ops.FORWARD.bind(args, {})
    cmp_kv, softmax_score, kv = _ops.forward_with_gradient(*args)
    if not a.grad_enabled:
        block = tuple(cmp_kv.shape[:-1]) + (a.coff * a.cmp_ratio, cmp_kv.shape[-1])
        softmax_score = a.x.new_zeros(block, dtype=torch.float32)
        kv = a.x.new_zeros(block, dtype=torch.float32)
    return cmp_kv, softmax_score, kv


def _backward(*args):
    """CompositeImplicitAutograd kernel of _compressor_backward: torch.ops.kvcomp.compressor_backward
    (the precision and profile in force at this call)."""
    return torch.ops.kvcomp.compressor_backward(*args)


def _register_ops():
    """Defines torch.ops.cann_ops_transformer._compressor_forward / _compressor_backward, once.

    Both are CompositeImplicitAutograd: they decompose into torch.ops.kvcomp.* (which carry the fake
    kernels, the declared state-cache mutation and the autograd formula) before autograd, fake-tensor
    tracing and functionalization see them, so opcheck and torch.compile(fullgraph=True) work as they
    do on kvcomp's own operators.
    """
    global _library
    if _library is not None:
        return
    namespace = getattr(torch.ops, PACKAGE)
    for name in ("_compressor_forward", "_compressor_backward"):
        if hasattr(namespace, name):
            raise _refusal(f"the operator torch.ops.{PACKAGE}.{name}", "registered by another library")
    lib = torch.library.Library(PACKAGE, "FRAGMENT")
    lib.define(_FORWARD_SCHEMA)
    lib.define(_BACKWARD_SCHEMA)
    lib.impl("_compressor_forward", _forward, "CompositeImplicitAutograd")
    lib.impl("_compressor_backward", _backward, "CompositeImplicitAutograd")
    _library = lib


def _missing_attribute(module_name):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"[kvcomp] {module_name}.{name} (= not provided) must be compressor: kvcomp stands in for "
            f"the Compressor operator of {PACKAGE} only"
        )

    return __getattr__


def _make_module(name, is_package):
    module = types.ModuleType(
        name, f"kvcomp's stand-in for {name} (kvcomp.torch.install_cann_ops_transformer): compressor only."
    )
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=is_package)
    module.__package__ = PACKAGE
    if is_package:
        module.__path__ = []  # a package with no folder: unknown submodules fail to import, cleanly
    module.compressor = _ops.compressor
    module.__all__ = ["compressor"]
    module.__getattr__ = _missing_attribute(name)
    setattr(module, _MARK, True)
    return module


def install_cann_ops_transformer():
    """Makes ``cann_ops_transformer`` (and ``.ops``, and its torch.ops names) resolve to kvcomp.

    After the call, ``import cann_ops_transformer`` and ``import cann_ops_transformer.ops`` give
    modules whose ``compressor`` is ``kvcomp.torch.compressor`` (upstream signature and defaults),
    and ``torch.ops.cann_ops_transformer._compressor_forward`` / ``_compressor_backward`` exist with
    the upstream schemas, calling the same kernels as ``torch.ops.kvcomp.*``. Call it before the
    client imports ``cann_ops_transformer`` (in a launcher or ``sitecustomize``; or run the script
    with ``python -m kvcomp.npu_compat SCRIPT ARGS``). Calling it again changes nothing. The
    operators stay registered for the life of the process.

    Returns:
        The module ``cann_ops_transformer``.

    Raises:
        KvcompError: a real ``cann_ops_transformer`` is importable (on ``sys.path``) or already
            imported, or its operators are registered; nothing was installed. kvcomp never shadows
            the NPU package: uninstall it to run on kvcomp, or do not call this to run on the NPU.
    """
    _check_no_real_package()
    _register_ops()
    package = sys.modules.get(PACKAGE)
    if package is None:
        package = _make_module(PACKAGE, is_package=True)
    ops = sys.modules.get(PACKAGE + ".ops")
    if ops is None or not getattr(ops, _MARK, False):
        ops = _make_module(PACKAGE + ".ops", is_package=False)
    package.ops = ops  # `import cann_ops_transformer.ops as m` and `from ... import ops` read this
    sys.modules[PACKAGE] = package
    sys.modules[PACKAGE + ".ops"] = ops
    return package


_USAGE = """usage: python -m kvcomp.npu_compat SCRIPT [ARGS...]
       python -m kvcomp.npu_compat -m MODULE [ARGS...]

Installs kvcomp as cann_ops_transformer (kvcomp.torch.install_cann_ops_transformer), then runs the
script or module as __main__ with ARGS, as `python SCRIPT ARGS` / `python -m MODULE ARGS` would."""


def main(argv=None):
    """Entry point of ``python -m kvcomp.npu_compat``.

    Returns:
        0 once the script or module has run (its own ``sys.exit`` propagates), 2 on bad usage.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_USAGE)
        return 0
    if not argv or argv == ["-m"]:
        print(_USAGE, file=sys.stderr)
        return 2
    install_cann_ops_transformer()
    if argv[0] == "-m":
        sys.argv = [argv[1]] + argv[2:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        # As `python SCRIPT` does: the script's folder first on sys.path.
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    # Run through the imported module, not this __main__ copy, so that the registration state is the
    # one kvcomp.torch.install_cann_ops_transformer sees when the script calls it again.
    from kvcomp.npu_compat import main as _main

    sys.exit(_main())
