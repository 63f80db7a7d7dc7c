"""The sharded program's overlap: gradient buckets reduced while backward runs, with the single-process numerics.

Two gloo ranks, the tiny LLaMA on a data axis of 2: ZeRO-0 (run on DTensors by full recompute), 1, 2 and 3 (ZeRO-2
and 3 reduce-scatter every micro-batch's gradients, at most `overlap.WINDOW` buckets in flight).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

import autopar
from tests.distributed.harness import backward_marks, for_this_run, run_distributed
from tests.models import make_batch, make_model, train_locally

pytestmark = pytest.mark.distributed

LR = 1e-2
# fp32 on CPU: the program sums gradients over two ranks in another order than one process does, ~1e-7
# relative on the loss (ZeRO-2/3 sum the micro-batches' reduce-scattered pieces where one process sums the
# micro-batches' gradients: the same terms reassociated, as small); a missing or doubled reduction moves the second
# step's loss by ~1e-2.
LOSS_RTOL = 1e-5
# Parameters after two steps: SGD moves them by lr * grad (~1e-3), so rounding-level gradient differences give
# ~1e-9; AdamW turns rounding on a near-zero gradient into up to ~lr / 100 (see test_train_numerics, eps 1e-6).
# A wrong reduction (unsummed, or summed twice) moves most elements by ~lr.
SGD_ATOL, ADAMW_ATOL = 1e-6, 1e-4
ADAM_EPS = 1e-6
ZERO = [
    {"dp": 2, "tp": 1, "zero": 0, "recompute": "full"},
    {"dp": 2, "tp": 1, "zero": 1},
    {"dp": 2, "tp": 1, "zero": 2, "num_microbatches": 2},
    {"dp": 2, "tp": 1, "zero": 3},
    {"dp": 2, "tp": 1, "zero": 0, "recompute": "full", "num_microbatches": 2},
    {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 2},
    {"dp": 2, "tp": 1, "zero": 1, "num_microbatches": 2},
]
# the numerics cases' bucket size: 2 or 3 of the tiny LLaMA's fp32 matrices a bucket, so that a step has several
# buckets of several parameters each, more than the ZeRO-2/3 window of 2 in flight
NUMERICS_BUCKET_BYTES = 40_000


# the counting tests count gloo's own reduce-scatter calls (the spawned ranks inherit the setting); the all-reduce
# form gloo runs by default (`collectives.reduce_scatter_by_all_reduce`) is checked by the numerics tests
NATIVE_REDUCE_SCATTER = ("AUTOPAR_GLOO_REDUCE_SCATTER", "native")


def _optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=LR, eps=ADAM_EPS)


def _train(rank: int, world_size: int, cases, opt: str):
    import autopar.runtime.overlap as overlap

    for_this_run(overlap, "BUCKET_BYTES", NUMERICS_BUCKET_BYTES)
    out = []
    for constraints in cases:
        model = make_model("llama")
        args, kwargs = make_batch("llama")
        pm = autopar.compile(
            model, f"cpu:{world_size}", args, kwargs, optimizer=_optimizer(opt), constraints=constraints
        )
        losses = [pm.train_step(*args, **kwargs) for _ in range(2)]
        state = pm.state_dict()  # every rank gathers
        out.append(
            {
                "program": str(pm.plan.program),
                "zero": pm.plan.zero_stage,
                "overlap": pm.overlap,
                "losses": losses,
                "state": state if rank == 0 else None,
                "buckets": sum(b.kind == "reduce_scatter" for b in pm._buckets),
            }
        )
    return out


# `make test` trains AdamW at each ZeRO stage once; the micro-batched cases (the last three) differ from their
# stage's first case in the gradients the step is handed, which SGD checks there (its update is linear in the
# gradient: AdamW's hides a wrong scale), not in what the optimizer does with them; `make test-all` adds them
CASES_OF = {"sgd": ZERO, "adamw": ZERO[:4], "adamw-micro-batched": ZERO[4:]}


@pytest.mark.parametrize("name", ["sgd", "adamw", pytest.param("adamw-micro-batched", marks=pytest.mark.slow)])
def test_overlapped_zero_stages_match_single_process(name):
    opt, cases = name.split("-")[0], CASES_OF[name]
    got = run_distributed(_train, 2, cases, opt)[0]
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    ref_losses, ref_state = train_locally(model, args, kwargs, _optimizer(opt)(model.parameters()), 2)
    atol = SGD_ATOL if opt == "sgd" else ADAMW_ATOL
    for constraints, run in zip(cases, got, strict=True):
        assert run["program"] == "sharded" and run["zero"] == constraints["zero"] and run["overlap"], constraints
        assert constraints["zero"] == 0 or run["buckets"] > 2, run["buckets"]  # more than the window holds
        assert run["losses"] == pytest.approx(ref_losses, rel=LOSS_RTOL), (constraints, run["losses"], ref_losses)
        for key, ref in ref_state.items():
            torch.testing.assert_close(
                run["state"][key], ref, atol=atol, rtol=0, msg=lambda m, k=key, c=constraints: f"{c} {k}: {m}"
            )


def _stepped(constraints, world_size: int):
    """Tiny LLaMA compiled under `constraints` after one training step (what the tests count is of a later one),
    with its batch and that step's loss."""
    args, kwargs = make_batch("llama")
    pm = autopar.compile(make_model("llama"), f"cpu:{world_size}", args, kwargs, constraints=constraints)
    return pm, args, kwargs, pm.train_step(*args, **kwargs)


