"""The GPU checks in one run: each check as its own process under its own timeout, one report in JSON and Markdown.

    python -m autopar.bench.gpu [--out DIR] [--only smoke,cost] [--budget-s 540] [--preset H100-80GB] [--list]

Run on a machine with one CUDA GPU (`scripts/gpu_checks.sh` installs autopar there first). The checks, in the
order they run (the cheap one that says whether anything works first, then the measurement the cost model
waits on):

========== ====== ==========================================================================================
name       limit  command
========== ====== ==========================================================================================
smoke      120 s  ``python -m autopar.bench.gpu_smoke``: import, plan a preset, two bf16 steps on one GPU
cost       230 s  ``python -m autopar.bench.gpu_measure --out DIR``: matmul and attention efficiency, the
                  device file (its own budget: 180 s)
memory     120 s  ``python -m autopar.memory check --gpu PRESET``: offload plan, measured peak vs predicted
kernels    150 s  ``python -m autopar.triton_kernels.bench --quick``: kernel correctness and speed
cp_blocks  180 s  ``python -m autopar.bench.cp_blocks``: context-parallel attention blocks
========== ====== ==========================================================================================

A check's limit is cut to what is left of `--budget-s` (540 s: the whole run ends inside ten minutes with time to
install and write); a check that would get less than `MIN_CHECK_S` is skipped. A check that runs past its limit is
killed with every process it started. Each check's output streams to the console as it runs; after each check
the report is written again, so a run cut short still leaves one: ``DIR/gpu_checks.json`` (environment, and per
check: command, status passed / failed / timeout / skipped, exit status, seconds, output) and
``DIR/gpu_checks.md`` (a table of the statuses, then each check's output). The cost check writes
``device_measurement.json`` and ``cluster_override.yaml`` into DIR too.

Exit status: 0 when every check passed, 1 otherwise; without a CUDA device it says so in one line and exits 2.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_BUDGET_S = 540.0
MIN_CHECK_S = 20.0  # a check given less than this would only start and be killed


@dataclass(frozen=True, slots=True)
class Check:
    """One check: `argv` after the Python interpreter ({out} and {preset} filled in), its time limit."""

    name: str
    title: str
    argv: tuple[str, ...]
    timeout_s: float


CHECKS = (
    Check("smoke", "(e) import, plan, two bf16 steps on one GPU", ("-m", "autopar.bench.gpu_smoke"), 120),
    Check("cost", "(d) cost-model measurement", ("-m", "autopar.bench.gpu_measure", "--out", "{out}"), 230),
    Check("memory", "(a) memory check", ("-m", "autopar.memory", "check", "--gpu", "{preset}"), 120),
    Check("kernels", "(b) Triton kernel bench", ("-m", "autopar.triton_kernels.bench", "--quick"), 150),
    Check("cp_blocks", "(c) context-parallel block bench", ("-m", "autopar.bench.cp_blocks"), 180),
)


@dataclass(slots=True)
class CheckResult:
    """What one check did: status is passed, failed, timeout or skipped."""

    name: str
    title: str
    command: str
    status: str
    returncode: int | None = None
    seconds: float = 0.0
    timeout_s: float = 0.0
    output: str = ""


@dataclass(slots=True)
class Report:
    environment: dict
    results: list[CheckResult] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.results) and all(r.status == "passed" for r in self.results)


def run_with_timeout(
    argv: Sequence[str], timeout_s: float, *, echo: bool = True, env=None
) -> tuple[int | None, str, float]:
    """Run `argv` with stdout and stderr merged, each line echoed as it comes (with `echo`); past `timeout_s`,
    kill it and every process it started (it runs in a session of its own). Returns (exit status, or None when
    killed; the output; seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        encoding="utf-8",
        errors="replace",  # a stray byte must not stop the reading of the rest
        start_new_session=True,
        env=env,
    )
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode: int | None = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        returncode = None
    reader.join(timeout=5)  # a grandchild that left the session may hold the pipe open: do not wait on it
    return returncode, "".join(lines), time.monotonic() - start


