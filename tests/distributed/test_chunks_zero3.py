"""ZeRO-3 with chunks on 4 gloo ranks: same parameters as one process, one collective per chunk, not per tensor."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from autopar.memory import ChunkAdamW, ChunkScheduler, ChunkStore
from tests.distributed.harness import run_distributed

pytestmark = pytest.mark.distributed

WORLD = 4
LR = 1e-2
STEPS = 2
CHUNK_NUMEL = 20000
VOCAB, DIM, GLOBAL_BATCH, SEQ = 128, 64, 8, 16
# See tests/distributed/test_train_numerics.py: eps=1e-6 damps AdamW's amplification of rounding-level
# gradient differences (the reduce-scatter sums over ranks in another order than one backward does).
# Each element may differ by 1e-4 (1% of lr), a tensor's mean difference by 1e-6; a wrong shard or a
# missing reduction moves most elements of a tensor by ~lr.
EPS = 1e-6
PARAM_ATOL, PARAM_MEAN_ATOL = 1e-4, 1e-6


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(DIM)
        self.up = torch.nn.Linear(DIM, 4 * DIM)
        self.down = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, h):
        return h + self.down(torch.nn.functional.gelu(self.up(self.norm(h))))


class _TinyLM(torch.nn.Module):
    """A small pre-norm language model in plain PyTorch: spawned ranks need not import transformers."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, DIM)
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(2))
        self.norm = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return _TinyLM()


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)  # every label counts: equal shares


def _train_zero3(rank: int, world_size: int):
    model = _model()
    store = ChunkStore.from_module(model, chunk_numel=CHUNK_NUMEL, group=dist.group.WORLD, device="cpu")
    store.bind(model)
    sched = ChunkScheduler(store, model)
    opt = ChunkAdamW(store, lr=LR, eps=EPS, weight_decay=0.1)
    share = GLOBAL_BATCH // world_size
    counts, losses = [], []
    for step in range(STEPS):
        ids = _batch(step)[rank * share : (rank + 1) * share]
        store.counter.reset()
        loss = model(ids)
        loss.backward()
        opt.step()
        counts.append(dict(store.counter.counts))
        losses.append(loss.item())
    sched.remove()
    state = store.full_state()
    return {
        "counts": counts,
        "losses": losses,
        "num_chunks": store.num_chunks,
        "num_params": len(store.params),
        "shard_numel": [c.master.numel() for c in store.chunks],
        "capacity": [c.layout.capacity for c in store.chunks],
        "state": state if rank == 0 else None,
    }


def _reference() -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.1, foreach=False)
    for step in range(STEPS):
        ids = _batch(step)
        model(ids).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach() for n, p in model.named_parameters()}


def test_zero3_chunks_match_single_process():
    results = run_distributed(_train_zero3, WORLD)
    got = results[0]
    assert got["num_params"] > got["num_chunks"] > 1
    for r in results:  # each rank owns a quarter of every chunk
        assert r["shard_numel"] == [c // WORLD for c in got["capacity"]]
    for counts in got["counts"]:
        # Per chunk: one all-gather for forward, one for backward, one reduce-scatter of its gradients.
        assert counts == {"all_gather": 2 * got["num_chunks"], "reduce_scatter": got["num_chunks"]}
    ref = _reference()
    for name, value in ref.items():
        diff = (got["state"][name] - value).abs()
        assert float(diff.max()) <= PARAM_ATOL, name
        assert float(diff.mean()) <= PARAM_MEAN_ATOL, name
    moved = sum(float((got["state"][n] - _model().get_parameter(n).detach()).abs().mean()) for n in ref)
    assert moved > 1e-3 * len(ref)  # the parameters did train (by ~lr per element)


def _record_reductions(rank: int, world_size: int, overlap: bool = True):
    """Two steps with the store's reduce-scatters, their completions, backward's chunk gathers and the gathers
    issued ahead logged in order (the second step's); `overlap` False: no prefetch, no reduce-scatter in flight."""
    model = _model()
    store = ChunkStore.from_module(model, chunk_numel=CHUNK_NUMEL, group=dist.group.WORLD, device="cpu")
    store.bind(model)
    sched = ChunkScheduler(store, model, prefetch=overlap, reduce_window=1 if overlap else 0)
    share = GLOBAL_BATCH // world_size
    model(_batch(0)[rank * share : (rank + 1) * share]).backward()  # the first step records the chunks' order
    events = []
    issue, finish, gather, ahead = store.reduce_scatter_grads, store.finish_reduce, sched._gather, sched._prefetch

    def issued(chunk, **kw):
        events.append(("issue", chunk.index))
        issue(chunk, **kw)

    def finished(chunk):
        if chunk.reducing is not None:
            events.append(("finish", chunk.index))
        finish(chunk)

    def gathered(chunk, direction):
        if direction < 0:
            events.append(("backward", chunk.index))
        gather(chunk, direction)

    def prefetched(chunk):
        ahead(chunk)
        if sched._prefetched is chunk:  # a gather issued ahead of use (not one skipped: resident, or over budget)
            events.append(("ahead", chunk.index))

    store.reduce_scatter_grads, store.finish_reduce, sched._gather, sched._prefetch = (
        issued,
        finished,
        gathered,
        prefetched,
    )
    model(_batch(1)[rank * share : (rank + 1) * share]).backward()
    sched.remove()
    return {"events": events, "num_chunks": store.num_chunks}


def test_chunk_reduce_scatters_run_while_backward_goes_on():
    got = run_distributed(_record_reductions, 2)[0]
    events, n = got["events"], got["num_chunks"]
    issues = [i for i, (what, _) in enumerate(events) if what == "issue"]
    assert len(issues) == n and sorted(c for what, c in events if what == "finish") == list(range(n))
    # the first reduce-scatter is issued before backward has reached the chunks it still needs (it is not held
    # until backward ends), and it completes only after backward has gathered at least one more chunk
    first = events[issues[0]][1]
    done = events.index(("finish", first))
    assert any(what == "backward" for what, _ in events[issues[0] + 1 : done]), events
    # at most one reduce-scatter in flight (the default window) beyond the one just issued
    flying = 0
    for what, _ in events:
        flying += {"issue": 1, "finish": -1}.get(what, 0)
        assert flying <= 2, events
    assert any(what == "ahead" for what, _ in events), events  # backward gathers the next chunks ahead


def test_without_overlap_chunks_are_gathered_where_used_and_reduced_where_issued():
    """prefetch=False, reduce_window=0 (what the offload program runs for a plan without overlap): no gather ahead,
    and each reduce-scatter completes before anything else happens."""
    got = run_distributed(_record_reductions, 2, False)[0]
    events, n = got["events"], got["num_chunks"]
    assert not any(what == "ahead" for what, _ in events), events
    issues = [i for i, (what, _) in enumerate(events) if what == "issue"]
    assert len(issues) == n
    for i in issues:
        assert events[i + 1] == ("finish", events[i][1]), events