def _events(rank: int, world_size: int, constraints, bucket_bytes: int):
    import torch.distributed as dist

    import autopar.runtime.overlap as overlap

    for_this_run(overlap, "BUCKET_BYTES", bucket_bytes)
    pm, args, kwargs, _ = _stepped(constraints, world_size)
    calls = []
    real = {name: getattr(dist, name) for name in ("all_reduce", "reduce_scatter_single")}

    def counting(name):
        def call(*a, **k):
            guard = name == "all_reduce" and a[0].dtype == torch.float64 and a[0].numel() == 3
            if not guard:  # the step guard's all-reduce (`runtime.step_guard`) follows the gradient buckets
                calls.append(name)
            return real[name](*a, **k)

        return call

    pm.comm_events = []
    for name in real:
        setattr(dist, name, counting(name))
    try:
        with backward_marks(lambda name: pm.comm_events.append(("backward", name))):
            pm.train_step(*args, **kwargs)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    trainable = sum(p.requires_grad for p in make_model("llama").parameters())  # the model `_stepped` compiled
    return {"events": pm.comm_events, "calls": calls, "trainable": trainable, "overlap": pm.overlap}


@pytest.mark.parametrize("constraints", [ZERO[0], ZERO[3]], ids=["zero0", "zero3"])
def test_first_bucket_is_reduced_before_backward_reaches_the_first_layer(constraints, monkeypatch):
    """With one parameter per bucket, the first reduction goes out while the backward still computes (before it
    reaches the last op it differentiates, and before the embedding's gradient, the last it produces, exists), and
    the step issues exactly one collective per bucket (every trainable parameter); with one bucket for all, exactly
    one, after the embedding's gradient."""
    kind = "all_reduce" if constraints["zero"] == 0 else "reduce_scatter"
    monkeypatch.setenv(*NATIVE_REDUCE_SCATTER)
    small, whole = (run_distributed(_events, 2, constraints, size)[0] for size in (1, 2**40))
    for got in (small, whole):
        events = got["events"]
        assert got["overlap"]
        # the step waits once, after issuing every bucket (ZeRO-3's window also waits for buckets while backward runs)
        assert [e for e, _ in events if e != "waited"][-1] == "wait"
        reductions = [i for i, (event, _) in enumerate(events) if event == kind]
        embedding = events.index(("grad", "model.embed_tokens.weight"))
        assert [e for e, _ in events].count(kind) == len(reductions)
        assert got["calls"] == [("reduce_scatter_single" if kind == "reduce_scatter" else kind)] * len(reductions)
        if got is small:
            assert len(reductions) == got["trainable"]
            assert reductions[0] < embedding < reductions[-1], events
            backward = [i for i, (event, _) in enumerate(events) if event == "backward"]
            # not all at the backward's end: most of its compute comes after the first reduction (made before the
            # run, a parameter's `from_local` would run, and its hook fire, only after all of it)
            assert sum(i > reductions[0] for i in backward) > len(backward) / 2, events
        else:
            assert len(reductions) == 1 and reductions[0] > embedding, events


