"""The step guard: what every program does between a step's backward and its optimizer update.

After `Program._forward_backward` and `_scale_gradients` each rank holds its gradients of the masters it
steps, divided by the step's loss weight and (fp16) by the loss scale. The guard then, the same for every
program kind, layout and precision:

1. `accumulate=True` (gradient accumulation across calls): adds the gradients, times the call's loss weight,
   into an fp32 accumulator (one copy of this rank's gradients, held until the step) and returns. No
   collective, no update. The call that steps folds the accumulator in: with W_c the loss weight of call c
   (the kept labels of a token-mean cross-entropy, the tokens of a `loss_fn`, else 1) and g_c its gradient,
   the step's gradient is sum_c W_c g_c / sum_c W_c: one step over the union of the calls' rows.
2. Reduces, in ONE all-reduce over the world of three fp64 numbers:
   - q_r = sum over this rank's gradient tensors g of |g|^2 / copies(g), where copies(g) is the number of
     ranks holding an identical copy of g (`Program._gradient_shares`: replicated over tp, over the data
     axis, on several pipeline stages); the sum over ranks counts every element once, so the global norm
     is sqrt(sum_r q_r), what `torch.nn.utils.clip_grad_norm_` computes on one process;
   - whether this rank found a non-finite gradient;
   - this rank's share of the step's tokens (`last_step.tokens`).
3. Non-finite loss or gradients follow `on_nonfinite`: "raise" (the default) raises `NonFiniteError` naming
   the step, after dropping the gradients: no update is applied and the step count stays at the last applied
   step, so nothing checkpointed afterwards comes from it; "skip" drops the gradients, counts the step in
   `skipped_steps` and returns. Under fp16 a non-finite step is first the loss scaler's: it halves the scale
   and the step is skipped and counted, as torch.amp's GradScaler does (an fp16 overflow, in the backward or
   the forward, is what the scale is for); "raise" raises once the scale falls below `MIN_LOSS_SCALE`, where
   halving it further would only hide a loss or gradient that stays non-finite.
4. Clips: with `max_grad_norm` the gradients are multiplied by min(1, max_grad_norm / (norm + 1e-6)), the
   coefficient `clip_grad_norm_` uses.
5. Steps the optimizer and records `StepStats` (`Program.last_step`).

The guard's one all-reduce runs every step (its flag is needed whether or not gradients are clipped); the
plan prices it with the pass over the gradients (`autopar.cost_model.step_guard`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from autopar.errors import NonFiniteError
from autopar.guard_options import check_guard_options
from autopar.runtime.collectives import collective_timeout, waiting_for

CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_'s
MIN_LOSS_SCALE = 1.0  # below it, an fp16 step that is still non-finite raises (on_nonfinite="raise")
NORM_PIECE = 2**12


@dataclass(frozen=True, slots=True)
class StepStats:
    """What the last `train_step` call did (`Program.last_step`).

    Attributes:
        step: optimizer steps applied so far (`Program.num_steps`).
        loss: the loss of the call's global batch; on a call that steps after accumulating, the loss over
            every accumulated call's rows.
        grad_norm: the global L2 norm of the gradients before clipping (inf or nan when non-finite); None on
            an accumulating call (no norm is computed until the step).
        tokens: input tokens of the step's global batch (every accumulated call's): the ones its
            `attention_mask` keeps, else the elements of its first integer input.
        skipped: whether the step was skipped (non-finite, or an fp16 overflow).
        skipped_steps: steps skipped so far.
        clipped: whether clipping scaled the gradients down.
        accumulated: calls whose gradients this step holds (1 without accumulation); on an accumulating
            call, how many are held so far.
    """

    step: int
    loss: float
    grad_norm: float | None
    tokens: int
    skipped: bool
    skipped_steps: int
    clipped: bool = False
    accumulated: int = 1


class StepGuard:
    """Gradient accumulation, the global norm, clipping and the non-finite policy of one program."""

    def __init__(self, *, max_grad_norm: float | None = None, on_nonfinite: str = "raise"):
        check_guard_options(max_grad_norm, on_nonfinite)
        self.max_grad_norm = float(max_grad_norm) if max_grad_norm is not None else None
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._sums: list[torch.Tensor] | None = None  # the accumulator: sum_c W_c g_c per gradient tensor
        self._weight = 0.0  # sum_c W_c
        self._loss_sum = 0.0  # sum_c W_c loss_c
        self._tokens = 0.0  # this rank's share of the accumulated calls' tokens
        self._calls = 0
        self._loss_finite = True

    @property
    def accumulating(self) -> int:
        """Calls whose gradients the accumulator holds."""
        return self._calls

    def finish(
        self, program, loss: float, weight: float, tokens_share: float, *, accumulate: bool, summed: bool = False
    ) -> float:
        """After the gradients are scaled: accumulate, or reduce, check, clip and step (module docstring).
        `summed`: the loss is a sum, and so are the accumulated calls' gradients. Returns the loss `train_step`
        returns."""
        weight = 1.0 if summed or weight <= 0 else weight
        self._loss_finite &= math.isfinite(loss)
        self._tokens += tokens_share
        shares = program._gradient_shares()
        if accumulate:
            self._add(program, shares, weight)
            self._loss_sum += loss * weight
            self._weight += weight
            self._calls += 1
            program._discard_gradients()
            program.last_step = StepStats(
                program.num_steps, loss, None, 0, False, self.skipped_steps, accumulated=self._calls
            )
            return loss
        calls = self._calls + 1
        if self._sums is not None:
            total = 1.0 if summed else self._weight + weight
            self._fold(program, shares, weight, total)
            loss = (self._loss_sum + loss * weight) / total
        loss_finite, tokens = self._loss_finite, self._tokens
        self._reset()
        norm, grads_finite, tokens = self._reduce(program, shares, tokens)
        step = program.num_steps + 1
        if not (loss_finite and grads_finite):
            return self._nonfinite(program, step, loss, norm, tokens, calls, loss_finite=loss_finite)
        if program.scaler is not None:
            program.scaler.update(False)
        clipped = False
        if self.max_grad_norm is not None:
            coef = self.max_grad_norm / (norm + CLIP_EPS)
            if coef < 1.0:
                program._scale_gradients_by(coef)
                clipped = True
        program._optimizer_step()
        program.num_steps = step
        program.last_step = StepStats(
            step, loss, norm, int(round(tokens)), False, self.skipped_steps, clipped=clipped, accumulated=calls
        )
        return loss

    def _nonfinite(self, program, step: int, loss, norm, tokens, calls, *, loss_finite: bool) -> float:
        """Drop the step's gradients; an fp16 overflow (the scale still at MIN_LOSS_SCALE or above after halving)
        or `on_nonfinite="skip"` counts a skipped step, else NonFiniteError."""
        program._discard_gradients()
        overflow = False
        if program.scaler is not None:
            program.scaler.update(True)
            overflow = program.scaler.scale >= MIN_LOSS_SCALE
        if overflow or self.on_nonfinite == "skip":
            self.skipped_steps += 1
            program.num_steps = step
            program.last_step = StepStats(
                step, loss, norm, int(round(tokens)), True, self.skipped_steps, accumulated=calls
            )
            return loss
        what = "the loss is" if not loss_finite else "the gradients are"
        fp16 = f", still after halving the fp16 loss scale down to {program.scaler.scale:g}" if program.scaler else ""
        raise NonFiniteError(
            f"step {step}: {what} not finite (loss {loss}, gradient norm {norm}{fp16}); no update was applied "
            f"and the step was not counted (the program stays at step {program.num_steps}). Lower the learning "
            f"rate, clip (max_grad_norm=1.0), check the batch, or compile with on_nonfinite='skip' to skip such "
            f"steps",
            step=step,
        )

    def _add(self, program, shares, weight: float) -> None:
        """sums += W_c g_c (in the program's gradient units: `_gradient_divisor` cancels in `_fold`)."""
        factor = weight / program._gradient_divisor()
        grads = [g for g, _ in shares]
        if self._sums is None:
            self._sums = [g.detach().float() * factor for g in grads]
            return
        if len(grads) != len(self._sums) or any(g.shape != s.shape for g, s in zip(grads, self._sums, strict=True)):
            raise AssertionError("the program's gradients changed between accumulating calls")
        torch._foreach_add_(self._sums, [g.float() for g in grads], alpha=factor)

    def _fold(self, program, shares, weight: float, total: float) -> None:
        """g <- (W_f g + divisor * sums) / sum W: the accumulated calls and this one as one step."""
        grads = [g for g, _ in shares]
        if len(grads) != len(self._sums):
            raise AssertionError("the program's gradients changed between accumulating calls")
        divisor = program._gradient_divisor()
        torch._foreach_mul_(grads, weight / total)
        torch._foreach_add_(
            grads, [s.to(g.dtype) for s, g in zip(self._sums, grads, strict=True)], alpha=divisor / total
        )

    def _reset(self) -> None:
        self._sums, self._weight, self._loss_sum, self._tokens, self._calls = None, 0.0, 0.0, 0.0, 0
        self._loss_finite = True

    def _reduce(self, program, shares, tokens_share: float) -> tuple[float, bool, float]:
        """(global gradient norm, whether every rank's gradients are finite, the step's tokens): one all-reduce."""
        device = program.device_type
        q = torch.zeros((), dtype=torch.float64, device=device)
        by_copies: dict[int, list[torch.Tensor]] = {}
        for g, copies in shares:
            if g.numel():
                by_copies.setdefault(copies, []).append(g)
        for copies, grads in by_copies.items():
            # fp32 norms of pieces of NORM_PIECE elements, squared and summed in fp64: torch's fp32 norm of one tensor
            # is off by ~1e-7 relative at 65,536 elements and ~3e-5 at 2 million (a chunk, an embedding); of 4,096,
            # by ~2e-9 (measured on CPU)
            pieces = [piece for g in grads for piece in g.detach().reshape(-1).split(NORM_PIECE)]
            norms = torch._foreach_norm(pieces, 2.0)
            q = q + torch.stack(norms).double().pow(2).sum() / copies
        q = q / program._gradient_divisor() ** 2
        bad = (~torch.isfinite(q)).double()
        totals = torch.stack([q, bad, torch.tensor(tokens_share, dtype=torch.float64, device=device)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            # on the world group, whose own timeout is the launcher's (gloo's 30 minutes unless autopar made it):
            # waited here for autopar's, so a rank that never joins is named as the programs' groups name it
            with waiting_for("the step guard's all-reduce of the gradient norm, the non-finite flag and the tokens"):
                _wait_bounded(dist.all_reduce(totals, async_op=True))
        q_all, bad_all, tokens = totals.tolist()
        return math.sqrt(q_all) if q_all >= 0 else float("nan"), bad_all == 0 and math.isfinite(q_all), tokens


def _wait_bounded(work) -> None:
    """Wait for `work` at most `collective_timeout()`; a work without a bounded wait (a collective replaced by a
    future, as `autopar bench`'s no-op collectives are) is waited for as it allows."""
    try:
        work.wait(timeout=collective_timeout())
    except RuntimeError as e:
        if "with finite timeout not implemented" not in str(e):  # c10d's word for a work that cannot bound its wait
            raise
        work.wait()
