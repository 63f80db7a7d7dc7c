"""torchtitan's published Llama runs, each planned by autopar on its published layout and SKU.

Sources (pytorch/torchtitan, read at the commits named):

- `benchmarks/llama3_h100_202412_torchtitan.md` (torchtitan 9dec370, December 2024): Grand Teton hosts of 8
  H100 with 96 GB HBM2e at 2.4 TB/s, 500 W, 400 Gb/s RDMA per GPU (preset "H100-96GB-500W"). Table 1: Llama
  3.1 8B, FSDP on 8 GPUs, local batch 2, selective activation checkpointing, eager ("FSDP" row): 5,762
  tokens/s per GPU, 82.4 GiB. Table 3: the same on 128 GPUs: 5,605 tokens/s, 67.0 GiB. Sequence 8,192 and
  selective "op" checkpointing are the `train_configs/llama3_8b.toml` of that commit.
- `benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md` (June 2025, same hosts), vanilla TP bf16 rows:
  Llama 3 8B on 64 GPUs, FSDP 8 x TP 8, torch.compile, per-op SAC, local batch 12: 4,378 tokens/s; Llama 3
  70B on 256 GPUs, FSDP 32 x TP 8, torch.compile, full AC, local batch 16: 597.3 tokens/s. No memory.
- `docs/performance.md` at 4d88a8a44 (64 A100 80GB): Llama 3 8B, local batch 1, selective op AC: 2,973
  tokens/s (MFU 58.2%); Llama 3 70B, local batch 1, full AC: 331 (51.7%). Sequence 8,192
  (`train_configs/llama3_{8b,70b}.toml`). No memory.
- `docs/performance.md` at 559a52676 (64 A100 80GB): LLaMA 13B (dim 5120, 40 layers, 40 heads, the Llama 2
  tokenizer: autopar's "llama2-13b"), local batch 2, sequence 4,096 (`train_configs/llama_13b.toml`), no
  activation checkpointing: 2,162 tokens/s (61.1%). No memory.

torchtitan's tokens/s per GPU is a data-parallel rank's tokens per step over the step time and the ranks that
share them (`non_data_parallel_size`, tp here), so the published step time is local batch x sequence / (tokens/s
x tp). The A100 runs name no network: the preset's DGX A100 (8 HDR adapters a node) is assumed.

What autopar cannot pin yet is said per row (`gaps`): torchtitan's "op" selective checkpointing (save every
op's output but every second matmul's) is no autopar policy, so those rows pin autopar's "selective"
(attention internals only); torch.compile's fusions are not priced (autopar prices eager kernels); the
tensor axis's op-level strategy is autopar's choice, not torchtitan's column/row split with sequence
parallelism.

Kernels: each row is priced on the kernels its run called. The eager runs call `F.scaled_dot_product_attention`
with `is_causal=True` (its flash backend: FlashAttention-2) and run everything else as ATen ops, one kernel and one
pass over HBM each: RMSNorm upcast to fp32, squared, averaged, scaled and cast back; the rotary embedding; SwiGLU's
silu and product; the residual adds; the loss over the fp32 logits. They are planned with attention fused
(`fuse_kernels=("attention",)`: the fused op prices causal flash attention) and the rest as traced. The compiled runs
are planned with autopar's fused norms and loss standing for Inductor's fusions.
"""

from __future__ import annotations

import dataclasses
import time

SOURCE_H100_2412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (9dec370)"
SOURCE_ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md (820504e)"
SOURCE_A100_LLAMA3 = "pytorch/torchtitan docs/performance.md at 4d88a8a44"
SOURCE_A100_LLAMA2 = "pytorch/torchtitan docs/performance.md at 559a52676"
GPUS_PER_NODE = 8

OP_SAC = "selective op (every op's output saved but every second matmul's)"
GAP_OP_SAC = "op SAC not expressible: planned with autopar's 'selective' (attention internals)"
GAP_COMPILE = "torch.compile's fusions not priced"
GAP_TP_OPS = "tensor-axis op strategy is autopar's, not column/row + sequence parallel"


