"""Small LightningModules for tests, written as users write them (no pipeline code)."""

from __future__ import annotations

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Pre-LN causal attention + MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(L.LightningModule):
    """A GPT with learned positions; ``tie`` ties the head to the token embedding."""

    def __init__(
        self,
        vocab: int = 32,
        dim: int = 16,
        layers: int = 4,
        heads: int = 2,
        max_len: int = 64,
        lr: float = 1e-2,
        tie: bool = False,
        optimizer: str = "adamw",
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits = self(batch[:, :-1])
        self.log("val_loss", F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1)))

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch[:, :-1]).argmax(-1)

    def configure_optimizers(self):
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


class ArgsBlock(nn.Module):
    """A block taking extra arguments (mask, positions) and returning a tuple, as HF layers do."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.rotate = nn.Linear(dim, dim)
        self.mlp = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor):
        h = self.ln(x) + torch.sin(position_ids.unsqueeze(-1).to(x.dtype) / 10.0) * self.rotate.weight[0]
        y, _ = self.attn(h, h, h, attn_mask=attention_mask, need_weights=False)
        x = x + y
        x = x + torch.tanh(self.mlp(x))
        return x, y.mean()


class MaskedModel(L.LightningModule):
    """Blocks with side inputs derived from the batch, tuple outputs, and a dict batch."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([ArgsBlock(dim) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab)

    def training_step(self, batch: dict, batch_idx: int) -> dict:
        ids, labels = batch["input_ids"], batch["labels"]
        T = ids.shape[1]
        causal = torch.triu(torch.full((T, T), -math.inf, device=ids.device), diagonal=1).to(self.embed.weight.dtype)
        positions = torch.arange(T, device=ids.device).expand_as(ids)
        x = self.embed(ids) * batch["scale"].unsqueeze(-1).unsqueeze(-1)
        for layer in self.layers:
            x, _ = layer(x, causal, positions)
        logits = self.out(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))
        self.log("train_loss", loss)
        self.log("tokens", float(ids.numel()), reduce_fx="sum")
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


class ConfiguredGPT(TinyGPT):
    """TinyGPT whose blocks are built in ``configure_model`` (as for large models)."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        super().__init__(layers=0, **kwargs)
        self.num_layers = layers

    def configure_model(self) -> None:
        if len(self.blocks) == 0:
            self.blocks.extend(Block(self.hparams.dim, self.hparams.heads) for _ in range(self.num_layers))


class PaddedLM(L.LightningModule):
    """A causal LM on padded batches whose labels mark padding with -100, as transformers' are.

    ``loss`` says how the step writes its token-averaged loss: ``"functional"`` (``F.cross_entropy``,
    default ``ignore_index=-100``), ``"module"`` (``nn.CrossEntropyLoss``), ``"num_items"`` (a sum
    divided by the counted labels, transformers' ``num_items_in_batch`` path), ``"weighted"``
    (per-token losses averaged with the batch's per-sample ``weight``: a normalisation no loss
    function shows, for ``loss_weights=``).
    """

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4, lr: float = 1e-2, loss: str = "functional") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Block(dim, 2) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.criterion = nn.CrossEntropyLoss()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x)).flatten(0, 1)  # [B * T, V]
        labels = batch["labels"].flatten()
        mode = self.hparams.loss
        if mode == "functional":
            loss = F.cross_entropy(logits, labels)
        elif mode == "module":
            loss = self.criterion(logits, labels)
        elif mode == "num_items":
            num_items = (labels != -100).sum()
            loss = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum") / num_items
        else:
            per_token = F.cross_entropy(logits, labels, reduction="none").view(batch["labels"].shape)
            counted = (batch["labels"] != -100).to(per_token.dtype)
            per_sample = (per_token * counted).sum(1) / counted.sum(1).clamp(min=1)
            loss = (per_sample * batch["weight"]).sum() / batch["weight"].sum()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def padded_batches(num: int, batch_size: int, length: int, counted: list, vocab: int = 32, seed: int = 0) -> list[dict]:
    """Dict batches ``{input_ids, labels, weight}``: sample ``i`` has ``counted[i % len(counted)]``
    labels, the rest -100 (very unequal token counts per microbatch); ``counted`` may also hold one
    such list per batch (batch ``b`` uses ``counted[b % len(counted)]``)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    per_batch = counted if isinstance(counted[0], list) else [counted]
    for b in range(num):
        counted = per_batch[b % len(per_batch)]
        ids = torch.randint(0, vocab, (batch_size, length), generator=generator)
        labels = torch.randint(0, vocab, (batch_size, length), generator=generator)
        for i in range(batch_size):
            labels[i, counted[i % len(counted)] :] = -100
        weight = torch.rand(batch_size, generator=generator, dtype=torch.float64) + 0.5
        batches.append({"input_ids": ids, "labels": labels, "weight": weight})
    return batches


class TimeMajorClassifier(L.LightningModule):
    """torch's ``nn.TransformerEncoder`` with ``batch_first=False``: inputs ``(T, B, d)``, targets ``(B,)``."""

    def __init__(self, dim: int = 8, layers: int = 4, classes: int = 3, lr: float = 1e-2, norm: bool = False) -> None:
        super().__init__()
        self.save_hyperparameters()
        layer = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=16, dropout=0.0)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.bn = nn.BatchNorm1d(dim) if norm else nn.Identity()
        self.head = nn.Linear(dim, classes)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch  # [T, B, d], [B]
        h = self.encoder(x).mean(0)  # [B, d]
        loss = F.cross_entropy(self.head(self.bn(h)), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def time_major_batches(num: int, batch_size: int, length: int, dim: int = 8, classes: int = 3, seed: int = 0) -> list:
    """``(x [T, B, d], y [B])`` batches (float64)."""
    generator = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(length, batch_size, dim, generator=generator, dtype=torch.float64),
            torch.randint(0, classes, (batch_size,), generator=generator),
        )
        for _ in range(num)
    ]


