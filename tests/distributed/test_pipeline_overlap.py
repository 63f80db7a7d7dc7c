"""The pipeline program overlaps: receives posted ahead of the compute before the one that reads them, and each
stage block's dp gradient reduction issued bucket by bucket during its last backward, as each bucket's last gradient
of the step comes in; overlap changes no count of transfers or collectives, and no figure of the training. At ZeRO-1
each split weight is gathered once a step (not once per micro-batch) and the fp32 sums of its gradients
reduce-scattered once, in buckets launched the same way.

pp=2 x dp=2 on four gloo ranks, a tiny GPT-2 with 1F1B over four micro-batches, gradient buckets of BUCKET bytes (so
that a stage block has several). The ranks record, in the second step (the first initialises the stages' buffers),
what the schedule does, through wrappers around the stages' methods (a receive is posted when the schedule asks the
stage for its receive ops) and around the program's launch of a bucket: a per-rank sequence number orders a rank's
own events, the wall clock (one machine, one clock) orders events of different ranks.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed.pipelining.schedules as torch_schedules

import autopar
from autopar.plan import Plan
from autopar.runtime import overlap
from autopar.runtime.pipeline_schedule import gpipe_order, one_f_one_b_order, post_receives_ahead
from tests.distributed.harness import backward_marks, for_this_run, run_distributed
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed

M = 4  # micro-batches: more than the stages, so 1F1B has a steady phase
SLOW_S = 1.0  # added to the first stage's last backward (see `_slow_last_backward`)
BUCKET = 64 * 1024  # a tiny GPT-2 layer's gradients are about 200 KiB in fp32: a few buckets a layer
CONSTRAINTS = {"pp": 2, "dp": 2, "tp": 1, "schedule": "1f1b", "num_microbatches": M}


class _Recorder:
    """Events of one rank: (sequence, wall time, what, micro-batch)."""

    def __init__(self):
        self.on = False
        self.events: list[tuple[int, float, str, int]] = []
        self.counts: dict[str, int] = {"isend": 0, "irecv": 0, "all_reduce": 0, "broadcast": 0}
        self.patched: list[tuple[object, str, object]] = []

    def note(self, what: str, mb: int = -1) -> None:
        if self.on:
            self.events.append((len(self.events), time.time(), what, mb))

    def wrap(self, obj, name: str, before: str | None, after: str | None, mb_of=lambda a: a[0] if a else -1):
        inner = getattr(obj, name)

        def run(*a, **k):
            mb = mb_of(a)
            if before:
                self.note(before, mb)
            out = inner(*a, **k)
            if after:
                self.note(after, mb)
            return out

        setattr(obj, name, run)

    def count(self, module, name: str, key=None):
        inner = getattr(module, name)
        self.patched.append((module, name, inner))

        def run(*a, **k):
            if self.on:
                if key is None:
                    self.counts[name] += 1
                else:
                    for kind in key(a):
                        self.counts[kind] += 1
            return inner(*a, **k)

        setattr(module, name, run)

    def restore(self) -> None:
        for module, name, inner in reversed(self.patched):
            setattr(module, name, inner)


def _slow_last_backward(stage, rec: _Recorder) -> None:
    """The first stage's last backward (the step's last compute) made SLOW_S longer in the recorded step, so that the
    cross-rank comparison of wall times below has a margin no scheduling delay of a loaded machine comes near."""
    inner = stage.backward_one_chunk

    def run(*a, **k):
        if rec.on and a and a[0] == M - 1:
            time.sleep(SLOW_S)
        return inner(*a, **k)

    stage.backward_one_chunk = run


def _p2p_kinds(args) -> list[str]:
    return ["isend" if op.op is dist.isend else "irecv" for op in args[0]]


def _run(rank: int, world_size: int, plans: dict[str, str]):
    for_this_run(overlap, "BUCKET_BYTES", BUCKET)  # read when a program makes its buckets
    out = {}
    for label, plan_json in plans.items():
        model = make_model("gpt2", num_layers=4)
        args, kwargs = make_batch("gpt2")
        pm = autopar.compile(
            model,
            f"cpu:{world_size}",
            args,
            kwargs,
            plan=Plan.from_json(plan_json),
            optimizer=lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9),
        )
        rec = _Recorder()
        for st in pm._pipe_stages:
            if pm.pp_rank == 0:
                _slow_last_backward(st, rec)
            rec.wrap(st, "forward_one_chunk", "forward_start", "forward_end")
            rec.wrap(st, "backward_one_chunk", "backward_start", "backward_end")
            rec.wrap(st, "get_fwd_recv_ops", "recv_input", None)
            rec.wrap(st, "get_bwd_recv_ops", "recv_grad", None)
        rec.wrap(pm, "_launch_bucket", "launch", None)  # the "micro-batch" field holds the bucket's index
        rec.count(torch_schedules, "_batch_p2p", _p2p_kinds)
        rec.count(dist, "all_reduce")
        rec.count(dist, "broadcast")
        losses = [pm.train_step(*args, **kwargs)]
        rec.on, pm.comm_events = True, []
        start = time.time()
        with backward_marks(lambda _, rec=rec: rec.note("backward")):
            losses.append(pm.train_step(*args, **kwargs))
        rec.on = False
        out[label] = {
            "events": rec.events,
            "counts": rec.counts,
            "losses": losses,
            "start": start,
            "stage": pm.pp_rank,
            "sends": [len(st.sg.sends) for st in pm.stages],
            "received": [len(st.sg.received) for st in pm.stages],
            "split": sorted(pm._step_split),
            "comm": list(pm.comm_events),
            "kinds": [b.kind for b in pm._buckets],
            "state": {k: v for k, v in pm.state_dict().items() if rank == 0},
        }
        rec.restore()
    return out


def _first(events, what: str, mb: int) -> tuple[int, float]:
    return next((seq, t) for seq, t, w, m in events if w == what and m == mb)


@pytest.fixture(scope="module")
def runs():
    model = make_model("gpt2", num_layers=4)
    args, kwargs = make_batch("gpt2")
    plan = autopar.plan(model, "cpu:4", args, kwargs, constraints=CONSTRAINTS, alternatives=False)
    assert plan.overlap and plan.mesh == {"pp": 2, "dp": 2, "tp": 1}
    zero1 = autopar.plan(model, "cpu:4", args, kwargs, constraints={**CONSTRAINTS, "zero": 1}, alternatives=False)
    assert zero1.overlap and all(st["zero_stage"] == 1 for st in zero1.pipeline["stages"])
    plans = {
        "on": plan.to_json(),
        "off": dataclasses.replace(plan, overlap=False).to_json(),
        "zero1": zero1.to_json(),
        "zero1-off": dataclasses.replace(zero1, overlap=False).to_json(),
    }
    return run_distributed(_run, 4, plans, timeout_s=600)


def test_the_next_micro_batch_is_received_while_the_current_one_computes(runs):
    for res in (r["on"] for r in runs):
        ev = res["events"]
        for i in range(M - 1):
            if res["stage"] == 1:  # the last stage receives activations
                posted, _ = _first(ev, "recv_input", i + 1)
                ended, _ = _first(ev, "forward_end", i)
            else:  # the first stage receives gradients
                posted, _ = _first(ev, "recv_grad", i + 1)
                ended, _ = _first(ev, "backward_end", i)
            assert posted < ended, (res["stage"], i, ev)


def test_without_overlap_a_receive_waits_for_the_compute_before_it(runs):
    """The contrast that makes the test above mean something: torch's 1F1B posts micro-batch i+1's input after
    micro-batch i's forward has ended."""
    res = next(r["off"] for r in runs if r["off"]["stage"] == 1)
    posted, _ = _first(res["events"], "recv_input", 1)
    ended, _ = _first(res["events"], "forward_end", 0)
    assert posted > ended


