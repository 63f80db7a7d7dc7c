"""Loading Hugging Face weights into a model built on the meta device: no rank's tensor memory ever holds the
full model, measured, not inferred from the bytes read.

What is measured: every CPU tensor storage the rank allocates from the moment it hands `compile` a meta model
until the program is built and loaded (torch.profiler's memory events, one per allocation and per free by
torch's CPU allocator), as a running total whose peak is what the rank held at once. Not counted: the files
themselves, which safetensors maps (`UntypedStorage.from_file(shared=False)`, a private file mapping: only
the pages read become resident, as page cache the kernel may drop, and the profiler reports the mapping as
one allocation of the file's size); the tracker records each mapping and leaves it out.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import autopar
from tests.distributed.harness import run_distributed
from tests.distributed.test_hf_weights import _on_meta, _sgd
from tests.models import make_batch, make_model

pytestmark = pytest.mark.distributed


class TensorMemory:
    """Peak bytes of CPU tensor storage allocated inside the block and not freed before that point (file
    mappings left out, see the module docstring). Blocks allocated before the block are not seen, nor their
    frees (the profiler knows only the sizes of blocks it saw allocated), so the count starts from zero."""

    def __enter__(self):
        self.mapped: list[tuple[str, int]] = []
        self._original = torch.UntypedStorage.from_file
        original, mapped = self._original, self.mapped

        def from_file(filename, *args, **kwargs):
            storage = original(filename, *args, **kwargs)
            mapped.append((str(filename), storage.nbytes()))
            return storage

        torch.UntypedStorage.from_file = from_file
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc):
        self._profile.__exit__(*exc)
        torch.UntypedStorage.from_file = self._original
        events = sorted(
            (e.start_ns(), e.nbytes()) for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"
        )
        self.peak, self.num_allocations, self.mappings_left_out = _peak(events, self.mapped)


def _peak(events: list[tuple[int, int]], mapped: list[tuple[str, int]]) -> tuple[int, int, int]:
    """(peak of the running total, allocations counted, mappings left out): a mapping is the allocation of its
    size that follows its `from_file`, and the free of that size that follows it."""
    to_map, to_unmap = Counter(n for _, n in mapped), Counter()
    live = peak = count = left_out = 0
    for _, n in events:
        if n > 0 and to_map[n]:
            to_map[n] -= 1
            to_unmap[n] += 1
            left_out += 1
            continue
        if n < 0 and to_unmap[-n]:
            to_unmap[-n] -= 1
            continue
        live += n
        count += n > 0
        peak = max(peak, live)
    return peak, count, left_out


def _load(rank: int, world: int, name: str, layout: dict, src: str):
    model = _on_meta(name)
    args, kwargs = make_batch(name)
    with TensorMemory() as load:
        pm = autopar.compile(model, f"cpu:{world}", args, kwargs, optimizer=_sgd, constraints=layout, pretrained=src)
    held = sum(p.tensor.numel() * p.tensor.element_size() for p in pm.checkpoint_masters().values())
    with TensorMemory() as full:  # the control: the tracker sees a model built whole on the CPU
        whole = make_model(name)
    out = {
        "program": str(pm.plan.program),
        "peak": load.peak,
        "count": load.num_allocations,
        "held": held,
        "mapped": load.mapped,
        "left_out": load.mappings_left_out,
        "control": full.peak,
    }
    del whole
    return out


CASES = [
    ("llama", {"tp": 2}, "sharded", None),
    ("llama", {"pp": 2, "num_microbatches": 2}, "pipeline", "60KB"),
    ("gpt2", {"tp": 2}, "sharded", "60KB"),
]


@pytest.mark.parametrize(("name", "layout", "program", "src_shard"), CASES, ids=["llama-tp2", "llama-pp2", "gpt2-tp2"])
def test_no_rank_holds_the_full_model_while_loading(tmp_path, name, layout, program, src_shard):
    model = make_model(name)
    model.save_pretrained(tmp_path, **({"max_shard_size": src_shard} if src_shard else {}))
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    files = sorted(str(p) for p in tmp_path.glob("*.safetensors"))
    runs = run_distributed(_load, 2, name, layout, str(tmp_path))
    for r, run in enumerate(runs):
        assert run["program"] == program, (r, run["program"])
        assert run["control"] >= total, (r, run["control"], total)  # the tracker can see a whole model
        # every file the rank opened was mapped once and left out, nothing else
        assert {f for f, _ in run["mapped"]} <= set(files) and run["left_out"] == len(run["mapped"]) > 0, run
        # the peak includes the rank's own share of the masters (it is held at the end) ...
        assert run["held"] <= run["peak"], (r, run["held"], run["peak"])
        # ... and stays below the full model: what the rank holds is its share plus slices in flight
        assert run["peak"] < total, (r, run["peak"], total, run["held"])
