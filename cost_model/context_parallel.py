"""Time and memory of one attention layer under context parallelism (cp), per algorithm.

A sequence of S tokens is split over c ranks (`autopar.context_parallel.layout`); every rank computes the
attention rows of its own tokens against all S keys (`autopar.context_parallel.attention`). Terms, for one
layer with batch b, h query heads, h_kv key/value heads, head dim d and e bytes per element:

* ``t(b, h, q, k, d)``: forward seconds of one unmasked attention of q queries against k keys (the device's
  block time: a callable, or the roofline of a `DeviceSpec`: 4·b·h·q·k·d FLOPs at the forward efficiency
  of the attention kernel the program runs, autopar's Triton kernel, plus one kernel launch). The backward
  is 2.5x the forward's FLOPs, as `cost_model.compute` prices attention, at the kernel's backward efficiency.
* ``f``: the fraction of scores a mask keeps: 1/2 when causal, 1 otherwise.
* ``λ``: the load-balance factor, the busiest rank's work over the average: 1 for zig-zag (and for any
  non-causal layout), (2c-1)/c for a contiguous causal split, whose last rank sees every key.
* ``KV = 2·b·h_kv·S·d·e``: K and V of the whole sequence; ``KV/c`` one rank's block.

| algorithm  | compute, forward                 | communication, forward / backward                          |
|------------|----------------------------------|------------------------------------------------------------|
| all-gather | C = λ·f·c·t(b, h, S/c, S/c, d)   | all-gather(KV) / reduce-scatter(KV), not overlapped          |
| ring       | C as all-gather, in c steps      | c-1 sends of KV/c / 2(c-1) sends of KV/c, overlapped        |
| all-to-all | f·t(b, h/c, S, S, d)             | all-to-all(q, k', v') + all-to-all(out) / the same two      |

Ring: the transfer of step i+1's block runs during step i's compute, so a step takes the longer of the two:
forward = (c-1)·max(C/c, x) + C/c with x the time of one send of KV/c. In the backward, step s overlaps the
K/V hop (when s <= c-2) and the dK/dV hop sent after step s-1 (when s >= 2; step 0's dK/dV stays home), and
the last dK/dV hop follows the last compute: backward = Σ_s max(2.5C/c, n_s·x) + x, n_s the hops of step s.
All-to-all (Ulysses) computes whole-sequence attention on h/c heads, so no layout imbalances it; k' and v'
have h_kv heads, or lcm(h_kv, c) when c does not divide h_kv (heads repeated). Collective times come from
`estimate_collective_time` (alpha-beta ring model of the cp axis's link).

Memory (bytes per rank beyond the local q, k, v, output and LSE every algorithm keeps for the backward):

* all-gather: the gathered K/V, KV, kept from forward to backward; the backward adds the whole sequence's
  dK/dV, KV, before the reduce-scatter.
* ring: nothing kept; the forward double-buffers blocks (2·KV/c); the backward double-buffers K/V blocks and
  travelling dK/dV blocks (4·KV/c).
* all-to-all: the head-split q', k', v' and output kept for the backward ((2h + 2h_kv')·b·S·d·e/c); each
  all-to-all holds a send and a receive buffer of its tensors while it runs (2(h + 2h_kv')·b·S·d·e/c).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from autopar.context_parallel.attention import CPAlgorithm
from autopar.context_parallel.layout import SequenceLayout, check_cp_sequence
from autopar.cost_model.comm import Collective, estimate_collective_time
from autopar.cost_model.compute import TRITON_KERNEL
from autopar.cost_model.devices import DeviceSpec, DType, LinkSpec
from autopar.errors import ConfigError

__all__ = [
    "AttentionTime",
    "CPAttentionCost",
    "CPAttentionShape",
    "attention_flops",
    "attention_time_from_device",
    "estimate_cp_attention",
    "estimate_cp_attention_all",
    "load_balance_factor",
]

BACKWARD_FACTOR = 2.5  # attention backward over forward, as cost_model.compute prices it

# forward seconds of one unmasked attention: (batch, heads, queries, keys, head_dim) -> s
AttentionTime = Callable[[int, int, int, int, int], float]


@dataclass(frozen=True, slots=True)
class CPAttentionShape:
    """One attention layer over the whole (unsplit) sequence."""

    batch: int
    heads: int
    kv_heads: int
    seq_len: int
    head_dim: int
    bytes_per_element: int

    def __post_init__(self):
        for name in ("batch", "heads", "kv_heads", "seq_len", "head_dim", "bytes_per_element"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"attention shape: {name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ConfigError(
                f"attention shape: the {self.heads} query heads must be a multiple of the "
                f"{self.kv_heads} key/value heads (grouped-query attention)"
            )

    def head_bytes(self, heads: int) -> float:
        """Bytes of a (batch, heads, seq_len, head_dim) tensor."""
        return float(self.batch * heads * self.seq_len * self.head_dim * self.bytes_per_element)

    @property
    def kv_bytes(self) -> float:
        """K and V of the whole sequence."""
        return 2 * self.head_bytes(self.kv_heads)


@dataclass(frozen=True, slots=True)
class CPAttentionCost:
    """Seconds and bytes of one attention layer on one rank of the cp group (the busiest rank)."""

    algorithm: CPAlgorithm
    forward_s: float
    backward_s: float
    compute_forward_s: float
    compute_backward_s: float
    comm_s: float  # every collective or transfer, forward and backward, overlapped or not
    saved_bytes: float  # held from the forward to the backward
    peak_extra_bytes: float  # the most held at once, saved bytes included

    @property
    def time_s(self) -> float:
        return self.forward_s + self.backward_s

    @property
    def exposed_comm_s(self) -> float:
        """Communication the compute does not hide."""
        return self.time_s - self.compute_forward_s - self.compute_backward_s


def load_balance_factor(num_ranks: int, causal: bool, layout: SequenceLayout | str) -> float:
    """The busiest rank's attention work over the average: (2c-1)/c for a contiguous causal split, else 1."""
    if causal and SequenceLayout(layout) == SequenceLayout.CONTIGUOUS:
        return (2 * num_ranks - 1) / num_ranks
    return 1.0


