"""PyTorch's own Meta kernels while a step is traced, even where another package replaced them.

A fake tensor computes shapes with the ``Meta`` kernel of each ATen op. ColossalAI
(0.5.0) registers its own ``Meta`` kernels over PyTorch's when ``colossalai.booster``
is imported: ``colossalai/_analyzer/_subclasses/_meta_registration.py`` calls
``torch.library.Library("aten", "IMPL", "Meta").impl(...)`` for ``convolution``,
``convolution_backward``, ``native_layer_norm(_backward)``, ``embedding_dense_backward``
and about thirty more. Its header says they are meant for PyTorch 1.12 and below; on
torch 2.x they differ from PyTorch's kernels:

* ``convolution_backward`` with ``bias_sizes=None`` (a convolution without a bias, as
  in Mllama's vision patch embedding) raises ``TypeError`` in ``torch.empty(None)``;
* the traced allocations of a decoder's backward differ from a real run of the same
  step (tests/techniques/test_reference.py runs both).

So a ColossalAI user, who imports the booster before estimating, would get a failed or
a different trace. :func:`pytorch_meta_kernels` puts PyTorch's own kernels back for the
duration of a trace and the replacements afterwards, so the process is left as the user
had it.

Taking the replacing ``Library`` out alone is not enough (measured on torch 2.13): the
dispatcher's table then names PyTorch's kernel again and a meta tensor gets it, but a fake
tensor (CPU backend key plus ``Meta`` in the TLS include set) keeps reaching the last
Python kernel registered for the op, even a destroyed one. So PyTorch's own functions are
registered again on top (the ones ``torch/_meta_registrations.py: activate_meta`` picks:
the ``meta``, then ``post_autograd``, then ``pre_autograd`` decomposition table), and
``FakeTensorMode.cache``, whose entries hold the outputs the replaced kernels gave, is
cleared on the way in and out.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["pytorch_meta_kernels"]

# Modules known to replace aten Meta kernels at import: module -> (library attribute, {op: fn} attribute).
_REPLACERS = {"colossalai._analyzer._subclasses._meta_registration": ("meta_lib", "meta_table")}

_depth = 0


def _op_name(op: torch._ops.OpOverload) -> str:
    # What the replacing module passed to Library.impl: the packet's name for a default overload.
    return op.overloadpacket.__name__ if op._overloadname == "default" else op.__name__


def _pytorch_meta_fn(op: torch._ops.OpOverload):
    from torch._decomp import global_decomposition_table as tables

    return next((tables[kind][op] for kind in ("meta", "post_autograd", "pre_autograd") if op in tables[kind]), None)


def _register(table: dict, fn_of) -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL", "Meta")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Overriding a previously registered kernel", as at the replacer's import
        for op in table:
            fn = fn_of(op)
            if fn is not None:
                with contextlib.suppress(Exception):  # the replacing module ignores the same failures
                    lib.impl(_op_name(op), fn)
    return lib


def _set_aside() -> list[tuple[object, str, dict, torch.library.Library]]:
    taken = []
    for modname, (lib_attr, table_attr) in _REPLACERS.items():
        module = sys.modules.get(modname)
        lib = getattr(module, lib_attr, None)
        table = getattr(module, table_attr, None)
        if lib is None or not table or getattr(lib, "m", None) is None:
            continue
        lib._destroy()
        taken.append((module, lib_attr, table, _register(table, _pytorch_meta_fn)))
    if taken:
        FakeTensorMode.cache.clear()
    return taken


def _restore(taken: list[tuple[object, str, dict, torch.library.Library]]) -> None:
    for module, lib_attr, table, ours in taken:
        ours._destroy()
        setattr(module, lib_attr, _register(table, table.get))
    FakeTensorMode.cache.clear()


@contextlib.contextmanager
def pytorch_meta_kernels() -> Iterator[None]:
    """Trace with PyTorch's own Meta kernels; nested uses set aside and restore once."""
    global _depth
    taken = _set_aside() if _depth == 0 else []
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if taken:
            _restore(taken)
