"""`autopar bench calibrate`: published training runs and collective benchmarks next to autopar's predictions.

Three tables, one document:

- torchtitan's published Llama runs (`autopar.bench.torchtitan`), each planned on its published layout and SKU:
  predicted against published step time and, where the source gives it, peak memory;
- Megatron-LM SC'21 Table 1 (`autopar.bench.megatron`), the same way;
- published nccl-tests bus bandwidths next to the collectives' prices (`autopar.bench.nccl_tests`).

No figure is fitted to a row: the devices' and links' figures are physical and sourced (`cost_model.devices`);
a row's ratio is what the model predicts of it. `rows` picks rows of either set by name.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from autopar.bench import megatron, nccl_tests, torchtitan
from autopar.bench.common import env_md, environment, md_table, write_json


def select(rows) -> tuple[list, list]:
    """(torchtitan rows, Megatron rows) named by `rows` (comma-separated or a list; None: all of both)."""
    from autopar.errors import ConfigError

    if rows is None:
        return list(torchtitan.ROWS), list(megatron.ROWS)
    names = [n.strip() for n in rows.split(",")] if isinstance(rows, str) else list(rows)
    names = [n for n in names if n]
    titan = [n for n in names if n in torchtitan.ROW_NAMES]
    others = [n for n in names if n not in torchtitan.ROW_NAMES]
    try:
        meg = megatron.select_rows(others) if others else []
    except ConfigError:
        raise ConfigError(
            f"unknown calibration rows in {names}: expected some of {', '.join(torchtitan.ROW_NAMES)} "
            f"or {', '.join(megatron.ROW_NAMES)}"
        ) from None
    return torchtitan.select_rows(titan), meg


def _gib(x) -> str | None:
    return None if x is None else f"{x:.1f}"


def torchtitan_table(results: list[dict]) -> str:
    header = [
        "row",
        "published layout (SKU)",
        "recompute: published / planned",
        "published s/step",
        "predicted s/step",
        "predicted / published",
        "published GiB",
        "predicted GiB",
        "predicted MFU",
        "not modelled",
    ]
    rows = []
    for r in results:
        row, p = r["row"], r["predicted"]
        layout = f"FSDP {row['dp']}" + (f" x TP {row['tp']}" if row["tp"] > 1 else "")
        layout += f", {row['gpus']} x {row['device']}, local batch {row['local_batch']} x {row['seq_len']}"
        layout += ", compiled" if row["compiled"] else ", eager"
        gaps = list(row["gaps"])
        if r.get("refused_on_device_memory"):
            gaps.append("refused on the device's memory by autopar's model; planned past it")
        rows.append(
            [
                row["name"],
                layout,
                f"{row['published_recompute'].split(' (')[0]} / {p['recompute']}",
                f"{r['published_step_time_s']:.3f}",
                f"{p['step_time_s']:.3f}",
                f"{r['ratio']:.2f}",
                _gib(r["published_memory_gib"]),
                _gib(p["peak_memory_gib"]),
                f"{p['mfu']:.1%}",
                "; ".join(gaps) or None,
            ]
        )
    return md_table(header, rows)


def megatron_table(results: list[dict]) -> str:
    header = ["row", "layout", "published s/step", "predicted s/step", "predicted / published", "predicted GiB"]
    rows = []
    for r in results:
        f32 = r["predicted_fp32_handed"]
        rows.append(
            [
                f"{r['row']['params_b']}B",
                f32["layout"],
                f"{r['published_step_time_s']:.2f}",
                f"{f32['step_time_s']:.2f}",
                f"{f32['step_time_s'] / r['published_step_time_s']:.2f}",
                _gib(f32["peak_memory_bytes"] / 2**30),
            ]
        )
    return md_table(header, rows)


def run(out_dir: str | Path = "out/calibrate", *, rows=None, show_progress: bool = True, free: bool = False) -> dict:
    """Plan the selected rows, price the nccl-tests points; write calibrate.json and calibrate.md to `out_dir`."""
    out = Path(out_dir)
    titan_rows, meg_rows = select(rows)
    t0 = time.perf_counter()
    titan, meg = [], []
    for row in titan_rows:
        if show_progress:
            print(f"[autopar bench] calibrate: {row.name} on {row.cluster}", file=sys.stderr, flush=True)
        titan.append(torchtitan.calibrate_row(row, free=free))
    for row in meg_rows:
        if show_progress:
            print(f"[autopar bench] calibrate: Megatron {row.name} on {row.cluster}", file=sys.stderr, flush=True)
        meg.append(megatron.calibrate_row(row))
    collectives = [{**vars(p), **nccl_tests.predicted(p)} for p in nccl_tests.POINTS]
    total = time.perf_counter() - t0
    env = environment()
    doc = {
        "suite": "calibrate",
        "environment": env,
        "torchtitan": titan,
        "megatron": meg,
        "nccl_tests": collectives,
        "total_time_s": round(total, 3),
    }
    write_json(out / "calibrate.json", doc)
    text = markdown(titan, meg, total, env)
    (out / "calibrate.md").write_text(text)
    print(text)
    return doc


def markdown(titan: list[dict], meg: list[dict], total: float, env: dict) -> str:
    parts = ["# Calibration: published runs next to autopar's predictions\n"]
    if titan:
        parts.append(f"## torchtitan\n\n{torchtitan_table(titan)}\n")
    if meg:
        parts.append(
            f"## Megatron-LM SC'21 Table 1\n\n{megatron.PAPER}; published s/step = F / (GPUs x TFLOP/s per GPU), "
            f"F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); the model handed in fp32, planned in bf16.\n\n"
            f"{megatron_table(meg)}\n"
        )
    parts.append(f"## Collectives: nccl-tests\n\n{nccl_tests.markdown()}\n")
    parts.append(f"Total time {total:.1f} s. {env_md(env)}\n")
    return "\n".join(parts)


__all__ = ["markdown", "run", "select"]
