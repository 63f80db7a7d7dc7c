"""Context parallelism (cp) in the planner: which models it applies to, and what its attention costs.

A cp plan traces the model on the batch of `autopar.context_parallel.inputs.traced_batch`: each sequence's cp
zig-zag chunks are rows of the batch, ``(cp·batch, seq/cp)``. On that graph every op except attention is
per token, so the sharding solver prices it unchanged with cp folded into the data axis (dp·cp ranks):

* compute and activations per device are those of ``batch/dp`` sequences of ``seq/cp`` tokens, i.e. the
  per-token work and memory divided by cp;
* parameters, gradients and optimizer states are replicated over cp exactly as over dp: gradients are
  reduced over dp·cp ranks and ZeRO shards over dp·cp ranks (the runtime runs them on that flattened axis).

Attention is not per token: a rank's queries attend to keys of the whole sequence. The graph's attention node
(on a ``seq/cp`` chunk) is priced instead by `cost_model.context_parallel.estimate_cp_attention` for one
attention layer over the whole sequence split over the cp group (batch: this rank's sequences of one
micro-batch; heads: those its tensor-axis strategy leaves it), with the algorithm pinned or, unpinned, the
fastest that applies whose memory fits. What that estimate says the algorithm keeps besides q, k, v and the
output (the gathered K/V of all-gather, the head-split copies of all-to-all) is added to the saved activations
of every attention layer the plan does not recompute, and what it holds while it runs (double-buffered ring
blocks, all-to-all send and receive buffers, the whole sequence's dK/dV before a reduce-scatter) to the
working memory (`passes.sharding`).

Terms: `cp` the degree; "data axis" the dp·cp ranks that split the traced batch; an attention node is
``aten.scaled_dot_product_attention`` or ``autopar::flash_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from autopar.cluster import ClusterSpec
from autopar.context_parallel.attention import CPAlgorithm
from autopar.context_parallel.inputs import LAYOUT
from autopar.cost_model.context_parallel import (
    CPAttentionCost,
    CPAttentionShape,
    attention_flops,
    estimate_cp_attention,
)
from autopar.cost_model.devices import DType
from autopar.errors import ConfigError

aten = torch.ops.aten
# convolutions mix neighbouring tokens, which a cp split puts on other ranks
_CONVOLUTIONS = ("aten.convolution.", "aten.conv1d.", "aten.conv2d.", "aten.conv3d.", "aten._convolution.")


def is_attention(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target is aten.scaled_dot_product_attention.default:
        return True
    flash = getattr(torch.ops.autopar, "flash_attention", None) if hasattr(torch.ops, "autopar") else None
    return flash is not None and node.target is flash.default


def attention_causal(node: fx.Node) -> bool:
    """Whether an attention node is causal over the sequence: SDPA's is_causal, or a mask the graph built.

    A cp plan refuses a caller's padding mask (`context_parallel.inputs.check_cp_inputs`), so a mask in the
    graph is the model's own causal mask, built from the local shapes; cp attention applies causality by
    global position instead.
    """
    if node.target is aten.scaled_dot_product_attention.default:
        mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
        causal = node.args[5] if len(node.args) > 5 else node.kwargs.get("is_causal", False)
        return bool(causal) or mask is not None
    return bool(node.args[3] if len(node.args) > 3 else node.kwargs.get("causal", False))


def drop_causal_masks(traced):
    """A graph traced for cp with the model's causal masks taken out: each SDPA node that reads a mask reads none
    and is causal instead, and the nodes that built the masks are removed. Returns `traced` (rewritten in place).

    A cp plan refuses a caller's padding mask (`context_parallel.inputs.check_cp_inputs`), so a mask in a cp graph
    is the model's causal mask built from the shape of one rank's chunks: (seq/cp)² scores per sequence row that
    mean nothing under the zig-zag layout, where cp attention applies causality by global position. Left in, each
    rank would build and hold it (and the plan would price it); it is never materialised.
    """
    gm = traced.graph_module
    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target is not aten.scaled_dot_product_attention.default:
            continue
        args, kwargs = list(n.args), dict(n.kwargs)
        mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
        if not isinstance(mask, fx.Node):
            continue
        if len(args) > 3:
            args[3] = None
        else:
            kwargs["attn_mask"] = None
        if len(args) > 5:
            args[5] = True
        else:
            kwargs["is_causal"] = True
        n.args, n.kwargs = tuple(args), kwargs
        changed = True
    if changed:
        # shape assertions on the mask's intermediates are all that would keep them alive
        gm.graph.eliminate_dead_code(
            is_impure_node=lambda node: node.target is not aten._assert_tensor_metadata.default and node.is_impure()
        )
        gm.recompile()
    return traced


@dataclass(frozen=True, slots=True)
class CPSpec:
    """The pinned cp degree and attention algorithm (None: the cheapest that applies)."""

    degree: int = 1
    algorithm: CPAlgorithm | None = None

    @classmethod
    def from_constraints(cls, constraints: dict, world_size: int) -> CPSpec:
        cp, alg = constraints.get("cp"), constraints.get("cp_attention")
        if cp is None:
            if alg is not None:
                raise ConfigError(
                    "constraints['cp_attention'] picks the attention algorithm of a cp axis: pin 'cp' too"
                )
            return cls()
        if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or world_size % cp:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ConfigError(
                f"constraints['cp']={cp!r} does not divide the world size {world_size}; choose one of {divisors}"
            )
        try:
            algorithm = CPAlgorithm(alg) if alg is not None else None
        except ValueError:
            raise ConfigError(
                f"constraints['cp_attention']={alg!r}: expected one of {[a.value for a in CPAlgorithm]}"
            ) from None
        return cls(cp, algorithm)

    @property
    def on(self) -> bool:
        return self.degree > 1


def check_cp_graph(graph: fx.Graph, spec: CPSpec) -> list[fx.Node]:
    """The attention nodes of a graph traced for cp; ConfigError where cp cannot split this model."""
    nodes = list(graph.nodes)
    convs = [n.name for n in nodes if n.op == "call_function" and str(n.target).startswith(_CONVOLUTIONS)]
    if convs:
        raise ConfigError(
            f"context parallelism splits the sequence over {spec.degree} ranks, but the model has "
            f"convolutions ({', '.join(convs[:3])}) that mix neighbouring tokens across that split; "
            f"plan without cp"
        )
    attn = [n for n in nodes if is_attention(n)]
    if not attn:
        raise ConfigError(
            "context parallelism needs the model's attention as scaled_dot_product_attention (or "
            "autopar's flash attention), and none was found in the traced graph: load the model "
            "with attn_implementation='sdpa', or plan without cp"
        )
    if spec.algorithm == CPAlgorithm.ALL_TO_ALL:
        for n in attn:
            heads = n.args[0].meta["val"].shape[1]
            if heads % spec.degree:
                raise ConfigError(
                    f"cp_attention='alltoall' splits the {heads} query heads over cp={spec.degree}, "
                    f"which does not divide them; pin 'ring' or 'allgather', or a cp dividing "
                    f"{heads}"
                )
    return attn


def attention_shape(node: fx.Node, degree: int, batch: int, divisor: int = 1) -> CPAttentionShape:
    """The whole-sequence attention layer an attention node of a graph traced for cp `degree` stands for.

    Args:
        node: the attention node, on a chunk of ``seq/degree`` tokens.
        batch: the sequences it runs on (the traced node holds `degree` rows per sequence).
        divisor: the tensor axis's split of the heads (kept whole when it does not divide them).
    """
    q, k = node.args[0].meta["val"], node.args[1].meta["val"]
    heads, kv_heads = q.shape[1], k.shape[1]
    if divisor > 1 and heads % divisor == 0 and kv_heads % divisor == 0:
        heads, kv_heads = heads // divisor, kv_heads // divisor
    return CPAttentionShape(
        batch=max(1, batch),
        heads=heads,
        kv_heads=kv_heads,
        seq_len=q.shape[2] * degree,
        head_dim=q.shape[3],
        bytes_per_element=q.element_size(),
    )


def cp_attention_flops(node: fx.Node, degree: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of an attention node of a graph traced for cp `degree`, over whole sequences.

    The traced node runs ``degree·batch`` chunks of ``seq/degree`` tokens under the mask the model built from the
    chunk's shape; what the cp program runs is attention over whole sequences, causal by global position
    (`attention_causal`). Its FLOPs are those of the plan without cp (`attention_flops`).
    """
    batch = node.args[0].meta["val"].shape[0] // degree
    return attention_flops(attention_shape(node, degree, batch), causal=attention_causal(node))


