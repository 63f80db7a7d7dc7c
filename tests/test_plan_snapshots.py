"""Plans of fixed cases are what the golden files say (wall-clock figures aside): code that moves must not
change what is planned. A change meant to alter plans rewrites them with `python -m tests.plan_snapshots --write`."""

from __future__ import annotations

import pytest

from tests.plan_snapshots import CASES, GOLDEN, snapshot


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_json_is_the_golden_one(name):
    golden = (GOLDEN / f"{name}.json").read_text()
    assert snapshot(name) == golden, f"plan {name} changed; if that is meant, rewrite the golden files"
