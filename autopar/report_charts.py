"""Charts of the strategy-explain report: inline SVG for the HTML page, text bars for the terminal.

Every chart is drawn here from numbers the report hands in (the plan's own fields); nothing is fetched:
the SVG is text inside the page, with the system's sans-serif font. Each chart comes in two forms with
the same content: `*_svg` (a string of <svg>) and `*_text` (lines of a fixed-width text chart).

Terms:
    bar chart   one horizontal bar per row, stacked from its parts (memory kinds, step-time terms); a row may
                carry hidden parts too (communication overlapped with compute), drawn hatched after the bar's
                end and left out of its total
    Gantt       one row per pipeline stage (device block); a box per forward (F) or backward (B) of a
                micro-batch, in the order the schedule runs them; the gaps are the bubble
"""

from __future__ import annotations

import html
from dataclasses import dataclass

# one colour per part, kept across charts so that "compute" is the same blue everywhere
PALETTE = ("#3b7dd8", "#e8a33d", "#5aa469", "#d1495b", "#8e6bbf", "#17a2b8", "#66a182", "#2e4057", "#b0b0b0", "#c97b63")
TEXT_FILL = "#█▓▒░=+*~-"  # a character per part in text bars (after the first, which is "#")
TEXT_WIDTH = 50
HIDDEN_FILL = "/"  # the text bars' character for hidden parts (not in the total)
HIDDEN_WORDS = "hidden behind compute (not in the total)"
_FONT = "font-family:sans-serif;font-size:11px"
LEGEND_COLUMNS, LEGEND_STEP = 2, 360  # legend entries per row, and pixels between them (the longest label fits)


def _esc(text) -> str:
    return html.escape(str(text), quote=True)


def _parts(rows: list[tuple[str, dict]], order=()) -> list[str]:
    """The parts with a positive value in some row, in `order` first (so a part keeps its colour across charts)."""
    seen = list(order)
    for _, values in rows:
        seen += [k for k in values if k not in seen]
    return [k for k in seen if any(values.get(k, 0.0) > 0 for _, values in rows)]


def _positive(values: dict) -> float:
    return sum(v for v in values.values() if v > 0)


def _colours(parts: list[str], labels: dict) -> dict[str, str]:
    """A part's colour: its place in `labels` (so it is the same in every chart), else after them."""
    colour = {p: PALETTE[i % len(PALETTE)] for i, p in enumerate(_parts([("", dict.fromkeys(labels, 1.0))], labels))}
    return colour | {p: PALETTE[(len(labels) + i) % len(PALETTE)] for i, p in enumerate(parts) if p not in colour}


def _hatch(chart: str, part: str, colour: str) -> str:
    """A pattern of `colour` stripes on white, for the hidden parts; its id is unique to the chart and the part
    (ids of inline SVG are the page's)."""
    pid = f"hatch-{chart}-{part}"
    return (
        f'<pattern id="{_esc(pid)}" patternUnits="userSpaceOnUse" width="6" height="6" '
        f'patternTransform="rotate(45)"><rect width="6" height="6" fill="#fff"/>'
        f'<rect width="3" height="6" fill="{colour}"/></pattern>'
    )


