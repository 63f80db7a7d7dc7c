"""Triton kernels of autopar, each a PyTorch custom op with a pure-PyTorch reference in ``reference``.

Public functions (each differentiable, each one op in ``torch.export`` / ``torch.compile`` graphs):

* ``flash_attention(q, k, v, *, causal=False, scale=None)``: ``autopar::flash_attention``;
  ``flash_attention.attention_block_forward`` / ``attention_block_backward`` run one block of it placed by its
  first query and key positions and return its log-sum-exp (context parallelism's ring steps and zig-zag halves);
* ``rms_norm(x, weight, eps=1e-6)``: ``autopar::rms_norm``;
* ``layer_norm(x, weight, bias, eps=1e-5)``: ``autopar::layer_norm``;
* ``linear_cross_entropy(hidden, weight, labels, *, ignore_index=-100)``: ``autopar::linear_cross_entropy``.

Importing this package registers the ops.

Interpreter mode: Triton decides between compiling a kernel and interpreting it in numpy when the kernel is
defined, from ``TRITON_INTERPRET``. Compiled kernels need a CUDA device, so on a machine without one this
package turns the interpreter on (it sets ``TRITON_INTERPRET=1`` for the process) before defining its kernels:
without a GPU the interpreter is the only way they can run at all, and this way the outcome does not depend on
whether a test harness set the variable before or after something imported this package. Interpreted kernels
are for testing; they are orders of magnitude slower than compiled ones.
"""

from __future__ import annotations

import os
import sys

import torch

__all__ = ["flash_attention", "layer_norm", "linear_cross_entropy", "rms_norm", "kernels_interpreted"]

_interpreted: bool | None = None


def kernels_interpreted() -> bool:
    """Whether this package's kernels run in the Triton interpreter (on any device) or compiled (on CUDA).

    Decided once, on the first call, which each kernel module makes before it defines its kernels: yes when
    ``TRITON_INTERPRET`` is set, or when there is no CUDA device (then the variable is set for the process).
    Later changes to the variable do not change the answer, because they do not change the kernels already
    defined. Tests use it to choose the device of their inputs.
    """
    global _interpreted
    if _interpreted is None:
        _interpreted = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
        if not _interpreted and not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
            _interpreted = True
        if _interpreted:
            _interpret_loaded_triton_language()
    return _interpreted


def _interpret_loaded_triton_language() -> None:
    """Make a ``triton.language`` imported before ``TRITON_INTERPRET`` was set usable by interpreted kernels.

    Triton defines its standard library (``tl.sum``, ``tl.max``, ``tl.zeros``, ...) as jit functions when
    ``triton.language`` is imported, compiled or interpreted according to the variable at that moment. Interpreted
    kernels cannot call the compiled flavour, and many libraries import triton early (``torch._dynamo`` does), so
    in one test process the variable is often set too late. This rebinds each compiled-flavour standard function
    to an interpreted one of the same Python function; one replacement per function, so identity checks inside
    the interpreter (its fast paths for sum and max) still hold. It only runs when interpretation was chosen,
    i.e. when compiled kernels could not be run by this package anyway.
    """
    if "triton.language" not in sys.modules:
        return  # triton will be imported with the variable already set
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    replacements: dict[int, InterpretedFunction] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("triton.language") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                if id(value) not in replacements:
                    replacements[id(value)] = InterpretedFunction(value.fn)
                setattr(module, attr, replacements[id(value)])


# The kernel modules call kernels_interpreted() as they load, so they come after it.
from .cross_entropy import linear_cross_entropy  # noqa: E402
from .flash_attention import flash_attention  # noqa: E402
from .norms import layer_norm, rms_norm  # noqa: E402