def _window(rank: int, world_size: int, cases, bucket_bytes: int):
    """Per case, a second step's reduce-scatters (calls and events), and what the program held at each launch and
    after each whole gradient it took in."""
    import torch.distributed as dist

    import autopar.runtime.overlap as overlap

    for_this_run(overlap, "BUCKET_BYTES", bucket_bytes)
    real_rs = dist.reduce_scatter_single
    out = []
    for constraints in cases:
        pm, args, kwargs, _ = _stepped(constraints, world_size)
        calls, kept, filling = [], [], []
        launch, take = pm._launch, pm._full_grad

        def launching(b, launch=launch, pm=pm, kept=kept):
            launch(b)
            if pm._buckets[b].kind == "reduce_scatter":  # whole gradients held besides the send buffers, after it
                kept.append([i for i, g in enumerate(pm._full) if g is not None])

        def taking(i, grad, take=take, pm=pm, filling=filling):
            take(i, grad)  # the buckets holding a send buffer not yet launched once this gradient is in
            filling.append(
                {b for b, bucket in enumerate(pm._buckets) if bucket.send is not None and bucket.work is None}
            )

        def counting(*a, calls=calls, **k):
            calls.append(1)
            return real_rs(*a, **k)

        pm._launch, pm._full_grad, pm.comm_events = launching, taking, []
        dist.reduce_scatter_single = counting
        try:
            pm.train_step(*args, **kwargs)
        finally:
            dist.reduce_scatter_single = real_rs
        out.append(
            {
                "events": pm.comm_events,
                "calls": len(calls),
                "kept": kept,
                "filling": filling,
                "buckets": sum(b.kind == "reduce_scatter" for b in pm._buckets),
                "microbatches": pm.plan.num_microbatches,
                "zero": pm.plan.zero_stage,
            }
        )
    return out


WINDOW_CASES = [{"dp": 2, "tp": 1, "zero": z, "num_microbatches": 2} for z in (1, 2, 3)]


@pytest.mark.parametrize("bucket_bytes", [1, NUMERICS_BUCKET_BYTES], ids=["bucket-per-parameter", "buckets-of-2-3"])
def test_zero23_reduce_scatter_every_micro_batch_within_a_window(bucket_bytes, monkeypatch):
    """ZeRO-2/3: every micro-batch's backward reduce-scatters its buckets, so a step issues buckets x micro-batches
    reduce-scatters (ZeRO-1: buckets, once); at most 2 are launched and not yet waited for, the third waiting for the
    oldest while backward goes on; a bucket's whole gradients are gone once it is launched."""
    model = make_model("llama")
    # every trainable tensor of the tiny LLaMA has a dim of at least dp = 2, so ZeRO splits each: with one byte a
    # bucket, each is a bucket of its own
    split = sum(p.requires_grad and max(p.shape) >= 2 for p in model.parameters())
    monkeypatch.setenv(*NATIVE_REDUCE_SCATTER)
    for got in run_distributed(_window, 2, WINDOW_CASES, bucket_bytes)[0]:
        events, zero = got["events"], got["zero"]
        if bucket_bytes == 1:
            assert got["buckets"] == split
        per_step = got["buckets"] * (got["microbatches"] if zero >= 2 else 1)
        assert got["calls"] == per_step == [e for e, _ in events].count("reduce_scatter"), (zero, got["calls"])
        assert [e for e, _ in events].count("waited") == per_step
        in_flight, most = 0, 0
        for event, _ in events:
            in_flight += {"reduce_scatter": 1, "waited": -1}.get(event, 0)
            most = max(most, in_flight)
            assert in_flight >= 0
        assert in_flight == 0
        if zero == 1:  # today's path: every bucket out on the last micro-batch's backward, waited for at its end
            assert most == got["buckets"]
            # whole fp32 gradients accumulated over the micro-batches, each dropped when its bucket is packed
            assert [len(k) for k in got["kept"]] == sorted((len(k) for k in got["kept"]), reverse=True)
            assert got["kept"][-1] == []
            continue
        assert got["kept"] == [[]] * per_step  # no whole gradient outside the buckets' send buffers
        assert most == 2, events
        # the window waits inside backward: a bucket is waited for before the micro-batch's last gradient is in
        first_wait = next(k for k, (e, _) in enumerate(events) if e == "waited")
        assert first_wait < next(k for k, (e, _) in enumerate(events) if e == "wait"), events
        assert any(e == "grad" for e, _ in events[first_wait:]), events
        # one bucket filled at a time (what the plan prices, `in_flight_grad_bytes`); none once a one-parameter
        # bucket's gradient is in, as it goes out at once
        filling = max(len(held) for held in got["filling"])
        assert filling == (0 if bucket_bytes == 1 else 1), got["filling"]