def attention_flops(shape: CPAttentionShape, causal: bool) -> tuple[float, float]:
    """(forward, backward) FLOPs of one attention layer over the whole sequence, however cp splits it.

    4·b·h·S²·d forward (QKᵀ and PV), half of it under a causal mask, and 2.5x that backward: the convention of
    `cost_model.compute` for an unsplit attention op, so a cp plan counts the same work as the plan without cp.
    """
    forward = 4.0 * shape.batch * shape.heads * shape.seq_len**2 * shape.head_dim * (0.5 if causal else 1.0)
    return forward, BACKWARD_FACTOR * forward


def _kernel_shares(device: DeviceSpec) -> tuple[float, float]:
    """(forward, backward) shares of the matrix peak the cp blocks run at: the Triton kernel's on `device`, or
    its plateau matmul efficiency when it lists none."""
    kernel = device.attention_kernel(TRITON_KERNEL)
    if kernel is None:
        return device.matmul_efficiency, device.matmul_efficiency
    return kernel.forward, kernel.backward


def attention_time_from_device(device: DeviceSpec, dtype: DType | str) -> AttentionTime:
    """The roofline block time of `device`: 4·b·h·q·k·d FLOPs at its attention kernel's forward rate, plus one
    launch."""
    rate = device.peak_matmul_flops(dtype) * _kernel_shares(device)[0]

    def attention_time_s(batch: int, heads: int, queries: int, keys: int, head_dim: int) -> float:
        return 4.0 * batch * heads * queries * keys * head_dim / rate + device.kernel_overhead_s

    return attention_time_s


def estimate_cp_attention(
    shape: CPAttentionShape,
    num_ranks: int,
    *,
    causal: bool,
    layout: SequenceLayout | str,
    algorithm: CPAlgorithm | str,
    link: LinkSpec,
    compute: AttentionTime | DeviceSpec,
    dtype: DType | str | None = None,
) -> CPAttentionCost:
    """Time and memory of one attention layer split over a cp group of `num_ranks` (see the module docstring).

    Args:
        shape: the layer over the whole sequence.
        num_ranks: the cp degree c.
        causal: causal attention (by global position).
        layout: "zigzag" or "contiguous".
        algorithm: "allgather", "ring" or "alltoall".
        link: the link the cp axis's ranks communicate over.
        compute: the device's block time, as a callable ``(batch, heads, queries, keys, head_dim) -> s`` or a
            `DeviceSpec` (its roofline in `dtype`).
        dtype: the compute format when `compute` is a DeviceSpec; default fp32 for 4-byte, bf16 for 2-byte
            elements.

    Raises:
        ConfigError: a sequence that does not split in `layout`, or all-to-all with a degree that does not
            divide the query heads.
    """
    algorithm, layout = CPAlgorithm(algorithm), SequenceLayout(layout)
    check_cp_sequence(shape.seq_len, num_ranks, layout)
    if algorithm == CPAlgorithm.ALL_TO_ALL and shape.heads % num_ranks:
        raise ConfigError(
            f"all-to-all (Ulysses) context parallelism needs the cp degree {num_ranks} to divide "
            f"the {shape.heads} query heads; price 'ring' or 'allgather' instead"
        )
    backward_factor = BACKWARD_FACTOR
    if isinstance(compute, DeviceSpec):
        dtype = dtype if dtype is not None else (DType.FP32 if shape.bytes_per_element >= 4 else DType.BF16)
        forward_share, backward_share = _kernel_shares(compute)
        backward_factor = BACKWARD_FACTOR * forward_share / backward_share
        compute = attention_time_from_device(compute, dtype)
    if algorithm == CPAlgorithm.ALL_TO_ALL:
        return _all_to_all(shape, num_ranks, causal, link, compute, backward_factor)
    fwd = _split_query_compute(shape, num_ranks, causal, layout, compute)
    if algorithm == CPAlgorithm.ALL_GATHER:
        return _all_gather(shape, num_ranks, fwd, link, backward_factor)
    return _ring(shape, num_ranks, fwd, link, backward_factor)


