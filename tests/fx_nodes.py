"""One fx call node with meta values, for tests that price or inspect single ops."""

from __future__ import annotations

import torch
import torch.fx as fx


def call_node(target, args, out=None, kwargs=None) -> fx.Node:
    """A call of `target` whose tensor arguments are placeholders carrying them as meta values.

    The node's own value is `out`, or what `target` returns on `args` (its meta kernel on meta tensors).
    """
    g = fx.Graph()
    built = []
    for a in args:
        if isinstance(a, torch.Tensor):
            p = g.placeholder(f"p{len(built)}")
            p.meta["val"] = a
            a = p
        built.append(a)
    node = g.call_function(target, tuple(built), kwargs or {})
    node.meta["val"] = out if out is not None else target(*args, **(kwargs or {}))
    return node
