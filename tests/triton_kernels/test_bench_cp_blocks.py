"""The context-parallel block benchmark runs (``--smoke`` at tiny sizes, the kernels interpreted without a GPU)
and, without a GPU, skips with a message rather than measuring anything."""

from __future__ import annotations

import pytest
import torch

from autopar.bench import cp_blocks


def test_zigzag_rank_pairs_are_balanced():
    # rank r holds chunks r and 2c-1-r: under a causal mask every rank meets 2c+1 (query, key) chunk pairs,
    # two of them diagonal, which is what the benchmark's per-rank time assumes
    for c in (2, 4, 8):
        for r in range(c):
            pairs = cp_blocks.zigzag_pairs(c, r)
            assert len(pairs) == 2 * c + 1
            assert [(q, k) for q, k, causal in pairs if causal] == [(r, r), (2 * c - 1 - r, 2 * c - 1 - r)]
            assert all(k <= q for q, k, _ in pairs)
    assert cp_blocks.zigzag_pairs(2) == [(0, 0, True), (3, 0, False), (3, 1, False), (3, 2, False), (3, 3, True)]


@pytest.mark.integration
def test_smoke_run_checks_the_merge_and_prints_a_row(device, capsys):
    rc = cp_blocks.main(["--device", device.type, "--smoke"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "  ok   zig-zag rank 0 of c=2" in out
    (row,) = [line for line in out.splitlines() if line.strip().startswith("64 ")]
    fields = row.split()
    assert fields[:3] == ["64", "2", "16"] and fields[-1] == "n/a", row  # 16-token chunks: outside the target
    assert all(float(x) > 0 for x in fields[3:10]), row


@pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CUDA is present: main() would time the GPU instead of printing its no-CUDA message",
)
def test_without_cuda_it_skips_with_a_message(capsys):
    assert cp_blocks.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA device" in out and "Nothing was measured" in out
