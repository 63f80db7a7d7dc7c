"""The README and the pages under docs/: their examples run or compile, their commands and pointers exist.

- Every page under docs/ starts with an example (after its title). The first ```python block of a page runs here
  when `FIRST_EXAMPLE` says "run" (plans of presets, a few seconds on CPU); every ```python block compiles.
- Every command of a ```bash block names something real: `autopar ...` parses with the CLI's own parser,
  `python -m M` names a module, `make T` a Makefile target, a script or example a file of the tree.
- A ```yaml block is a cluster file and loads as one.
- Every path of the tree a page names (in backticks or as a link) exists, and every `autopar.x.y` it names
  imports or is an attribute of what imports.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
import shlex
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(p.relative_to(ROOT).as_posix() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

# How the first example of each page is checked: "run" executes its first ```python block here; any other value
# says why that block only compiles, or that the page's example is a shell block (checked by `test_shell_commands`).
FIRST_EXAMPLE = {
    "README.md": "run",
    "docs/architecture.md": "run",
    "docs/benchmarks.md": "shell",
    "docs/checkpoints.md": "compiles only: it trains under torchrun from a Hugging Face folder",
    "docs/constraints.md": "run",
    "docs/cost-model.md": "run",
    "docs/gpu.md": "shell",
    "docs/long-sequences.md": "run",
    "docs/moe.md": "run",
    "docs/programs.md": "run",
    "docs/solver.md": "run",
    "docs/testing.md": "shell",
    "docs/training-loop.md": "compiles only: it trains under torchrun (examples/finetune.py runs it all)",
}
README_MAX_LINES = 100  # the front door: what autopar is, the two commands, an example, what to read next
# the top-level entries of the tree: a path in a page that starts with one of them must exist
TREE = ("autopar", "passes", "cost_model", "triton_kernels", "tests", "examples", "scripts", "docs", ".ci")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _blocks(page: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(_text(page)) if kind == lang]


def _prose(page: str) -> str:
    """The page without its fenced blocks."""
    return FENCE.sub("", _text(page))


def test_every_page_says_how_its_example_is_checked():
    assert sorted(FIRST_EXAMPLE) == PAGES


def test_readme_is_short():
    lines = _text("README.md").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines: move details to a page under docs/"


@pytest.mark.parametrize("page", [p for p in PAGES if p.startswith("docs/")])
def test_page_starts_with_an_example(page):
    lines = [line for line in _text(page).splitlines() if line.strip()]
    assert lines[0].startswith("# "), f"{page} starts with its title"
    assert lines[1].startswith("```"), f"{page}: the line after the title opens a code block, got {lines[1]!r}"
    first_kind = FENCE.search(_text(page)).group(1)
    expected = "bash" if FIRST_EXAMPLE[page] == "shell" else "python"
    assert first_kind == expected, f"{page}: FIRST_EXAMPLE says {FIRST_EXAMPLE[page]!r}, the page opens {first_kind}"


@pytest.mark.integration  # plans of presets: 2 to 20 s a page
@pytest.mark.parametrize("page", [p for p, how in FIRST_EXAMPLE.items() if how == "run"])
def test_first_python_example_runs(page, capsys):
    source = _blocks(page, "python")[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ops without a sharding rule warn; the example is checked for errors
        exec(compile(source, f"{page} (first python block)", "exec"), {"__name__": "__docs__"})
    assert capsys.readouterr().out.strip(), f"{page}: the example prints what it shows"


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_compile(page):
    for i, source in enumerate(_blocks(page, "python")):
        compile(source, f"{page} (python block {i})", "exec")


def _commands(block: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments and environment assignments dropped."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words = words[1:]
        if words:
            out.append(words)
    return out


def _module_exists(name: str) -> bool:
    if (ROOT / (name.replace(".", "/") + ".py")).is_file():  # tests.plan_snapshots and the like
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))


def _check_script(path: str) -> None:
    """A script of the tree exists; a bare name (`train.py`) is the user's own file."""
    if "/" in path:
        assert (ROOT / path).is_file(), f"no file {path}"


