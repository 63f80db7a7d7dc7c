"""Whether an attention mask is provably causal: the mask's computation evaluated from constants only, whole
when small and block by block (or tile by tile, with interval bounds) when larger than `MAX_MASK_ELEMENTS`, then
compared with SDPA's top-left causal mask. `fused_ops.py` asks this of each attention site with a mask; a mask
that is not provable raises `Skip`, the reason a site is left alone.
"""

from __future__ import annotations

import itertools

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

aten = torch.ops.aten

MAX_MASK_ELEMENTS = 1 << 24  # largest tensor of a mask computation evaluated whole; larger ones go in blocks
CASTS = {aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout, aten.type_as.default}
IDENTITIES = {aten.clone.default, aten.alias.default, aten.contiguous.default}


class Skip(Exception):
    """A matched site that cannot be expressed by the fused op; the message is the reason."""


# ---------------------------------------------------------------------------------------- masks


# Elementwise ops (and expand, which only broadcasts) whose value on a block of the output is the op applied to
# the same block of its inputs: a mask too large to evaluate whole is evaluated block by block through them.
_BLOCKWISE = {
    aten.expand.default,
    aten.__and__.Tensor,
    aten.bitwise_and.Tensor,
    aten.__or__.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_and.default,
    aten.logical_or.default,
    aten.logical_not.default,
    aten.bitwise_not.default,
    aten.eq.Tensor,
    aten.ne.Tensor,
    aten.le.Tensor,
    aten.lt.Tensor,
    aten.ge.Tensor,
    aten.gt.Tensor,
    aten.eq.Scalar,
    aten.ne.Scalar,
    aten.le.Scalar,
    aten.lt.Scalar,
    aten.ge.Scalar,
    aten.gt.Scalar,
    aten.where.self,
    aten.where.ScalarOther,
    aten.where.ScalarSelf,
    aten.where.Scalar,
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.add.Tensor,
    aten.sub.Tensor,
    aten.mul.Tensor,
    aten.add.Scalar,
    aten.sub.Scalar,
    aten.mul.Scalar,
    aten.neg.default,
    aten.abs.default,
    *CASTS,
    *IDENTITIES,
}


