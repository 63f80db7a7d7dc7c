"""GPU benchmark of the Triton kernels: correctness on the GPU first, then speed and memory next to PyTorch.

Run ``python -m autopar.triton_kernels.bench``. Without a CUDA device it says so and exits 0, so it is safe to call
anywhere; with one it prints:

1. correctness: every kernel against PyTorch (SDPA math, ``F.rms_norm``, ``F.layer_norm``, ``F.cross_entropy``)
   computed in fp32 from the same inputs, forward and all input gradients; a failure makes the exit status 1;
2. flash attention forward and forward+backward TFLOP/s, bf16, sequence 1k..16k, head dim 64 and 128, causal and
   not, next to ``F.scaled_dot_product_attention`` on its flash backend. Batch x heads fill the GPU with 16k
   tokens per batch and a model width of 2048 (heads = 2048 / head_dim). FLOPs: forward ``4 b h s^2 d``, backward
   2.5x the forward, half of each when causal;
3. ``linear_cross_entropy`` against ``F.cross_entropy`` on materialised bf16 logits at vocab 128256: time of
   forward+backward and peak memory above the inputs.

The first call of each attention shape autotunes (a few configs per kernel), which dominates the run time; the
whole script takes about three minutes on one H100 or H200. ``--quick`` runs a smaller sweep.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

FAILED: list[str] = []


def _rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest elementwise error relative to the largest expected magnitude."""
    scale = expected.abs().max().item() or 1.0
    return ((actual.float() - expected.float()).abs().max().item()) / scale


def _report(what: str, errors: dict[str, float], tol: float) -> None:
    ok = all(math.isfinite(e) and e <= tol for e in errors.values())
    if not ok:
        FAILED.append(what)
    detail = "  ".join(f"{name} {err:.1e}" for name, err in errors.items())
    print(f"  {'ok  ' if ok else 'FAIL'} {what:55s} {detail}  (tol {tol:.0e} of max)")


