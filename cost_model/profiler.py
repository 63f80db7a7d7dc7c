"""ProfiledEstimator: time each op on the local device once, and remember it.

For a node of a traced graph, the profiler builds random inputs with the shapes, strides and
dtypes of the node's arguments (from their `meta["val"]`), calls `node.target` on them and
times the forward (median of `repeats` calls after warm-up) and the backward
(`torch.autograd.grad` of the output, with a random output gradient, w.r.t. every floating
input, on a retained graph so that only the backward is timed). Integer inputs are drawn in
range of what they index: the rows of an embedding table, else the smallest dimension of the
op's other tensor inputs; boolean inputs (masks) are all true. Non-tensor arguments are the
node's own.

Results are cached in a JSON file keyed by (target, argument shapes, strides, dtypes and
non-tensor values, device, thread count), the shapes being those timed (a rank's share for a
divisor > 1), so a graph's repeated layers are timed once and a
second estimator on the same file times nothing. The cache file is
`~/.cache/autopar/profile-<device>.json` unless `cache_path` or the environment variable
`AUTOPAR_PROFILE_CACHE` names another.

A timed op is not a free-standing call in a training step: it runs inside one long forward and
one long backward. Host costs measured once per cache (by `calibrate.measure_host_overheads`,
and kept in the cache file next to the ops) turn the isolated timings into in-step ones:

- a backward timed alone pays one `torch.autograd.grad` call (the engine's start and finish,
  `grad_call_s`) where a step's backward pays one node (`op_backward_s`): the difference is
  taken off, and no op's backward is priced below one node;
- an op timed in a loop of itself runs with its dispatch path and kernel code warm in the caches
  and branch predictors; in a forward, op after different op, it is not. So a forward is timed
  with twenty different small ops run between its timed calls (`calibrate.evict_dispatch_paths`).
  On tiny-llama's and tiny-gpt2's ops (local shapes, one thread, a 2-core machine) running the
  graph's own other ops between the calls made the sum of their forwards 1.35 to 1.5 times the
  loop-of-itself sum, and the small mix did about as much; the additive `op_cold_extra_s`
  (measured on 4 x 4 tensors) had covered a tenth of that. Views are not timed and pay
  `op_cold_extra_s` on top of their dispatch;
- `_assert_tensor_metadata` checks cost nothing: the parallel programs drop them before running;
- views and metadata ops launch no kernel and are not timed, but each still pays dispatch in
  the forward (`view_forward_s`) and, when its output is floating, a backward node
  (`view_backward_s`);
- `divisor` > 1 (the op's work split over that many devices, data-parallel ranks, micro-batches
  and tensor-parallel shards together) is priced by timing the op on the share a rank runs: the
  inputs whose leading dimension is the op's (its output's, or for an op that reduces to a
  scalar its largest input's) get that dimension divided by the largest factor of `divisor`
  that divides it (`local_share`), the others are kept whole, and the op must then return its
  outputs' leading dimension divided the same way. A small op's time does not shrink with its
  shapes (dispatch, allocation, loop set-up), so dividing a whole op's time would be
  optimistic; timing the share is not. What the share does not account for (a divisor that
  does not divide the leading dimension, or an op that does not run or does not shrink on the
  smaller inputs) divides only the part of the whole op's time above the fixed per-call cost
  (`op_forward_s`, `op_backward_s`): a rank that runs a tenth of a matmul still pays a whole
  dispatch. Such a division ignores how much less efficient a smaller kernel is.

An op that cannot be run on random inputs is priced by a fallback estimator instead (the
analytic roofline of the "cpu" preset unless another is given), with a warning naming it;
fallback figures are cached like measured ones.

`optimizer_step_time_s` prices the optimizer's update (AdamW) from a cost per parameter tensor
and per parameter byte, both measured with the host costs (`calibrate.measure_optimizer_step`);
an estimator told of another optimizer (`optimizer=(name, factory)`) measures the same two figures
for that one, once per cache, thread count and name, and prices it instead.

This is the one part of the cost model that measures the machine it runs on; planning for
another machine needs that machine's profile file.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from autopar.cost_model.calibrate import (
    evict_dispatch_paths,
    measure_host_overheads,
    measure_lowered_overhead,
    measure_optimizer_step,
)
from autopar.cost_model.compute import AnalyticEstimator, estimate_node_cost, estimate_optimizer_step_time
from autopar.cost_model.devices import DType, get_device

CACHE_ENV = "AUTOPAR_PROFILE_CACHE"
# the optimizer's step (`calibrate.measure_optimizer_step`): AdamW's among the host costs, another's on its own
_OPTIMIZER_FIELDS = ("optimizer_tensor_s", "optimizer_s_per_param_byte")
_HOST_FIELDS = (
    "op_forward_s",
    "op_cold_extra_s",
    "op_backward_s",
    "view_forward_s",
    "view_backward_s",
    "grad_call_s",
    *_OPTIMIZER_FIELDS,
)
# Nodes the parallel programs drop before running the graph (export's dtype/device checks): free.
_NOT_RUN = frozenset({torch.ops.aten._assert_tensor_metadata.default})
_CACHE_VERSION = 3  # 2: forwards timed with other ops between their calls; 3: only inputs that need grad get one
_WARMUP = 2


def default_cache_path(device: str) -> Path:
    """$AUTOPAR_PROFILE_CACHE, else ~/.cache/autopar/profile-<device>.json."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path.home() / ".cache" / "autopar" / f"profile-{device.replace(':', '-')}.json"