class MaskValue:
    """The value of a mask node computed from constants only, whole when small, else block by block.

    Nodes of at most `MAX_MASK_ELEMENTS` elements are evaluated whole, once. Larger ones (the
    `batch x 1 x seq x seq` masks of Hugging Face models at planning sizes) must be `_BLOCKWISE` ops
    over the small ones: `block(region)` evaluates them on one region of the mask's dims only (dims
    aligned to the right, as in broadcasting). Blocks that differ only in their leading (batch,
    head) index and read equal slices of the small inputs have equal values: `leading_groups`
    finds one representative per such group, so a batch of identical masks is evaluated once.
    """

    def __init__(self, graph: fx.Graph, node: fx.Node):
        self.node = node
        ancestors = self._ancestors(node)
        order = {n: i for i, n in enumerate(graph.nodes)}
        self.large = {n for n in ancestors if _numel(n) > MAX_MASK_ELEMENTS}
        for n in self.large:
            if n.target not in _BLOCKWISE:
                raise Skip(
                    f"{n.name} has more than {MAX_MASK_ELEMENTS} elements and {n.target} cannot be evaluated in blocks"
                )
        self.frontier = [n for n in ancestors if n not in self.large and any(u in self.large for u in n.users)]
        self.whole: dict[fx.Node, object] = {}
        try:
            with torch.no_grad():
                for n in sorted(ancestors - self.large, key=order.__getitem__):
                    if any(a in self.large for a in n.all_input_nodes):
                        raise Skip(f"{n.name} reads a mask larger than {MAX_MASK_ELEMENTS} elements")
                    args, kwargs = _args_off_meta(n, self.whole.__getitem__)
                    self.whole[n] = n.target(*args, **kwargs)
        except Skip:
            raise
        except Exception as e:  # noqa: BLE001  (any failure means: not provable)
            raise Skip(f"it could not be evaluated ({type(e).__name__}: {e})") from None

    @staticmethod
    def _ancestors(node: fx.Node) -> set[fx.Node]:
        """Every node `node` is computed from; raises Skip unless they are all constant ops."""
        ancestors, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in ancestors:
                continue
            ancestors.add(n)
            if n.op == "placeholder":
                raise Skip(f"it depends on the graph input {n.name!r}, so it cannot be proven causal")
            if n.op != "call_function" or (
                isinstance(n.target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded in n.target.tags
            ):
                raise Skip(f"it is computed by {n.target}, which is not a constant op")
            stack.extend(n.all_input_nodes)
        return ancestors

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.node.meta["val"].shape)

    def block(self, region: tuple[slice, ...]) -> torch.Tensor:
        """The mask on `region` (one slice per dim of the mask), broadcastable to the region's shape."""
        try:
            with torch.no_grad():
                return self._block(self.node, region, {})
        except Exception as e:  # noqa: BLE001
            raise Skip(f"it could not be evaluated ({type(e).__name__}: {e})") from None

    def _block(self, n, region: tuple[slice, ...], done: dict):
        if not isinstance(n, fx.Node):
            return n
        if n not in self.large:
            return _cut(self.whole[n], region)
        if n not in done:
            if n.target == aten.expand.default:
                done[n] = self._block(n.args[0], region, done)  # broadcasting does the expansion
            else:
                args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: self._block(a, region, done))
                args, kwargs = pytree.tree_map_only(torch.device, _off_meta, (args, kwargs))
                done[n] = n.target(*args, **kwargs)
        return done[n]

    def bounds(self, region: tuple[slice, ...]) -> tuple[float, float] | None:
        """(least, greatest) value of the mask on `region` by interval arithmetic, without evaluating it
        elementwise; None where an op has no interval rule (the caller evaluates the region instead).

        Sound: the true values lie within the bounds. A comparison is decided where its operands' intervals do
        not overlap (the causal mask's comparison of key and query positions, away from the diagonal).
        """
        try:
            with torch.no_grad():
                return self._bounds(self.node, region, {})
        except Exception:  # noqa: BLE001  (no rule or no value: evaluate instead)
            return None

    def _bounds(self, n, region: tuple[slice, ...], done: dict) -> tuple[float, float] | None:
        if not isinstance(n, fx.Node):
            return (float(n), float(n)) if isinstance(n, (bool, int, float)) else None
        if n not in self.large:
            value = _cut(self.whole[n], region)
            if not isinstance(value, torch.Tensor):
                return (float(value), float(value))
            if value.numel() == 0 or value.is_complex():
                return None
            return float(value.min()), float(value.max())
        if n not in done:
            done[n] = self._large_bounds(n, region, done)
        return done[n]

    def _large_bounds(self, n: fx.Node, region: tuple[slice, ...], done: dict) -> tuple[float, float] | None:
        args = [self._bounds(a, region, done) if isinstance(a, fx.Node) else a for a in n.args]
        if n.target == aten.expand.default or n.target in IDENTITIES:
            return args[0]
        if n.target in CASTS:
            dtype = n.meta["val"].dtype
            if args[0] is None or not (dtype == torch.bool or dtype.is_floating_point):
                return None
            return (float(args[0][0] != 0), float(args[0][1] != 0)) if dtype == torch.bool else args[0]
        a, b = (args + [None])[:2]
        if a is None or (len(n.args) > 1 and not isinstance(b, tuple)):
            return None
        if n.target in _BOOLEAN_OPS and not all(
            isinstance(x, fx.Node) and x.meta["val"].dtype == torch.bool for x in n.args[:2]
        ):
            return None  # on integers these are bitwise: the 0/1 intervals below do not apply
        rule = _INTERVAL_RULES.get(n.target)
        return rule(a, b) if rule is not None else None

    def leading_groups(self) -> list[tuple[slice, ...]]:
        """The leading dims (all but the last two) of one block per group of blocks with equal values."""
        lead = self.shape[:-2]
        if not self.large:
            return [tuple(slice(None) for _ in lead)]  # small: one block
        seen, out = set(), []
        for index in itertools.product(*map(range, lead)):
            region = tuple(slice(i, i + 1) for i in index) + (slice(None), slice(None))
            key = tuple(_cut(self.whole[f], region).numpy().tobytes() for f in self.frontier)
            if key not in seen:
                seen.add(key)
                out.append(region[:-2])
        return out