@dataclasses.dataclass(frozen=True)
class TorchtitanRow:
    """One published torchtitan run and the layout it ran."""

    name: str  # as --rows names it
    model: str  # autopar preset
    device: str  # autopar device preset (the SKU)
    source: str
    gpus: int
    seq_len: int
    local_batch: int  # sequences per data-parallel rank per step
    dp: int  # FSDP degree (ZeRO-3)
    tp: int
    recompute: str  # autopar's policy pinned
    published_recompute: str
    tokens_per_s_per_gpu: float
    memory_gib: float | None  # published peak (PyTorch's reserved memory), None when not published
    compiled: bool
    gaps: tuple[str, ...] = ()

    @property
    def cluster(self) -> str:
        return f"{self.gpus // GPUS_PER_NODE}x{GPUS_PER_NODE}x{self.device}"

    @property
    def global_batch(self) -> int:
        return self.dp * self.local_batch

    @property
    def fuse_kernels(self):
        """The kernels the run fused, as `autopar.plan`'s `fuse_kernels`: an eager run calls SDPA's flash kernel
        for attention and runs its RMSNorm, rotary embedding, SwiGLU and fp32 cross-entropy as separate ATen ops,
        each a kernel with its own pass over HBM ("attention" only); a compiled run fuses those, which autopar's
        fused norms and loss stand for (every kind)."""
        return True if self.compiled else ("attention",)

    def constraints(self) -> dict:
        # FSDP2 reshards after forward: ZeRO-3; one micro-batch of the local batch per step
        return {
            "dp": self.dp,
            "tp": self.tp,
            "pp": 1,
            "cp": 1,
            "zero": 3,
            "recompute": self.recompute,
            "micro_batch_size": self.local_batch,
        }


def published_step_time_s(row: TorchtitanRow) -> float:
    """local batch x sequence / (tokens/s per GPU x tp): torchtitan's tokens/s counts a dp rank's tokens per GPU."""
    return row.local_batch * row.seq_len / (row.tokens_per_s_per_gpu * row.tp)


ROWS: tuple[TorchtitanRow, ...] = (
    TorchtitanRow(
        "tt-8b-fsdp8-h100",
        "llama3-8b",
        "H100-96GB-500W",
        f"{SOURCE_H100_2412}, Table 1, FSDP",
        8,
        8192,
        2,
        8,
        1,
        "selective",
        OP_SAC,
        5762,
        82.4,
        False,
        (GAP_OP_SAC,),
    ),
    TorchtitanRow(
        "tt-8b-fsdp128-h100",
        "llama3-8b",
        "H100-96GB-500W",
        f"{SOURCE_H100_2412}, Table 3, FSDP",
        128,
        8192,
        2,
        128,
        1,
        "selective",
        OP_SAC,
        5605,
        67.0,
        False,
        (GAP_OP_SAC,),
    ),
    TorchtitanRow(
        "tt-8b-fsdp8-tp8-h100",
        "llama3-8b",
        "H100-96GB-500W",
        f"{SOURCE_ASYNC_TP}, Llama3 8b, vanilla TP, bfloat16",
        64,
        8192,
        12,
        8,
        8,
        "selective",
        OP_SAC,
        4378,
        None,
        True,
        (GAP_OP_SAC, GAP_COMPILE, GAP_TP_OPS),
    ),
    TorchtitanRow(
        "tt-70b-fsdp32-tp8-h100",
        "llama3-70b",
        "H100-96GB-500W",
        f"{SOURCE_ASYNC_TP}, Llama3 70b, vanilla TP, bfloat16",
        256,
        8192,
        16,
        32,
        8,
        "full",
        "full",
        597.3,
        None,
        True,
        (GAP_COMPILE, GAP_TP_OPS),
    ),
    TorchtitanRow(
        "tt-8b-fsdp64-a100",
        "llama3-8b",
        "A100-80GB",
        f"{SOURCE_A100_LLAMA3}, 8B, selective op",
        64,
        8192,
        1,
        64,
        1,
        "selective",
        OP_SAC,
        2973,
        None,
        False,
        (GAP_OP_SAC,),
    ),
    TorchtitanRow(
        "tt-70b-fsdp64-a100",
        "llama3-70b",
        "A100-80GB",
        f"{SOURCE_A100_LLAMA3}, 70B, full",
        64,
        8192,
        1,
        64,
        1,
        "full",
        "full",
        331,
        None,
        False,
    ),
    TorchtitanRow(
        "tt-13b-fsdp64-a100",
        "llama2-13b",
        "A100-80GB",
        f"{SOURCE_A100_LLAMA2}, 13B, no AC",
        64,
        4096,
        2,
        64,
        1,
        "none",
        "none",
        2162,
        None,
        False,
    ),
)
ROW_NAMES = tuple(r.name for r in ROWS)
# a budget to plan with when the device's own refuses the published layout: the row is then reported with the
# prediction over the device (autopar's memory model is over the published figures on these rows)
FALLBACK_BUDGET = "1TB"