def _signature(value, local: dict[fx.Node, torch.Tensor] | None = None) -> object:
    """A JSON-able description of one argument: tensors by layout and dtype, the rest by value."""
    if isinstance(value, fx.Node):
        value = (local or {}).get(value, value.meta.get("val"))
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), list(value.stride()), str(value.dtype)]
    return repr(value)


def profile_key(node: fx.Node, device: str, num_threads: int | None, share: LocalShare | None = None) -> str:
    """The cache key of `node` on `device` with `num_threads` threads, at a rank's `share` of it if given.

    It names which floating inputs need a gradient (`needs_grad`): the same op with fewer of them has a
    cheaper backward.
    """
    local = share.inputs if share is not None else None
    leaves = pytree.tree_leaves((node.args, node.kwargs))
    args = [_signature(leaf, local) for leaf in leaves]
    grads = [isinstance(leaf, fx.Node) and needs_grad(leaf) for leaf in leaves]
    return json.dumps([str(node.target), args, device, num_threads, grads])


def needs_grad(node: fx.Node) -> bool:
    """Whether the backward of a training step computes a gradient for `node`'s value.

    A placeholder needs one when its value requires grad (export keeps that on the parameters' meta
    values); any other node when one of its inputs needs one and it returns a floating tensor. A graph
    none of whose placeholders says so (a graph built by hand, without that information) is taken to
    need gradients for every floating value, as if each were trained.
    """
    graph = node.graph
    found = _NEEDS_GRAD.get(graph)
    if found is None or found[0] != len(graph.nodes):
        found = _NEEDS_GRAD[graph] = (len(graph.nodes), _nodes_needing_grad(graph))
    return node in found[1]


def _floating(value) -> bool:
    return any(t.dtype.is_floating_point for t in _tensor_vals(value))


