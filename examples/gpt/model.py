"""A small GPT, written as any Lightning user would write it.

Nothing here knows about pipeline parallelism: no special base class, no hooks, no
`nn.Sequential`. This is the module that `Trainer(strategy="elastic_pipe")` is expected to train
unchanged. The layout follows nanoGPT: token and position embeddings, a stack of pre-LayerNorm
transformer blocks in `self.blocks`, a final LayerNorm and a linear head.

Batches are `LongTensor[B, T + 1]`: the model reads tokens `[:, :-1]` and predicts `[:, 1:]`.
Transformers-style dict batches work too (`input_ids`, `labels` with -100 where nothing is
predicted, optional `position_ids`), which is what `ElasticPipelineStrategy(packing=True)` packs:
positions come from the batch, so several sequences can share one row.
"""

import math

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused QKV projection.

    Args:
        n_embd: Width of the residual stream.
        n_head: Number of attention heads; must divide `n_embd`.
        dropout: Dropout probability on attention weights and on the output.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head != 0:
            raise ValueError(f"`n_embd` ({n_embd}) must be divisible by `n_head` ({n_head}).")
        self.n_head = n_head
        self.dropout = dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Attends each position to itself and the positions before it.

        Args:
            x: Hidden states `[B, T, C]`.

        Returns:
            The attention output `[B, T, C]`.
        """
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(C, dim=2)
        # [B, T, C] -> [B, n_head, T, head_size]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.c_proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward network: `C -> 4C -> GELU -> C`.

    Args:
        n_embd: Width of the residual stream.
        dropout: Dropout probability on the output.
    """

    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps hidden states `[B, T, C]` to `[B, T, C]`."""
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: `x + attn(ln(x))`, then `x + mlp(ln(x))`.

    Args:
        n_embd: Width of the residual stream.
        n_head: Number of attention heads.
        dropout: Dropout probability.
    """

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Maps hidden states `[B, T, C]` to `[B, T, C]`."""
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(L.LightningModule):
    """A nanoGPT-like decoder-only language model.

    Args:
        vocab_size: Number of distinct tokens.
        block_size: Longest sequence the position embedding covers.
        n_layer: Number of transformer blocks.
        n_head: Number of attention heads per block.
        n_embd: Width of the residual stream.
        dropout: Dropout probability (0.0 keeps training deterministic).
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied to 2-D parameters only (matrices and
            embeddings, not biases or LayerNorm weights).
        tie_weights: Share the weight of `lm_head` with the token embedding `wte`.
        cosine_schedule: Decay the learning rate along a cosine to 10% of its peak over
            `trainer.estimated_stepping_batches` steps.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 1024,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 64,
        dropout: float = 0.0,
        learning_rate: float = 3e-3,
        weight_decay: float = 0.1,
        tie_weights: bool = False,
        cosine_schedule: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([Block(n_embd, n_head, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight

        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(number of residual additions).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Computes next-token logits.

        Args:
            idx: Token ids `[B, T]` with `T <= block_size`.
            position_ids: Position of each token `[B, T]` (restarting per sequence when several
                sequences are packed in a row); None: `0 .. T-1`.

        Returns:
            Logits `[B, T, vocab_size]`.
        """
        T = idx.size(1)  # idx: [B, T]
        if T > self.hparams.block_size:
            raise ValueError(f"Sequence length {T} exceeds `block_size` ({self.hparams.block_size}).")
        pos = torch.arange(T, dtype=torch.long, device=idx.device) if position_ids is None else position_ids  # [T] or [B, T]
        x = self.drop(self.wte(idx) + self.wpe(pos))  # [B, T, C]
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)  # [B, T, V]

    def _loss(self, batch: torch.Tensor | dict) -> torch.Tensor:
        if isinstance(batch, dict):  # input_ids [B, T], labels [B, T] (the model shifts them), position_ids
            logits = self(batch["input_ids"], batch.get("position_ids"))  # [B, T, V]
            if batch.get("shift_labels") is not None:  # each position's own target, as transformers takes it
                y = batch["shift_labels"]
            else:
                logits, y = logits[:, :-1], batch["labels"][:, 1:]
        else:
            x, y = batch[:, :-1], batch[:, 1:]  # [B, T] each
            logits = self(x)  # [B, T, V]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Returns the mean next-token cross-entropy of a `[B, T + 1]` batch."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        """Logs `val_loss` for a `[B, T + 1]` batch."""
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        """Logs `test_loss` for a `[B, T + 1]` batch."""
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        """Returns the greedy next-token prediction `[B, T]` for the inputs `batch[:, :-1]`."""
        logits = self(batch[:, :-1])
        return logits.argmax(-1)

    def configure_optimizers(self):
        """AdamW with weight decay on 2-D parameters, optionally with a cosine schedule."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.hparams.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
        )
        if not self.hparams.cosine_schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(
            optimizer,
            T_max=max(1, int(self.trainer.estimated_stepping_batches)),
            eta_min=0.1 * self.hparams.learning_rate,
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
