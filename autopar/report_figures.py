"""How the plan report writes its figures: seconds as milliseconds, bytes as GiB, index lists as ranges."""

from __future__ import annotations

from autopar.units import GIB


def index_ranges(indices) -> str:
    """0, 1, 2, 5 as "0-2, 5"."""
    out, run = [], []
    for i in sorted(indices):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def fmt_ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:,.2f}"


def fmt_gib(b) -> str:
    return "-" if b is None else f"{b / GIB:,.2f}"


def priced_rows(entries, step_s: float) -> list[list]:
    """Table rows of priced layouts (label, layout, step, its ratio to `step_s`, peak memory, fits, why not), the
    ones that fit first, fastest first: the report's alternatives and the expert degrees weighed."""
    rows = []
    for e in sorted(entries, key=lambda e: (not e["feasible"], e["step_time_s"] or 0.0)):
        ratio = f"{e['step_time_s'] / step_s:.2f}x" if e["feasible"] and step_s else "-"
        fits = "yes" if e["feasible"] else "no"
        rows.append([e["label"], e["layout"], fmt_ms(e["step_time_s"]), ratio, fmt_gib(e["peak_memory_bytes"]), fits,
                     e["reason"]])  # fmt: skip
    return rows
