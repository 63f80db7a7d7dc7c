"""The pipeline search: cut the layers into stages, give each stage a sub-mesh, choose micro-batches and a schedule.

`search_pipeline` is the entry point; it returns a `PipelineSolution`. The modules, in reading order (each
docstring states its terms and formulas, pointing at the functions that compute them):

    search.py         the entry point: the steps of the search, the plan without a pipeline, the errors
    layout_search.py  the search over configurations (pp, sub-mesh, micro-batches, schedule) and their cuts
    schedules.py      GPipe, 1F1B and interleaved 1F1B: activations kept, slots and bubble, chunk order
    layers.py         the layers to cut in the traced graph, the view of one stage, what crosses a cut
    stage_cost.py     one stage priced by its sharding program: compute, gradient sync, memory
    step_cost.py      the step of a cut: transfers between stages, what overlap hides, T
    pins.py           the pins the search reads, checked before anything is priced
    solution.py       what the search returns: StagePlan, PipelineSolution
"""

from autopar.passes.pipeline.schedules import Schedule
from autopar.passes.pipeline.search import search_pipeline
from autopar.passes.pipeline.solution import PipelineSolution, StagePlan

__all__ = ["PipelineSolution", "Schedule", "StagePlan", "search_pipeline"]
