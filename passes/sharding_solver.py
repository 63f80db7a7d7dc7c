"""The sharding solver's former module: its names now live in `autopar.passes.sharding`."""

from autopar.passes.sharding.graph import *  # noqa: F403
from autopar.passes.sharding.precision import *  # noqa: F403
from autopar.passes.sharding.program import *  # noqa: F403
from autopar.passes.sharding.report import *  # noqa: F403
from autopar.passes.sharding.reshard import *  # noqa: F403
from autopar.passes.sharding.search import *  # noqa: F403
from autopar.passes.sharding.search import _microbatch_choices, _solution  # noqa: F401
from autopar.passes.sharding.solution import *  # noqa: F403
from autopar.passes.sharding.solver import *  # noqa: F403
