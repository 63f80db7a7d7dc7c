"""`autopar bench overhead`: the compute-free part on cpu:2, checked for structure and invariants (no timing
asserted beyond "measured, positive, not a constant"), and the op count it divides by."""

from __future__ import annotations

import warnings

import pytest
import torch

from autopar.bench import overhead
from autopar.bench.execution import RunSettings, count_ops

KINDS = ("eager", "ddp", "autopar-tp", "autopar-zero1")


def test_count_ops_counts_every_aten_op_of_a_step():
    x = torch.ones(3, requires_grad=True)

    def step():
        (x * 2).sum().backward()

    # forward: mul, sum; backward: at least the expand of sum's gradient and mul's gradient
    n = count_ops(step)
    assert n >= 4
    assert count_ops(lambda: [step() for _ in range(2)]) == 2 * n  # counted, not a constant


@pytest.mark.slow
@pytest.mark.distributed
def test_overhead_suite_times_each_kind_per_step_and_per_op(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        doc = overhead.run(
            tmp_path,
            cluster="cpu:2",
            quick=True,
            show_progress=False,
            kinds=KINDS,
            settings=RunSettings(
                1, 2, 2, 1, min_measured_s=0.1, max_repetitions=3, measure_exposed=False, count_ops=True
            ),
        )
    methods = doc["compute_free"]["methods"]
    assert set(methods) == set(KINDS)
    times = []
    for name, m in methods.items():
        assert m["ops_per_step"] > 0, name
        assert m["host_time_per_op_s"] == pytest.approx(m["median_step_time_s"] / m["ops_per_step"]), name
        assert m["paired_per_op_ratio_to_eager"] > 0 and m["paired_ratio_to_ddp"]["median"] > 0, name
        times += m["times_s"]
    # the base's ratios are to itself
    assert methods["eager"]["paired_per_op_ratio_to_eager"] == 1.0
    assert methods["ddp"]["paired_ratio_to_ddp"] == {"median": 1.0, "min": 1.0, "max": 1.0}
    assert methods["autopar-tp"]["mesh"] == {"dp": 1, "tp": 2} and methods["autopar-tp"]["program"] == "sharded"
    assert methods["autopar-zero1"]["zero_stage"] == 1
    assert len(set(times)) > 1  # measured
    assert doc["small_llama"] is None  # quick: the compute-free part only
    md = (tmp_path / "overhead.md").read_text()
    assert "us/op" in md and "autopar-zero1" in md and (tmp_path / "overhead.json").exists()