def test_overlap_off_keeps_the_synchronous_path(monkeypatch):
    """`overlap: False`: no bucket, no deferred gather: the reductions run inside DTensor's redistributions. The
    only events are ZeRO-3's gathers for the backward (its weights are released after the forward either way)."""
    monkeypatch.setenv(*NATIVE_REDUCE_SCATTER)
    got = run_distributed(_events, 2, {**ZERO[3], "overlap": False}, 1)[0]
    assert not got["overlap"] and got["calls"] == []
    assert {e for e, _ in got["events"] if e != "backward"} == {"gather"}, got["events"]  # (backward: the marks)


def _kept(rank: int, world_size: int, cases):
    """Per case, a second step's all-gathers and, of what its forwards hand autograd to keep for backward, how many
    tensors share the storage of a gathered weight; and the step's gather events by where they were issued."""
    import torch.distributed as dist

    real = dist.all_gather_single
    out = []
    for constraints in cases:
        pm, args, kwargs, _ = _stepped(constraints, world_size)
        gathered, kept = [], []  # gathered weights kept alive here, so that no other tensor reuses their storage
        calls = []
        released = pm._released

        def counting(*a, calls=calls, **k):
            calls.append(1)
            return real(*a, **k)

        def collecting(i, full, source, gathered=gathered, released=released):
            gathered.append(full)  # every weight a forward gathers whole is handed here
            return released(i, full, source)

        pm._released = collecting

        def recording(pm=pm, kept=kept):
            def pack(saved):
                kept.append(pm._pack(saved) if pm._release else saved)
                return kept[-1]

            return torch.autograd.graph.saved_tensors_hooks(pack, pm._unpack)

        pm._releasing, pm.comm_events = recording, []
        dist.all_gather_single = counting
        try:
            pm.train_step(*args, **kwargs)
        finally:
            dist.all_gather_single = real
        storages = {g.untyped_storage().data_ptr() for g in gathered}
        locals_ = [t._local_tensor if isinstance(t, DTensor) else t for t in kept if isinstance(t, torch.Tensor)]
        out.append(
            {
                "gathers": len(calls),
                "groups": len(pm._groups),
                "weights_kept": sum(t.untyped_storage().data_ptr() in storages for t in locals_),
                "handles": sum(type(t).__name__ == "_Released" for t in kept),
                "events": [e for e, _ in pm.comm_events],
                "split": sum(d is not None for d in pm._split_dim) if pm.overlap else None,
            }
        )
    return out


def test_zero3_releases_gathered_weights_after_forward_and_zero12_gather_once_a_step():
    """ZeRO-3 keeps no gathered weight from a forward to its backward: what autograd saves of one becomes a handle,
    and the backward gathers the weight again, once per micro-batch for all its saved uses (FSDP's reshard after
    forward; the plan prices two gathers per micro-batch, and no whole weight between them). ZeRO-1 and 2 keep a
    weight gathered for the whole step: one gather per weight per step, whatever the micro-batches, as priced. A
    layer's weights go in one all-gather (`runtime.layer_gather`): the counts are of layer groups."""
    cases = [
        {"dp": 2, "tp": 1, "zero": 3},
        {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 2},
        {"dp": 2, "tp": 1, "zero": 2},
        {"dp": 2, "tp": 1, "zero": 2, "num_microbatches": 2},
        {"dp": 2, "tp": 1, "zero": 1, "num_microbatches": 2},
        {"dp": 2, "tp": 1, "zero": 3, "overlap": False},
    ]
    z3, z3_two, z2, z2_two, z1_two, z3_sync = run_distributed(_kept, 2, cases)[0]
    split, groups = z3["split"], z3["groups"]
    assert split == 21  # the tiny LLaMA: every weight splits over the data axis
    assert groups == 5  # its two layers, the embedding, the final norm and the output projection
    # every weight but the embedding table (its backward reads only the token ids) is saved by the forward, so the
    # backward gathers every group again but the embedding's
    assert z3["handles"] == z3_two["handles"] / 2 > 0 and z3["weights_kept"] == z3_two["weights_kept"] == 0
    assert z3["gathers"] == groups + (groups - 1) and z3_two["gathers"] == 2 * z3["gathers"]
    assert z3_sync["weights_kept"] == 0 and z3_sync["events"].count("gather") == z3_sync["gathers"] == 2 * groups - 1
    # the control: without release the forward keeps gathered weights, which is what makes the check above fail
    assert z2["weights_kept"] > 0 and z2["handles"] == 0
    assert z2["gathers"] == z2_two["gathers"] == z1_two["gathers"] == groups


