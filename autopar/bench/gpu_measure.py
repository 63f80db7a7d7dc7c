"""Cost-model measurement on one GPU: matmul efficiency by shape and format, flash attention by sequence length.

    python -m autopar.bench.gpu_measure [--out DIR] [--preset H100-80GB] [--budget-s 180]

Measures, on the one CUDA device it finds (its preset from its name, or `--preset`):

1. memory bandwidth: a 1 GiB device-to-device copy, bytes read plus written;
2. matmul efficiency: ``C[M, N] = A[M, K] @ B[K, N]`` for every (M, N, K) of `MATMUL_SIZES` (27 shapes) in bf16,
   fp16, tf32 (fp32 tensors, TF32 on) and fp32 (TF32 off), achieved FLOP/s over the preset's peak of that format;
3. flash attention, causal, bf16, head dim 128, 16 heads, sequences 4K to 128K (batch = 128K tokens / sequence):
   forward and backward efficiency over the preset's bf16 peak, for SDPA's flash backend ("sdpa-flash") and
   autopar's Triton kernel ("autopar-triton", which the fused programs run). FLOPs: forward ``4·b·h·s²·d``,
   backward 2.5x, halved for causal.

It prints each figure next to what the preset assumes (its one `matmul_efficiency` for every matmul and every
attention call, and its memory bandwidth x `memory_efficiency`), and writes into DIR the device file
``device_measurement.json`` (format: `autopar.bench.device_file`) and ``cluster_override.yaml``, a cluster file
with the scalar figures DeviceSpec takes today (`autopar plan --cluster DIR/cluster_override.yaml`).

Time: every point is timed with CUDA events over batches of calls after a warm-up; the whole run stops taking new
points once `--budget-s` (180 s) is spent, lists the points it skipped in the file, and so ends in under four
minutes (the Triton kernel's first call at each length autotunes, which is most of its share). Without a CUDA
device it says so in one line and exits 2; ``--device cpu --smoke`` runs every step at tiny sizes on the CPU
(kernels in the Triton interpreter, which needs ``TRITON_INTERPRET=1``): a test that it runs, not a measurement.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from autopar.bench.device_file import AttentionPoint, DeviceMeasurement, MatmulPoint

MATMUL_SIZES = (1024, 4096, 16384)
SMOKE_MATMUL_SIZES = (16, 64)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "tf32": torch.float32, "fp32": torch.float32}
ATTENTION_SEQS = (4096, 8192, 16384, 32768, 65536, 131072)
ATTENTION_TOKENS, ATTENTION_HEADS, HEAD_DIM = 131072, 16, 128
SMOKE_ATTENTION = ((32, 64), 64, 2, 16)  # sequences, tokens, heads, head dim
KERNELS = ("sdpa-flash", "autopar-triton")
DEFAULT_BUDGET_S = 180.0
SAMPLE_S = 2e-3  # each timed sample runs the call this long or more (short kernels in batches)
SAMPLES = 5  # timed samples per point, after a warm-up call; the median is kept
COPY_BYTES = 2**30


class Deadline:
    """The run's time budget: `expired()` once `budget_s` seconds have passed since it was made."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock, self.end = clock, clock() + budget_s

    def expired(self) -> bool:
        return self.clock() >= self.end


def preset_for(device_name: str, memory_bytes: int) -> str:
    """The device preset a GPU of this name (as torch reports it) and memory is priced as."""
    from autopar.errors import ConfigError

    name = device_name.upper()
    if "H200" in name:
        return "H200-141GB"
    if "H100" in name:
        return "H100-80GB"
    if "A100" in name:
        return "A100-80GB" if memory_bytes > 50e9 else "A100-40GB"
    raise ConfigError(f"no device preset for {device_name!r}: pass --preset with one of the known names")


def time_call_s(fn: Callable[[], object], device: torch.device, samples: int = SAMPLES) -> float:
    """Seconds per call of `fn`: the median of `samples` timed batches after a warm-up call; a batch repeats the
    call until it lasts `SAMPLE_S` (so that launch gaps do not count for microsecond kernels). CUDA events on a
    GPU, a CPU clock otherwise."""
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    repeat = max(1, min(100, int(SAMPLE_S / max(time.perf_counter() - start, 1e-7))))
    times = []
    for _ in range(samples):
        if cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            for _ in range(repeat):
                fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e-3 / repeat)
        else:
            t0 = time.perf_counter()
            for _ in range(repeat):
                fn()
            times.append((time.perf_counter() - t0) / repeat)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / time_call_s(lambda: dst.copy_(src), device)


