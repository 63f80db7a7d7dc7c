"""Tiny Hugging Face models for tests, built from configs (no weights downloaded), dropout off."""

from __future__ import annotations

import torch
from torch import nn
from transformers import BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

VOCAB = 128


def tiny_llama(num_layers: int = 2) -> torch.nn.Module:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def tiny_gpt2(num_layers: int = 2) -> torch.nn.Module:
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=num_layers,
        n_head=4,
        n_positions=64,
        use_cache=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        attn_implementation="sdpa",
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def tiny_bert(num_layers: int = 2) -> torch.nn.Module:
    cfg = BertConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    return BertForMaskedLM(cfg)


class MLPBlock(nn.Module):
    """A pre-norm transformer MLP block with its residual: the repeated layer of synthetic stacks."""

    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class PreNormBlock(nn.Module):
    """A pre-norm transformer block of torch.nn modules (separate q, k, v projections, as Llama has)."""

    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q, self.k, self.v, self.proj = (nn.Linear(hidden, hidden) for _ in range(4))
        self.up, self.down = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        y = self.norm1(x)
        q, k, v = (f(y).view(b, s, self.heads, h // self.heads).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class PreNormStack(nn.Module):
    """A stack of `PreNormBlock`s whose loss is the mean square of its output (a model for planner and numerics
    tests of the tensor axis: Megatron tensor and sequence parallelism)."""

    def __init__(self, hidden: int = 1024, heads: int = 8, num_layers: int = 2):
        super().__init__()
        self.layers = nn.ModuleList(PreNormBlock(hidden, heads) for _ in range(num_layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


BUILDERS = {"llama": tiny_llama, "gpt2": tiny_gpt2, "bert": tiny_bert}


def make_model(name: str, seed: int = 0, **kw) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[name](**kw)


def make_batch(name: str, batch: int = 8, seq: int = 16, seed: int = 1) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    labels = ids.clone()
    if name == "bert":  # masked-LM: most positions ignored, unevenly across rows
        keep = torch.rand(batch, seq, generator=g) < 0.3
        labels[~keep] = -100
    else:  # some padded rows so that ignored labels are spread unevenly over the batch
        labels[: batch // 2, seq // 2 :] = -100
    return (ids,), {"labels": labels}


def train_locally(model: torch.nn.Module, args, kwargs, optimizer, steps: int) -> tuple[list[float], dict]:
    """The single-process reference: `steps` optimizer steps on one batch; (losses, copy of the state dict).

    The loss is the output's `.loss` (Hugging Face models) or its first element.
    """
    losses = []
    for _ in range(steps):
        out = model(*args, **kwargs)
        loss = out.loss if hasattr(out, "loss") else out[0]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