def _launches(res) -> list[tuple[int, float, int]]:
    return [(seq, t, b) for seq, t, w, b in res["events"] if w == "launch"]


def test_each_stage_block_reduces_over_dp_bucket_by_bucket_during_its_last_backward(runs):
    # the first stage's last backward is the step's last compute (1F1B ends with stage p-1, ..., 0 in turn)
    first_done = min(_first(r["on"]["events"], "backward_end", M - 1)[1] for r in runs if r["on"]["stage"] == 0)
    for res in (r["on"] for r in runs):
        launches, kinds = _launches(res), res["kinds"]
        assert len(kinds) >= 3 and set(kinds) == {"all_reduce"}, kinds  # several buckets; ZeRO-0: all-reduces
        assert sorted(b for *_, b in launches) == list(range(len(kinds)))  # each bucket once a step
        start = _first(res["events"], "backward_start", M - 1)[0]
        end = _first(res["events"], "backward_end", M - 1)[0]
        # none before the step's last backward of the block (earlier micro-batches only accumulate) ...
        assert all(seq > start for seq, _, _ in launches), (start, launches)
        # ... and all but possibly the last while it runs, in the order backward fills them
        during = [b for seq, _, b in launches if seq < end]
        assert len(during) >= len(kinds) - 1 and during == sorted(during), (launches, start, end)
        # the first while most of that backward's compute is still to come, not in a burst at its end
        marks = [seq for seq, _, w, _ in res["events"] if w == "backward" and start < seq < end]
        assert sum(seq > launches[0][0] for seq in marks) > len(marks) / 2, (launches, marks)
        if res["stage"] == 1:  # the last block's reductions all go out while the first block still runs backward
            assert max(t for _, t, _ in launches) < first_done
    for res in (r["off"] for r in runs):  # without overlap: every bucket after the schedule
        end = _first(res["events"], "backward_end", M - 1)[0]
        assert all(seq > end for seq, _, _ in _launches(res))


