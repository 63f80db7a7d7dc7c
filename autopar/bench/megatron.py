"""Megatron-LM SC'21 Table 1 rows of `autopar bench calibrate` (`autopar.bench.calibrate`): predicted step times
next to the paper's measured ones.

The reference is Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM" (SC'21): GPT models with sequence length 2048 and a vocabulary of 51,200,
mixed precision, full activation recompute, on DGX A100 80GB nodes of 8 GPUs. Each row gives the layout
(tensor- and pipeline-parallel sizes, GPUs), the global batch and the achieved teraFLOP/s per GPU; the
step time follows from the paper's FLOPs per iteration (with full recompute, eq. 3 of the paper):

    F = 96 B s l h^2 (1 + s / (6 h) + V / (16 l h))

so the published step time is F / (GPUs x TFLOP/s per GPU).

Table 1 does not print the micro-batch size or the interleaving; the paper's artifact does: Megatron-LM's
`examples/sc21/run_table_1.sh` gives, per row, the micro-batch size (MBS) and, for the interleaved rows,
`--num-layers-per-virtual-pipeline-stage` (so v = layers / (pp x that)). Each row is planned with that
whole layout pinned (tp, pp, dp, micro-batch size, interleaved 1F1B with v chunks where the script
interleaves, full recompute) as a GPT-2 architecture module built on the meta device, once handed in
fp32 and once in bf16, both with precision="bf16": mixed precision should price the same step whatever
dtype the parameters arrive in. The op-level sharding on the tensor axis stays autopar's choice.

The kernels priced are the ones the paper's runs had. SC'21 predates FlashAttention (2022): its attention
is two batched GEMMs around a scaled, masked softmax, with the s x s scores in memory (and dropout on
them), so the model uses Hugging Face's eager attention and is planned without autopar's fused Triton ops
(`fuse_kernels=False`): the scores' memory passes are priced as the traced ops make them. Megatron fuses
the scale, mask and softmax into one kernel, and its LayerNorm and bias-GeLU too, which autopar prices as
separate elementwise passes: a little more memory traffic than ran.

The whole model is traced (autopar.plan shortens the trace only for presets given by name, and a preset
name would fix the parameter dtype to the precision); at 105 layers of width 20480 on meta that stays
within seconds.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from autopar.bench.common import env_md, environment, md_table, write_json

SEQ_LEN = 2048
VOCAB = 51200
GPUS_PER_NODE = 8
DEVICE = "A100-80GB"
PAPER = (
    'Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", '
    "SC'21, Table 1"
)


@dataclasses.dataclass(frozen=True)
class MegatronRow:
    """One row of the paper's Table 1."""

    name: str  # "1.7b", as --rows names it
    params_b: float  # billions of parameters, as the paper prints it
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int  # global batch, sequences
    tflops: float  # achieved teraFLOP/s per GPU
    micro_batch: int  # MBS in the paper's run script
    layers_per_virtual_stage: int | None = None  # the run script's interleaving; None: not interleaved

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline device: layers / (pp x layers per virtual stage); 1 when not interleaved."""
        if self.layers_per_virtual_stage is None:
            return 1
        return self.layers // (self.pp * self.layers_per_virtual_stage)

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def cluster(self) -> str:
        return f"{self.gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}x{DEVICE}"

    def constraints(self) -> dict:
        # the paper's runs replicate optimizer states over the data axis (no ZeRO) and recompute every layer
        pins = {
            "tp": self.tp,
            "pp": self.pp,
            "dp": self.dp,
            "zero": 0,
            "recompute": "full",
            "micro_batch_size": self.micro_batch,
        }
        if self.pp > 1:
            pins["schedule"] = "interleaved_1f1b" if self.virtual_stages > 1 else "1f1b"
            pins["virtual_stages"] = self.virtual_stages
        return pins


ROWS: tuple[MegatronRow, ...] = (
    MegatronRow("1.7b", 1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16),
    MegatronRow("18.4b", 18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8),
    MegatronRow("76.1b", 76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5),
    MegatronRow("310.1b", 310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3),
    MegatronRow("529.6b", 529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1),
)
ROW_NAMES = tuple(r.name for r in ROWS)


def published_flops(row: MegatronRow, seq_len: int = SEQ_LEN, vocab: int = VOCAB) -> float:
    """The paper's FLOPs per iteration with full recompute: 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    b, s, l, h, v = row.batch, seq_len, row.layers, row.hidden, vocab  # noqa: E741
    return 96.0 * b * s * l * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * l * h))


