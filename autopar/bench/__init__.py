"""Benchmark suites behind `autopar bench SUITE --out DIR`.

- `plans` (`autopar.bench.plans`): autopar's plan next to hand-configured layouts (data parallel,
  ZeRO-1/2/3, tensor parallel inside the node, the best of a Megatron-style grid), all priced by
  the same cost model, for GPT-3 and LLaMA-2 presets on 8 to 1024 simulated GPUs.
- `compile` (`autopar.bench.compile_time`): planning time against model depth and cluster size.
- `run` (`autopar.bench.execution`): measured training steps on local CPU ranks, autopar next to
  DDP, FSDP2 and tensor parallelism configured by hand.
- `overhead` (`autopar.bench.overhead`): host time per step and per op of every program kind on a compute-free
  model, next to eager PyTorch, DDP and FSDP2; the small LLaMA with autopar's plan against DDP.
- `soak` (`autopar.bench.checkpoints`): 300 steps on cpu:4 with a checkpoint every 50, each loaded back;
  every rank's resident set at each checkpoint, retention checked.
- `checkpoint` (`autopar.bench.checkpoints`): save and load time of a ~100M-parameter model's training
  checkpoint on cpu:2, next to torch.save / torch.load of the full state dicts from one process.
- `calibrate` (`autopar.bench.calibrate`, run by the CLI): published runs (torchtitan's Llama benchmarks,
  Megatron-LM SC'21 Table 1) planned on their layouts and SKUs, and published nccl-tests bus bandwidths, next
  to autopar's predictions.
- `exits` (`autopar.bench.exits`, run by the CLI): torchrun launches of a user-style script per program kind
  (compile, two steps, a save, destroy_process_group, exit), counting those that do not exit 0.
- `lengths` (`autopar.bench.lengths`): step time at half the planned sequence length against the full one, on
  one CPU process (JSON and Markdown only).

Each suite writes a JSON document (with autopar and torch versions and a machine description), a
Markdown table and a PNG plot into the output folder. `quick=True` runs a subset in about a minute.
"""

from __future__ import annotations

from pathlib import Path

SUITES = ("plans", "compile", "run", "overhead", "soak", "checkpoint", "lengths")
# the cluster a suite that runs on local CPU ranks uses when none is given
DEFAULT_CLUSTERS = {"run": "cpu:2", "overhead": "cpu:2", "soak": "cpu:4", "checkpoint": "cpu:2"}


def run_suite(
    suite: str,
    out_dir: str | Path,
    *,
    quick: bool = False,
    cluster: str | None = None,
    show_progress: bool = True,
    **picks,
):
    """Run one suite by name and return what it wrote to its JSON file.

    Args:
        suite: "plans", "compile" or "run".
        out_dir: folder for the results.
        quick: the subset that runs in about a minute.
        cluster: "cpu:N" for the suites that run on local CPU ranks (run, soak, checkpoint; default
            `DEFAULT_CLUSTERS`); ignored by the others.
        show_progress: progress on stderr.
        picks: for the run suite, `methods` and `models` (comma-separated names) and `repetitions` (the least
            number of repetitions); see `execution.run`.
    """
    from autopar.errors import ConfigError

    cluster = cluster or DEFAULT_CLUSTERS.get(suite, "cpu:2")

    if suite == "plans":
        from autopar.bench import plans

        return plans.run(out_dir, quick=quick, show_progress=show_progress)
    if suite == "compile":
        from autopar.bench import compile_time

        return compile_time.run(out_dir, quick=quick, show_progress=show_progress)
    if suite == "run":
        from autopar.bench import execution

        return execution.run(out_dir, cluster=cluster, quick=quick, show_progress=show_progress, **picks)
    if suite == "overhead":
        from autopar.bench import overhead

        return overhead.run(out_dir, cluster=cluster, quick=quick, show_progress=show_progress)
    if suite == "soak":
        from autopar.bench import checkpoints

        return checkpoints.run_soak(out_dir, cluster=cluster, quick=quick, show_progress=show_progress)
    if suite == "checkpoint":
        from autopar.bench import checkpoints

        return checkpoints.run_checkpoint_timing(out_dir, cluster=cluster, quick=quick, show_progress=show_progress)
    if suite == "lengths":
        from autopar.bench import lengths

        return lengths.run(out_dir, quick=quick, show_progress=show_progress)
    raise ConfigError(f"unknown bench suite {suite!r}: expected one of {', '.join(SUITES)}")


__all__ = ["DEFAULT_CLUSTERS", "SUITES", "run_suite"]
