"""Tiny models of a dozen families for the coverage matrix, built from config classes (nothing downloaded).

Every model takes (ids,) with labels= and returns a loss first (Hugging Face output or a tuple); dropout is
off so that parallel and single-process runs see the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.models import VOCAB, tiny_bert, tiny_gpt2, tiny_llama

HIDDEN, HEADS, FFN, POSITIONS = 64, 4, 128, 64


def tiny_t5() -> nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        d_kv=HIDDEN // HEADS,
        d_ff=FFN,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=HEADS,
        dropout_rate=0.0,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    return T5ForConditionalGeneration(cfg)


def tiny_bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    cfg = BloomConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        n_layer=2,
        n_head=HEADS,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
    )
    return BloomForCausalLM(cfg)


def tiny_falcon() -> nn.Module:
    from transformers import FalconConfig, FalconForCausalLM

    cfg = FalconConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        new_decoder_architecture=False,
        multi_query=True,
        parallel_attn=True,
        bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        max_position_embeddings=POSITIONS,
        attn_implementation="sdpa",
    )
    return FalconForCausalLM(cfg)


def tiny_gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=POSITIONS,
        sliding_window=8,
        use_cache=False,
        attn_implementation="eager",
    )  # Gemma-2 has no sdpa path (its logit soft-capping)
    return Gemma2ForCausalLM(cfg)


def tiny_mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    # batched_mm selects each token's experts by index and multiplies in one bmm: no data-dependent loop,
    # so export traces it (the eager loop over hit experts does not trace)
    cfg = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=POSITIONS,
        use_cache=False,
        router_aux_loss_coef=0.0,
        attn_implementation="sdpa",
        experts_implementation="batched_mm",
    )
    return MixtralForCausalLM(cfg)


class TorchBlock(nn.Module):
    """A pre-norm transformer block of plain torch.nn modules: multi-head attention and a GELU MLP."""

    def __init__(self):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.up, self.down = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, HEADS, HIDDEN // HEADS).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, HIDDEN))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class TorchTransformer(nn.Module):
    """A causal LM of plain torch.nn modules whose input is the sum of token and position embeddings."""

    def __init__(self, num_layers: int = 2, vocab: int = VOCAB):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, HIDDEN)
        self.pos = nn.Embedding(POSITIONS, HIDDEN)
        self.layers = nn.ModuleList(TorchBlock() for _ in range(num_layers))
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, vocab, bias=False)

    def forward(self, ids, labels=None):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.norm(x))
        loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, self.vocab), labels[:, 1:].reshape(-1))
        return loss, logits


FAMILIES = {
    "gpt2": tiny_gpt2,
    "llama": tiny_llama,
    "bert": tiny_bert,
    "t5": tiny_t5,
    "bloom": tiny_bloom,
    "falcon": tiny_falcon,
    "gemma2": tiny_gemma2,
    "mixtral": tiny_mixtral,
    "torch": TorchTransformer,
}


def make_family(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return FAMILIES[name]()


def family_batch(name: str, batch: int = 4, seq: int = 16, seed: int = 1) -> tuple[tuple, dict]:
    """One batch for `name`: ids and labels (masked-LM labels mostly ignored for BERT, decoder labels for T5)."""
    from tests.models import make_batch

    return make_batch("bert" if name == "bert" else name, batch=batch, seq=seq, seed=seed)
