"""`autopar bench compile --matrix`: its cases, its table, and a case that runs past its limit."""

from __future__ import annotations

import pytest

from autopar.bench import compile_matrix as cm
from autopar.errors import ConfigError


def _world(cluster: str) -> int:
    from autopar.cluster import ClusterSpec

    return ClusterSpec.parse(cluster).world_size


def test_the_matrix_spans_what_the_suite_promises():
    worlds = {_world(c.cluster) for c in cm.CASES}
    assert min(worlds) == 8 and max(worlds) == 4096
    assert {c.seq_len for c in cm.CASES} >= {4096, 32768, 131072}
    assert any(c.pins for c in cm.CASES) and any(not c.pins for c in cm.CASES)
    assert any(c.model.startswith("mixtral") for c in cm.CASES)
    assert {c.seq_len for c in cm.CASES if c.model == "llama3-405b" and not c.pins} >= {8192, 131072}
    assert len(cm.BY_NAME) == len(cm.CASES)  # names are unique


def test_unknown_case_names_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="nope"):
        cm.run(tmp_path, names=["nope"], show_progress=False)


def test_cases_picked_on_the_command_line_reach_the_suite(monkeypatch, tmp_path):
    from autopar.cli import main

    calls = []
    monkeypatch.setattr(cm, "run", lambda out, **kw: calls.append(kw))
    assert main(["bench", "compile", "--cases", "405b-1024, 7b-8", "--out", str(tmp_path), "--quiet"]) == 0
    assert main(["bench", "compile", "--matrix", "--out", str(tmp_path), "--quiet"]) == 0
    assert [c["names"] for c in calls] == [["405b-1024", "7b-8"], None]


# what `bench.common.environment` records (it asks the system, a process on some platforms)
ENV = dict.fromkeys(
    ("autopar_version", "torch_version", "python_version", "processor", "cpu_count", "platform", "time_utc"), "x"
)


def test_the_table_counts_cases_against_the_targets():
    base = {"model": "m", "cluster": "8xH100-80GB", "global_batch_size": 8, "seq_len": 4096, "pins": {}}
    rows = [
        base | {"name": "a", "status": "ok", "wall_s": 3.0, "plan_cpu_s": 2.0, "mesh": {"dp": 8}},
        base | {"name": "b", "status": "ok", "wall_s": 12.0, "plan_cpu_s": 11.0, "mesh": {"dp": 8}},
        base | {"name": "c", "status": "killed after 60 s", "wall_s": 60.0, "pins": {"tp": 8}},
    ]
    text = cm.markdown({"environment": ENV, "timeout_s": 60, "cases": rows})
    # two planned, one under 10 s, median of the planned (3 + 12) / 2
    assert "2 of 3 cases planned; under 10 s: 1; median wall 7.5 s (of those planned)" in text
    assert "pinned tp=8" in text and "killed after 60 s" in text


@pytest.mark.subprocess
def test_a_case_past_its_limit_is_killed_and_says_so():
    row = cm.run_case(cm.BY_NAME["7b-8"], timeout_s=0.5)
    assert row["status"] == "killed after 0.5 s"
    assert row["wall_s"] >= 0.5