def _decided(true: bool, false: bool) -> tuple[float, float]:
    """The interval of a boolean: (1, 1) when surely true, (0, 0) when surely false, (0, 1) when either."""
    return (1.0, 1.0) if true else (0.0, 0.0) if false else (0.0, 1.0)


# interval rules of the comparisons and boolean ops a causal mask is built with: (lo, hi) of each operand -> result
_INTERVAL_RULES = {
    aten.le.Tensor: lambda a, b: _decided(a[1] <= b[0], a[0] > b[1]),
    aten.lt.Tensor: lambda a, b: _decided(a[1] < b[0], a[0] >= b[1]),
    aten.ge.Tensor: lambda a, b: _decided(a[0] >= b[1], a[1] < b[0]),
    aten.gt.Tensor: lambda a, b: _decided(a[0] > b[1], a[1] <= b[0]),
    aten.eq.Tensor: lambda a, b: _decided(a[0] == a[1] == b[0] == b[1], a[1] < b[0] or b[1] < a[0]),
    aten.ne.Tensor: lambda a, b: _decided(a[1] < b[0] or b[1] < a[0], a[0] == a[1] == b[0] == b[1]),
    aten.__and__.Tensor: lambda a, b: _decided(a[0] > 0 and b[0] > 0, a[1] == 0 or b[1] == 0),
    aten.bitwise_and.Tensor: lambda a, b: _decided(a[0] > 0 and b[0] > 0, a[1] == 0 or b[1] == 0),
    aten.logical_and.default: lambda a, b: _decided(a[0] > 0 and b[0] > 0, a[1] == 0 or b[1] == 0),
    aten.__or__.Tensor: lambda a, b: _decided(a[0] > 0 or b[0] > 0, a[1] == 0 and b[1] == 0),
    aten.bitwise_or.Tensor: lambda a, b: _decided(a[0] > 0 or b[0] > 0, a[1] == 0 and b[1] == 0),
    aten.logical_or.default: lambda a, b: _decided(a[0] > 0 or b[0] > 0, a[1] == 0 and b[1] == 0),
    aten.logical_not.default: lambda a, _: _decided(a[1] == 0, a[0] > 0),
}


_BOOLEAN_OPS = {
    aten.__and__.Tensor,
    aten.bitwise_and.Tensor,
    aten.logical_and.default,
    aten.__or__.Tensor,
    aten.bitwise_or.Tensor,
    aten.logical_or.default,
    aten.logical_not.default,
}


def _numel(node: fx.Node) -> int:
    return sum(t.numel() for t in pytree.tree_leaves(node.meta.get("val")) if isinstance(t, torch.Tensor))


def _args_off_meta(n: fx.Node, value_of) -> tuple[tuple, dict]:
    """The node's arguments with node values filled in; a graph traced on the meta device is evaluated on the
    CPU (a mask's values do not depend on where it is computed)."""
    args, kwargs = fx.node.map_arg((n.args, n.kwargs), value_of)
    return pytree.tree_map_only(torch.device, _off_meta, (args, kwargs))


def _cut(value, region: tuple[slice, ...]):
    """`value` restricted to `region`, dims aligned to the right; size-1 (broadcast) dims are kept whole."""
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    cuts = zip(region[len(region) - value.ndim :], value.shape, strict=True)
    return value[tuple(s if size != 1 else slice(None) for s, size in cuts)]


def _off_meta(device: torch.device) -> torch.device:
    return torch.device("cpu") if device.type == "meta" else device


