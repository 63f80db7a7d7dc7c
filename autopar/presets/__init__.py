"""Model presets: Hugging Face model configurations shipped as data, never weights.

Each preset is one ``<name>.json`` file next to this module, written in the format of a Hugging
Face ``config.json`` (``model_type`` picks the config class, ``architectures`` the head), so a
preset and a downloaded ``config.json`` go through the same code. Planning only needs shapes:
models are built on the meta device by default, so a 175B-parameter model costs no memory.

Presets:
- ``gpt2``: GPT-2 small (124M), as released.
- ``gpt3-1.3b`` ... ``gpt3-175b``: the GPT-3 paper / Megatron-LM shapes as GPT-2 architecture
  configs (vocabulary 50257, context 2048). The paper's 1.3B row (24 heads of 128 for a width of
  2048) and 13B row (width 5140 for 40 heads of 128) are not realisable as written; like
  Megatron-LM we use 16 heads and a width of 5120.
- ``llama2-7b``, ``llama2-13b``, ``llama2-70b`` (grouped-query attention, 8 key/value heads),
  ``llama3-8b``, ``llama3-70b`` (vocabulary 128256, rope theta 500000, 8 key/value heads).
- ``llama3-405b``: Llama 3.1 405B as published (its Hugging Face ``config.json``; shapes as in Table 3 of "The
  Llama 3 Herd of Models", 2024): 126 layers of width 16384, 128 heads with 8 key/value heads, feed-forward width
  53248, vocabulary 128256, rope theta 500000 with Llama 3.1's rope scaling (factor 8 over 8192 original
  positions) to 131072 positions; 405.85B parameters.
- ``mixtral-8x7b``: Mixtral 8x7B as published (46.7B parameters, 12.9B active: 8 experts per layer, 2 per
  token; grouped-query attention with 8 key/value heads, rope theta 1e6). Its experts run as Hugging
  Face's default "grouped_mm" (tokens sorted by expert, one grouped matmul per projection), which the
  cost model prices as the routed top-2, not all 8.
- ``bert-large``: BERT-large, uncased, with the masked-LM head.
- ``tiny-llama``, ``tiny-gpt2``, ``tiny-bert``: versions of about 100k parameters for
  tests, with dropout off so that runs are deterministic.

Every config comes back with ``use_cache=False`` (training keeps no KV cache) and
``attn_implementation="sdpa"``, so ``torch.export`` shows attention as one
``aten.scaled_dot_product_attention`` op that the planner can shard and the rewrite can replace.
"""

from __future__ import annotations

import json
import os
from importlib import resources
from typing import Any

import torch
import transformers
from transformers.models.auto import modeling_auto

from autopar.errors import ConfigError

PRESET_NAMES: tuple[str, ...] = (
    "gpt2",
    "gpt3-1.3b",
    "gpt3-2.7b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mixtral-8x7b",
    "bert-large",
    "tiny-llama",
    "tiny-gpt2",
    "tiny-bert",
)

# Labels of a masked-LM batch are -100 (ignored by the loss) except at every MASK_EVERY-th position;
# a fixed pattern rather than a random draw guarantees at least one position per sequence has a loss.
IGNORE_INDEX = -100
MASK_EVERY = 7


def load_config(name_or_path: str, **overrides: Any) -> transformers.PretrainedConfig:
    """Load a model configuration from a preset name or a Hugging Face ``config.json``.

    Args:
        name_or_path: a preset name from :data:`PRESET_NAMES` (case-insensitive), or the path of a
            ``config.json`` file or of a folder that holds one.
        **overrides: config attributes to replace, e.g. ``num_hidden_layers=2``. Aliases a config
            class defines work (``num_hidden_layers`` sets ``n_layer`` of a GPT-2 config);
            ``attn_implementation`` overrides the default ``"sdpa"``.

    Returns:
        The config, with ``use_cache=False`` and ``attn_implementation="sdpa"`` unless overridden.

    Raises:
        ConfigError: an unknown preset, a file that cannot be read or is not a model config, or an
            override the config class does not know.
    """
    raw, source = _read_raw_config(name_or_path)
    config = _config_from_dict(raw, source)
    overrides = dict(overrides)
    config._attn_implementation = overrides.pop("attn_implementation", "sdpa")
    config.use_cache = False
    for key, value in overrides.items():
        # A typo such as `num_hidden_layer=2` would otherwise plan the full-depth model without a word.
        if not hasattr(config, key):
            raise ConfigError(
                f"override {key}={value!r} is not an attribute of {type(config).__name__} (from {source}); "
                f"check the spelling against the config's fields, e.g. {_some_fields(config)}"
            )
        setattr(config, key, value)
    return config


