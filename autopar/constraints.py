"""The pins a user puts on a plan: one frozen, documented type, read once at the API's edge.

`plan(..., constraints={"tp": 2, "zero": 1})` still takes a dict; `Constraints.of` checks it once and every
layer behind the edge reads the same frozen `Constraints`. Each field carries its own documentation and, for
those the command line offers, its flag: `autopar plan --help` and the table of `docs/constraints.md` are
generated from the fields (`cli_flags`, `markdown_table`; `python -m autopar.constraints` prints the table), so
the three cannot drift apart.

A field left at None is not pinned: the planner chooses. A `Constraints` reads like the dict it replaces
(`c["tp"]`, `c.get("recompute", "none")`, `"overlap" in c`, `dict(c)`): the unpinned fields are absent.
`c | {"cp": 2}` is a new `Constraints` with more pins, checked like the first.

This module imports nothing heavier than the standard library, so that `autopar plan --help` stays fast.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping

from autopar.errors import ConfigError

RECOMPUTE_MODES = ("none", "selective", "full")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")  # the values of passes.pipeline.Schedule
CP_ATTENTIONS = ("allgather", "ring", "alltoall")


def _pin(
    doc: str, *, kind: str, flag: bool = True, choices: tuple = (), default: str = "searched"
) -> dataclasses.Field:
    """A field of `Constraints`: unpinned by default; `kind` names the check `Constraints.of` applies
    ("count": a positive integer; "layers": 0 or more; "stage": 0-3; "choice": one of `choices`; "name": a
    string, which the solver checks against the model, `choices` listing the values for the flag and the docs;
    "fraction": a number; "switch": True or False; "placements": a dict of names to placements); `flag`: offered
    by `autopar plan` as --<name with dashes>; `default`: what the planner does when it is not pinned, for the docs
    ("searched": it chooses)."""
    meta = {"doc": doc, "kind": kind, "flag": flag, "choices": choices, "default": default}
    return dataclasses.field(default=None, metadata=meta)


@dataclasses.dataclass(frozen=True, eq=False)
class Constraints(Mapping):
    """What a plan must hold; every field None (unpinned) by default."""

    tp: int | None = _pin("size of the tensor-parallel axis; a pinned tp splits weights", kind="count")
    dp: int | None = _pin("size of the data-parallel axis", kind="count")
    cp: int | None = _pin(
        "context-parallel axis size ([long sequences](long-sequences.md))",
        kind="count",
        default="searched on long sequences, else 1",
    )
    ep: int | None = _pin(
        "expert-parallel group size: each mixture-of-experts layer's experts split over groups of this many "
        "data-parallel ranks; must divide dp and the number of experts ([mixture of experts](moe.md))",
        kind="count",
        default="searched for models with experts, else 1",
    )
    cp_attention: str | None = _pin(
        "cp attention algorithm", kind="name", choices=CP_ATTENTIONS, default="the cheapest that fits"
    )
    zero: int | None = _pin("ZeRO stage: what is sharded over the data axis (dp x cp)", kind="stage")
    pp: int | None = _pin(
        "pipeline stages; 1 is no pipeline", kind="count", default="searched on clusters of several GPU nodes, else 1"
    )
    num_microbatches: int | None = _pin("gradient accumulation steps per data-parallel rank", kind="count")
    micro_batch_size: int | None = _pin("samples per micro-batch per rank", kind="count")
    schedule: str | None = _pin("pipeline schedule", kind="name", choices=SCHEDULES)
    virtual_stages: int | None = _pin("model chunks per device (`interleaved_1f1b`)", kind="count")
    recompute: str | None = _pin(
        "activation recompute: `selective` recomputes attention internals, `full` whole layers",
        kind="choice",
        choices=RECOMPUTE_MODES,
    )
    tp_min_split: float | None = _pin(
        "fraction of the layer matmul weights' elements (attention, MLP, experts) a tensor axis must split",
        kind="fraction",
        flag=False,
        default="1",
    )
    param_placements: dict | None = _pin(
        'parameter name -> placement on the tensor axis, `"R"` or `"S(dim)"`, e.g. '
        '`{"model.embed_tokens.weight": "S(0)"}`',
        kind="placements",
        flag=False,
        default="none",
    )
    grad_reduce: str | None = _pin(
        'format mixed precision all-reduces ZeRO-0 gradients in: `"fp32"` or the compute format, e.g. `"bf16"`',
        kind="name",
        flag=False,
        default='`"fp32"`',
    )
    overlap: bool | None = _pin(
        "issue collectives from backward and ahead of use, and price that; False runs and prices them synchronously",
        kind="switch",
        flag=False,
        default="True",
    )
    prefetch_depth: int | None = _pin(
        "layers ahead that ZeRO-split weights are gathered; 0 gathers each weight when it is read",
        kind="layers",
        flag=False,
        default="1",
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check(f, getattr(self, f.name))

    @classmethod
    def of(cls, value) -> Constraints:
        """`value` (None, a dict of pins, or a Constraints) as a Constraints; ConfigError names a key it does not
        know or a value of the wrong kind."""
        if value is None:
            return cls()
        if isinstance(value, Constraints):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"constraints must be a dict such as {{'tp': 2, 'zero': 1}}, got {type(value).__name__}")
        unknown = set(value) - set(KEYS)
        if unknown:
            raise ConfigError(f"unknown constraints {sorted(map(str, unknown))}: supported are {sorted(KEYS)}")
        return cls(**value)

    # ------------------------------------------------------------------ read like the dict it replaces
    def __getitem__(self, key: str):
        value = getattr(self, key, None) if key in KEYS else None
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return (k for k in KEYS if getattr(self, k) is not None)

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __or__(self, other) -> Constraints:
        return Constraints.of(dict(self) | dict(Constraints.of(other)))

    def __repr__(self) -> str:
        return f"Constraints({', '.join(f'{k}={v!r}' for k, v in self.items())})"


KEYS = tuple(f.name for f in dataclasses.fields(Constraints))


def _check(f: dataclasses.Field, v) -> None:
    """ConfigError unless `v` is None or of the kind field `f` declares."""
    if v is None:
        return
    kind, key = f.metadata["kind"], f.name
    integer = isinstance(v, int) and not isinstance(v, bool)
    if kind == "count" and not (integer and v >= 1):
        expected = "a positive integer (or None to let the planner choose)"
    elif kind == "layers" and not (integer and v >= 0):
        expected = "a count of layers, 0 (gather each parameter when it is used) or more"
    elif kind == "stage" and not (integer and v in (0, 1, 2, 3)):
        expected = "0, 1, 2 or 3"
    elif kind == "choice" and v not in f.metadata["choices"]:
        expected = f"one of {', '.join(f.metadata['choices'])}"
    elif kind == "name" and not isinstance(v, str):
        expected = "a name (a string)"
    elif kind == "fraction" and (isinstance(v, bool) or not isinstance(v, (int, float))):
        expected = "a fraction between 0 and 1"
    elif kind == "switch" and not isinstance(v, bool):
        expected = "True or False"
    elif kind == "placements" and not isinstance(v, Mapping):
        expected = "a dict of parameter names to placements ('R' or 'S(dim)')"
    else:
        return
    raise ConfigError(f"constraints[{key!r}]={v!r}: expected {expected}")


def cli_flags() -> list[tuple[str, dict]]:
    """`(flag, argparse keywords)` of each constraint `autopar plan` offers, in field order."""
    out = []
    for f in dataclasses.fields(Constraints):
        if not f.metadata["flag"]:
            continue
        doc = f.metadata["doc"].split(" ([")[0].replace("`", "")  # the docs' links and code marks, not in --help
        kw: dict = {"dest": f.name, "help": f"pin the {doc}"}
        if f.metadata["choices"]:
            kw["choices"] = list(f.metadata["choices"])
        elif f.metadata["kind"] == "stage":
            kw |= {"type": int, "choices": [0, 1, 2, 3]}
        else:
            kw["type"] = int
        out.append(("--" + f.name.replace("_", "-"), kw))
    return out


def markdown_table() -> str:
    """The table of `docs/constraints.md`: each constraint, its values, what happens unpinned, its meaning, its
    command-line flag."""
    rows = ["| key | values | default | meaning | flag |", "|---|---|---|---|---|"]
    values = {
        "count": "int >= 1",
        "layers": "int >= 0",
        "stage": "int 0-3",
        "name": "str",
        "fraction": "float 0-1",
        "switch": "bool",
        "placements": "dict",
    }
    for f in dataclasses.fields(Constraints):
        md = f.metadata
        flag = f"`--{f.name.replace('_', '-')}`" if md["flag"] else ""
        shown = ", ".join(f'`"{c}"`' for c in md["choices"]) if md["choices"] else values[md["kind"]]
        rows.append(f"| `{f.name}` | {shown} | {md['default']} | {md['doc']} | {flag} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(markdown_table(), end="")