def classify_mask(mask: MaskValue, seq_q: int, seq_k: int) -> str:
    """'none' for a mask that keeps everything, 'causal' for SDPA's top-left causal mask; raises Skip otherwise.

    A large boolean mask whose ops all have interval rules is classified tile by tile (`_classify_tile`): only
    the tiles across the diagonal are evaluated. Any other is evaluated in blocks of query rows, at most
    `MAX_MASK_ELEMENTS` elements each. Both go over one leading index per group of equal blocks (`MaskValue`).
    """
    shape = mask.shape
    if len(shape) < 2 or len(shape) > 4 or shape[-2] not in (1, seq_q) or shape[-1] not in (1, seq_k):
        raise Skip(f"a mask of shape {tuple(shape)} that does not broadcast to ({seq_q}, {seq_k})")
    leads = mask.leading_groups()
    whole = (*leads[0], slice(None), slice(None))
    if (
        mask.large
        and shape[-2] == seq_q > 1
        and shape[-1] == seq_k > 1
        and mask.node.meta["val"].dtype == torch.bool
        and mask.bounds(whole) is not None
    ):
        found = {"none", "causal"}
        for lead in leads:
            _classify_tile(mask, lead, 0, seq_q, 0, seq_k, found)
        return "none" if "none" in found else "causal"
    rows = max(1, MAX_MASK_ELEMENTS // max(seq_k, 1)) if mask.large else seq_q
    keeps_all, is_causal = True, True
    for lead in leads:
        for r0 in range(0, seq_q, rows):
            r1 = min(r0 + rows, seq_q)
            region = (*lead, slice(r0, r1) if shape[-2] > 1 else slice(None), slice(None))
            keep = _keep_of(mask.block(region))
            causal = torch.arange(r0, r1)[:, None] >= torch.arange(seq_k)[None, :]
            keep, causal = torch.broadcast_tensors(keep.cpu(), causal)
            keeps_all = keeps_all and bool(keep.all())
            is_causal = is_causal and torch.equal(keep, causal)
            if not (keeps_all or is_causal):
                raise Skip("an arbitrary (non-causal) mask; the flash kernel takes no mask but the causal one")
    return "none" if keeps_all else "causal"


def _classify_tile(
    mask: MaskValue, lead: tuple[slice, ...], r0: int, r1: int, c0: int, c1: int, found: set[str]
) -> None:
    """Remove from `found` ("none", "causal") what the mask's rows [r0, r1) x columns [c0, c1) rule out.

    A tile the interval bounds decide (`MaskValue.bounds`: all kept or all blocked) is compared with the causal
    mask's tile without evaluating it; an undecided one is split in four, down to `_LEAF_ELEMENTS`, where it is
    evaluated. A causal mask leaves undecided only the tiles across its diagonal: O(seq · leaf side) elements
    evaluated instead of seq².
    """
    region = (*lead, slice(r0, r1), slice(c0, c1))
    bounds = mask.bounds(region)
    if bounds is not None and bounds[0] == bounds[1]:
        kept = bounds[0] > 0
        if not kept:
            found.discard("none")
        causal_all, causal_none = c1 - 1 <= r0, c0 >= r1  # the causal tile keeps all / none of its scores
        if not (causal_all if kept else causal_none):
            found.discard("causal")
    elif (r1 - r0) * (c1 - c0) <= _LEAF_ELEMENTS or r1 - r0 < 2 or c1 - c0 < 2:
        keep = _keep_of(mask.block(region))
        causal = torch.arange(r0, r1)[:, None] >= torch.arange(c0, c1)[None, :]
        keep, causal = torch.broadcast_tensors(keep.cpu(), causal)
        if not bool(keep.all()):
            found.discard("none")
        if not torch.equal(keep, causal):
            found.discard("causal")
    else:
        rm, cm = (r0 + r1) // 2, (c0 + c1) // 2
        for a, b in ((r0, rm), (rm, r1)):
            for c, d in ((c0, cm), (cm, c1)):
                if found:
                    _classify_tile(mask, lead, a, b, c, d, found)
    if not found:
        raise Skip("an arbitrary (non-causal) mask; the flash kernel takes no mask but the causal one")


_LEAF_ELEMENTS = 1 << 16  # a mask tile the interval bounds leave undecided is evaluated at this size


def _keep_of(mask: torch.Tensor) -> torch.Tensor:
    """Where a boolean or additive float mask keeps the score."""
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point():
        keep = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((keep | blocked).all()):
            raise Skip("an additive mask with values other than 0 and a large negative number (a bias)")
        return keep
    raise Skip(f"a mask of dtype {mask.dtype}")