class DirectHeadDecoder(L.LightningModule):
    """The head is the embedding's own weight, used directly: ``self.norm(h) @ self.embed.weight.T``."""

    def __init__(self, vocab: int = 32, dim: int = 16, layers: int = 4, heads: int = 2, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(64, dim) * 0.02)  # a free parameter of the root, used in pre
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            h = block(h)
        logits = self.norm(h) @ self.embed.weight.T
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.1)


class GatedGPT(TinyGPT):
    """Free parameters of the root used at later units: a gate applied after block ``gate_at`` (inputs of
    the next block) and a temperature in the head; the head is declared before the blocks."""

    def __init__(self, layers: int = 4, gate_at: int = 1, **kwargs) -> None:
        super().__init__(layers=layers, **kwargs)
        dim, vocab = self.hparams.dim, self.hparams.vocab
        self.gate_at = gate_at
        del self.head
        head = nn.Linear(dim, vocab, bias=False)
        blocks = self.blocks
        del self.blocks, self.ln_f, self.wte, self.wpe
        self.head = head  # declared before everything else
        self.temperature = nn.Parameter(torch.tensor(1.5))
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(64, dim)
        self.blocks = blocks
        self.gate = nn.Parameter(torch.linspace(0.5, 1.5, dim))
        self.ln_f = nn.LayerNorm(dim)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for i, block in enumerate(self.blocks):
            x = block(x)
            if i == self.gate_at:
                x = x * self.gate
        return self.head(self.ln_f(x)) / self.temperature


class LoopedStack(TinyGPT):
    """Runs its block stack twice per step (weights shared across depth, as looped models do)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T, device=idx.device))
        for _ in range(2):
            for block in self.blocks:
                x = block(x)
        return self.head(self.ln_f(x))


class AuxBlock(Block):
    """A block that also returns an auxiliary loss (as mixture-of-experts layers do)."""

    def forward(self, x: torch.Tensor):
        out = super().forward(x)
        return out, out.pow(2).mean() * 1e-2


class AuxLossGPT(TinyGPT):
    """Sums the blocks' auxiliary losses in its own loop: a value carried across blocks outside their outputs."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        super().__init__(layers=0, **kwargs)
        self.blocks = nn.ModuleList([AuxBlock(self.hparams.dim, self.hparams.heads) for _ in range(layers)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        idx, targets = batch[:, :-1], batch[:, 1:]
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        aux = 0.0
        for block in self.blocks:
            x, block_aux = block(x)
            aux = aux + block_aux
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)) + aux


class HookedAuxGPT(TinyGPT):
    """Collects a statistic of every block's MLP with a forward hook (as router logits are collected) and
    adds it to the loss: produced inside the blocks, never among their outputs."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        super().__init__(layers=layers, **kwargs)
        self.collected: list[torch.Tensor] = []
        for block in self.blocks:
            block.mlp.register_forward_hook(lambda module, args, out: self.collected.append(out.pow(2).mean()))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        self.collected = []
        logits = self(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))
        return loss + 1e-2 * torch.stack(self.collected).sum()


def with_spare_parameter(module: TinyGPT) -> TinyGPT:
    """Give a block a parameter the step never uses: no gradient on one device, so AdamW's weight
    decay skips it; replicas must hand it back without one too (not a zero gradient)."""
    module.blocks[2].spare = nn.Parameter(torch.ones(4, dtype=torch.float64))
    return module
