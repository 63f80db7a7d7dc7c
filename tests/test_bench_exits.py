"""`autopar bench exits`: the suite refuses unknown program kinds, reports what it counted, and one launch of
its user-style script per kind exits 0 (slow: each launch starts torchrun and compiles)."""

from __future__ import annotations

import pytest

from autopar.bench import exits
from autopar.errors import ConfigError


def test_unknown_kinds_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="unknown program kinds \\['ddp'\\]"):
        exits.run(tmp_path, launches=1, kinds=("ddp",))


def test_the_report_counts_failed_launches():
    doc = {
        "environment": {k: "x" for k in ("autopar_version", "torch_version", "python_version", "processor")}
        | {"cpu_count": 2, "platform": "p", "time_utc": "t"},
        "kinds": {
            "sharded": {
                "launches": 3,
                "failed": 1,
                "seconds": [1.0, 2.0, 3.0],
                "failures": [{"launch": 2, "status": -6, "tail": "terminate called without an active exception"}],
            },
        },
    }
    text = exits.markdown(doc)
    assert "| sharded | 3 | 1 | 2 s |" in text and "launch 2: status -6" in text and "terminate called" in text


@pytest.mark.slow
@pytest.mark.subprocess
def test_one_launch_per_kind_exits_cleanly(tmp_path):
    doc = exits.run(tmp_path, launches=1, show_progress=False)
    for kind, result in doc["kinds"].items():
        assert result["failed"] == 0, (kind, result["failures"])
    assert (tmp_path / "exits.json").is_file() and (tmp_path / "exits.md").is_file()
