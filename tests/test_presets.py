"""Tests of autopar.presets: preset configs, building on meta and CPU, example batches, parameter counts."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from autopar.errors import ConfigError
from autopar.presets import PRESET_NAMES, build_model, count_parameters, example_batch, load_config

# Exact counts computed on the meta device; the comment gives the published figure they reproduce.
EXACT_COUNTS = {
    "gpt2": 124_439_808,  # GPT-2 small, "124M"
    "llama2-7b": 6_738_415_616,  # Llama 2 model card
    "llama2-13b": 13_015_864_320,  # Llama 2 model card
    "llama2-70b": 68_976_648_192,  # Llama 2 model card, 68.98e9
    "llama3-8b": 8_030_261_248,  # Llama 3 model card, 8.03e9
    "llama3-70b": 70_553_706_496,  # Llama 3 model card, 70.55e9
    # Llama 3.1 model card, "405B"; by hand: 126 layers of 3,187,703,808, two 128256 x 16384 tables, final norm
    "llama3-405b": 405_853_388_800,
    "gpt3-175b": 174_604_259_328,  # GPT-3 paper, "175B"
    "mixtral-8x7b": 46_702_792_704,  # Mixtral of Experts paper, 47B (13B active)
}

# The GPT-3 paper's sizes are rounded names, not counts; the shapes reproduce them to within 2.5%
# (1.3B is 1.316e9: embeddings are a larger share of the small models).
NOMINAL_GPT3 = {"gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9, "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9}


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return None


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_every_preset_loads_for_training_with_sdpa(name):
    config = load_config(name)
    assert isinstance(config, transformers.PretrainedConfig)
    assert config.use_cache is False
    assert config._attn_implementation == "sdpa"


def test_preset_names_are_case_insensitive():
    assert load_config("LLaMA2-7B").to_dict() == load_config("llama2-7b").to_dict()


@pytest.mark.integration
@pytest.mark.parametrize("name, expected", sorted(EXACT_COUNTS.items()))
def test_count_parameters_matches_published_counts(name, expected):
    assert count_parameters(load_config(name)) == expected


@pytest.mark.parametrize("name, nominal", sorted(NOMINAL_GPT3.items()))
def test_gpt3_shapes_give_the_paper_sizes(name, nominal):
    tolerance = 0.01 if name == "gpt3-175b" else 0.025
    assert abs(count_parameters(load_config(name)) - nominal) / nominal < tolerance


def test_shapes_of_the_big_presets():
    gpt3 = load_config("gpt3-175b")
    assert (gpt3.n_embd, gpt3.n_layer, gpt3.n_head, gpt3.vocab_size, gpt3.n_positions) == (12288, 96, 96, 50257, 2048)
    llama70 = load_config("llama2-70b")
    assert (llama70.num_attention_heads, llama70.num_key_value_heads, llama70.num_hidden_layers) == (64, 8, 80)
    llama3 = load_config("llama3-70b")
    assert llama3.vocab_size == 128256 and llama3.num_key_value_heads == 8
    assert llama3.rope_parameters["rope_theta"] == 500000.0
    llama405 = load_config("llama3-405b")
    assert (llama405.hidden_size, llama405.num_hidden_layers, llama405.intermediate_size) == (16384, 126, 53248)
    assert (llama405.num_attention_heads, llama405.num_key_value_heads, llama405.vocab_size) == (128, 8, 128256)
    assert llama405.max_position_embeddings == 131072 and llama405.rms_norm_eps == 1e-5
    rope = llama405.rope_parameters
    assert (rope["rope_type"], rope["rope_theta"], rope["factor"]) == ("llama3", 500000.0, 8.0)
    assert (rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]) == (1, 4, 8192)
    assert load_config("bert-large").architectures == ["BertForMaskedLM"]
    mixtral = load_config("mixtral-8x7b")
    assert (mixtral.hidden_size, mixtral.intermediate_size, mixtral.num_hidden_layers) == (4096, 14336, 32)
    assert (mixtral.num_attention_heads, mixtral.num_key_value_heads, mixtral.vocab_size) == (32, 8, 32000)
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.max_position_embeddings) == (8, 2, 32768)
    assert mixtral.rope_parameters["rope_theta"] == 1e6 and mixtral.rms_norm_eps == 1e-5


def test_tiny_llama_shape():
    c = load_config("tiny-llama")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (64, 2, 4, 2)
    assert (c.intermediate_size, c.vocab_size) == (128, 256)


@pytest.mark.parametrize(
    "name, cls",
    [
        ("tiny-llama", transformers.LlamaForCausalLM),
        ("tiny-gpt2", transformers.GPT2LMHeadModel),
        ("tiny-bert", transformers.BertForMaskedLM),
    ],
)
def test_build_model_gives_the_training_model(name, cls):
    model = build_model(load_config(name))
    assert type(model) is cls
    assert model.training
    assert all(p.is_meta for p in model.parameters())


def test_build_model_without_a_preset_architecture_picks_by_model_type():
    config = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4
    )
    assert type(build_model(config)) is transformers.MistralForCausalLM
    bert = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    assert type(build_model(bert)) is transformers.BertForMaskedLM


def test_llama2_70b_on_meta_allocates_nothing():
    before = _rss_bytes()
    model = build_model(load_config("llama2-70b"))
    after = _rss_bytes()
    assert all(t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert sum(p.numel() for p in model.parameters()) == EXACT_COUNTS["llama2-70b"]
    if before is not None:
        # 69e9 float32 parameters would be 276 GB; module objects and Python bookkeeping stay far below 1 GiB.
        assert after - before < 2**30


def test_build_model_on_cpu_is_seeded_by_the_caller_and_takes_a_dtype():
    config = load_config("tiny-llama")
    torch.manual_seed(0)
    a = build_model(config, device="cpu")
    torch.manual_seed(0)
    b = build_model(config, device="cpu")
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert pa.device.type == "cpu"
        torch.testing.assert_close(pa, pb, rtol=0, atol=0, msg=name)
    assert a.model.embed_tokens.weight.std() > 0
    half = build_model(config, device="cpu", dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


def test_overrides_replace_fields_and_accept_aliases():
    assert load_config("llama2-7b", num_hidden_layers=2).num_hidden_layers == 2
    gpt2 = load_config("gpt2", num_hidden_layers=3)
    assert gpt2.n_layer == 3
    assert load_config("tiny-llama", attn_implementation="eager")._attn_implementation == "eager"


def test_an_unknown_override_is_an_error():
    with pytest.raises(ConfigError, match="num_hidden_layer="):
        load_config("llama2-7b", num_hidden_layer=2)


def test_unknown_preset_lists_the_presets_and_mentions_config_json():
    with pytest.raises(ConfigError) as info:
        load_config("llama9-1t")
    message = str(info.value)
    assert "llama2-70b" in message and "gpt3-175b" in message and "config.json" in message


def test_a_config_json_path_or_folder_loads(tmp_path):
    raw = load_config("tiny-llama").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for path in (tmp_path / "config.json", tmp_path):
        config = load_config(str(path), num_hidden_layers=1)
        assert isinstance(config, transformers.LlamaConfig)
        assert (config.hidden_size, config.num_hidden_layers, config.use_cache) == (64, 1, False)


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"model_type": "llama", "hidden_size": ', "not valid json"),
        ("[1, 2]", "json list"),
        ('{"hidden_size": 64}', "model_type"),
        ('{"model_type": "no-such-model"}', "does not know"),
    ],
)
def test_a_broken_config_json_is_a_config_error(tmp_path, text, match):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(path))


def test_a_missing_config_json_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset nor a config file"):
        load_config(str(tmp_path / "missing" / "config.json"))


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_example_batch_of_a_causal_lm(device):
    config = load_config("tiny-llama")
    (ids,), kwargs = example_batch(config, 3, 16, device=device)
    assert ids.shape == (3, 16) and ids.dtype == torch.int64 and ids.device.type == device
    assert set(kwargs) == {"labels"} and kwargs["labels"].shape == ids.shape
    if device == "cpu":
        assert 0 <= int(ids.min()) and int(ids.max()) < config.vocab_size
        assert torch.equal(kwargs["labels"], ids)


def test_example_batch_of_a_masked_lm_trains():
    config = load_config("tiny-bert")
    torch.manual_seed(0)
    (ids,), kwargs = example_batch(config, 2, 32, device="cpu")
    labels = kwargs["labels"]
    assert labels.shape == ids.shape
    scored = labels != -100
    assert 0 < int(scored.sum()) < labels.numel()
    assert torch.equal(labels[scored], ids[scored])
    loss = build_model(config, device="cpu")(ids, labels=labels).loss
    assert torch.isfinite(loss)


def test_example_batch_rejects_a_sequence_longer_than_learned_positions():
    with pytest.raises(ConfigError, match="1024 positions"):
        example_batch(load_config("gpt2"), 1, 2048)
