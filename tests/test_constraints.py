"""`autopar.constraints.Constraints`: the dict a user passes, converted once and read like it behind the edge."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from autopar.constraints import KEYS, Constraints, markdown_table
from autopar.errors import ConfigError


def test_a_dict_converts_once_and_reads_like_the_dict():
    pins = {"zero": 1, "tp": 2, "recompute": "full", "param_placements": {"w": "S(0)"}}
    c = Constraints.of(pins)
    assert Constraints.of(c) is c  # converted once: a Constraints passes through
    assert dict(c) == pins and c == pins  # the unpinned fields are absent
    assert c["tp"] == 2 and c.get("pp") is None and c.get("recompute", "none") == "full"
    assert "zero" in c and "dp" not in c and len(c) == 4
    with pytest.raises(KeyError):
        c["dp"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.tp = 4


def test_more_pins_make_a_new_checked_constraints():
    c = Constraints.of({"tp": 2})
    more = c | {"cp": 2}
    assert isinstance(more, Constraints) and dict(more) == {"tp": 2, "cp": 2} and dict(c) == {"tp": 2}
    with pytest.raises(ConfigError, match="constraints\\['cp'\\]=0"):
        c | {"cp": 0}


def test_nothing_pinned():
    assert dict(Constraints.of(None)) == {} and not Constraints() and Constraints() == {}


@pytest.mark.parametrize(
    "pins, message",
    [
        ({"bogus": 1}, "unknown constraints \\['bogus'\\]"),
        ({"tp": 0}, "expected a positive integer"),
        ({"tp": True}, "expected a positive integer"),
        ({"zero": 4}, "expected 0, 1, 2 or 3"),
        ({"recompute": "some"}, "expected one of none, selective, full"),
        ({"overlap": 1}, "expected True or False"),
        ({"prefetch_depth": -1}, "expected a count of layers"),
        ({"schedule": 3}, "expected a name"),
        ({"tp_min_split": "half"}, "expected a fraction"),
        ({"param_placements": ["R"]}, "expected a dict of parameter names"),
    ],
)
def test_bad_pins_are_config_errors_naming_the_key(pins, message):
    with pytest.raises(ConfigError, match=message):
        Constraints.of(pins)


def test_not_a_dict():
    with pytest.raises(ConfigError, match="constraints must be a dict"):
        Constraints.of([("tp", 2)])


def test_every_field_is_documented_in_the_table():
    table = markdown_table()
    assert all(f"| `{key}` |" in table for key in KEYS)
    assert all(f.metadata["doc"] for f in dataclasses.fields(Constraints))


def test_the_docs_table_is_the_generated_one():
    page = (Path(__file__).resolve().parents[1] / "docs" / "constraints.md").read_text()
    generated = page.split("<!-- generated: python -m autopar.constraints -->\n")[1].split("<!-- end generated -->")[0]
    assert generated == markdown_table(), "docs/constraints.md: paste the output of python -m autopar.constraints"