def measure_matmul(dtype_name: str, m: int, n: int, k: int, device: torch.device) -> float:
    """Achieved FLOP/s of one (m, n, k) matmul in `dtype_name` ("tf32": fp32 with TF32 on; "fp32": off)."""
    matmul = torch.backends.cuda.matmul
    saved = matmul.fp32_precision
    matmul.fp32_precision = "tf32" if dtype_name == "tf32" else "ieee"
    try:
        a = torch.randn(m, k, device=device).to(DTYPES[dtype_name])
        b = torch.randn(k, n, device=device).to(DTYPES[dtype_name])
        out = torch.empty(m, n, device=device, dtype=DTYPES[dtype_name])
        return 2 * m * n * k / time_call_s(lambda: torch.matmul(a, b, out=out), device)
    finally:
        matmul.fp32_precision = saved


def attention_flops(batch: int, heads: int, seq: int, head_dim: int, causal: bool = True) -> float:
    """Forward FLOPs of one attention call (the backward's are 2.5 times these)."""
    return 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)


def measure_attention(
    kernel: str, seq: int, tokens: int, heads: int, head_dim: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, float]:
    """Achieved (forward, backward) FLOP/s of causal attention by `kernel`; backward time is forward+backward's
    less forward's."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.triton_kernels import flash_attention

    batch = max(1, tokens // seq)
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in "qkv")
    grad = torch.randn_like(q)

    def forward():
        if kernel == "autopar-triton":
            return flash_attention(q, k, v, causal=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        q.grad = k.grad = v.grad = None
        forward().backward(grad)

    with torch.no_grad():
        fwd_s = time_call_s(forward, device, samples=3)
    both_s = time_call_s(forward_backward, device, samples=3)
    flops = attention_flops(batch, heads, seq, head_dim)
    return flops / fwd_s, 2.5 * flops / max(both_s - fwd_s, 1e-9)


def _date() -> str:
    return datetime.datetime.now(datetime.timezone.utc).date().isoformat()


def run(device: torch.device, preset: str, deadline: Deadline, smoke: bool = False) -> DeviceMeasurement:
    """Measure everything the module docstring lists (at tiny sizes with `smoke`), printing each table next to
    the preset's figures; points past the deadline are skipped and listed."""
    from autopar.cost_model.devices import get_device

    spec = get_device(preset)
    peaks = {name: spec.peak_matmul_flops(name) for name in DTYPES}
    skipped: list[str] = []
    bandwidth = measure_bandwidth(device, 2**20 if smoke else COPY_BYTES)
    assumed_bw = spec.memory_bandwidth_bytes_per_s * spec.memory_efficiency
    print(f"memory copy: {bandwidth / 1e12:.3f} TB/s measured, {assumed_bw / 1e12:.3f} TB/s assumed by {preset}")
    matmul = _matmul_table(device, peaks, spec.matmul_efficiency, deadline, skipped, smoke)
    seqs, tokens, heads, head_dim = (
        SMOKE_ATTENTION if smoke else (ATTENTION_SEQS, ATTENTION_TOKENS, ATTENTION_HEADS, HEAD_DIM)
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16  # the CPU's flash kernel: fp32
    att_dtype = "fp32" if dtype == torch.float32 else "bf16"
    attention = _attention_table(
        device, peaks[att_dtype], spec.matmul_efficiency, (seqs, tokens, heads, head_dim), dtype, deadline, skipped
    )
    for line in skipped:
        print(f"skipped: {line}")
    return DeviceMeasurement(
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        preset=preset,
        torch_version=torch.__version__,
        measured_on=_date(),
        peak_flops_per_s=tuple(peaks.items()),
        memory_bandwidth_bytes_per_s=bandwidth,
        matmul=tuple(matmul),
        attention_dtype=att_dtype,
        attention_head_dim=head_dim,
        attention_num_heads=heads,
        attention=tuple(attention),
        skipped=tuple(skipped),
    )


def _matmul_table(device, peaks, assumed: float, deadline: Deadline, skipped: list[str], smoke: bool) -> list:
    sizes = SMOKE_MATMUL_SIZES if smoke else MATMUL_SIZES
    points = []
    print(
        f"\nmatmul C[M,N] = A[M,K] @ B[K,N]: TFLOP/s and efficiency (achieved / peak); the preset assumes {assumed:.3f}"
    )
    print(
        f"  {'format':6s} {'MxNxK':>17s} {'TFLOP/s':>9s} {'eff':>6s} {'preset TFLOP/s':>15s} {'measured/preset':>16s}"
    )
    for name in DTYPES:
        for m, n, k in itertools.product(sizes, repeat=3):
            if deadline.expired():
                skipped.append(f"matmul {name} {m}x{n}x{k}: time budget spent")
                continue
            rate = measure_matmul(name, m, n, k, device)
            point = MatmulPoint(name, m, n, k, rate / peaks[name])
            points.append(point)
            preset_rate = assumed * peaks[name]
            print(
                f"  {name:6s} {point.key:>17s} {rate / 1e12:9.2f} {point.efficiency:6.3f} "
                f"{preset_rate / 1e12:15.2f} {rate / preset_rate:16.2f}",
                flush=True,
            )
    return points


def _attention_table(device, peak: float, assumed: float, sizes, dtype, deadline, skipped: list[str]) -> list:
    seqs, tokens, heads, head_dim = sizes
    points = []
    print(f"\nattention, causal, {heads} heads of {head_dim}, batch = {tokens} tokens / sequence: TFLOP/s (efficiency)")
    print(
        f"  the preset prices attention at its matmul efficiency: {assumed * peak / 1e12:.1f} TFLOP/s ({assumed:.3f})"
    )
    print(f"  {'kernel':15s} {'sequence':>9s} {'forward':>17s} {'backward':>17s}")
    for kernel in KERNELS:
        for seq in seqs:
            if deadline.expired():
                skipped.append(f"attention {kernel} {seq}: time budget spent")
                continue
            try:
                fwd, bwd = measure_attention(kernel, seq, tokens, heads, head_dim, device, dtype)
            except (RuntimeError, ValueError) as e:  # a backend that does not take this shape: say so, go on
                skipped.append(f"attention {kernel} {seq}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                continue
            points += [
                AttentionPoint(kernel, "forward", seq, fwd / peak),
                AttentionPoint(kernel, "backward", seq, bwd / peak),
            ]
            print(
                f"  {kernel:15s} {seq:9d} {fwd / 1e12:9.1f} ({fwd / peak:5.3f}) {bwd / 1e12:9.1f} ({bwd / peak:5.3f})",
                flush=True,
            )
    return points


def write_outputs(measurement: DeviceMeasurement, out_dir: Path, cluster: str) -> list[Path]:
    """The device file and the cluster file of `measurement` in `out_dir`."""
    import yaml

    out_dir.mkdir(parents=True, exist_ok=True)
    device_file = measurement.write(out_dir / "device_measurement.json")
    cluster_file = out_dir / "cluster_override.yaml"
    cluster_file.write_text(yaml.safe_dump(measurement.cluster_overrides(cluster), sort_keys=False))
    return [device_file, cluster_file]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m autopar.bench.gpu_measure", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("out/gpu"), help="folder for the device and cluster files")
    p.add_argument("--preset", help="the device preset to measure against (default: from the GPU's name)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, help="stop taking new points after this")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: does the script run (not a measurement)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"autopar.bench.gpu_measure: no CUDA device (torch {torch.__version__}); run it on a GPU machine")
        return 2
    device = torch.device(args.device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        preset = args.preset or preset_for(props.name, props.total_memory)
        print(
            f"device: {props.name}, {props.total_memory / 2**30:.1f} GiB, priced as {preset}; torch {torch.__version__}"
        )
    else:
        preset = args.preset or "cpu"
    measurement = run(device, preset, Deadline(args.budget_s), smoke=args.smoke or device.type == "cpu")
    for path in write_outputs(measurement, args.out, f"8x{preset}" if device.type == "cuda" else "cpu:2"):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
