"""Command line: `autopar plan`, `autopar explain`, `autopar bench` (also `python -m autopar ...`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autopar.constraints import cli_flags
from autopar.errors import AutoparError


def _plan_cmd(args) -> int:
    import autopar

    flags = [kw["dest"] for _, kw in cli_flags()]
    constraints = {k: getattr(args, k) for k in flags if getattr(args, k) is not None}
    # Unset switches stay out of the call, so autopar.plan's own defaults (None: decide by cluster) apply.
    switches = {k: getattr(args, k) for k in ("offload", "pipeline", "fuse_kernels") if getattr(args, k) is not None}
    from autopar.progress import PlanProgress

    cluster = autopar.ClusterSpec.from_file(args.cluster) if Path(args.cluster).is_file() else args.cluster
    progress = None if args.quiet else PlanProgress(verbose=args.verbose)
    plan = autopar.plan(
        args.model,
        cluster,
        global_batch_size=args.global_batch_size,
        seq_len=args.seq_len,
        constraints=constraints,
        memory_budget=args.memory_budget,
        precision=args.precision,
        estimator=args.estimator,
        progress=progress,
        compare=args.compare or (),
        max_grad_norm=args.max_grad_norm,
        **switches,
    )
    if progress is not None:
        progress.close()
    say = (lambda msg: None) if args.quiet else (lambda msg: print(f"[autopar] {msg}", file=sys.stderr))
    if args.json:
        Path(args.json).write_text(plan.to_json())
        say(f"wrote {args.json}")
    if args.report:
        fmt = "html" if args.report.endswith((".html", ".htm")) else "markdown"
        Path(args.report).write_text(plan.explain(fmt))
        say(f"wrote {args.report}")
    print(plan.explain() if args.explain else plan.summary())
    return 0


def _explain_cmd(args) -> int:
    from autopar.plan import Plan

    plan = Plan.from_file(args.plan)
    if args.html:
        Path(args.html).write_text(plan.explain("html"))
        print(f"[autopar] wrote {args.html}", file=sys.stderr)
        return 0
    print(plan.explain(args.format))
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, got {text!r}")
    return value


def _bench_cmd(args) -> int:
    import warnings

    from autopar.bench import run_suite

    if args.suite == "calibrate":  # published runs (torchtitan, Megatron-LM) and nccl-tests next to predictions
        from autopar.bench import calibrate

        calibrate.run(args.out or "out/calibrate", rows=args.rows, show_progress=not args.quiet)
        print(f"[autopar] wrote calibrate.json and calibrate.md to {args.out or 'out/calibrate'}", file=sys.stderr)
        return 0
    args.out = args.out or "bench-results"
    if args.suite == "exits":  # torchrun launches of a user-style script per program kind
        from autopar.bench import exits

        kinds = tuple(args.kinds.split(",")) if args.kinds else tuple(exits.KINDS)
        exits.run(args.out, launches=args.launches or 200, kinds=kinds, show_progress=not args.quiet)
        print(f"[autopar] wrote exits.json and exits.md to {args.out}", file=sys.stderr)
        return 0
    if args.suite == "compile" and (args.matrix or args.cases):
        from autopar.bench import compile_matrix

        names = [n.strip() for n in args.cases.split(",") if n.strip()] if args.cases else None
        compile_matrix.run(args.out, names=names, show_progress=not args.quiet)
        print(f"[autopar] wrote compile-matrix.json and compile-matrix.md to {args.out}", file=sys.stderr)
        return 0
    if args.matrix or args.cases:
        flag = "--matrix" if args.matrix else "--cases"
        warnings.warn(f"{flag} applies to the compile suite only; the {args.suite} suite ignores it", stacklevel=1)
    if args.rows is not None:
        warnings.warn(f"--rows applies to the calibrate suite only; the {args.suite} suite ignores it", stacklevel=1)
    if args.cluster is not None and args.suite not in ("run", "overhead", "soak", "checkpoint"):
        warnings.warn(
            f"--cluster applies to the run, overhead, soak and checkpoint suites only; the {args.suite} suite "
            "ignores it",
            stacklevel=1,
        )
    picks = {
        k: v
        for k, v in (("methods", args.methods), ("models", args.models), ("repetitions", args.repetitions))
        if v is not None
    }
    if picks and args.suite != "run":
        warnings.warn(
            f"--{' and --'.join(picks)} apply to the run suite only; the {args.suite} suite ignores them", stacklevel=1
        )
        picks = {}
    run_suite(args.suite, args.out, quick=args.quick, cluster=args.cluster, show_progress=not args.quiet, **picks)
    plot = "" if args.suite in ("overhead", "soak", "checkpoint", "lengths") else f" and {args.suite}.png"
    print(f"[autopar] wrote {args.suite}.json, {args.suite}.md{plot} to {args.out}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="autopar", description="Plan and run parallel training of PyTorch models.")
    sub = ap.add_subparsers(dest="command", required=True)
    p = sub.add_parser("plan", help="choose a parallel layout for a model on a cluster")
    p.add_argument("--model", required=True, help="preset name (e.g. llama2-70b) or path to a config.json")
    p.add_argument("--cluster", required=True, help="NODESxDEVICESxKIND, DEVICESxKIND, cpu:N, or a YAML/JSON file")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    for flag, kw in cli_flags():  # one per field of autopar.constraints.Constraints that the command line offers
        p.add_argument(flag, **kw)
    p.add_argument("--memory-budget", help="per-device memory cap, e.g. 20GB")
    p.add_argument(
        "--offload",
        action=argparse.BooleanOptionalAction,
        help="put all optimizer states and gradients on the host, or none (default: where memory needs)",
    )
    p.add_argument(
        "--pipeline",
        action=argparse.BooleanOptionalAction,
        help="search pipeline layouts, or not (default: on GPU clusters of more than one node)",
    )
    p.add_argument(
        "--fuse-kernels",
        action=argparse.BooleanOptionalAction,
        help="plan with autopar's Triton ops for attention, norms and loss (default: on GPU clusters)",
    )
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"])
    p.add_argument(
        "--max-grad-norm",
        type=float,
        metavar="NORM",
        help="price clipping the gradients to this global norm (the program's max_grad_norm; e.g. 1.0)",
    )
    p.add_argument("--estimator", choices=["analytic", "profile"], default="analytic")
    p.add_argument("--json", help="write the plan as JSON to this file")
    p.add_argument("--report", help="write the report to this file (.md or .html)")
    p.add_argument("--explain", action="store_true", help="print the full report instead of the summary")
    p.add_argument(
        "--compare",
        action="append",
        metavar="LAYOUT",
        help="price this layout next to the plan, e.g. 'tp=8,pp=4,zero=1' (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the result (no progress)")
    p.add_argument("--verbose", action="store_true", help="log every mesh and pipeline layout priced")
    p.set_defaults(fn=_plan_cmd)
    e = sub.add_parser("explain", help="print the report of a saved plan")
    e.add_argument("plan", help="a plan JSON file")
    e.add_argument("--format", choices=["markdown", "html"], default="markdown")
    e.add_argument("--html", metavar="OUT", help="write the HTML page to this file instead of printing")
    e.set_defaults(fn=_explain_cmd)
    b = sub.add_parser(
        "bench",
        help="benchmark suites: plans (predicted, vs baselines), compile (planning time), "
        "run (measured on CPU ranks, vs DDP/FSDP2/TP), overhead (host time per step and per op of every program "
        "kind, vs eager, DDP and FSDP2), calibrate (predicted vs torchtitan's and Megatron-LM's published runs, "
        "and nccl-tests), "
        "soak (300 steps with checkpoints: memory, loadability, retention), checkpoint (save/load time of ~100M "
        "parameters vs torch.save), lengths (step time at half the planned sequence length), exits (torchrun "
        "launches per program kind that must all exit 0)",
    )
    b.add_argument(
        "suite",
        choices=["plans", "compile", "run", "overhead", "calibrate", "soak", "checkpoint", "lengths", "exits"],
    )
    b.add_argument(
        "--out",
        help="folder for the JSON, Markdown and PNG results (default bench-results; out/calibrate for calibrate)",
    )
    b.add_argument(
        "--rows",
        help="calibrate suite: rows by name, torchtitan's (e.g. tt-8b-fsdp8-h100) or Megatron-LM Table 1's "
        "(e.g. 1.7b,18.4b); default all",
    )
    b.add_argument("--quick", action="store_true", help="a subset that runs in about a minute")
    b.add_argument(
        "--matrix",
        action="store_true",
        help="compile suite: the wide matrix instead (dense and MoE presets, 8 to 4,096 devices, 4K to 128K "
        "sequences, pinned layouts), each case planned in a fresh process",
    )
    b.add_argument(
        "--cases",
        help="compile suite: matrix cases by name, comma-separated (e.g. 405b-1024,70b-256; implies --matrix; "
        "default all)",
    )
    b.add_argument(
        "--cluster",
        help="run, overhead, soak and checkpoint suites: local CPU ranks, cpu:N (default cpu:2; cpu:4 for soak)",
    )
    b.add_argument(
        "--methods",
        help="run suite: comma-separated methods, e.g. autopar,autopar-dp,ddp (default "
        "autopar,ddp,fsdp2,tp; also eager, autopar-dp, autopar-tp, autopar-zero1, autopar-zero3, autopar-pp, "
        "autopar-dp-no-overlap, autopar-offload, "
        "autopar-offload-no-overlap, autopar-pp-zero1, autopar-pp-zero1-no-overlap)",
    )
    b.add_argument("--models", help="run suite: comma-separated models, e.g. wide-llama (default: the small ones)")
    b.add_argument(
        "--repetitions",
        type=_positive_int,
        help="run suite: the least number of repetitions per method "
        "(default 5, 3 with --quick; more narrow the spread of the paired ratios on a noisy machine)",
    )
    b.add_argument(
        "--launches", type=_positive_int, help="exits suite: torchrun launches per program kind (default 200)"
    )
    b.add_argument("--kinds", help="exits suite: comma-separated program kinds (default all four)")
    b.add_argument("--quiet", action="store_true", help="no progress on stderr")
    b.set_defaults(fn=_bench_cmd)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