def _check_autopar_words(args: list[str]) -> None:
    """A command quoted in the text may leave arguments out (`autopar plan ... --compare LAYOUT`): its subcommand
    and every flag it names exist."""
    from autopar.cli import build_parser

    subparsers = next(a for a in build_parser()._actions if a.choices and isinstance(a.choices, dict))
    assert args[0] in subparsers.choices, f"no subcommand {args[0]!r}"
    flags = subparsers.choices[args[0]]._option_string_actions
    for word in args[1:]:
        if word.startswith("--"):
            flag = word.split("=")[0]
            names = [flag.replace("[no-]", ""), flag.replace("[no-]", "no-")] if "[no-]" in flag else [flag]
            assert all(n in flags for n in names), f"`autopar {args[0]}` has no flag {flag}"


def _check_command(words: list[str], *, whole: bool = True) -> None:
    from autopar.cli import build_parser

    program, args = words[0], words[1:]
    if program == "autopar" and whole:
        build_parser().parse_args(args)  # SystemExit on a flag or suite the CLI does not have
    elif program == "autopar":
        _check_autopar_words(args)
    elif program.endswith("python") or program == "python3":
        if args[0] == "-m":
            assert _module_exists(args[1]), f"no module {args[1]}"
        else:
            _check_script(args[0])
    elif program == "make":
        assert args[0] in _make_targets(), f"no Makefile target {args[0]}"
    elif program in ("bash", "torchrun"):  # `torchrun --standalone --nproc_per_node 2` quoted alone names no script
        for script in [a for a in args if a.endswith((".sh", ".py"))]:
            _check_script(script)
    else:
        raise AssertionError(f"a command this test does not know how to check: {' '.join(words)}")


@pytest.mark.parametrize("page", PAGES)
def test_shell_commands(page):
    commands = [(c, True) for block in _blocks(page, "bash") for c in _commands(block)]
    for inline in INLINE.findall(_prose(page)):  # commands quoted in the text
        if re.match(r"^(autopar|python|make|bash|torchrun|[A-Z_]+=\S+ python) ", inline):
            commands += [(c, False) for c in _commands(inline)]
    for words, whole in commands:
        try:
            _check_command(words, whole=whole)
        except SystemExit as e:
            raise AssertionError(f"{page}: `{' '.join(words)}` does not parse (exit {e.code})") from None
        except AssertionError as e:
            raise AssertionError(f"{page}: `{' '.join(words)}`: {e}") from None


@pytest.mark.parametrize("page", [p for p in PAGES if _blocks(p, "yaml")])
def test_yaml_blocks_are_cluster_files(page):
    import yaml

    from autopar.cluster import ClusterSpec

    for block in _blocks(page, "yaml"):
        ClusterSpec.from_overrides(yaml.safe_load(block))


def _paths(page: str) -> set[str]:
    found = set()
    for token in INLINE.findall(_prose(page)):
        token = token.split()[0]
        if "/" in token and token.split("/")[0] in TREE and not re.search(r"[<>*]", token):
            found.add(token)
    for target in LINK.findall(_text(page)):
        if not re.match(r"^(https?:|#)", target):
            found.add((Path(page).parent / target.split("#")[0]).as_posix())
    return found


@pytest.mark.parametrize("page", PAGES)
def test_paths_exist(page):
    missing = sorted(p for p in _paths(page) if not (ROOT / p).exists())
    assert not missing, f"{page} names paths that do not exist: {missing}"


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        if not _module_exists(name):
            continue
        obj = importlib.import_module(name)
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("page", PAGES)
def test_modules_exist(page):
    names = set()
    for token in INLINE.findall(_prose(page)):
        names.update(re.findall(r"(?:^|\s|-m\s)(autopar(?:\.\w+)+)", token))
    missing = sorted(n for n in names if not _resolves(n))
    assert not missing, f"{page} names modules or attributes that do not exist: {missing}"
