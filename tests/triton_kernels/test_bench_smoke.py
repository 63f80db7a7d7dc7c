"""The GPU benchmark script runs: ``--smoke`` takes every check and timing path of it at tiny sizes.

Without a GPU the kernels run in the Triton interpreter on CPU tensors (``--device cpu``; conftest sets
``TRITON_INTERPRET``), so the script is known to work before it meets a GPU; with one (and no
``TRITON_INTERPRET``) the same smoke run uses CUDA. About 15 s on two CPU cores.
"""

from __future__ import annotations

import re

import pytest

import autopar.triton_kernels
from autopar.triton_kernels import bench


def _section(text: str, title: str) -> list[str]:
    """The indented lines under the line that starts with `title`."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    body = []
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        body.append(line)
    return body


@pytest.mark.integration
def test_smoke_run_checks_and_times_every_kernel(device, capsys):
    rc = bench.main(["--device", device.type, "--smoke"])
    out = capsys.readouterr().out
    assert rc == 0, out

    checks = _section(out, "correctness")
    assert all(line.startswith("  ok   ") for line in checks), out
    kinds = [line.split()[1] for line in checks]
    assert kinds.count("flash_attention") == len(bench.SMOKE_ATTENTION_CASES)
    assert kinds.count("rms_norm") == kinds.count("layer_norm") == len(bench.SMOKE_NORM_CASES)
    assert kinds.count("linear_cross_entropy") == len(bench.SMOKE_CROSS_ENTROPY_CASES)
    # GQA, causal and unequal query / key lengths are among the attention checks
    shapes = [re.search(r"(\d+)x(\d+)/(\d+)x(\d+)x(\d+)x\d+ causal=(\w+)", line).groups() for line in checks[:3]]
    assert any(hq != hkv for _, hq, hkv, *_ in shapes)
    assert any(sq != sk for *_, sq, sk, _ in shapes) and {c for *_, c in shapes} == {"True", "False"}

    attention = _section(out, "flash attention")[1:]  # after the header
    assert len(attention) == 4  # two sequence lengths, causal and not
    for line in attention:
        shape, causal, *rates = line.split()
        assert re.fullmatch(r"\d+x\d+x\d+x32", shape) and causal in ("True", "False"), line
        assert len(rates) == 4 and all(float(r) > 0 for r in rates), line

    (row,) = _section(out, "linear + cross-entropy")[1:]
    fields = row.split()
    assert int(fields[0]) > 0 and float(fields[1]) > 0 and float(fields[2]) > 0, row
    if device.type == "cpu":
        assert fields[3:] == ["n/a", "n/a"]  # peak memory is counted by CUDA's allocator only
    else:
        assert all(float(x) >= 0 for x in fields[3:]), row


def test_a_failed_check_sets_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(
        bench, "check_correctness", lambda device, smoke: bench._report("bad kernel", {"out": 1.0}, 1e-3)
    )
    monkeypatch.setattr(bench, "bench_attention", lambda *a, **k: None)
    monkeypatch.setattr(bench, "bench_cross_entropy", lambda *a, **k: None)
    monkeypatch.setattr(autopar.triton_kernels, "kernels_interpreted", lambda: True)
    assert bench.main(["--device", "cpu", "--smoke"]) == 1
    assert "FAILED correctness checks: bad kernel" in capsys.readouterr().out
    # failures do not carry over to the next run in the same process
    monkeypatch.setattr(bench, "check_correctness", lambda device, smoke: None)
    assert bench.main(["--device", "cpu", "--smoke"]) == 0


def test_cpu_needs_the_interpreter(monkeypatch, capsys):
    monkeypatch.setattr(autopar.triton_kernels, "kernels_interpreted", lambda: False)
    assert bench.main(["--device", "cpu", "--smoke"]) == 2
    assert "TRITON_INTERPRET=1" in capsys.readouterr().out


def test_device_choices():
    with pytest.raises(SystemExit):
        bench.main(["--device", "tpu"])
