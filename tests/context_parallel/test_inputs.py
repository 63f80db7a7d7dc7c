"""A batch as the ranks of a cp group see it (`context_parallel.inputs`): which models get their labels shifted."""

from __future__ import annotations

import pytest
import torch

from autopar.context_parallel.inputs import IGNORE_INDEX, is_causal_lm, local_batch
from tests.models import make_batch, make_model


@pytest.mark.parametrize(("name", "causal"), [("llama", True), ("gpt2", True), ("bert", False)])
def test_causal_lms_are_recognised_by_their_loss(name, causal):
    # GPT-2's GPT2LMHeadModel has no "ForCausalLM" in its name nor a loss_type, but its loss shifts the labels
    # inside the model as LLaMA's does; a masked LM's does not
    assert is_causal_lm(make_model(name)) is causal


def test_a_causal_lm_s_chunk_takes_its_labels_shifted_over_the_whole_sequence():
    args, kwargs = make_batch("gpt2", batch=2, seq=8)
    _, local = local_batch(args, kwargs, 2, 0, causal_lm=is_causal_lm(make_model("gpt2")))
    labels = kwargs["labels"]
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), IGNORE_INDEX)], dim=1)
    # zig-zag: rank 0 of 2 holds chunks 0 and 3 of four chunks of two tokens
    assert torch.equal(local["shift_labels"], torch.cat([shifted[:, 0:2], shifted[:, 6:8]], dim=1))
    assert torch.equal(local["position_ids"][0], torch.tensor([0, 1, 6, 7]))
