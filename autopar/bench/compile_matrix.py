"""`autopar bench compile --matrix`: planning time as a user meets it, over dense and MoE presets, clusters of 8 to
4,096 devices, sequences of 4K to 128K tokens, free search and pinned layouts.

Each case is planned in a fresh process (`python -m autopar.bench.compile_matrix CASE`), as `autopar plan` would
plan it: the preset traced (its shortened trace), the layouts searched, the alternatives of the report priced.
The parent measures the wall time of the whole process (interpreter start and imports included) and reads the
child's split from the plan's stats: tracing, the search (per-mesh solves and the pipeline search), the layouts
priced next to the plan for the report. A case that runs past `timeout_s` is killed and recorded as such, with
the limit it ran past. Process CPU time is recorded next to wall time: on a machine shared with other work the
wall time says more about the machine than about planning.

The suite's targets (issue "Planning in seconds at any scale"): every case under 10 s, the median under 5 s, on 2
cores. The dense presets go from 7B to 405B (llama3-405b, free search at 8K on 1,024 devices and at 128K on 4,096).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from autopar.bench.common import env_md, environment, md_table, write_json


@dataclass(frozen=True, slots=True)
class Case:
    """One planning case: a preset on a cluster at a batch and sequence, with pins (empty: the free search)."""

    name: str
    model: str
    cluster: str
    global_batch_size: int
    seq_len: int
    pins: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return "pinned" if self.pins else "free"


CASES = (
    Case("7b-8", "llama2-7b", "8xH100-80GB", 256, 4096),
    Case("8b-64", "llama3-8b", "8x8xH100-80GB", 256, 4096),
    Case("13b-32", "llama2-13b", "4x8xH100-80GB", 256, 4096),
    Case("70b-256", "llama3-70b", "32x8xH100-80GB", 512, 4096),
    Case("70b-1024", "llama2-70b", "128x8xH100-80GB", 1024, 4096),
    Case("70b-4096", "llama3-70b", "512x8xH100-80GB", 2048, 4096),
    Case("175b-1024", "gpt3-175b", "128x8xH100-80GB", 1536, 2048),
    Case("405b-1024", "llama3-405b", "128x8xH100-80GB", 2048, 8192),
    Case("8b-64-32k", "llama3-8b", "8x8xH100-80GB", 32, 32768),
    Case("8b-256-128k", "llama3-8b", "32x8xH100-80GB", 8, 131072),
    # 128 x 128K, like 2048 x 8K above: 16M tokens a step, as Llama 3 405B trained (Table 4 of its paper).
    Case("405b-4096-128k", "llama3-405b", "512x8xH100-80GB", 128, 131072),
    Case("moe-64", "mixtral-8x7b", "8x8xH100-80GB", 256, 4096),
    Case("moe-512", "mixtral-8x7b", "64x8xH100-80GB", 1024, 4096),
    Case("70b-64-pinned", "llama2-70b", "8x8xH100-80GB", 256, 4096, {"tp": 8, "pp": 4}),
    Case("175b-512-pinned", "gpt3-175b", "64x8xH100-80GB", 512, 2048, {"tp": 8, "pp": 8}),
)
BY_NAME = {c.name: c for c in CASES}


def plan_case(case: Case) -> dict:
    """Plan `case` in this process; its times by phase (seconds, wall and process CPU) and the layout chosen."""
    import autopar

    t0, c0 = time.perf_counter(), time.process_time()
    plan = autopar.plan(
        case.model,
        case.cluster,
        global_batch_size=case.global_batch_size,
        seq_len=case.seq_len,
        constraints=dict(case.pins),
    )
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = plan.stats
    trace, alternatives = st.get("trace_time_s", 0.0), st.get("alternatives_time_s", 0.0)
    return {
        "plan_time_s": total,
        "plan_cpu_s": cpu,
        "trace_time_s": trace,
        "search_time_s": max(total - trace - alternatives, 0.0),
        "solve_time_s": st.get("solve_time_s", 0.0),
        "report_time_s": alternatives,
        "mesh": dict(plan.mesh),
        "step_time_s": plan.predicted.step_time_s,
        "stage_programs": st.get("stage_programs"),
    }


def run_case(case: Case, timeout_s: float) -> dict:
    """`plan_case` in a fresh process, with the wall time of that process; killed past `timeout_s`."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    t0 = time.perf_counter()
    try:
        out = subprocess.run(
            [sys.executable, "-m", "autopar.bench.compile_matrix", case.name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return asdict(case) | {"status": f"killed after {timeout_s:g} s", "wall_s": time.perf_counter() - t0}
    wall = time.perf_counter() - t0
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        err = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return asdict(case) | {"status": f"failed: {err[:200]}", "wall_s": wall}
    return asdict(case) | {"status": "ok", "wall_s": wall} | json.loads(lines[-1])


def run(
    out_dir: str | Path, *, names: list[str] | None = None, timeout_s: float = 600.0, show_progress: bool = True
) -> dict:
    """Plan every case (or those `names` picks), each in its own process; write compile-matrix.json and .md."""
    unknown = [n for n in names or () if n not in BY_NAME]
    if unknown:
        from autopar.errors import ConfigError

        raise ConfigError(f"unknown compile matrix case(s) {unknown}: expected some of {sorted(BY_NAME)}")
    cases = [BY_NAME[n] for n in names] if names else list(CASES)
    rows = []
    for i, case in enumerate(cases):
        if show_progress:
            print(f"\r[autopar] compile matrix: {case.name} ({i + 1}/{len(cases)})", end="", file=sys.stderr)
        rows.append(run_case(case, timeout_s))
    if show_progress:
        print(file=sys.stderr)
    doc = {"environment": environment(), "timeout_s": timeout_s, "cases": rows}
    out = Path(out_dir)
    write_json(out / "compile-matrix.json", doc)
    (out / "compile-matrix.md").write_text(markdown(doc))
    return doc


def _s(row: dict, key: str) -> str:
    return f"{row[key]:.1f}" if isinstance(row.get(key), (int, float)) else "-"


def markdown(doc: dict) -> str:
    """The table: one row per case, seconds by phase, and how the cases stand against 10 s each and 5 s median."""
    rows = doc["cases"]
    table = md_table(
        [
            "case",
            "model",
            "cluster",
            "batch x seq",
            "search",
            "wall s",
            "plan CPU s",
            "trace s",
            "search s",
            "report s",
            "layout",
            "status",
        ],
        [
            [
                r["name"],
                r["model"],
                r["cluster"],
                f"{r['global_batch_size']}x{r['seq_len']}",
                "pinned " + ",".join(f"{k}={v}" for k, v in r["pins"].items()) if r["pins"] else "free",
                _s(r, "wall_s"),
                _s(r, "plan_cpu_s"),
                _s(r, "trace_time_s"),
                _s(r, "search_time_s"),
                _s(r, "report_time_s"),
                " ".join(f"{k}={v}" for k, v in r.get("mesh", {}).items()),
                r["status"],
            ]
            for r in rows
        ],
    )
    ok = [r["wall_s"] for r in rows if r["status"] == "ok"]
    summary = (
        f"{len(ok)} of {len(rows)} cases planned; under 10 s: {sum(w < 10 for w in ok)}; "
        f"median wall {statistics.median(ok):.1f} s" + ("" if len(ok) == len(rows) else " (of those planned)")
        if ok
        else f"none of {len(rows)} cases planned"
    )
    return (
        "\n\n".join(
            [
                "# autopar bench compile --matrix",
                "Each case planned in a fresh process as `autopar plan` plans it; wall time of the process, "
                f"planning CPU time, and the plan's split by phase. {summary}. " + env_md(doc["environment"]),
                table,
            ]
        )
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    """Plan one case by name and print its `plan_case` figures as one JSON line (the parent reads it)."""
    import warnings

    warnings.simplefilter("ignore")
    (name,) = argv if argv is not None else sys.argv[1:]
    print(json.dumps(plan_case(BY_NAME[name])), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
