"""Intra-op sharding: one integer program per (dp, tp) mesh, and the search over meshes that picks the plan.

Read in this order:

- `program`: the integer program of one mesh; its docstring is the math, each family pointing at its method;
  the families it builds live in `cost_rows` (compute, edges, sync and optimizer by stage, offload),
  `overlap_rows` (what overlapping programs leave exposed) and `memory_rows` (the memory row, recompute modes);
- `search`: every mesh, micro-batch count and recompute mode, solved cheapest bound first (`solve_sharding`);
- `solver`: how one program is solved, and its result read;
- `groups`: the decision groups of a mesh, their strategies, edges and compute;
- `prices`: the program's coefficients by group, strategy and ZeRO stage, asked of
  - `sync` (data-axis gradient sync and gathers, as `autopar.program_comm.ProgramComm` declares them),
  - `offload` (host offload and the offload program's chunks),
  - `memory` (state bytes, activations, recompute), `reshard` (tensor-axis resharding);
- `graph`: mesh-independent facts about the traced graph; `report`: what a solved layout says about itself;
  `precision`, `solution`: small types.
"""

from autopar.passes.sharding.precision import Precision
from autopar.passes.sharding.program import ShardingProgram
from autopar.passes.sharding.search import solve_sharding
from autopar.passes.sharding.solution import MeshResult, ShardingSolution

__all__ = ["MeshResult", "Precision", "ShardingProgram", "ShardingSolution", "solve_sharding"]