@dataclass(frozen=True, slots=True)
class CPPricing:
    """What cp attention costs on one mesh: the algorithm used and each algorithm's price (or why it cannot run).

    `lines` holds one line per algorithm for the plan ("ring: 1.20 ms per layer and step, 0.10 ms of it
    exposed communication", "alltoall: 32 heads not divisible by cp=48").
    """

    degree: int
    algorithm: CPAlgorithm
    cluster: ClusterSpec
    dtype: DType
    link_axis: tuple[int, int]
    lines: tuple[str, ...] = field(default=())
    # the algorithms that apply, fastest first (the pinned one alone when pinned)
    ranked: tuple[CPAlgorithm, ...] = field(default=())

    def with_algorithm(self, algorithm: CPAlgorithm, why: str = "") -> CPPricing:
        """This pricing running `algorithm` instead; `why` (a line for the plan) says why the faster ones were not."""
        lines = self.lines + ((why,) if why else ())
        return CPPricing(self.degree, algorithm, self.cluster, self.dtype, self.link_axis, lines, self.ranked)

    def cost(
        self, node: fx.Node, local_batch: int, divisor: int = 1, algorithm: CPAlgorithm | None = None
    ) -> CPAttentionCost:
        """One attention node's cost per micro-batch on the busiest rank; `divisor` splits its heads (tp)."""
        shape = attention_shape(node, self.degree, local_batch, divisor)
        return estimate_cp_attention(
            shape,
            self.degree,
            causal=attention_causal(node),
            layout=LAYOUT,
            algorithm=algorithm or self.algorithm,
            link=self.cluster.link_for_axis(*self.link_axis),
            compute=self.cluster.device,
            dtype=self.dtype,
        )

    def times(self, node: fx.Node, local_batch: int, divisor: int = 1) -> tuple[float, float]:
        c = self.cost(node, local_batch, divisor)
        return c.forward_s, c.backward_s