def estimate_cp_attention_all(shape: CPAttentionShape, num_ranks: int, **kwargs) -> dict[CPAlgorithm, CPAttentionCost]:
    """:func:`estimate_cp_attention` for every algorithm that applies (all-to-all only when c divides the heads)."""
    algorithms = [a for a in CPAlgorithm if a != CPAlgorithm.ALL_TO_ALL or shape.heads % num_ranks == 0]
    return {a: estimate_cp_attention(shape, num_ranks, algorithm=a, **kwargs) for a in algorithms}


def _split_query_compute(
    shape: CPAttentionShape, c: int, causal: bool, layout: SequenceLayout, compute: AttentionTime
) -> float:
    """Forward compute of the busiest rank when queries stay split: λ·f·c blocks of (S/c x S/c)."""
    block = compute(shape.batch, shape.heads, shape.seq_len // c, shape.seq_len // c, shape.head_dim)
    return load_balance_factor(c, causal, layout) * (0.5 if causal else 1.0) * c * block


def _all_gather(shape: CPAttentionShape, c: int, fwd: float, link: LinkSpec, backward_factor: float) -> CPAttentionCost:
    gather = estimate_collective_time(Collective.ALL_GATHER, shape.kv_bytes, c, link)
    scatter = estimate_collective_time(Collective.REDUCE_SCATTER, shape.kv_bytes, c, link)
    bwd = backward_factor * fwd
    kept = shape.kv_bytes if c > 1 else 0.0
    return CPAttentionCost(
        CPAlgorithm.ALL_GATHER,
        gather + fwd,
        bwd + scatter,
        fwd,
        bwd,
        gather + scatter,
        saved_bytes=kept,
        peak_extra_bytes=2 * kept,
    )


def _ring(shape: CPAttentionShape, c: int, fwd: float, link: LinkSpec, backward_factor: float) -> CPAttentionCost:
    bwd = backward_factor * fwd
    if c == 1:
        return CPAttentionCost(CPAlgorithm.RING, fwd, bwd, fwd, bwd, 0.0, 0.0, 0.0)
    hop = estimate_collective_time(Collective.SEND_RECV, shape.kv_bytes / c, 2, link)
    step_f, step_b = fwd / c, bwd / c
    forward = (c - 1) * max(step_f, hop) + step_f
    hops = [(s <= c - 2) + (s >= 2) for s in range(c)]  # K/V hop, dK/dV hop from the step before
    backward = sum(max(step_b, n * hop) for n in hops) + hop
    block = shape.kv_bytes / c
    return CPAttentionCost(
        CPAlgorithm.RING, forward, backward, fwd, bwd, 3 * (c - 1) * hop, saved_bytes=0.0, peak_extra_bytes=4 * block
    )


def _all_to_all(
    shape: CPAttentionShape, c: int, causal: bool, link: LinkSpec, compute: AttentionTime, backward_factor: float
) -> CPAttentionCost:
    kv_heads = shape.kv_heads if shape.kv_heads % c == 0 else math.lcm(shape.kv_heads, c)
    qkv = shape.head_bytes(shape.heads + 2 * kv_heads)
    out = shape.head_bytes(shape.heads)
    fwd = (0.5 if causal else 1.0) * compute(
        shape.batch, shape.heads // c, shape.seq_len, shape.seq_len, shape.head_dim
    )
    bwd = backward_factor * fwd
    comm = estimate_collective_time(Collective.ALL_TO_ALL, qkv, c, link)
    comm += estimate_collective_time(Collective.ALL_TO_ALL, out, c, link)
    if c == 1:
        return CPAttentionCost(CPAlgorithm.ALL_TO_ALL, fwd, bwd, fwd, bwd, 0.0, 0.0, 0.0)
    saved = (qkv + out) / c
    return CPAttentionCost(
        CPAlgorithm.ALL_TO_ALL,
        fwd + comm,
        bwd + comm,
        fwd,
        bwd,
        2 * comm,
        saved_bytes=saved,
        peak_extra_bytes=saved + 2 * qkv / c,
    )