def test_overlap_changes_no_count_of_transfers_or_collectives(runs):
    for r in runs:
        on, off = r["on"], r["off"]
        assert on["counts"] == off["counts"]
        # every micro-batch: the index and each value forward, a gradient of each value back
        values = on["sends"][0] if on["stage"] == 0 else on["received"][0]
        forward, backward = ("isend", "irecv") if on["stage"] == 0 else ("irecv", "isend")
        assert on["counts"][forward] == M * (1 + values)
        assert on["counts"][backward] == M * values
        assert on["counts"]["broadcast"] == 1  # the loss from the last stage
        assert on["counts"]["all_reduce"] >= 1  # the dp buckets (and the tied embedding's sum)


def test_overlap_changes_no_figure_of_the_training(runs):
    on, off = runs[0]["on"], runs[0]["off"]
    # the same ops in the same order on every rank: only the time a transfer waits differs
    assert on["losses"] == off["losses"]
    for key, ref in off["state"].items():
        torch.testing.assert_close(on["state"][key], ref, rtol=0, atol=0)


@pytest.mark.parametrize("pp,m", [(2, 2), (2, 4), (3, 5), (4, 8)])
@pytest.mark.parametrize("order", [one_f_one_b_order, gpipe_order])
def test_receives_move_ahead_in_their_own_order(order, pp, m):
    from torch.distributed.pipelining.schedules import RECV_B, RECV_F, _add_send_recv

    comm = _add_send_recv({r: list(a) for r, a in order(pp, m).items()}, lambda s: s, pp)
    for rank, actions in comm.items():
        moved = post_receives_ahead(actions, lambda s: s)
        assert sorted(map(str, moved)) == sorted(map(str, actions))
        recvs = [a for a in moved if a.computation_type in (RECV_F, RECV_B)]
        for kind in (RECV_F, RECV_B):  # from one peer (a kind, one stage a rank), in order: matched with the sends
            kept = [a for a in actions if a.computation_type == kind]
            assert [a for a in recvs if a.computation_type == kind] == kept
        where = {str(a): i for i, a in enumerate(moved)}
        for a in recvs:
            kind = "F" if a.computation_type == RECV_F else "B"
            reader = f"{a.stage_index}{kind}{a.microbatch_index}"
            previous = f"{a.stage_index}{kind}{a.microbatch_index - 1}"
            assert where[str(a)] < where[reader]
            if a.microbatch_index > 0:  # posted before the compute of the micro-batch before
                assert where[str(a)] < where[previous], (rank, moved)


def test_zero1_weights_are_gathered_once_a_step_and_reduce_scattered_during_the_last_backward(runs):
    first_done = min(_first(r["zero1"]["events"], "backward_end", M - 1)[1] for r in runs if r["zero1"]["stage"] == 0)
    for r in (r["zero1"] for r in runs):
        comm = r["comm"]
        assert r["split"], "no weight split over dp"
        gathered = [k for e, k in comm if e == "gather"]
        assert sorted(gathered) == r["split"]  # each split weight once, for all M micro-batches
        assert sorted(k for e, k in comm if e == "gathered") == r["split"]
        # every gather issued before the first one is waited on: all go out before the schedule
        assert max(i for i, (e, _) in enumerate(comm) if e == "gather") < comm.index(("gathered", comm[0][1]))
        scattered = [b for e, b in comm if e == "reduce_scatter"]
        assert scattered and scattered == sorted(scattered)  # once a step, in buckets, in backward order
        assert sorted(scattered) == [b for b, kind in enumerate(r["kinds"]) if kind == "reduce_scatter"]
        assert comm[-1] == ("reduced", len(r["kinds"]))
        launches = [(seq, t) for seq, t, b in _launches(r) if r["kinds"][b] == "reduce_scatter"]
        start = _first(r["events"], "backward_start", M - 1)[0]
        end = _first(r["events"], "backward_end", M - 1)[0]
        assert all(seq > start for seq, _ in launches)  # the sums are complete with the last micro-batch's
        assert launches[0][0] < end  # the first bucket goes out while that backward runs
        if r["stage"] == 1:
            assert max(t for _, t in launches) < first_done  # while stage block 0 still runs its last backward
    for r in (r["zero1-off"] for r in runs):  # without overlap: gathered wherever a micro-batch reads a weight
        assert r["split"] == [] and set(r["kinds"]) <= {"all_reduce"}
        assert [e for e, _ in r["comm"]] == ["all_reduce"] * len(r["kinds"]) + ["reduced"]


def test_zero1_once_a_step_trains_as_the_per_micro_batch_gathers_do(runs):
    on, off = runs[0]["zero1"], runs[0]["zero1-off"]
    # fp32: the same sums, but the micro-batches' gradients summed before the reduce-scatter, not after (~1e-7)
    assert on["losses"] == pytest.approx(off["losses"], rel=1e-6)
    for key, ref in off["state"].items():
        torch.testing.assert_close(on["state"][key], ref, rtol=1e-5, atol=1e-6)