def _gathers(rank: int, world_size: int, cases):
    import torch.distributed as dist

    out = []
    calls = []
    real = dist.all_gather_single

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    for constraints in cases:
        pm, args, kwargs, first = _stepped(constraints, world_size)
        calls.clear()
        pm.comm_events = []
        dist.all_gather_single = counting
        try:
            pm.train_step(*args, **kwargs)
        finally:
            dist.all_gather_single = real
        out.append(
            {
                "events": pm.comm_events,
                "gathers": len(calls),
                "depth": pm.plan.prefetch_depth,
                "loss": first,
                "groups": [[pm._param_names[i] for i in members] for members in pm._groups],
            }
        )
    return out


def _issued(events, layer: int, start: int = 0) -> int:
    """Index of the first gather of layer `layer`'s parameters issued at or after `start` (ahead or on demand)."""
    prefix = f"model.layers.{layer}."
    return next(
        k
        for k, (e, name) in enumerate(events)
        if k >= start and e in ("gather", "prefetch") and name.startswith(prefix)
    )


def test_zero3_gathers_the_next_layer_while_the_current_one_computes():
    """Depth 1: layer 1's gathers go out before layer 0's last weight (its MLP down projection) is handed to its
    op, so they overlap layer 0's compute; depth 0 gathers layer by layer. Under full recompute the backward
    gathers layer 0 ahead while layer 1 is recomputed. The number of gathers per step is the same at every
    depth, one per layer group gathered, and so is the loss."""
    last = ("gathered", "model.layers.0.mlp.down_proj.weight")
    cases = [{"dp": 2, "tp": 1, "zero": 3, "prefetch_depth": d} for d in (0, 1)]
    cases.append({"dp": 2, "tp": 1, "zero": 3, "recompute": "full"})
    on_demand, ahead, recomputed = run_distributed(_gathers, 2, cases)[0]
    assert (on_demand["depth"], ahead["depth"], recomputed["depth"]) == (0, 1, 1)
    assert "prefetch" not in [e for e, _ in on_demand["events"]]
    assert _issued(on_demand["events"], 1) > on_demand["events"].index(last), on_demand["events"]
    assert _issued(ahead["events"], 1) < ahead["events"].index(last), ahead["events"]
    for got in (on_demand, ahead, recomputed):
        issued = sum(e in ("gather", "prefetch") for e, _ in got["events"])
        assert got["gathers"] == issued < [e for e, _ in got["events"]].count("gathered")
    assert ahead["gathers"] == on_demand["gathers"]
    assert ahead["loss"] == on_demand["loss"]  # the same gathers, earlier: bit for bit the same step
    # backward: layer 1 is recomputed first (its weights gathered again), and layer 0's gathers go out before
    # layer 1's recompute hands its last weight over
    events = recomputed["events"]
    backward = next(k for k, (e, _) in enumerate(events) if e == "grad")
    second = events.index(("gathered", "model.layers.1.mlp.down_proj.weight"), backward)
    assert _issued(events, 0, backward) < second, events


