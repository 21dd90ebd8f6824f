"""LightningModules around models nobody in this project wrote, written as users write them.

transformers' Llama and GPT-2 built from tiny config objects (no hub download), and Lightning's own
demo Transformer. Dropout is off so that one device and a pipeline draw no random numbers.
"""

from __future__ import annotations

import lightning as L
import torch
from torch import nn


class HFCausalLM(L.LightningModule):
    """``self.model(input_ids=..., attention_mask=..., labels=...).loss``, as a user writes it.

    SGD with momentum: transformers' loss is float32 even in a float64 model, and Adam would turn
    float32 rounding of near-zero gradients into ``lr``-sized differences between two correct runs."""

    def __init__(
        self, family: str = "llama", layers: int = 4, lr: float = 0.1, attn: str = "sdpa", positions: bool = False
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = build_causal_lm(family, layers, attn)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        extra = {"position_ids": batch["position_ids"]} if self.hparams.positions else {}  # a user who passes them
        out = self.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"], **extra
        )
        self.log("train_loss", out.loss)
        return out.loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def build_causal_lm(family: str, layers: int, attn: str = "sdpa") -> nn.Module:
    """A tiny transformers causal LM: ``"llama"`` (grouped-query attention, rotary) or ``"gpt2"`` (tied)."""
    import transformers

    if family == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, tie_word_embeddings=False,
            attn_implementation=attn,
        )
        return transformers.LlamaForCausalLM(config)
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=layers, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation=attn,
        )
        return transformers.GPT2LMHeadModel(config)
    raise ValueError(family)


def lm_batches(
    num: int, batch_size: int, lengths: list[int], vocab: int = 64, padding: str = "variable", seed: int = 0
) -> list[dict]:
    """Right-padded batches: ``input_ids``, ``attention_mask``, ``labels`` (-100 at padding).

    ``padding="variable"``: sample ``i`` of a batch of length ``T`` holds ``T - (i % 3)`` real tokens
    (microbatches count different numbers of tokens); ``"equal"``: every sample holds ``T - 2``
    (real padding, equal counts); ``"none"``: every position is real.
    """
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for k in range(num):
        T = lengths[k % len(lengths)]
        ids = torch.randint(1, vocab, (batch_size, T), generator=generator)
        mask = torch.ones(batch_size, T, dtype=torch.long)
        for i in range(batch_size):
            pad = {"variable": i % 3, "equal": 2, "none": 0}[padding]
            mask[i, T - pad :] = 0
        ids = ids.masked_fill(mask == 0, 0)
        labels = ids.masked_fill(mask == 0, -100)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


class DemoTransformer(L.LightningModule):
    """Lightning's own demo encoder-decoder (``lightning.pytorch.demos.Transformer``), as its example trains it.

    The block stack found is the decoder's layers; the encoder's output (``memory``) feeds every
    decoder layer, so every stage needs the encoder and its embedding: they are shared by all units.
    """

    def __init__(self, layers: int = 4, lr: float = 0.1) -> None:
        super().__init__()
        from lightning.pytorch.demos import Transformer

        self.lr = lr
        self.model = Transformer(vocab_size=64, ninp=32, nhead=2, nhid=64, nlayers=layers, dropout=0.0)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        inputs, target = batch
        output = self.model(inputs, target)
        loss = torch.nn.functional.nll_loss(output, target.view(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.model.parameters(), lr=self.lr)


def pair_batches(num: int, batch_size: int, lengths: list[int], vocab: int = 64, seed: int = 0) -> list:
    """``(inputs, target)`` token batches of the demo's language-model data."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for k in range(num):
        T = lengths[k % len(lengths)]
        ids = torch.randint(0, vocab, (batch_size, T + 1), generator=generator)
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out