def plan_row(row: TorchtitanRow, *, budget: str | None = None, free: bool = False, progress=None):
    """autopar's plan of `row`: its published layout pinned (every state on the device, as the runs kept them), or
    only its batch and sequence when `free`."""
    import autopar

    return autopar.plan(
        row.model,
        row.cluster,
        global_batch_size=row.global_batch,
        seq_len=row.seq_len,
        constraints={} if free else row.constraints(),
        memory_budget=budget,
        offload=None if free else False,
        fuse_kernels=None if free else row.fuse_kernels,
        alternatives=False,
        pipeline=False if not free else None,
        progress=progress,
    )


def calibrate_row(row: TorchtitanRow, *, free: bool = False) -> dict:
    """The row's published figures next to autopar's plan of them (and of the free search when `free`)."""
    from autopar.errors import AutoparError

    t0 = time.perf_counter()
    refused = None
    try:
        plan = plan_row(row)
    except AutoparError as e:  # the published layout does not fit autopar's memory model of the device
        refused = str(e).splitlines()[0]
        plan = plan_row(row, budget=FALLBACK_BUDGET)
    record = {
        "row": dataclasses.asdict(row),
        "cluster": row.cluster,
        "published_step_time_s": published_step_time_s(row),
        "published_memory_gib": row.memory_gib,
        "predicted": plan_record(plan, time.perf_counter() - t0),
        "refused_on_device_memory": refused,
    }
    record["ratio"] = record["predicted"]["step_time_s"] / record["published_step_time_s"]
    if free:
        t0 = time.perf_counter()
        try:
            record["free"] = plan_record(plan_row(row, free=True), time.perf_counter() - t0)
        except AutoparError as e:
            record["free"] = {"error": str(e).splitlines()[0]}
    return record


def plan_record(plan, seconds: float) -> dict:
    """What the calibration table reports of a plan."""
    p = plan.predicted
    mesh = dict(plan.mesh)
    return {
        "step_time_s": p.step_time_s,
        "peak_memory_gib": p.peak_memory_bytes / 2**30,
        "mfu": p.mfu,
        "mesh": mesh,
        "layout": ", ".join(f"{k}{v}" for k, v in mesh.items() if v > 1) + f", ZeRO-{plan.zero_stage}",
        "recompute": plan.recompute,
        "num_microbatches": plan.num_microbatches,
        "time_breakdown": {k: v for k, v in plan.time_breakdown.items() if v},
        "planning_time_s": round(seconds, 3),
    }


def select_rows(names) -> list[TorchtitanRow]:
    """Rows by name (a comma-separated string or a list); None: all."""
    from autopar.errors import ConfigError

    if names is None:
        return list(ROWS)
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    by_name = {r.name: r for r in ROWS}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ConfigError(f"unknown torchtitan rows {unknown}: expected some of {', '.join(ROW_NAMES)}")
    return [by_name[n] for n in names]


__all__ = [
    "ROWS",
    "ROW_NAMES",
    "TorchtitanRow",
    "calibrate_row",
    "plan_record",
    "plan_row",
    "published_step_time_s",
    "select_rows",
]