def _slug(text: str) -> str:
    """'Step time (ms)' -> 'step-time-ms'."""
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def bars_svg(
    rows: list[tuple[str, dict]],
    *,
    unit: str,
    scale: float,
    title: str,
    labels: dict | None = None,
    limit: tuple[str, float] | None = None,
    hidden: dict[str, dict] | None = None,
) -> str:
    """Stacked horizontal bars: `rows` are (label, {part: value}); values are divided by `scale` for the axis.

    `limit` draws a dashed line at (label, value) (the memory capacity); `labels` names the parts in the legend.
    `hidden` maps a row's label to its hidden parts ({part: value}): drawn hatched in the part's colour after
    the bar's total, which they are not part of, and named "+ x hidden" after it.
    """
    labels, hidden = labels or {}, hidden or {}
    parts = _parts(rows + list(hidden.items()), labels)
    colour = _colours(parts, labels)
    top = max(
        [_positive(values) + _positive(hidden.get(label, {})) for label, values in rows] + [limit[1] if limit else 0.0]
    )
    top = top or 1.0
    hatched = [p for p in parts if any(h.get(p, 0.0) > 0 for h in hidden.values())]
    left, width, bar_h, gap = 190, 520, 18, 8
    legend_rows = (len(parts) + bool(hatched) + LEGEND_COLUMNS - 1) // LEGEND_COLUMNS
    height = 28 + len(rows) * (bar_h + gap) + 24 + legend_rows * 16 + 6
    chart = _slug(title)
    # room after the longest bar for its total ("(+ x hidden)" makes it longer)
    margin = 150 if hatched else 60
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + margin}" height="{height}" role="img" '
        f'aria-label="{_esc(title)}" style="{_FONT}">',
        f"<title>{_esc(title)}</title>",
        f'<text x="4" y="14" font-weight="bold">{_esc(title)}</text>',
    ]
    if hatched:
        out.append("<defs>" + "".join(_hatch(chart, p, colour[p]) for p in hatched) + "</defs>")
    y = 24
    for label, values in rows:
        x = left
        out.append(f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">{_esc(label)}</text>')
        for part in parts:
            v = values.get(part, 0.0)
            if v <= 0:
                continue
            w = v / top * width
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{bar_h}" fill="{colour[part]}">'
                f"<title>{_esc(labels.get(part, part))}: {v / scale:,.3f} {unit}</title></rect>"
            )
            x += w
        for part in hatched:
            v = hidden.get(label, {}).get(part, 0.0)
            if v <= 0:
                continue
            w = v / top * width
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{max(w, 0.5):.2f}" height="{bar_h}" '
                f'fill="url(#{_esc(f"hatch-{chart}-{part}")})" stroke="{colour[part]}" stroke-width="0.8">'
                f"<title>{_esc(labels.get(part, part))}, hidden behind compute (not in the total): "
                f"{v / scale:,.3f} {unit}</title></rect>"
            )
            x += w
        words = f"{_positive(values) / scale:,.2f}"
        if _positive(hidden.get(label, {})):
            words += f" (+ {_positive(hidden[label]) / scale:,.2f} hidden)"
        out.append(f'<text x="{x + 4:.2f}" y="{y + 13}">{_esc(words)}</text>')
        y += bar_h + gap
    if limit is not None:
        lx = left + limit[1] / top * width
        # named above the bars, where neither the axis labels nor a bar's total can cover it
        out.append(
            f'<line x1="{lx:.2f}" y1="16" x2="{lx:.2f}" y2="{y}" stroke="#000" stroke-dasharray="4,3"/>'
            f'<text x="{lx - 3:.2f}" y="13" text-anchor="end">{_esc(limit[0])}</text>'
        )
    out.append(
        f'<text x="{left}" y="{y + 12}">0</text><text x="{left + width}" y="{y + 12}" text-anchor="end">'
        f"{top / scale:,.2f} {_esc(unit)}</text>"
    )
    y += 20
    for i, part in enumerate(parts):
        lx, ly = 4 + (i % LEGEND_COLUMNS) * LEGEND_STEP, y + (i // LEGEND_COLUMNS) * 16
        out.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="{colour[part]}"/>'
            f'<text x="{lx + 14}" y="{ly + 9}">{_esc(labels.get(part, part))}</text>'
        )
    if hatched:
        i = len(parts)
        lx, ly = 4 + (i % LEGEND_COLUMNS) * LEGEND_STEP, y + (i // LEGEND_COLUMNS) * 16
        out.append(
            f'<rect x="{lx}" y="{ly}" width="10" height="10" fill="url(#{_esc(f"hatch-{chart}-{hatched[0]}")})" '
            f'stroke="{colour[hatched[0]]}" stroke-width="0.8"/>'
            f'<text x="{lx + 14}" y="{ly + 9}">hatched: {HIDDEN_WORDS}</text>'
        )
    out.append("</svg>")
    return "".join(out)


def bars_text(
    rows: list[tuple[str, dict]],
    *,
    unit: str,
    scale: float,
    labels: dict | None = None,
    limit: tuple[str, float] | None = None,
    hidden: dict[str, dict] | None = None,
) -> list[str]:
    """The same chart as `bars_svg` in characters: one fill character per part, a `|` at the limit, hidden parts
    as `/` after the bar (not in its total)."""
    labels, hidden = labels or {}, hidden or {}
    parts = _parts(rows + list(hidden.items()), labels)
    fill = {p: TEXT_FILL[i % len(TEXT_FILL)] for i, p in enumerate(parts)}
    top = max(
        [_positive(values) + _positive(hidden.get(label, {})) for label, values in rows] + [limit[1] if limit else 0.0]
    )
    top = top or 1.0
    name_w = max(len(label) for label, _ in rows)
    lines = []
    for label, values in rows:
        bar = "".join(fill[p] * round(values.get(p, 0.0) / top * TEXT_WIDTH) for p in parts if values.get(p, 0.0) > 0)
        bar += HIDDEN_FILL * round(_positive(hidden.get(label, {})) / top * TEXT_WIDTH)
        if limit is not None:
            at = round(limit[1] / top * TEXT_WIDTH)
            bar = (bar + " " * TEXT_WIDTH)[:TEXT_WIDTH]
            bar = bar[:at] + "|" + bar[at + 1 :] if at < TEXT_WIDTH else bar + "|"
        words = f"{_positive(values) / scale:,.2f} {unit}"
        if _positive(hidden.get(label, {})):
            words += f" (+ {_positive(hidden[label]) / scale:,.2f} {unit} hidden)"
        lines.append(f"{label:<{name_w}} {bar.rstrip()} {words}")
    lines.append(
        "legend: "
        + ", ".join(f"{fill[p]} {labels.get(p, p)}" for p in parts)
        + (f", {HIDDEN_FILL} {HIDDEN_WORDS}" if any(map(_positive, hidden.values())) else "")
        + (f"; | {limit[0]}" if limit else "")
    )
    return lines


# ----------------------------------------------------------------------------------------- pipeline Gantt


@dataclass(frozen=True, slots=True)
class Slot:
    """One box of the Gantt chart: stage `stage` runs the forward or backward of `microbatch` on `chunk`."""

    stage: int
    kind: str  # "F" or "B"
    microbatch: int
    chunk: int
    start: float
    end: float


def schedule_order(schedule: str, pp: int, num_microbatches: int, virtual_stages: int = 1) -> list[list[tuple]]:
    """Per stage, its (kind, micro-batch, chunk) in the order the schedule runs them.

    GPipe: every forward, then every backward. 1F1B: pp - s - 1 forwards to warm up, then one forward and
    one backward in turn, then the remaining backwards. Interleaved 1F1B (Megatron-LM's order): forwards
    go through the chunks in groups of pp micro-batches, warm-up 2 (pp - s - 1) + (v - 1) pp.
    """
    m, p = num_microbatches, pp
    v = virtual_stages if schedule == "interleaved_1f1b" else 1
    orders = []
    for s in range(p):
        fwd = [("F", (k // (p * v)) * p + k % p, (k // p) % v) for k in range(m * v)]
        bwd = [("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v) for k in range(m * v)]
        if schedule == "gpipe":
            orders.append(fwd + bwd)
            continue
        warm = min(m * v, (p - s - 1) * 2 + (v - 1) * p) if v > 1 else min(m, p - s - 1)
        order = fwd[:warm]
        for i in range(m * v - warm):
            order += [fwd[warm + i], bwd[i]]
        order += bwd[m * v - warm :]
        orders.append(order)
    return orders


def simulate(orders: list[list[tuple]], forward_s: float, backward_s: float) -> list[Slot]:
    """Start and end of every box: a stage runs its list in order, each box once its inputs are there.

    A forward of chunk c on stage s needs the forward of the virtual stage before it (stage s - 1, or the
    last stage's chunk c - 1); a backward needs the one after it, and the last virtual stage's backward
    its own forward. Every forward takes `forward_s`, every backward `backward_s`.
    """
    p = len(orders)
    v = 1 + max((c for order in orders for _, _, c in order), default=0)
    last = p * v - 1
    done: dict[tuple, float] = {}
    pos, clock, slots = [0] * p, [0.0] * p, []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(p):
            if pos[s] >= len(orders[s]):
                continue
            kind, mb, chunk = orders[s][pos[s]]
            vs = chunk * p + s
            if kind == "F":
                dep = ("F", mb, vs - 1) if vs > 0 else None
            else:
                dep = ("B", mb, vs + 1) if vs < last else ("F", mb, vs)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            end = start + (forward_s if kind == "F" else backward_s)
            done[(kind, mb, vs)] = end
            slots.append(Slot(s, kind, mb, chunk, start, end))
            clock[s], pos[s] = end, pos[s] + 1
            remaining -= 1
            progressed = True
        if not progressed:
            raise AssertionError("pipeline schedule order deadlocks")  # an internal invariant of schedule_order
    return slots


def gantt_svg(slots: list[Slot], pp: int, *, title: str, unit_s: float) -> str:
    """The Gantt chart: a row per stage, forward boxes light, backward boxes dark, gaps the bubble."""
    end = max(s.end for s in slots) or 1.0
    left, width, row_h = 70, 760, 18
    height = 30 + pp * (row_h + 4) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 20}" height="{height}" role="img" '
        f'aria-label="{_esc(title)}" style="{_FONT}">',
        f"<title>{_esc(title)}</title>",
        f'<text x="4" y="14" font-weight="bold">{_esc(title)}</text>',
    ]
    for s in range(pp):
        y = 24 + s * (row_h + 4)
        out.append(
            f'<rect x="{left}" y="{y}" width="{width}" height="{row_h}" fill="#f1f1f1"/>'
            f'<text x="{left - 6}" y="{y + 13}" text-anchor="end">stage {s}</text>'
        )
    for sl in slots:
        x = left + sl.start / end * width
        w = max((sl.end - sl.start) / end * width, 0.4)
        y = 24 + sl.stage * (row_h + 4)
        fill = "#8fb8ec" if sl.kind == "F" else "#1f4e96"
        out.append(
            f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{row_h}" fill="{fill}" stroke="#fff" '
            f'stroke-width="0.3"><title>{sl.kind} micro-batch {sl.microbatch} chunk {sl.chunk}</title></rect>'
        )
    y = 24 + pp * (row_h + 4)
    out.append(
        f'<text x="{left}" y="{y + 12}">0</text><text x="{left + width}" y="{y + 12}" text-anchor="end">'
        f"{end * unit_s * 1e3:,.1f} ms</text>"
        f'<rect x="{left}" y="{y + 20}" width="10" height="10" fill="#8fb8ec"/>'
        f'<text x="{left + 14}" y="{y + 29}">forward</text>'
        f'<rect x="{left + 80}" y="{y + 20}" width="10" height="10" fill="#1f4e96"/>'
        f'<text x="{left + 94}" y="{y + 29}">backward</text>'
        f'<text x="{left + 170}" y="{y + 29}">grey: idle (bubble)</text></svg>'
    )
    return "".join(out)


def gantt_text(slots: list[Slot], pp: int, width: int = 100) -> list[str]:
    """The Gantt chart in characters: F forward, B backward, . idle; one column per 1/width of the step."""
    end = max(s.end for s in slots) or 1.0
    rows = [["."] * width for _ in range(pp)]
    for sl in slots:
        a, b = int(sl.start / end * width), max(int(sl.start / end * width) + 1, round(sl.end / end * width))
        for i in range(a, min(b, width)):
            rows[sl.stage][i] = sl.kind
    return [f"stage {s:>2} {''.join(r)}" for s, r in enumerate(rows)]
