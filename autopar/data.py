"""Batches: the same global batch on every rank (checked), or each data-parallel rank's own rows.

Which rows of a global batch of B rows a data-parallel rank trains on is fixed by the plan: the batch is cut
into the plan's m micro-batches along dim 0 (rows [i B/m, (i+1) B/m) for micro-batch i), and each of those
into dp equal parts, of which data-parallel rank r takes part r (`plan_rows`). Ranks of one data-parallel
group (its tp, cp and pp ranks) take the same rows. A rank's data-parallel index in the mesh
pp x dp x cp x tp (tp innermost) is `data_parallel_index`.

Two ways to feed a program (`BatchFeed`):

- the global batch on every rank (the default): at the first step every rank sends a fingerprint of its batch
  (sums of its values, plain and weighted by position, and the sizes: three numbers) in one all-gather; ranks
  that passed different batches get a `ConfigError` at once, instead of training on rows no rank agreed on;
- `local_batch=True`: each data-parallel rank passes its own B/dp rows. The program puts them where the plan
  reads this rank's rows of a global batch (`place_rows`; the rows of other ranks stay zero and are never
  read), so every program runs unchanged and the step equals one over the union of the ranks' rows. The
  fingerprint check then requires ranks of one data-parallel group to pass the same rows. `PlanSampler`
  (and `Program.data_loader`) gives each rank exactly the rows the plan gives it of a global batch drawn the
  same way on every rank: the same step, row for row, as passing that global batch everywhere. Rows split
  any other way (a `DistributedSampler` over `Program.data_parallel_size` ranks) train on the same union.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from autopar.errors import ConfigError
from autopar.runtime.collectives import waiting_for


def data_parallel_index(plan, rank: int) -> int:
    """The data-parallel index of global rank `rank` in the plan's mesh (pp x dp x cp x tp, tp innermost)."""
    inner = plan.mesh.get("tp", 1) * plan.mesh.get("cp", 1)
    return (rank // inner) % plan.mesh.get("dp", 1)


def plan_rows(plan, index: int) -> list[int]:
    """The rows of a global batch data-parallel rank `index` trains on, in the order it takes them."""
    batch, m, dp = plan.global_batch_size, plan.num_microbatches, plan.mesh.get("dp", 1)
    share = batch // (m * dp)
    return [i * (batch // m) + index * share + j for i in range(m) for j in range(share)]


def local_batch_size(plan) -> int:
    """Rows each data-parallel rank passes with `local_batch=True`."""
    return plan.global_batch_size // plan.mesh.get("dp", 1)


def place_rows(t, plan, index: int):
    """A global batch tensor holding this rank's local rows `t` where the plan reads them (zeros elsewhere);
    a scalar or non-tensor as it is."""
    if not isinstance(t, torch.Tensor) or not t.ndim:
        return t
    batch, m, dp = plan.global_batch_size, plan.num_microbatches, plan.mesh.get("dp", 1)
    if t.shape[0] != batch // dp:
        raise ConfigError(
            f"local_batch=True: each data-parallel rank passes its own {batch // dp} rows (the plan's global batch "
            f"of {batch} over dp={dp}), but an input has {t.shape[0]}; pass this rank's rows (Program.data_loader "
            f"gives them), or compile without local_batch and pass the global batch on every rank"
        )
    if dp == 1:
        return t
    share = batch // (m * dp)
    out = t.new_zeros((batch, *t.shape[1:]))
    for i in range(m):
        start = i * (batch // m) + index * share
        out[start : start + share] = t[i * share : (i + 1) * share]
    return out


def count_tokens(args, kwargs) -> int:
    """Input tokens of a batch: those its `attention_mask` keeps, else the elements of its first integer
    input, else its rows."""
    mask = kwargs.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    leaves = [t for t in pytree.tree_leaves((tuple(args), dict(kwargs))) if isinstance(t, torch.Tensor) and t.ndim]
    for t in leaves:
        if not t.is_floating_point():
            return int(t.numel())
    return int(leaves[0].shape[0]) if leaves else 0


def fingerprint(args, kwargs) -> torch.Tensor:
    """Three fp64 numbers that differ between two batches of different values, order or sizes (not a
    proof of equality: a cheap check that catches ranks fed by different loaders)."""
    plain, weighted, sizes = 0.0, 0.0, 0.0
    for k, t in enumerate(pytree.tree_leaves((tuple(args), dict(kwargs)))):
        if not isinstance(t, torch.Tensor):
            continue
        x = t.detach().reshape(-1).to("cpu", torch.float64)
        pos = torch.arange(x.numel(), dtype=torch.float64) % 1009 + 1
        plain += (k + 1) * float(x.sum())
        weighted += (k + 1) * float((x * pos).sum())
        sizes += (k + 1) * (x.numel() + 7 * t.ndim)
    return torch.tensor([plain, weighted, sizes], dtype=torch.float64)


class BatchFeed:
    """How a program's `train_step` / `eval_step` get their batch (module docstring)."""

    def __init__(self, plan, device: str = "cpu", *, local_batch: bool = False):
        self.plan, self.device = plan, device
        self.local_batch = bool(local_batch)
        self.checked = False  # the fingerprint check runs at the first training step
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.index = data_parallel_index(plan, self.rank)
        self.dp = plan.mesh.get("dp", 1)

    @property
    def copies(self) -> int:
        """Ranks holding the batch this rank holds: every rank (global batch), or its data-parallel group."""
        return self.world // self.dp if self.local_batch else self.world

    def inputs(self, args, kwargs, *, check: bool) -> tuple[tuple, dict, float]:
        """(args, kwargs) as the program reads a global batch, and this rank's share of the batch's tokens (the
        shares sum to its tokens over the ranks). `check`: run the fingerprint check if it has not run yet."""
        if check and not self.checked:
            self.check(args, kwargs)
        share = count_tokens(args, kwargs) / self.copies
        if self.local_batch:
            args, kwargs = pytree.tree_map(lambda t: place_rows(t, self.plan, self.index), (tuple(args), dict(kwargs)))
        return tuple(args), dict(kwargs), share

    def check(self, args, kwargs) -> None:
        """ConfigError on every rank when ranks that must pass the same rows passed different ones."""
        self.checked = True
        if self.world == 1:
            return
        mine = fingerprint(args, kwargs).to(self.device)
        everyone = torch.zeros(self.world * 3, dtype=torch.float64, device=self.device)
        with waiting_for("the first step's all-gather of every rank's batch fingerprint"):
            dist.all_gather_into_tensor(everyone, mine)
        prints = everyone.view(self.world, 3).cpu()
        groups = [data_parallel_index(self.plan, r) if self.local_batch else 0 for r in range(self.world)]
        for r in range(self.world):
            first = groups.index(groups[r])
            if not torch.equal(prints[r], prints[first]) and not _close(prints[r], prints[first]):
                raise ConfigError(self._mismatch(first, r))

    def _mismatch(self, first: int, other: int) -> str:
        if self.local_batch:
            return (
                f"ranks {first} and {other} are in one data-parallel group (tp/cp/pp ranks of it train on the same "
                f"rows) but passed different batches at the first step; give each data-parallel rank its rows "
                f"(Program.data_loader, or a sampler over Program.data_parallel_size ranks at "
                f"Program.data_parallel_rank)"
            )
        return (
            f"ranks {first} and {other} passed different batches at the first step, but every rank must pass the "
            f"same global batch (autopar takes each rank's share of it); seed the data loader the same on every "
            f"rank, or compile with local_batch=True and pass each data-parallel rank its own rows "
            f"(Program.data_loader gives them)"
        )


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Fingerprints of one batch are computed the same way on every rank: they agree bit for bit. Equal values
    reached on another device type may differ in the last bits of a sum."""
    return all(math.isclose(x, y, rel_tol=1e-12, abs_tol=0.0) for x, y in zip(a.tolist(), b.tolist(), strict=True))


class PlanSampler(torch.utils.data.Sampler):
    """Dataset indices for one data-parallel rank: each global batch of `global_batch_size` indices (an epoch's
    permutation, the same on every rank for one seed) cut as the plan cuts it (`plan_rows`). With
    `local_batch=True` the program then trains on exactly that global batch.

    Args:
        num_samples: the dataset's length.
        plan: the program's plan.
        index: the data-parallel rank (`data_parallel_index`); None: the whole global batch (every rank the same).
        shuffle, seed: a permutation by `torch.Generator(seed + epoch)` (`set_epoch`), else the dataset order.
    The last partial global batch is dropped.
    """

    def __init__(self, num_samples: int, plan, index: int | None, *, shuffle: bool = True, seed: int = 0):
        self.num_samples, self.plan, self.shuffle, self.seed, self.epoch = num_samples, plan, shuffle, seed, 0
        batch = plan.global_batch_size
        self.rows = plan_rows(plan, index) if index is not None else list(range(batch))
        self.num_batches = num_samples // batch
        if self.num_batches == 0:
            raise ConfigError(
                f"the dataset holds {num_samples} samples, fewer than one global batch of {batch}; plan a smaller "
                f"global batch or use more data"
            )

    def set_epoch(self, epoch: int) -> None:
        """Draw the next epoch's permutation (call before iterating each epoch, as with DistributedSampler)."""
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        else:
            order = torch.arange(self.num_samples)
        batch = self.plan.global_batch_size
        for b in range(self.num_batches):
            for row in self.rows:
                yield int(order[b * batch + row])

    def __len__(self) -> int:
        return self.num_batches * len(self.rows)