def price_cp_attention(
    attention: list[fx.Node],
    cluster: ClusterSpec,
    spec: CPSpec,
    *,
    data: int,
    tp: int,
    num_microbatches: int,
    precision: str,
) -> CPPricing:
    """The algorithm a (data, tp) mesh runs cp attention with, and every algorithm's price on it.

    Args:
        attention: the graph's attention nodes (the first stands for all: layers are alike).
        spec: the pinned degree and algorithm.
        data: ranks of the data axis (dp·cp); num_microbatches: per data rank.
        precision: the plan's compute format.
    """
    node = attention[0]
    local_batch = node.args[0].meta["val"].shape[0] // (data * num_microbatches)
    base = CPPricing(spec.degree, spec.algorithm or CPAlgorithm.RING, cluster, DType(precision), (spec.degree, tp))
    costs, lines = {}, []
    heads, kv_heads = node.args[0].meta["val"].shape[1], node.args[1].meta["val"].shape[1]
    # where the tensor axis splits the heads (`CPPricing.cost`), all-to-all splits a tensor rank's share
    local = heads // tp if tp > 1 and heads % tp == 0 and kv_heads % tp == 0 else heads
    for alg in CPAlgorithm:
        if alg == CPAlgorithm.ALL_TO_ALL and local % spec.degree:
            per = f" ({local} per rank of tp={tp})" if local != heads else ""
            lines.append(f"{alg}: {heads} heads{per} not divisible by cp={spec.degree}")
            continue
        c = base.cost(node, local_batch, algorithm=alg)
        costs[alg] = c
        lines.append(
            f"{alg}: {c.time_s * 1e3:.3f} ms per layer and micro-batch, {c.exposed_comm_s * 1e3:.3f} ms of "
            f"it exposed communication"
        )
    ranked = (spec.algorithm,) if spec.algorithm else tuple(sorted(costs, key=lambda a: costs[a].time_s))
    return CPPricing(spec.degree, ranked[0], cluster, DType(precision), (spec.degree, tp), tuple(lines), ranked)