def test_zero3_overlaps_by_default_holding_only_its_buckets_in_flight():
    """Unpinned, a ZeRO-3 plan runs the overlapping program (prefetch depth 1), and its gradient memory is the
    synchronous plan's plus the buckets in flight (`ShardingProgram.in_flight_grad_bytes`), not whole gradients."""
    model = make_model("llama")
    args, kwargs = make_batch("llama")
    default = autopar.plan(model, "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1, "zero": 3}, alternatives=False)
    off = autopar.plan(
        model, "cpu:2", args, kwargs, constraints={"dp": 2, "tp": 1, "zero": 3, "overlap": False}, alternatives=False
    )
    assert default.overlap and default.prefetch_depth == 1 and not off.overlap and off.prefetch_depth == 0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # fp32 on CPU, dp = 2: the synchronous plan holds this rank's half of the gradients; the tiny LLaMA is one bucket
    # of B = 4 x trainable bytes (< 25 MiB): its send buffer, which backward fills, and this rank's piece (B / 2)
    assert off.predicted.memory_breakdown["grads"] == pytest.approx(4 * trainable / 2, rel=1e-12)
    bucket = 4 * trainable
    assert default.predicted.memory_breakdown["grads"] - off.predicted.memory_breakdown["grads"] == pytest.approx(
        bucket * (1 + 1 / 2), rel=1e-12
    )


def test_sharded_program_gathers_a_layer_in_one_all_gather():
    """ZeRO-3 issues one all-gather per layer group and pass, not one per parameter (FSDP's one flat buffer a
    layer, as the plan prices it): each micro-batch's forward gathers every group once, its backward every group
    whose weights it needs again (all but the embedding's), with or without overlap and prefetch; and the losses are
    the same bit for bit."""
    cases = [
        {"dp": 2, "tp": 1, "zero": 3, "prefetch_depth": 0},
        {"dp": 2, "tp": 1, "zero": 3, "prefetch_depth": 1},
        {"dp": 2, "tp": 1, "zero": 3, "overlap": False},
        {"dp": 2, "tp": 1, "zero": 3, "num_microbatches": 2},
    ]
    results = run_distributed(_gathers, 2, cases)[0]
    groups = results[0]["groups"]
    params = sum(len(members) for members in groups)
    assert (len(groups), params) == (5, 21)  # two layers of 9 weights, the embedding, the final norm, the output
    group_of = {name: g for g, members in enumerate(groups) for name in members}
    for got, micro in zip(results, (1, 1, 1, 2), strict=True):
        assert got["groups"] == groups
        assert got["gathers"] == micro * (2 * len(groups) - 1), got["events"]
        # each gather event names a parameter of the group it brings: every group twice a micro-batch, the
        # embedding's once
        named = [group_of[name] for e, name in got["events"] if e in ("gather", "prefetch")]
        assert len(named) == got["gathers"], got["events"]
        assert sorted(named) == sorted([0] * micro + list(range(1, len(groups))) * 2 * micro), got["events"]
    assert results[0]["loss"] == results[1]["loss"] == results[2]["loss"]


def _group_against_split(rank: int, world_size: int):
    """Tensors split as the program splits them (`torch.chunk`'s pieces: uneven, one rank's piece empty), gathered
    in one group all-gather and each on its own (`split_gather`)."""
    import torch.distributed as dist

    from autopar.runtime import overlap
    from autopar.runtime.layer_gather import GroupGather

    torch.manual_seed(0)
    wholes = [(torch.randn(5, 3), 0), (torch.randn(4, 7), 1), (torch.randn(1, 2, 3), 0), (torch.randn(6), 0)]
    locals_ = [w.narrow(d, *overlap.piece_rows(w.shape[d], world_size, rank)) for w, d in wholes]
    group = dist.group.WORLD
    dims, sizes = [d for _, d in wholes], [w.shape[d] for w, d in wholes]
    gathered = GroupGather(locals_, dims, sizes, group, async_op=True)
    together = [gathered.whole(k) for k in range(len(wholes))]
    alone = [
        overlap.split_gather(loc.contiguous(), d, n, group) for loc, d, n in zip(locals_, dims, sizes, strict=True)
    ]
    return [
        (torch.equal(a, b), torch.equal(a, w), a.is_contiguous())
        for a, b, (w, _) in zip(together, alone, wholes, strict=True)
    ]


def test_a_group_gather_gives_split_gathers_values_bit_for_bit():
    """One all-gather of several tensors' padded pieces gives each tensor exactly as its own `split_gather` does,
    and as it was before it was split: uneven pieces, a rank whose piece is empty, a split on dim 1."""
    for got in run_distributed(_group_against_split, 2):
        assert got == [(True, True, True)] * 4, got
