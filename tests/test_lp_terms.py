"""`lp_terms.scaled` makes the expression PuLP's `coef * var` makes, so the programs HiGHS solves are unchanged."""

from __future__ import annotations

import math

import pulp
import pytest

from autopar.passes.sharding.lp_terms import scaled


@pytest.mark.parametrize("coef", [0, 0.0, 1, 7, 2.5, -3.25, 1e-300])
def test_scaled_is_pulps_product(coef):
    x = pulp.LpVariable("x")
    want, got = coef * x, scaled(coef, x)
    assert list(got.items()) == list(want.items())
    assert [type(c) for c in got.values()] == [type(c) for c in want.values()]
    assert got.constant == want.constant and type(got.constant) is type(want.constant)
    assert str(pulp.lpSum([got, scaled(2.0, x)])) == str(pulp.lpSum([want, 2.0 * x]))


def test_scaled_refuses_what_pulp_refuses():
    x = pulp.LpVariable("x")
    for bad in (math.inf, math.nan):
        with pytest.raises(pulp.PulpError):
            scaled(bad, x)
