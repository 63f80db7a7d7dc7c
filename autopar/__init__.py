"""autopar: a compiler-style auto-parallelizer for PyTorch training.

`autopar.plan(model, cluster, ...)` traces a model, prices every way to split it across the
cluster and returns the fastest plan that fits; `autopar.compile(...)` turns a plan into a
parallel program that trains on `torch.distributed`.
"""

from autopar.api import compare, compile, plan
from autopar.checkpoint import latest_checkpoint
from autopar.cluster import ClusterSpec, parse_bytes
from autopar.constraints import Constraints
from autopar.errors import (
    AutoparError,
    ConfigError,
    InfeasiblePlanError,
    LoweringError,
    NonFiniteError,
    PlanFormatError,
    TraceError,
)
from autopar.plan import Plan, Predicted

__version__ = "0.1.0"

__all__ = [
    "AutoparError",
    "ClusterSpec",
    "ConfigError",
    "Constraints",
    "InfeasiblePlanError",
    "LoweringError",
    "NonFiniteError",
    "Plan",
    "PlanFormatError",
    "Predicted",
    "TraceError",
    "compare",
    "compile",
    "latest_checkpoint",
    "parse_bytes",
    "plan",
]