def published_step_time_s(row: MegatronRow) -> float:
    """Seconds per iteration implied by the paper's teraFLOP/s per GPU."""
    return published_flops(row) / (row.gpus * row.tflops * 1e12)


def select_rows(names: str | list[str] | None) -> list[MegatronRow]:
    """Rows by name ("1.7b,18.4b" or a list; case-insensitive, a trailing "b" optional); None: all."""
    from autopar.errors import ConfigError

    if names is None:
        return list(ROWS)
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    by_name = {r.name: r for r in ROWS}
    out = []
    for n in names:
        key = n.strip().lower()
        key = key if key.endswith("b") else key + "b"
        if key not in by_name:
            raise ConfigError(f"unknown calibration row {n!r}: expected some of {', '.join(ROW_NAMES)}")
        out.append(by_name[key])
    return out


def build_model(row: MegatronRow, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The row's GPT as a GPT-2 architecture model on the meta device (tied embeddings, 4h MLP)."""
    import transformers

    from autopar import presets

    config = transformers.GPT2Config(
        n_embd=row.hidden,
        n_layer=row.layers,
        n_head=row.heads,
        n_positions=SEQ_LEN,
        vocab_size=VOCAB,
        use_cache=False,
        tie_word_embeddings=True,
    )
    config._attn_implementation = "eager"  # unfused attention, as in 2021 (see the module docstring)
    return presets.build_model(config, device="meta", dtype=dtype)


def plan_row(row: MegatronRow, dtype: torch.dtype = torch.float32, progress=None):
    """autopar's plan of one row with its layout pinned; the model handed in `dtype`, planned in bf16."""
    import autopar

    model = build_model(row, dtype)
    ids = torch.zeros(row.batch, SEQ_LEN, dtype=torch.int64, device="meta")
    return autopar.plan(
        model,
        row.cluster,
        (ids,),
        {"labels": ids},
        precision="bf16",
        constraints=row.constraints(),
        pipeline=row.pp > 1,
        progress=progress,
        alternatives=False,
        fuse_kernels=False,
    )


def layout(plan) -> str:
    """The plan's layout in a few words: axis sizes, micro-batching, pipeline schedule."""
    mesh = plan.mesh
    parts = [f"tp{mesh.get('tp', 1)} pp{mesh.get('pp', 1)} dp{mesh.get('dp', 1)}"]
    if plan.pipeline:
        p = plan.pipeline
        sched = p["schedule"] + (f" v{p['virtual_stages']}" if p.get("virtual_stages", 1) > 1 else "")
        parts.append(f"mbs {p['micro_batch_size']} x{plan.num_microbatches}, {sched}")
    else:
        per_rank = plan.global_batch_size // max(mesh.get("dp", 1), 1)
        parts.append(f"mbs {per_rank // max(plan.num_microbatches, 1)} x{plan.num_microbatches}")
    if plan.zero_stage:
        parts.append(f"ZeRO-{plan.zero_stage}")
    return ", ".join(parts)


_PIPELINE_FIELDS = ("schedule", "virtual_stages", "micro_batch_size", "bubble_fraction")


def _plan_record(plan, seconds: float) -> dict:
    return {
        "step_time_s": plan.predicted.step_time_s,
        "tflops_per_device": plan.predicted.tflops_per_device,
        "layout": layout(plan),
        "mesh": dict(plan.mesh),
        "zero_stage": plan.zero_stage,
        "num_microbatches": plan.num_microbatches,
        "recompute": plan.recompute,
        "pipeline": {k: plan.pipeline[k] for k in _PIPELINE_FIELDS} if plan.pipeline else None,
        "num_parameters": plan.num_parameters,
        "peak_memory_bytes": plan.predicted.peak_memory_bytes,
        "planning_time_s": round(seconds, 3),
    }


def calibrate_row(row: MegatronRow, progress=None) -> dict:
    """Plan one row handed in fp32 and in bf16; the record of both next to the published figures."""
    records = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t0 = time.perf_counter()
        plan = plan_row(row, dtype, progress=progress)
        records[label] = _plan_record(plan, time.perf_counter() - t0)
    published = published_step_time_s(row)
    predicted = records["fp32"]["step_time_s"]
    return {
        "row": dataclasses.asdict(row),
        "cluster": row.cluster,
        "published_flops": published_flops(row),
        "published_step_time_s": published,
        "predicted_fp32_handed": records["fp32"],
        "predicted_bf16_handed": records["bf16"],
        "error_pct": 100.0 * (predicted - published) / published,
        "handed_dtype_gap_pct": 100.0 * (records["bf16"]["step_time_s"] - predicted) / predicted,
    }


def markdown(results: list[dict]) -> str:
    header = [
        "row",
        "layout (fp32-handed plan)",
        "published s/step",
        "predicted s/step (fp32-handed)",
        "predicted s/step (bf16-handed)",
        "error %",
        "planning s (fp32 / bf16)",
    ]
    rows = []
    for r in results:
        f32, b16 = r["predicted_fp32_handed"], r["predicted_bf16_handed"]
        rows.append(
            [
                f"{r['row']['params_b']}B",
                f32["layout"],
                f"{r['published_step_time_s']:.2f}",
                f"{f32['step_time_s']:.2f}",
                f"{b16['step_time_s']:.2f}",
                f"{r['error_pct']:+.1f}",
                f"{f32['planning_time_s']:.1f} / {b16['planning_time_s']:.1f}",
            ]
        )
    return md_table(header, rows)


def run(
    out_dir: str | Path = "out/calibrate", *, rows: str | list[str] | None = None, show_progress: bool = True
) -> dict:
    """Plan the selected rows, print the Markdown table, write calibrate.json and calibrate.md to `out_dir`."""
    out = Path(out_dir)
    selected = select_rows(rows)
    t0 = time.perf_counter()
    results = []
    for row in selected:
        if show_progress:
            print(
                f"[autopar bench] calibrate: {row.name} on {row.cluster} (tp{row.tp} pp{row.pp} dp{row.dp})",
                file=sys.stderr,
                flush=True,
            )
        results.append(calibrate_row(row))
    total = time.perf_counter() - t0
    env = environment()
    doc = {
        "suite": "calibrate",
        "environment": env,
        "reference": PAPER,
        "seq_len": SEQ_LEN,
        "vocab_size": VOCAB,
        "precision": "bf16",
        "recompute": "full",
        "published_flops_formula": "96 B s l h^2 (1 + s/(6h) + V/(16 l h))",
        "error": "predicted (fp32-handed) over published step time, minus one, in percent",
        "rows": results,
        "total_time_s": round(total, 3),
    }
    write_json(out / "calibrate.json", doc)
    table = markdown(results)
    text = (
        f"# Calibration against Megatron-LM (SC'21) Table 1\n\n{PAPER}: sequence {SEQ_LEN}, vocabulary {VOCAB}, "
        f"bf16 mixed precision, full recompute, {DEVICE} nodes of {GPUS_PER_NODE}. Published s/step = "
        f"F / (GPUs x TFLOP/s per GPU) with F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)). Error: the fp32-handed "
        f"prediction against the published time.\n\n{table}\n\nTotal time {total:.1f} s. {env_md(env)}\n"
    )
    (out / "calibrate.md").write_text(text)
    print(table)
    return doc


__all__ = [
    "ROWS",
    "ROW_NAMES",
    "MegatronRow",
    "build_model",
    "calibrate_row",
    "layout",
    "plan_row",
    "published_flops",
    "published_step_time_s",
    "run",
    "select_rows",
]
