"""The pipeline search: cut the layers into stages, give each stage a sub-mesh, choose micro-batches and a schedule.

`search_pipeline` is the entry point; it returns a `PipelineSolution`.
"""

from autopar.passes.pipeline.schedules import Schedule
from autopar.passes.pipeline.search import search_pipeline
from autopar.passes.pipeline.solution import PipelineSolution, StagePlan

__all__ = ["PipelineSolution", "Schedule", "StagePlan", "search_pipeline"]
