"""PEFT adapters out: `Program.save_pretrained` of a `peft.PeftModel` writes what `PeftModel.from_pretrained`
reads, or with `merged=True` the base model with the adapters merged in, which `from_pretrained` of the base
model's class reads.

What a PEFT model is, `export_info` reads once from the model `compile` was given (nothing of it is kept but
names and figures): the active adapter's config, the key each adapter tensor is saved under (PEFT's own
`get_peft_model_state_dict`: `...q_proj.lora_A.weight`, the adapter's name dropped), and each LoRA layer's
scaling and layout.

- Adapters (`save_adapter`): the adapter tensors are gathered whole on rank 0 only (`pieces.assemble`) and written
  as `adapter_model.safetensors` with `adapter_config.json` (the config as PEFT writes it, in inference mode).
- Merged (`save_merged`): rank 0 gathers the whole model, merges each LoRA layer, W + scaling * B A (transposed for
  a `fan_in_fan_out` layer), as PEFT's `merge_and_unload` does, takes the trained copies of `modules_to_save`, drops
  the adapter tensors and PEFT's name parts (`base_model.model.`, `.base_layer`), and writes the base model's
  safetensors (one file, or shards of `max_shard_size` with an index) with its config and generation config. Rank
  0 holds the whole model while it writes. Only plain LoRA on linear layers merges (DoRA, LoRA on embeddings or
  convolutions, other PEFT methods: a ConfigError; their adapters are saved as PEFT saves them).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from autopar.checkpoint.pieces import assemble, barrier, rank
from autopar.errors import ConfigError

ADAPTER_FILE = "adapter_model.safetensors"
BASE_PREFIX = "base_model.model."


@dataclass(frozen=True)
class PeftExport:
    """What saving a PEFT model needs of it (see the module docstring)."""

    config: object  # the active adapter's PeftConfig (a copy)
    adapter: str
    base_class: str  # the base model's class: `architectures` of a merged export
    keys: dict  # model name -> key in adapter_model.safetensors
    lora: dict  # LoRA layer path (model names) -> (scaling, fan_in_fan_out), for layers that merge
    unmergeable: tuple  # adapter layers a merge does not know (DoRA, embeddings, other methods)


def export_info(model: torch.nn.Module) -> PeftExport | None:
    """The PEFT facts of `model`; None for a model that is not a `peft.PeftModel`."""
    if not hasattr(model, "peft_config") or not hasattr(model, "base_model"):
        return None
    try:
        from peft.tuners.lora import LoraLayer
        from peft.utils import get_peft_model_state_dict
    except ImportError:
        return None
    adapter = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
    state = model.state_dict(keep_vars=True)
    name_of = {id(t): n for n, t in state.items()}
    saved = get_peft_model_state_dict(model, state_dict=state, adapter_name=adapter)
    keys = {name_of[id(t)]: key for key, t in saved.items() if id(t) in name_of}
    lora, unmergeable = {}, []
    for path, module in model.named_modules():
        if not isinstance(module, LoraLayer) or adapter not in module.scaling:
            continue
        base_layer = module.get_base_layer()
        dense = isinstance(base_layer, torch.nn.Linear) or type(base_layer).__name__ == "Conv1D"  # GPT-2's
        if dense and adapter in module.lora_A and not module.use_dora.get(adapter, False):
            lora[path] = (float(module.scaling[adapter]), bool(module.fan_in_fan_out))
        else:
            unmergeable.append(path)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model.base_model.model
    return PeftExport(
        copy.deepcopy(model.peft_config[adapter]), adapter, type(base).__name__, keys, lora, tuple(unmergeable)
    )


def save_adapter(program, path) -> None:
    """`adapter_model.safetensors` and `adapter_config.json` in `path`; every rank calls it."""
    from safetensors.torch import save_file

    info: PeftExport = program.peft
    path = Path(path)
    names = [n for n in info.keys if n in program.checkpoint_names.shapes]
    full = _gather(program, names)
    if rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        tensors = {info.keys[n]: full[n].contiguous() for n in names}
        save_file(tensors, str(path / ADAPTER_FILE), metadata={"format": "pt"})
        config = copy.deepcopy(info.config)
        config.inference_mode = True
        config.save_pretrained(str(path))
    barrier()


def save_merged(program, path, *, max_shard_size) -> None:
    """The base model with the adapters merged, as Hugging Face safetensors with its config; every rank calls it."""
    from safetensors.torch import save_file

    from autopar.checkpoint import hf

    info: PeftExport = program.peft
    if info.unmergeable:
        raise ConfigError(
            f"merged=True merges plain LoRA on linear layers; {len(info.unmergeable)} adapter layers are of another "
            f"kind (e.g. {info.unmergeable[0]}): save the adapters (merged=False) and merge with PEFT"
        )
    path = Path(path)
    full = _gather(program, list(program.checkpoint_names.masters))
    if rank() == 0:
        buffers = program.checkpoint_buffers()
        state = merged_state(
            info, full | {n: b.detach().to("cpu", program.checkpoint_names.dtypes[n]) for n, b in buffers.items()}
        )
        sizes = {n: t.numel() * t.element_size() for n, t in state.items()}
        files = hf.shard_files(sizes, hf._bytes(max_shard_size))
        names = hf.file_names(len(files))
        path.mkdir(parents=True, exist_ok=True)
        for old in [*path.glob("model*.safetensors"), path / hf.INDEX]:
            old.unlink(missing_ok=True)
        for group, name in zip(files, names, strict=True):
            save_file({n: state[n].contiguous() for n in group}, str(path / name), metadata={"format": "pt"})
        if len(files) > 1:
            weight_map = {n: names[i] for i, group in enumerate(files) for n in group}
            index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
            (path / hf.INDEX).write_text(json.dumps(index, indent=2))
        config = hf.config_to_write(program)
        if config is not None:
            config.architectures = [info.base_class]
            config.save_pretrained(str(path))
        if program.generation_config is not None:
            program.generation_config.save_pretrained(str(path))
    barrier()


def merged_state(info: PeftExport, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's tensors from a PEFT model's (names of the PEFT model): LoRA layers merged, the trained
    copies of `modules_to_save` in place of the originals, adapter tensors dropped, base names."""
    out: dict[str, torch.Tensor] = {}
    adapter = info.adapter
    for name, value in state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        base = name.removeprefix(BASE_PREFIX).replace(".base_layer.", ".")
        base = base.replace(f".modules_to_save.{adapter}.", ".")
        layer = name.rsplit(".base_layer.", 1)[0] if ".base_layer." in name else None
        if layer in info.lora and name.endswith(".base_layer.weight"):
            scaling, fan_in_fan_out = info.lora[layer]
            a = state[f"{layer}.lora_A.{adapter}.weight"].float()
            b = state[f"{layer}.lora_B.{adapter}.weight"].float()
            delta = (b @ a) * scaling
            value = (value.float() + (delta.T if fan_in_fan_out else delta)).to(value.dtype)
        out[base] = value
    return out


def _gather(program, names: list[str]) -> dict[str, torch.Tensor]:
    """Full tensors of `names` (the masters' first names) on rank 0, in the model's dtypes (collective)."""
    masters = program.checkpoint_masters()
    shapes = {n: program.checkpoint_names.shapes[n] for n in names}
    dtypes = {n: program.checkpoint_names.dtypes[n] for n in names}
    owners = dict.fromkeys(names, 0)
    return assemble({n: p for n, p in masters.items() if n in owners}, owners, dtypes, shapes=shapes)
