"""The layers of the package, checked on its source: no module imports one of a layer above its own, whether the
import sits at the top of the file or inside a function, and packages of one layer import each other one way.

The layers, bottom up (`docs/architecture.md` draws them):

0. base: errors, units, compat, constraints, the planning time limit, presets, the Triton kernels, and the collectives with a timeout
   (`runtime/collectives.py` imports only compat and errors; it lives beside the programs that use most of it)
1. cost model and the model's graph: cost_model, cluster, trace, ir, the context-parallel algorithms
2. plans and what describes them: plan, rationale, explain and the report_* sections and charts, program_comm,
   the memory manager
3. passes: the solvers and rewrites, flops, cp_search, expert_parallel, ep_search
4. programs: runtime, checkpoint, data, loss, loop
5. planning: input_validation, tracing, plan_build, planning, progress
6. the surface and the tools that run everything: api, the package itself, cli, bench, and the memory checks
   that launch programs
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir)
FOLDERS = {
    "autopar": "autopar",
    "passes": "autopar.passes",
    "cost_model": "autopar.cost_model",
    "triton_kernels": "autopar.triton_kernels",
}
LAYERS = (
    (
        "autopar.errors",
        "autopar.units",
        "autopar.compat",
        "autopar.constraints",
        "autopar.guard_options",
        "autopar.time_limit",
        "autopar.presets",
        "autopar.triton_kernels",
        "autopar.runtime.collectives",
    ),
    (
        "autopar.cost_model",
        "autopar.cluster",
        "autopar.trace",
        "autopar.trace_cache",
        "autopar.ir",
        "autopar.context_parallel",
    ),
    (
        "autopar.plan",
        "autopar.rationale",
        "autopar.explain",
        "autopar.report_charts",
        "autopar.report_costs",
        "autopar.report_experts",
        "autopar.report_layers",
        "autopar.report_choice",
        "autopar.report_figures",
        "autopar.program_comm",
        "autopar.memory",
    ),
    ("autopar.passes", "autopar.flops", "autopar.cp_search", "autopar.expert_parallel", "autopar.ep_search"),
    ("autopar.runtime", "autopar.checkpoint", "autopar.data", "autopar.loss", "autopar.loop"),
    ("autopar.input_validation", "autopar.tracing", "autopar.plan_build", "autopar.planning", "autopar.progress"),
    (
        "autopar",
        "autopar.api",
        "autopar.__main__",
        "autopar.cli",
        "autopar.bench",
        "autopar.memory.check",
        "autopar.memory.bench",
        "autopar.memory.__main__",
    ),
)
# imports against the layers that stand, each with its reason; none may be added
KNOWN_UPWARD = {
    ("autopar.cost_model.calibrate", "autopar.passes.lower"): "the profiled estimator times the graph the "
    "programs run, lowered by the pass itself (imported inside the measurement)",
}
# package pairs of one layer that import each other today (a cycle between packages); none may be added
KNOWN_CYCLES = {frozenset({"autopar.runtime", "autopar.checkpoint"})}


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in FOLDERS.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(REPO / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> list[tuple[str, int]]:
    """(module imported, line) of every import of a package module in `path`, in functions too; not those under
    `if TYPE_CHECKING:`, which name types for annotations and never run."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        found += [(n, node.lineno) for n in names if n in modules]
    return found


def _place(name: str) -> tuple[int, str]:
    """The layer of module `name` and the entry of LAYERS that put it there (the longest that names it)."""
    hits = [(len(p), i, p) for i, layer in enumerate(LAYERS) for p in layer if name == p or name.startswith(p + ".")]
    assert hits, f"{name} is in no layer: add it to LAYERS in {Path(__file__).name}"
    _, layer, entry = max(hits)
    return layer, entry


def test_no_module_imports_a_layer_above_its_own():
    modules = _modules()
    upward = []
    for name, path in sorted(modules.items()):
        mine = _place(name)[0]
        for target, line in _imports(name, path, modules):
            theirs = _place(target)[0]
            if theirs > mine and (name, target) not in KNOWN_UPWARD:
                upward.append(f"{path.relative_to(REPO)}:{line} (layer {mine}) imports {target} (layer {theirs})")
    assert not upward, "imports against the layers:\n" + "\n".join(upward)


def test_packages_of_one_layer_import_each_other_one_way():
    modules = _modules()
    edges = set()
    for name, path in modules.items():
        layer, entry = _place(name)
        for target, _ in _imports(name, path, modules):
            t_layer, t_entry = _place(target)
            if t_layer == layer and t_entry != entry:
                edges.add((entry, t_entry))
    cycles = {frozenset(e) for e in edges if (e[1], e[0]) in edges}
    assert cycles <= KNOWN_CYCLES, f"new cycles between packages: {sorted(map(sorted, cycles - KNOWN_CYCLES))}"


def test_layers_name_existing_modules():
    modules = _modules()
    missing = [p for layer in LAYERS for p in layer if p not in modules]
    assert not missing, f"LAYERS names modules that do not exist: {missing}"
