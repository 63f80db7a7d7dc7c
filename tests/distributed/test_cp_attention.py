"""Context-parallel attention on 2 and 4 gloo ranks against single-process SDPA on the whole sequence.

Every algorithm (all-gather, ring, all-to-all) x causal or not x heads (multi-head, grouped-query, one
key/value head) x layout (zig-zag, contiguous) runs in one spawn per group size; each rank returns its output
shard, the gradients of its q, k, v shards and how many times each collective was called in the forward and
in the backward. The parent unshards and compares with `torch.nn.functional.scaled_dot_product_attention`
(`enable_gqa=True`) and its autograd, in float64.

With 4 ranks and 4 query heads, 2 and 1 key/value heads are fewer than the all-to-all degree, so those
cases exercise the repetition of key/value heads; with 2 ranks the single key/value head does.
"""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

from autopar.context_parallel import CPAlgorithm, SequenceLayout, shard_sequence, unshard_sequence
from tests.distributed.harness import for_this_run, run_distributed

pytestmark = pytest.mark.distributed

BATCH, HEADS, HEAD_DIM = 2, 4, 8
SEQ = {2: 12, 4: 24}  # zig-zag chunks of 3 tokens: odd sizes, so no off-by-one hides behind a power of two
KV_HEADS = (4, 2, 1)  # multi-head, grouped-query, multi-query
CASES = list(itertools.product(CPAlgorithm, (False, True), KV_HEADS, SequenceLayout))
# float64: the reference and the cp op sum the same terms in another order (a few dozen per output, merged
# through exp/log of the LSE), so they agree to ~1e-15 relative; a key masked wrongly or a merge weight off
# moves entries by ~1e-2, and a gradient missing one rank's share by O(1).
ATOL = RTOL = 1e-10

_COUNTED = ("all_gather_single", "reduce_scatter_single", "all_reduce", "all_to_all_single", "isend", "irecv")


def _full_inputs(world_size: int, kv_heads: int):
    g = torch.Generator().manual_seed(1000 * world_size + kv_heads)
    seq = SEQ[world_size]

    def randn(heads):
        return torch.randn(BATCH, heads, seq, HEAD_DIM, generator=g, dtype=torch.float64)

    return randn(HEADS), randn(kv_heads), randn(kv_heads), randn(HEADS)  # q, k, v, grad of the output


def _count_collectives(counts: dict):
    """Wrap the torch.distributed functions cp_attention calls so that each call is counted."""
    import torch.distributed as dist

    def wrap(name, fn):
        def counted(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    for name in _COUNTED:
        for_this_run(dist, name, wrap(name, getattr(dist, name)))


def _run_cases(rank: int, world_size: int):
    from autopar.context_parallel import cp_attention

    counts: dict[str, int] = {}
    _count_collectives(counts)
    results = {}
    for algorithm, causal, kv_heads, layout in CASES:
        q, k, v, dout = (shard_sequence(t, 2, world_size, rank, layout) for t in _full_inputs(world_size, kv_heads))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        counts.clear()
        out = cp_attention(q, k, v, causal=causal, layout=layout, algorithm=algorithm)
        forward = dict(counts)
        counts.clear()
        out.backward(dout)
        backward = dict(counts)
        results[(algorithm, causal, kv_heads, layout)] = {
            "out": out.detach(),
            "dq": q.grad,
            "dk": k.grad,
            "dv": v.grad,
            "forward": forward,
            "backward": backward,
        }
    return results


_RESULTS: dict[int, list] = {}


def _results(world_size: int) -> list:
    if world_size not in _RESULTS:
        _RESULTS[world_size] = run_distributed(_run_cases, world_size, timeout_s=600)
    return _RESULTS[world_size]


def _expected_counts(algorithm: CPAlgorithm, n: int) -> tuple[dict, dict]:
    """Collective calls per rank in one forward and one backward."""
    if algorithm == CPAlgorithm.ALL_GATHER:  # dK/dV's reduce-scatter runs as an all-reduce over gloo by default
        native = os.environ.get("AUTOPAR_GLOO_REDUCE_SCATTER") == "native"
        return {"all_gather_single": 1}, {"reduce_scatter_single" if native else "all_reduce": 1}
    if algorithm == CPAlgorithm.ALL_TO_ALL:  # q, k, v in one; the output in one
        return {"all_to_all_single": 2}, {"all_to_all_single": 2}
    # ring: cp-1 K/V hops forward; cp-1 K/V hops and cp-1 dK/dV hops backward
    return {"isend": n - 1, "irecv": n - 1}, {"isend": 2 * (n - 1), "irecv": 2 * (n - 1)}


def _check(world_size: int, algorithm, causal, kv_heads, layout):
    q, k, v, dout = _full_inputs(world_size, kv_heads)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    ref.backward(dout)
    per_rank = [r[(algorithm, causal, kv_heads, layout)] for r in _results(world_size)]
    for name, want in (("out", ref), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        got = unshard_sequence([r[name] for r in per_rank], 2, layout)
        torch.testing.assert_close(got, want.detach(), atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}")
    forward, backward = _expected_counts(algorithm, world_size)
    for rank, r in enumerate(per_rank):
        assert (r["forward"], r["backward"]) == (forward, backward), f"rank {rank} collective calls"


@pytest.mark.parametrize("algorithm,causal,kv_heads,layout", CASES)
def test_two_ranks_match_sdpa(algorithm, causal, kv_heads, layout):
    _check(2, algorithm, causal, kv_heads, layout)


@pytest.mark.parametrize("algorithm,causal,kv_heads,layout", CASES)
def test_four_ranks_match_sdpa(algorithm, causal, kv_heads, layout):
    _check(4, algorithm, causal, kv_heads, layout)
