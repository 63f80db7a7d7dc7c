"""Write the strategy-explain reports of two large plans into this folder, with planning and report times.

    python examples/reports/make_reports.py            # both cases (about a minute each on one core)

Each case writes NAME.md, NAME.html and NAME.json (the plan) and adds a row to timings.md: the planning
time (tracing, the search, and pricing the "why" alternatives, as `plan.stats` records it), its CPU time
(the wall time grows on a machine whose cores other jobs share; the CPU time much less), and the time to
render the Markdown and the HTML report from the plan.
"""

from __future__ import annotations

import time
from pathlib import Path

import autopar

HERE = Path(__file__).parent
# (file name, preset, cluster, global batch, sequence length)
CASES = (
    ("llama2-70b-64x8xA100-40GB", "llama2-70b", "64x8xA100-40GB", 1536, 4096),
    ("gpt3-175b-128x8xA100-80GB", "gpt3-175b", "128x8xA100-80GB", 2048, 2048),
)


def main() -> None:
    rows = [
        "| report | global batch x seq | planning s | planning CPU s | of which alternatives s | Markdown report s | "
        "HTML report s | report / planning |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, model, cluster, batch, seq in CASES:
        t0, c0 = time.perf_counter(), time.process_time()
        plan = autopar.plan(model, cluster, global_batch_size=batch, seq_len=seq)
        planning, cpu = time.perf_counter() - t0, time.process_time() - c0
        t1 = time.perf_counter()
        md = plan.explain()
        t2 = time.perf_counter()
        page = plan.explain("html")
        t3 = time.perf_counter()
        (HERE / f"{name}.md").write_text(md)
        (HERE / f"{name}.html").write_text(page)
        (HERE / f"{name}.json").write_text(plan.to_json())
        report = (t2 - t1) + (t3 - t2)
        rows.append(
            f"| {name} | {batch} x {seq} | {planning:.2f} | {cpu:.2f} | {plan.stats.get('alternatives_time_s', 0):.2f} | "
            f"{t2 - t1:.3f} | {t3 - t2:.3f} | {report / planning:.1%} |"
        )
        print(rows[-1], flush=True)
    (HERE / "timings.md").write_text("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