def run_checks(
    checks: Sequence[Check], out_dir: Path, preset: str, budget_s: float, environment: dict, echo: bool = True
) -> Report:
    """Run `checks` in order within `budget_s`, writing the report into `out_dir` after each."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = Report(environment)
    deadline = time.monotonic() + budget_s
    for check in checks:
        argv = [sys.executable, *(a.format(out=out_dir, preset=preset) for a in check.argv)]
        command = " ".join(["python", *argv[1:]])
        left = deadline - time.monotonic()
        if left < MIN_CHECK_S:
            report.results.append(CheckResult(check.name, check.title, command, "skipped", output="time budget spent"))
            continue
        timeout = min(check.timeout_s, left)
        if echo:
            print(f"\n=== {check.name}: {check.title} (limit {timeout:.0f} s)\n$ {command}", flush=True)
        returncode, output, seconds = run_with_timeout(argv, timeout, echo=echo)
        status = "timeout" if returncode is None else "passed" if returncode == 0 else "failed"
        report.results.append(
            CheckResult(check.name, check.title, command, status, returncode, round(seconds, 1), timeout, output)
        )
        if echo:
            print(f"=== {check.name}: {status} in {seconds:.0f} s", flush=True)
        write_report(report, out_dir)
    write_report(report, out_dir)
    return report


def write_report(report: Report, out_dir: Path) -> tuple[Path, Path]:
    """``gpu_checks.json`` and ``gpu_checks.md`` in `out_dir`."""
    data = {
        "environment": report.environment,
        "passed": report.passed,
        "checks": [asdict(r) for r in report.results],
    }
    json_path = out_dir / "gpu_checks.json"
    json_path.write_text(json.dumps(data, indent=2) + "\n")
    md_path = out_dir / "gpu_checks.md"
    md_path.write_text(markdown(report))
    return json_path, md_path


def markdown(report: Report) -> str:
    env = report.environment
    lines = [
        "# GPU checks",
        "",
        ", ".join(f"{k}: {v}" for k, v in env.items()),
        "",
        "| check | status | exit | seconds | limit s | command |",
        "|---|---|---|---|---|---|",
    ]
    for r in report.results:
        code = "" if r.returncode is None else str(r.returncode)
        lines.append(
            f"| {r.name}: {r.title} | {r.status} | {code} | {r.seconds:.1f} | {r.timeout_s:.0f} | `{r.command}` |"
        )
    for r in report.results:
        lines += ["", f"## {r.name}: {r.status}", "", "```", r.output.rstrip("\n"), "```"]
    return "\n".join(lines) + "\n"


def environment(preset: str) -> dict:
    """What the report says of the machine: GPU, preset, versions, date."""
    import torch

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none",
        "preset": preset,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }
    for name in ("triton", "transformers", "pulp", "highspy"):
        try:
            from importlib.metadata import version

            env[name] = version(name)
        except Exception:  # noqa: BLE001 - a missing package is reported as such
            env[name] = "missing"
    return env


def select(names: str | None) -> tuple[Check, ...]:
    """The checks named in a comma-separated list (all of them for None), in the order they run."""
    from autopar.errors import ConfigError

    if not names:
        return CHECKS
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {c.name for c in CHECKS})
    if unknown:
        raise ConfigError(f"unknown checks {unknown}: expected names among {[c.name for c in CHECKS]}")
    return tuple(c for c in CHECKS if c.name in wanted)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m autopar.bench.gpu", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/gpu"), help="report folder")
    p.add_argument("--only", help="comma-separated check names (default: all): " + ", ".join(c.name for c in CHECKS))
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="time for all the checks together")
    p.add_argument("--preset", help="the device preset of this GPU (default: from its name)")
    p.add_argument("--list", action="store_true", help="print the checks and their commands, run nothing")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        checks = select(args.only)
    except ValueError as e:
        print(f"autopar.bench.gpu: {e}")
        return 2
    if args.list:
        for c in checks:
            print(f"{c.name:10s} {c.timeout_s:5.0f} s  python {' '.join(c.argv)}  # {c.title}")
        return 0
    import torch

    if not torch.cuda.is_available():
        print(
            f"autopar.bench.gpu: no CUDA device is visible (torch {torch.__version__}, CUDA {torch.version.cuda}); "
            "these checks run on a GPU machine (docs/gpu.md)"
        )
        return 2
    from autopar.bench.gpu_measure import preset_for

    props = torch.cuda.get_device_properties(0)
    preset = args.preset or preset_for(props.name, props.total_memory)
    report = run_checks(checks, args.out, preset, args.budget_s, environment(preset))
    print("\n" + "\n".join(f"{r.name:10s} {r.status:8s} {r.seconds:6.1f} s" for r in report.results))
    print(f"report: {args.out / 'gpu_checks.md'}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
