"""Pipeline schedules whose transfers do not block compute, and that report each stage's last backward.

`torch.distributed.pipelining`'s GPipe and 1F1B schedules post each receive right before the compute that
reads it and wait for it there, so a stage idles for the whole transfer. The schedules here run on its
action runtime (`_PipelineScheduleRuntime`, the one its interleaved schedule runs on), which executes a
list of actions per pp rank: compute (F, B), receives (RECV_F, RECV_B: an `irecv` posted, waited on by the
compute that reads it), sends (SEND_F, SEND_B: an `isend` posted, waited on at the end of the step; every
micro-batch has its own send and receive buffers, so none is reused before that) and REDUCE_GRAD (after a
stage's last backward of the step).

On top of torch's lowering (`_add_send_recv`, which places a receive where its sender's send falls in a
lock-step simulation), `post_receives_ahead` moves every receive earlier: the receive of micro-batch i+1's
input (or output gradient) is posted before the compute that reads micro-batch i's starts, so the transfer
runs while that compute does. Receives keep their order among themselves, which keeps them matched with the
peer's sends (point-to-point messages between two ranks pair up in the order they are posted; receives from
different peers may pass each other), and posting
a receive earlier cannot create a wait cycle: only the compute waits, for data its schedule already needed.

REDUCE_GRAD calls `on_last_backward(stage_index)`: the program launches the stage's data-parallel gradient
reduction there, so it runs while the other stages still run their cooldown backwards.

The schedules use torch's private action runtime (`torch.distributed.pipelining.schedules`), which the smoke tier
(`make test-torch`) runs on each torch release autopar is checked on.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.pipelining.schedules import (
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    ScheduleInterleaved1F1B,
    _Action,
    _PipelineScheduleRuntime,
)

_RECEIVES = (RECV_F, RECV_B)
# the compute action that reads each kind of receive
_READER = {RECV_F: FORWARD, RECV_B: FULL_BACKWARD}


def gpipe_order(pp: int, m: int) -> dict[int, list[_Action]]:
    """Per pp rank (one stage each): every micro-batch's forward, then every backward."""
    return {
        s: [_Action(s, FORWARD, i) for i in range(m)] + [_Action(s, FULL_BACKWARD, i) for i in range(m)]
        for s in range(pp)
    }


def one_f_one_b_order(pp: int, m: int) -> dict[int, list[_Action]]:
    """Per pp rank (one stage each), torch's Schedule1F1B order: min(m, pp - s) forwards, then a backward and a
    forward alternately, then the remaining backwards."""
    out = {}
    for s in range(pp):
        warmup = min(m, pp - s)
        actions = [_Action(s, FORWARD, i) for i in range(warmup)]
        fwd = warmup
        for bwd in range(m):
            actions.append(_Action(s, FULL_BACKWARD, bwd))
            if fwd < m:
                actions.append(_Action(s, FORWARD, fwd))
                fwd += 1
        out[s] = actions
    return out


def post_receives_ahead(actions: list[_Action], stage_to_rank: Callable[[int], int]) -> list[_Action]:
    """`actions` (one rank's, with communication) with every receive moved before the compute that reads the
    previous receive of its kind and stage, or left where it is if that is earlier; receives from one peer rank
    (`stage_to_rank` of the sending stage) keep their order.

    So the input (output gradient) of micro-batch i+1 is posted before the forward (backward) of micro-batch i.
    """
    compute_at: dict[tuple, int] = {}  # (stage, kind, micro-batch) -> position of the compute reading it
    for pos, a in enumerate(actions):
        for kind, reader in _READER.items():
            if a.computation_type == reader:
                compute_at[(a.stage_index, kind, a.microbatch_index)] = pos
    previous: dict[tuple, int] = {}  # (stage, kind) -> micro-batch of its last receive seen
    target: dict[int, int] = {}  # position of a receive -> position it is posted before
    floor: dict[int, int] = {}  # peer rank -> where its last receive was put
    for pos, a in enumerate(actions):
        if a.computation_type not in _RECEIVES:
            continue
        key = (a.stage_index, a.computation_type)
        before = pos
        if key in previous:
            before = min(pos, compute_at.get((*key, previous[key]), pos))
        peer = stage_to_rank(a.stage_index + (-1 if a.computation_type == RECV_F else 1))
        floor[peer] = max(floor.get(peer, 0), before)  # never ahead of an earlier receive from the same peer
        target[pos] = floor[peer]
        previous[key] = a.microbatch_index
    out: list[_Action] = []
    hoisted = sorted(target.items(), key=lambda kv: (kv[1], kv[0]))
    k = 0
    for pos, a in enumerate(actions):
        while k < len(hoisted) and hoisted[k][1] <= pos:
            out.append(actions[hoisted[k][0]])
            k += 1
        if a.computation_type not in _RECEIVES:
            out.append(a)
    return out


def _reduce_hook(on_last_backward: Callable[[int], None]):
    def run(action: _Action, ctx) -> None:  # noqa: ARG001 - the runtime's custom-function signature
        on_last_backward(action.stage_index)

    return run


class OverlappedSchedule(_PipelineScheduleRuntime):
    """GPipe or 1F1B over one stage per pp rank, receives posted ahead and sends asynchronous (module docstring).

    Args:
        stage: this rank's `PipelineStage`.
        n_microbatches: micro-batches per step.
        name: "gpipe" or "1f1b".
        loss_fn, scale_grads: as torch's schedules take them.
        on_last_backward: called with the stage index after the stage's last backward of a step.
    """

    def __init__(
        self,
        stage,
        n_microbatches: int,
        name: str,
        *,
        loss_fn,
        scale_grads: bool,
        on_last_backward: Callable[[int], None],
    ):
        super().__init__([stage], n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
        pp = stage.group_size
        if name == "1f1b" and n_microbatches < pp:
            raise ValueError(f"1F1B needs at least as many micro-batches as stages ({n_microbatches} < {pp})")
        order = (one_f_one_b_order if name == "1f1b" else gpipe_order)(pp, n_microbatches)
        self.pipeline_order = dict(order)
        self._prepare_schedule_with_comms(order)
        finish(self, on_last_backward)


def finish(schedule: _PipelineScheduleRuntime, on_last_backward: Callable[[int], None]):
    """Post `schedule`'s receives ahead and call `on_last_backward` at each REDUCE_GRAD; returns it."""
    ranks = schedule.stage_index_to_group_rank
    schedule.pipeline_order_with_comms = {
        r: post_receives_ahead(a, ranks.__getitem__) for r, a in schedule.pipeline_order_with_comms.items()
    }
    schedule.register_custom_function(REDUCE_GRAD, _reduce_hook(on_last_backward))
    return schedule


def interleaved(
    stages, n_microbatches: int, *, loss_fn, scale_grads: bool, on_last_backward: Callable[[int], None]
) -> ScheduleInterleaved1F1B:
    """torch's interleaved 1F1B with its receives posted ahead and `on_last_backward` at each REDUCE_GRAD."""
    sched = ScheduleInterleaved1F1B(stages, n_microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return finish(sched, on_last_backward)