def build_model(
    config: transformers.PretrainedConfig,
    *,
    device: str | torch.device = "meta",
    dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """Build the training model for a config: causal LM, or masked LM for BERT-style encoders.

    Args:
        config: a config from :func:`load_config` (or any Hugging Face config).
        device: where parameters live. On ``"meta"`` nothing is allocated, whatever the size; on a
            real device weights are initialised as Hugging Face does, from torch's global RNG (seed
            it first for reproducible weights).
        dtype: parameter dtype; ``None`` means torch's default dtype (float32), not the dtype a
            downloaded ``config.json`` may name, so that a plan's dtype is always an explicit choice.

    Returns:
        The model in training mode (dropout active), e.g. ``LlamaForCausalLM``, ``GPT2LMHeadModel``
        or ``BertForMaskedLM``.
    """
    auto_class = transformers.AutoModelForMaskedLM if _is_masked_lm(config) else transformers.AutoModelForCausalLM
    kwargs: dict[str, Any] = {"attn_implementation": config._attn_implementation or "sdpa"}
    if dtype is not None:
        kwargs["dtype"] = dtype
    try:
        # Constructing under the device context creates every parameter directly on it: on meta
        # that is the difference between planning a 70B model and allocating 280 GB.
        with torch.device(device):
            model = auto_class.from_config(config, **kwargs)
    except ValueError as e:
        raise ConfigError(
            f"transformers has no {auto_class.__name__} for model_type {config.model_type!r}: {e}. "
            "Build the model yourself and pass the nn.Module instead of a preset."
        ) from e
    model.train()
    return model


def example_batch(
    config: transformers.PretrainedConfig,
    batch_size: int,
    seq_len: int,
    *,
    device: str | torch.device = "meta",
) -> tuple[tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """An example training batch: ``((input_ids,), {"labels": labels})``.

    Args:
        config: the model's config (its ``vocab_size`` bounds the token ids).
        batch_size, seq_len: the shape of ``input_ids`` and ``labels``.
        device: where the tensors live; on ``"meta"`` they only carry shape and dtype. On a real
            device the ids are drawn from torch's global RNG.

    Returns:
        int64 token ids in ``[0, vocab_size)``. For a causal LM the labels are the ids (the model
        shifts them). For a masked LM the labels are the ids at every ``MASK_EVERY``-th position and
        ``-100`` elsewhere; the inputs are not replaced by a mask token, which changes no shape.
    """
    if batch_size < 1 or seq_len < 1:
        raise ConfigError(f"batch_size and seq_len must be positive; got batch_size={batch_size}, seq_len={seq_len}")
    max_positions = getattr(config, "max_position_embeddings", None)
    if _uses_learned_positions(config) and max_positions is not None and seq_len > max_positions:
        raise ConfigError(
            f"seq_len={seq_len} exceeds the {max_positions} positions of this {config.model_type} config; "
            f"use seq_len <= {max_positions} or override max_position_embeddings"
        )
    shape = (batch_size, seq_len)
    ids = torch.randint(0, config.vocab_size, shape, dtype=torch.int64, device=device)
    if not _is_masked_lm(config):
        return (ids,), {"labels": ids.clone()}
    position = torch.arange(seq_len, device=device).expand(shape)
    labels = torch.where(position % MASK_EVERY == 0, ids, torch.full_like(ids, IGNORE_INDEX))
    return (ids,), {"labels": labels}


def count_parameters(config: transformers.PretrainedConfig) -> int:
    """Exact number of trainable parameters of :func:`build_model`'s model, counted on meta.

    Tied weights (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) count once.
    """
    model = build_model(config, device="meta")
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def _read_raw_config(name_or_path: str) -> tuple[dict[str, Any], str]:
    """The json dict of a preset or config file, and a description of where it came from."""
    key = name_or_path.strip().lower()
    if key in PRESET_NAMES:
        text = resources.files(__name__).joinpath(f"{key}.json").read_text(encoding="utf-8")
        return json.loads(text), f"preset {key!r}"
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(
            f"{name_or_path!r} is neither a preset nor a config file. Presets: {', '.join(PRESET_NAMES)}. "
            "A path to a Hugging Face config.json (or to a folder holding one) works too."
        )
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read the model config {path!r}: {e}") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path!r} is not valid json ({e}); expected a Hugging Face config.json") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path!r} holds a json {type(raw).__name__}; a Hugging Face config.json holds an object")
    return raw, path


def _config_from_dict(raw: dict[str, Any], source: str) -> transformers.PretrainedConfig:
    model_type = raw.get("model_type")
    if not model_type:
        raise ConfigError(
            f'{source} has no \'model_type\'; a Hugging Face config.json names it (e.g. "llama", "gpt2", "bert")'
        )
    if model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(
            f"{source} has model_type {model_type!r}, which transformers {transformers.__version__} does not know"
        )
    try:
        return transformers.CONFIG_MAPPING[model_type].from_dict(raw)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"{source} is not a valid {model_type} config: {e}") from e


def _is_masked_lm(config: transformers.PretrainedConfig) -> bool:
    """Whether the training model is a masked LM: the architecture the config names, else the model type."""
    for arch in config.architectures or ():
        if arch.endswith("ForMaskedLM"):
            return True
        if arch.endswith(("ForCausalLM", "LMHeadModel")):
            return False
    # Encoders such as BERT also have a causal-LM head class (for use as a decoder), but pretraining trains
    # them as masked LMs; decoder-only families have no masked-LM class at all.
    has_masked_lm = config.model_type in modeling_auto.MODEL_FOR_MASKED_LM_MAPPING_NAMES
    return has_masked_lm and not config.is_decoder and not config.is_encoder_decoder


def _uses_learned_positions(config: transformers.PretrainedConfig) -> bool:
    """Whether positions past the config's maximum would index out of an embedding table."""
    return config.model_type in ("gpt2", "bert", "roberta", "gpt_neo", "opt")


def _some_fields(config: transformers.PretrainedConfig) -> str:
    names = [k for k in config.to_dict() if not k.startswith("_")]
    return ", ".join(sorted(names)[:12]) + ", ..."