def _nodes_needing_grad(graph: fx.Graph) -> set[fx.Node]:
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    informed = any(getattr(n.meta.get("val"), "requires_grad", False) for n in placeholders)
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            val = n.meta.get("val")
            if getattr(val, "requires_grad", False) if informed else _floating(val):
                out.add(n)
        elif n.op != "output" and _floating(n.meta.get("val")) and any(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


# per graph: (its node count when computed, the nodes that need a gradient); weak, so graphs are not kept
_NEEDS_GRAD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _tensor_vals(tree) -> list[torch.Tensor]:
    """The tensors among the leaves of `tree`, nodes replaced by their meta values."""
    vals = (leaf.meta.get("val") if isinstance(leaf, fx.Node) else leaf for leaf in pytree.tree_leaves(tree))
    return [v for v in vals if isinstance(v, torch.Tensor)]


@dataclass(frozen=True, slots=True)
class LocalShare:
    """The inputs one rank runs an op on when its work is split `factor` ways along the leading dimension.

    inputs: a meta tensor per input node whose leading dimension was divided (the others are whole).
    factor: what the leading dimension was divided by.
    output_shapes: the shapes the op must return on these inputs (its outputs' leading dimension divided
        the same way where it is the op's), so that an op whose output does not follow is not taken for one.
    """

    inputs: dict[fx.Node, torch.Tensor]
    factor: int
    output_shapes: tuple[tuple[int, ...], ...]


def local_share(node: fx.Node, divisor: float) -> LocalShare | None:
    """`node`'s inputs on one rank of `divisor`, or None where no factor of `divisor` divides its leading dimension.

    The leading dimension is the output's first (the batch, or batch and sequence flattened, for an op
    that carries the batch; a parameter's rows for one that does not), or, for an op that reduces to a
    scalar, its largest input's. It is divided by the largest factor of `divisor` that divides it, in
    every input that has it first; strides are kept, as a rank's share is the leading rows of the whole.
    """
    if divisor <= 1 or divisor != int(divisor):
        return None
    outs = _tensor_vals(node.meta.get("val"))
    ins = [t for t in _tensor_vals((node.args, node.kwargs)) if t.ndim]
    if outs and outs[0].ndim:
        rows = int(outs[0].shape[0])
    elif ins:
        rows = int(max(ins, key=lambda t: t.numel()).shape[0])
    else:
        return None
    factor = math.gcd(rows, int(divisor))
    local = {}
    for leaf in pytree.tree_leaves((node.args, node.kwargs)):
        meta = leaf.meta.get("val") if isinstance(leaf, fx.Node) else None
        if isinstance(meta, torch.Tensor) and meta.ndim and meta.shape[0] == rows:
            local[leaf] = torch.empty_strided(
                (rows // factor, *meta.shape[1:]), meta.stride(), dtype=meta.dtype, device="meta"
            )
    if factor == 1 or not local:
        return None
    shapes = tuple((rows // factor, *t.shape[1:]) if t.ndim and t.shape[0] == rows else tuple(t.shape) for t in outs)
    return LocalShare(local, factor, tuple(tuple(int(s) for s in shape) for shape in shapes))


def _split(total_s: float, fixed_s: float, divisor: float) -> float:
    """`total_s` of a whole op on one rank of `divisor`: the fixed per-call part whole, the rest divided."""
    fixed = min(fixed_s, total_s)
    return fixed + (total_s - fixed) / divisor


def _index_bound(node: fx.Node, metas: list[torch.Tensor]) -> int:
    """Exclusive upper bound for random integer inputs of `node` that keeps every index in range."""
    if node.target == torch.ops.aten.embedding.default:
        return int(metas[0].shape[0])
    if node.target in (torch.ops.aten.cross_entropy_loss.default, torch.ops.aten.nll_loss_forward.default):
        logits = metas[0]
        return int(logits.shape[1] if logits.ndim > 1 else logits.shape[0])
    dims = [int(s) for t in metas if t.dtype.is_floating_point for s in t.shape if s > 0]
    return max(min(dims), 1) if dims else 2


class ProfiledEstimator:
    """A ComputeEstimator that times ops on the local device and caches what it measured.

    Args:
        cache_path: the JSON cache; default `default_cache_path(device)`.
        device: the torch device to time on ("cpu", "cuda").
        repeats: timed calls per measurement; the median is kept.
        num_threads: intra-op threads while timing (1: one rank per core); None leaves torch's setting.
        fallback: the ComputeEstimator for ops that cannot be timed; default the analytic roofline of
            the "cpu" preset (for a CUDA device pass an AnalyticEstimator of its preset).
        ranks_per_core: how many times longer each rank's host work takes while the ranks of the planned
            job run together than alone: about ranks / cores when CPU ranks share cores (the scheduler
            time-slices them), more where sharing also costs caches; `bench run` measures it
            (`calibrate.measure_shared_core_slowdown`). Every time this estimator returns is
            multiplied by it. 1 when each rank has its own core (or its own GPU).
        in_step: (forward, backward) scale of every op's time: how much longer a graph's ops take when the
            graph runs as one training step than the sum of their profiles (`measure_in_step_scale`
            measures it on a graph). (1, 1) trusts the profiles as they are.
        optimizer: the optimizer the plan trains with, as (a name that identifies it and its settings, a
            factory over a list of parameters): its step is measured (`calibrate.measure_optimizer_step`,
            cached under the name) and priced; None prices AdamW from the profile's host costs.
    """

    def __init__(
        self,
        cache_path: str | Path | None = None,
        *,
        device: str = "cpu",
        repeats: int = 5,
        num_threads: int | None = 1,
        fallback=None,
        ranks_per_core: float = 1.0,
        in_step: tuple[float, float] = (1.0, 1.0),
        optimizer: tuple[str, Callable] | None = None,
    ):
        if repeats < 1:
            raise ValueError(f"repeats must be at least 1, got {repeats}")
        if not ranks_per_core >= 1:
            raise ValueError(f"ranks_per_core must be at least 1, got {ranks_per_core}")
        if len(in_step) != 2 or not all(0 < f < math.inf for f in in_step):
            raise ValueError(f"in_step must be two positive scales (forward, backward), got {in_step}")
        self.ranks_per_core = float(ranks_per_core)
        self.in_step = (float(in_step[0]), float(in_step[1]))
        self.device = str(device)
        self.repeats = repeats
        self.num_threads = num_threads
        self.cache_path = Path(cache_path) if cache_path is not None else default_cache_path(self.device)
        self.num_timed = 0  # measurements taken by this estimator (not served from the cache)
        self.failed_targets: set[str] = set()
        self.unshared_targets: set[str] = set()  # ops timed whole and divided: their share did not run or shrink
        self._entries: dict[str, dict[str, float]] = self._load()
        self._fallback = fallback
        if optimizer is not None and not (
            len(optimizer) == 2 and isinstance(optimizer[0], str) and optimizer[0] and callable(optimizer[1])
        ):
            raise ValueError(f"optimizer must be (a name, a factory over parameters), got {optimizer!r}")
        self.optimizer = optimizer

    # ---------------------------------------------------------------------------- public

    def forward_time_s(self, node: fx.Node, divisor: float) -> float:
        if node.target in _NOT_RUN:
            return 0.0
        host = self.host_overheads()
        cold = host["op_cold_extra_s"]
        scale = self.ranks_per_core * self.in_step[0]
        if self._is_view(node):
            return scale * (host["view_forward_s"] + cold) if node.op == "call_function" else 0.0
        fixed = host["op_forward_s"] + cold  # the part of a forward a smaller share does not shrink
        measured, rest = self._measure(node, divisor)
        return scale * _split(measured["forward_s"], fixed, rest)

    def backward_time_s(self, node: fx.Node, divisor: float) -> float:
        if node.target in _NOT_RUN:
            return 0.0
        host = self.host_overheads()
        scale = self.ranks_per_core * self.in_step[1]
        if self._is_view(node):
            return scale * host["view_backward_s"] if node.op == "call_function" else 0.0
        measured, rest = self._measure(node, divisor)
        isolated = measured["backward_s"]
        if isolated == 0.0:  # no floating input or output: no backward node
            return 0.0
        node_s = host["op_backward_s"]
        in_graph = max(isolated - (host["grad_call_s"] - node_s), node_s)
        return scale * _split(in_graph, node_s, rest)

    def optimizer_step_time_s(self, num_tensors: int, num_param_bytes: float) -> float:
        """Seconds of one optimizer step (AdamW, or the estimator's `optimizer`) over `num_tensors` local parameter
        tensors holding `num_param_bytes`."""
        host = self.optimizer_overheads()
        return self.ranks_per_core * estimate_optimizer_step_time(
            num_tensors,
            num_param_bytes,
            tensor_s=host["optimizer_tensor_s"],
            s_per_param_byte=host["optimizer_s_per_param_byte"],
        )

    def optimizer_overheads(self) -> dict[str, float]:
        """{"optimizer_tensor_s", "optimizer_s_per_param_byte"} of the optimizer priced: AdamW's from the host
        costs, or the estimator's `optimizer`, measured once per cache, thread count and name."""
        if self.optimizer is None:
            host = self.host_overheads()
            return {k: host[k] for k in _OPTIMIZER_FIELDS}
        name, make = self.optimizer
        key = json.dumps(["optimizer-step", self.device, self.num_threads, name])
        found = self._entries.get(key)
        if found is None or set(found) != set(_OPTIMIZER_FIELDS):
            repeats = max(self.repeats, 5)
            found = self._entries[key] = self._with_threads(lambda: measure_optimizer_step(repeats, make))
            self._save()
        return found

    def host_overheads(self) -> dict[str, float]:
        """The fixed host costs of this device and thread count (`calibrate.measure_host_overheads`), measured once."""
        key = json.dumps(["host-overheads", self.device, self.num_threads])
        found = self._entries.get(key)
        if found is None or set(found) != set(_HOST_FIELDS):
            repeats = max(self.repeats, 5)
            found = self._entries[key] = self._with_threads(
                lambda: measure_host_overheads(repeats) | measure_optimizer_step(repeats)
            )
            self._save()
        return found

    def sharded_op_overhead_s(self) -> float:
        """Seconds the sharded and pipeline programs add to each op of a training step (forward and backward) over
        eager PyTorch, by running it in their lowered graph (`calibrate.measure_lowered_overhead`), measured once."""
        key = json.dumps(["lowered-overhead", self.device, self.num_threads])
        found = self._entries.get(key)
        if found is None or set(found) != {"lowered_op_s"}:
            found = self._entries[key] = self._with_threads(lambda: measure_lowered_overhead(max(self.repeats, 5)))
            self._save()
        return self.ranks_per_core * found["lowered_op_s"]

    @staticmethod
    def _is_view(node: fx.Node) -> bool:
        return node.op != "call_function" or estimate_node_cost(node).is_view

    # ----------------------------------------------------------------------------- cache

    def _load(self) -> dict[str, dict[str, float]]:
        try:
            data = json.loads(self.cache_path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, json.JSONDecodeError) as e:
            warnings.warn(f"ignoring unreadable profile cache {self.cache_path}: {e}", stacklevel=3)
            return {}
        if not isinstance(data, dict) or data.get("version") != _CACHE_VERSION:
            warnings.warn(f"ignoring profile cache {self.cache_path} of another format", stacklevel=3)
            return {}
        return dict(data.get("entries", {}))

    def _save(self) -> None:
        """Merge with what is on disk (another estimator may have added entries) and replace atomically."""
        self.cache_path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**self._load_quietly(), **self._entries}
        fd, tmp = tempfile.mkstemp(dir=self.cache_path.parent, prefix=".profile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"version": _CACHE_VERSION, "entries": merged}, f)
        os.replace(tmp, self.cache_path)

    def _load_quietly(self) -> dict[str, dict[str, float]]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self._load()

    # -------------------------------------------------------------------------- measuring

    def _measure(self, node: fx.Node, divisor: float = 1.0) -> tuple[dict[str, float], float]:
        """(timings of `node` on one rank of `divisor`, the part of `divisor` they leave to divide)."""
        share = local_share(node, divisor)
        if share is not None:
            key = profile_key(node, self.device, self.num_threads, share)
            found = self._entries.get(key)
            if found is None:
                found = self._entries[key] = self._time_share(node, share)
                self._save()
            if "forward_s" in found:
                return found, divisor / share.factor
            self.unshared_targets.add(str(node.target))
        key = profile_key(node, self.device, self.num_threads)
        found = self._entries.get(key)
        if found is None:
            found = self._entries[key] = self._time_node(node)
            self._save()
        return found, divisor

    def _time_share(self, node: fx.Node, share: LocalShare) -> dict[str, float]:
        """Timings on a rank's share; {"unshared": 1.0} (cached too) when the op fails or does not shrink on it."""
        try:
            result = self._with_threads(lambda: self._run(node, share))
        except Exception:  # the whole op is timed instead, and its time divided
            return {"unshared": 1.0}
        self.num_timed += 1
        return result

    def _with_threads(self, fn):
        previous = torch.get_num_threads()
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        try:
            return fn()
        finally:
            torch.set_num_threads(previous)

    def _time_node(self, node: fx.Node) -> dict[str, float]:
        try:
            result = self._with_threads(lambda: self._run(node))
            self.num_timed += 1
            return result
        except Exception as e:  # an op that random inputs cannot drive: fall back, and say so
            target = str(node.target)
            if target not in self.failed_targets:
                warnings.warn(
                    f"cannot time {target} on random inputs ({type(e).__name__}: {e}); "
                    "using the analytic estimate of the local device instead",
                    stacklevel=4,
                )
            self.failed_targets.add(target)
            return self._analytic(node)

    def _analytic(self, node: fx.Node) -> dict[str, float]:
        if self._fallback is None:
            self._fallback = AnalyticEstimator(get_device("cpu"), DType.FP32)
        fb = self._fallback
        return {"forward_s": fb.forward_time_s(node, 1.0), "backward_s": fb.backward_time_s(node, 1.0)}

    def _inputs(self, node: fx.Node, share: LocalShare | None = None):
        """(args, kwargs, floating leaf inputs) of random tensors shaped like the node's arguments (or `share`'s)."""
        local = share.inputs if share is not None else {}
        metas = [
            t
            for leaf in pytree.tree_leaves((node.args, node.kwargs))
            if isinstance(leaf, fx.Node) and isinstance(t := local.get(leaf, leaf.meta.get("val")), torch.Tensor)
        ]
        bound = _index_bound(node, metas)
        generator = torch.Generator().manual_seed(0)
        leaves: list[torch.Tensor] = []

        def build(value):
            if isinstance(value, fx.Node):
                trained = needs_grad(value)
                value = local.get(value, value.meta.get("val"))
                if not isinstance(value, torch.Tensor):
                    return value
                tensor = self._random_like(value, bound, generator)
                if tensor.dtype.is_floating_point and trained:
                    leaves.append(tensor.requires_grad_(True))
                return tensor
            return torch.device(self.device) if isinstance(value, torch.device) else value

        args, kwargs = pytree.tree_map(build, (node.args, node.kwargs))
        return args, kwargs, leaves

    def _random_like(self, meta: torch.Tensor, bound: int, generator: torch.Generator) -> torch.Tensor:
        """A tensor with `meta`'s shape, strides and dtype (not requiring grad)."""
        shape, stride = tuple(meta.shape), tuple(meta.stride())
        storage = 1 + sum((s - 1) * st for s, st in zip(shape, stride, strict=True)) if all(shape) else 0
        if meta.dtype.is_floating_point:
            base = torch.randn(storage, generator=generator).to(meta.dtype)
        elif meta.dtype == torch.bool:
            base = torch.ones(storage, dtype=torch.bool)
        else:
            base = torch.randint(0, bound, (storage,), generator=generator).to(meta.dtype)
        return base.to(self.device).as_strided(shape, stride).detach()

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _median_s(self, fn, between=None) -> float:
        """Median seconds of `fn` over `repeats` calls after warm-up, running `between` (untimed) before each."""
        for _ in range(_WARMUP):
            fn()
        self._sync()
        times = []
        for _ in range(self.repeats):
            if between is not None:
                between()
                self._sync()
            t0 = time.perf_counter()
            fn()
            self._sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    def _run(self, node: fx.Node, share: LocalShare | None = None) -> dict[str, float]:
        args, kwargs, leaves = self._inputs(node, share)
        if share is not None:
            result = node.target(*args, **kwargs)
            shapes = tuple(tuple(t.shape) for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor))
            if shapes != share.output_shapes:
                raise ValueError(f"on a rank's share {node.target} returns {shapes}, not {share.output_shapes}")
        forward_s = self._median_s(lambda: node.target(*args, **kwargs), between=evict_dispatch_paths)
        outs = [
            t
            for t in pytree.tree_leaves(node.target(*args, **kwargs))
            if isinstance(t, torch.Tensor) and t.grad_fn is not None and t.dtype.is_floating_point
        ]
        if not outs or not leaves:
            return {"forward_s": forward_s, "backward_s": 0.0}
        grads = [torch.randn_like(t) for t in outs]

        def backward():
            torch.autograd.grad(outs, leaves, grads, retain_graph=True, allow_unused=True)

        return {"forward_s": forward_s, "backward_s": self._median_s(backward)}


@dataclass(frozen=True, slots=True)
class InStepScale:
    """A graph's forward and backward run as a training step, next to the sum of its ops' profiles (seconds)."""

    forward_measured_s: float
    forward_profiled_s: float
    backward_measured_s: float
    backward_profiled_s: float

    @property
    def scale(self) -> tuple[float, float]:
        """(forward, backward): measured over profiled, the `in_step` of a `ProfiledEstimator`."""
        return (self.forward_measured_s / self.forward_profiled_s, self.backward_measured_s / self.backward_profiled_s)


def measure_in_step_scale(
    estimator: ProfiledEstimator, gm: fx.GraphModule, values: list, *, loss_index: int = 0, repeats: int = 5
) -> InStepScale:
    """Run `gm` forward and backward as a training step does, and compare with the sum of its ops' profiles.

    Ops timed one at a time miss what a step adds around them: the Python of the graph's own code, an
    allocator serving a growing set of live activations, caches holding other ops' data. Running the
    graph itself measures all of it. `values` are the graph's placeholder values in order (parameters
    requiring grad, so that the backward reaches them); output `loss_index` is the scalar the backward
    starts from. The profiles are `estimator`'s (its cache), summed over the graph's ops at divisor 1
    with no scale (one rank alone, as measured here); forward and backward are medians over `repeats`.
    """
    plain = ProfiledEstimator(
        estimator.cache_path,
        device=estimator.device,
        repeats=estimator.repeats,
        num_threads=estimator.num_threads,
        fallback=estimator._fallback,
    )
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    forward_profiled = sum(plain.forward_time_s(n, 1.0) for n in nodes)
    backward_profiled = sum(plain.backward_time_s(n, 1.0) for n in nodes)
    leaves = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    if not leaves:
        raise ValueError("measure_in_step_scale: no placeholder value requires grad, so there is no backward to time")

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        loss = gm(*values)[loss_index]
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        for leaf in leaves:
            leaf.grad = None
        return t1 - t0, t2 - t1

    def run() -> tuple[float, float]:
        for _ in range(_WARMUP):
            step()
        samples = [step() for _ in range(repeats)]
        return statistics.median(f for f, _ in samples), statistics.median(b for _, b in samples)

    forward, backward = plain._with_threads(run)
    return InStepScale(forward, forward_profiled, backward, backward_profiled)
