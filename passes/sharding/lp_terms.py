"""One objective or memory term of a sharding program, `coef * var`, made the cheap way.

PuLP makes `coef * var` as three expressions (the variable as an expression, an empty copy, the product); the
programs make hundreds of thousands of such terms. `scaled` makes the one expression PuLP's product gives (the same
coefficient, the same constant, nothing for a zero coefficient), so the programs HiGHS solves are unchanged.
"""

from __future__ import annotations

import math

from pulp import LpAffineExpression, LpVariable


def scaled(coef: float, var: LpVariable) -> LpAffineExpression:
    """`coef * var` as PuLP makes it, in one expression instead of three."""
    if not math.isfinite(coef):
        return coef * var  # PuLP's own error
    e = LpAffineExpression()
    if coef != 0:
        e.constant = 0 * coef
        e[var] = coef * 1
    return e
