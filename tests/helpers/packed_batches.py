"""Batches of sequences of different lengths, right-padded as a tokenizer pads them, for packing tests."""

from __future__ import annotations

import torch


def padded_lm_batches(
    num: int, batch_size: int, max_len: int, vocab: int = 64, min_len: int = 2, seed: int = 0
) -> list[dict]:
    """Right-padded transformers-style batches: ``input_ids``, ``attention_mask``, ``labels``
    (-100 at padding), each sample of its own random length in ``[min_len, max_len]`` (one sample
    of each batch is ``max_len`` long, so the batch is as wide as it says)."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(num):
        lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=generator)
        lengths[0] = max_len
        ids = torch.randint(1, vocab, (batch_size, max_len), generator=generator)
        mask = (torch.arange(max_len)[None, :] < lengths[:, None]).long()
        ids = ids.masked_fill(mask == 0, 0)
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return batches
