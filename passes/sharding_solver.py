"""The sharding solver's former module: its names now live in `autopar.passes.sharding`."""

from autopar.passes.sharding.program import *  # noqa: F403
from autopar.passes.sharding.program import _microbatch_choices, _solution  # noqa: F401
