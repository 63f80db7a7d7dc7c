"""Strategy-explain reports: what the plan chose, what it predicts, and what it was chosen over.

`render_markdown` (readable in a terminal, charts as text bars) and `render_html` (one self-contained page,
charts as inline SVG) render the same sections, in this order: Summary, Memory per device, Context parallelism
(when the plan has or searched a cp axis), Time breakdown,
Layer table, Pipeline (with a Gantt chart of one step), Why this plan, Your layout, Assumptions, then an
appendix (fusion, ops without a rule, planning statistics). Every figure is one of the plan's own fields,
formatted; nothing is priced again here, so a plan read back from JSON reports identically.

This module puts the sections in order and renders them; the sections are built in `report_costs.py` (Summary to
Time breakdown), `report_layers.py` (Layer table, Pipeline) and `report_choice.py` (Why this plan to the
appendix), with the figures written by `report_figures.py` and the charts drawn by `report_charts.py`.
"""

from __future__ import annotations

import html

from autopar.report_choice import appendix_blocks, assumptions_blocks, why_blocks, yours_blocks
from autopar.report_costs import context_parallel_blocks, memory_blocks, summary_blocks, time_blocks
from autopar.report_experts import expert_parallel_blocks
from autopar.report_layers import layer_blocks, pipeline_blocks

# ------------------------------------------------------------------------------------------ blocks
# A report is a list of blocks, rendered to Markdown (charts as text) or HTML (charts as inline SVG):
#   ("h1" | "h2" | "h3" | "p" | "li", text)   ("table", header, rows)   ("chart", svg, text lines)


def report_blocks(plan) -> list:
    """The report's sections, in order: Summary, Memory, Time, Layers, Pipeline, Why, Your layout, Assumptions."""
    return [
        *summary_blocks(plan),
        *memory_blocks(plan),
        *context_parallel_blocks(plan),
        *expert_parallel_blocks(plan),
        *time_blocks(plan),
        *layer_blocks(plan),
        *pipeline_blocks(plan),
        *why_blocks(plan),
        *yours_blocks(plan),
        *assumptions_blocks(plan),
        *appendix_blocks(plan),
    ]


# --------------------------------------------------------------------------------------- renderers


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return out + ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]


def render_markdown(plan) -> str:
    """The report as Markdown: tables, and charts as fixed-width text bars a terminal shows."""
    lines: list[str] = []
    for block in report_blocks(plan):
        kind = block[0]
        if lines and lines[-1].startswith("- ") and kind != "li":
            lines.append("")
        if kind in ("h1", "h2", "h3"):
            lines += ["#" * int(kind[1]) + " " + block[1], ""]
        elif kind == "p":
            lines += [block[1], ""]
        elif kind == "li":
            lines.append("- " + block[1])
            continue
        elif kind == "table":
            lines += _md_table(block[1], block[2]) + [""]
        elif kind == "chart":
            lines += ["```", *block[2], "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def _inline(text: str) -> str:
    """Markdown's `code` and **bold** in a cell, escaped."""
    out = html.escape(str(text))
    parts = out.split("`")
    out = "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
    parts = out.split("**")
    return "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))


_STYLE = (
    "body{font-family:sans-serif;max-width:72em;margin:2em auto;padding:0 1em;color:#222}"
    "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left;"
    "vertical-align:top}th{background:#f4f4f4}code{font-size:90%}.chart{margin:1em 0;overflow-x:auto}"
    "h2{border-bottom:1px solid #ddd;padding-bottom:2px;margin-top:1.6em}"
)


def render_html(plan) -> str:
    """One self-contained page: the same sections, tables as HTML, charts as inline SVG (nothing fetched)."""
    body, in_list = [], False
    for block in report_blocks(plan):
        kind = block[0]
        if in_list and kind != "li":
            body.append("</ul>")
            in_list = False
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline(block[1])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline(block[1])}</p>")
        elif kind == "li":
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{_inline(block[1])}</li>")
        elif kind == "table":
            head = "".join(f"<th>{_inline(h)}</th>" for h in block[1])
            rows = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in block[2])
            body.append(f"<table><tr>{head}</tr>{rows}</table>")
        elif kind == "chart":
            body.append(f'<div class="chart">{block[1]}</div>')
    if in_list:
        body.append("</ul>")
    title = html.escape(f"autopar plan: {plan.model_name}")
    return (
        f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>{title}</title>"
        f"<style>{_STYLE}</style></head><body>{''.join(body)}</body></html>\n"
    )