def _grads_of(fn: Callable, inputs: list[torch.Tensor], grad_out: torch.Tensor) -> tuple[torch.Tensor, list]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def _check_attention(b, hq, hkv, sq, sk, d, causal, dtype, gen) -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from autopar.triton_kernels import flash_attention

    q = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(b, hkv, sk, d, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    grad_out = torch.randn(b, hq, sq, d, device="cuda", dtype=dtype, generator=gen)
    out, grads = _grads_of(lambda q, k, v: flash_attention(q, k, v, causal=causal), [q, k, v], grad_out)

    def sdpa_fp32(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    ref, ref_grads = _grads_of(sdpa_fp32, [t.float() for t in (q, k, v)], grad_out.float())
    errors = {"out": _rel_error(out, ref)}
    errors.update({n: _rel_error(g, r) for n, g, r in zip(("dq", "dk", "dv"), grads, ref_grads, strict=True)})
    # 16-bit: P and dS are rounded to the input dtype before their matmuls (as in every flash kernel).
    tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    _report(f"flash_attention {b}x{hq}/{hkv}x{sq}x{sk}x{d} causal={causal} {dtype}", errors, tol)


def _check_norms(rows, cols, dtype, gen) -> None:
    from autopar.triton_kernels import layer_norm, rms_norm

    x = torch.randn(rows, cols, device="cuda", dtype=dtype, generator=gen)
    w, b = (1 + 0.5 * torch.randn(cols, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    dy = torch.randn_like(x)
    cases = (
        ("rms_norm", lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (cols,), w, 1e-6), [x, w]),
        ("layer_norm", lambda x, w, b: layer_norm(x, w, b, 1e-5),
         lambda x, w, b: F.layer_norm(x, (cols,), w, b, 1e-5), [x, w, b]),
    )  # fmt: skip
    for name, ours, theirs, params in cases:
        out, grads = _grads_of(ours, params, dy)
        ref, ref_grads = _grads_of(theirs, [t.float() for t in params], dy.float())
        errors = {"out": _rel_error(out, ref)}
        errors.update({f"d{i}": _rel_error(g, r) for i, (g, r) in enumerate(zip(grads, ref_grads, strict=True))})
        # One rounding of each result to the input dtype; the statistics and sums are fp32.
        tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
        _report(f"{name} {rows}x{cols} {dtype}", errors, tol)


def _check_cross_entropy(tokens, hidden_dim, vocab, dtype, gen) -> None:
    from autopar.triton_kernels import linear_cross_entropy

    h = torch.randn(tokens, hidden_dim, device="cuda", dtype=dtype, generator=gen)
    w = torch.randn(vocab, hidden_dim, device="cuda", dtype=dtype, generator=gen) / hidden_dim**0.5
    labels = torch.randint(0, vocab, (tokens,), device="cuda", generator=gen)
    labels[::7] = -100
    one = torch.ones((), device="cuda", dtype=dtype)
    out, grads = _grads_of(lambda h, w: linear_cross_entropy(h, w, labels), [h, w], one)
    ref, ref_grads = _grads_of(lambda h, w: F.cross_entropy(h @ w.T, labels), [h.float(), w.float()], one.float())
    errors = {"loss": _rel_error(out, ref), "dhidden": _rel_error(grads[0], ref_grads[0])}
    errors["dweight"] = _rel_error(grads[1], ref_grads[1])
    # 16-bit: the logits and their gradient are rounded to the input dtype before the matmuls.
    tol = 3e-2 if dtype != torch.float32 else 1e-4
    _report(f"linear_cross_entropy {tokens}x{hidden_dim} vocab {vocab} {dtype}", errors, tol)


def check_correctness() -> None:
    """Each kernel against PyTorch in fp32 from the same (16-bit or fp32) inputs, on the GPU."""
    print("correctness (max error / max |expected|):")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for case in [
        (2, 8, 2, 1000, 1000, 128, True, torch.bfloat16),
        (1, 4, 4, 777, 1500, 64, False, torch.float16),
        (1, 8, 1, 300, 300, 96, True, torch.float32),
        (2, 16, 16, 4096, 4096, 64, True, torch.bfloat16),
    ]:
        _check_attention(*case, gen)
    for case in [(4096, 4096, torch.bfloat16), (1024, 16384, torch.float32), (333, 1000, torch.float16)]:
        _check_norms(*case, gen)
    for case in [(4096, 1024, 32000, torch.bfloat16), (1000, 512, 50257, torch.float32)]:
        _check_cross_entropy(*case, gen)


def _attention_row(batch: int, heads: int, seq: int, head_dim: int, causal: bool) -> list[float]:
    """TFLOP/s: ours forward, SDPA forward, ours forward+backward, SDPA forward+backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from triton.testing import do_bench

    from autopar.triton_kernels import flash_attention

    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn_like(q)
    flops = 4 * batch * heads * seq * seq * head_dim * (0.5 if causal else 1.0)

    def ours():
        return flash_attention(q, k, v, causal=causal)

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    row = []
    with torch.no_grad():
        row += [flops / do_bench(fn) * 1e-9 for fn in (ours, sdpa)]
    for fn in (ours, sdpa):
        ms = do_bench(lambda fn=fn: fn().backward(grad_out), grad_to_none=[q, k, v])
        row.append(3.5 * flops / ms * 1e-9)  # backward is 2.5x the forward
    return row


def bench_attention(seq_lens: list[int], head_dims: list[int]) -> None:
    """TFLOP/s of our forward and forward+backward next to SDPA's flash backend, bf16."""
    print("\nflash attention, bf16, TFLOP/s (batch x heads x seq x head_dim):")
    print(f"  {'shape':28s} {'causal':>6s} {'fwd ours':>9s} {'fwd sdpa':>9s} {'f+b ours':>9s} {'f+b sdpa':>9s}")
    for head_dim in head_dims:
        for causal in (False, True):
            for seq in seq_lens:
                batch, heads = max(1, 16384 // seq), 2048 // head_dim
                row = _attention_row(batch, heads, seq, head_dim, causal)
                shape = f"{batch}x{heads}x{seq}x{head_dim}"
                print(f"  {shape:28s} {causal!s:>6s} " + " ".join(f"{x:9.1f}" for x in row), flush=True)


def _cross_entropy_row(tokens: int, hidden_dim: int, vocab: int) -> list[float]:
    """ms ours, ms materialised, peak GiB ours, peak GiB materialised (forward+backward)."""
    from triton.testing import do_bench

    from autopar.triton_kernels import linear_cross_entropy

    h = torch.randn(tokens, hidden_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden_dim, device="cuda", dtype=torch.bfloat16) / hidden_dim**0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), device="cuda")

    def ours():
        linear_cross_entropy(h, w, labels).backward()

    def materialised():
        F.cross_entropy(h @ w.T, labels).backward()

    row = [do_bench(fn, grad_to_none=[h, w]) for fn in (ours, materialised)]
    for fn in (ours, materialised):
        h.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        row.append((torch.cuda.max_memory_allocated() - base) / 2**30)
    return row


def bench_cross_entropy(token_counts: list[int], hidden_dim: int = 4096, vocab: int = 128256) -> None:
    """Time of forward+backward and peak memory above the inputs, fused op against materialised logits."""
    print(f"\nlinear + cross-entropy, bf16, hidden {hidden_dim}, vocab {vocab} (forward+backward):")
    print(f"  {'tokens':>7s} {'ms ours':>9s} {'ms torch':>9s} {'peak GiB ours':>14s} {'peak GiB torch':>15s}")
    for tokens in token_counts:
        ms_ours, ms_torch, gib_ours, gib_torch = _cross_entropy_row(tokens, hidden_dim, vocab)
        print(f"  {tokens:7d} {ms_ours:9.2f} {ms_torch:9.2f} {gib_ours:14.2f} {gib_torch:15.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m autopar.triton_kernels.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="seq 1k and 4k, head dim 128, one token count")
    parser.add_argument("--skip-correctness", action="store_true", help="only time the kernels")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("autopar.triton_kernels.bench: no CUDA device is available; this benchmark needs a GPU. Nothing to run.")
        return 0
    from autopar.triton_kernels import kernels_interpreted

    if kernels_interpreted():
        print("autopar.triton_kernels.bench: TRITON_INTERPRET is set, so the kernels would run in the interpreter; "
              "unset it to benchmark the compiled kernels.")  # fmt: skip
        return 1
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    if not args.skip_correctness:
        check_correctness()
    if args.quick:
        bench_attention([1024, 4096], [128])
        bench_cross_entropy([8192])
    else:
        bench_attention([1024, 2048, 4096, 8192, 16384], [64, 128])
        bench_cross_entropy([8192, 32768])
    if FAILED:
        print(f"\nFAILED correctness checks: {', '.join(FAILED)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
