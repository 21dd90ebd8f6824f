"""Sub-block units: an unchanged block cut at its attention call equals the block, in float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from examples.gpt.model import GPT
from lightning_pipe.model.sub_blocks import BlockNotSplittable, split_block_at_attention


def _grads(output, inputs):
    return torch.autograd.grad(output.sum(), inputs)


def _assert_units_equal_block(block, units, make_inputs, shapes):
    params = list(block.parameters())
    for shape in shapes:
        args, kwargs, leaf = make_inputs(*shape)
        expected = block(*args, **kwargs)
        got = units(*args, **kwargs)
        assert torch.equal(got, expected), shape
        for a, b in zip(_grads(got, [leaf, *params]), _grads(expected, [leaf, *params]), strict=True):
            assert torch.equal(a, b), shape


def test_gpt_example_block_cut_at_sdpa():
    torch.manual_seed(0)
    block = GPT(n_layer=2, n_embd=32, n_head=4).double().blocks[0]

    def make_inputs(b, s):
        x = torch.randn(b, s, 32, dtype=torch.float64, requires_grad=True)
        return (x,), {}, x

    units = split_block_at_attention(block, *make_inputs(2, 8)[:2])
    # the units hold the block's own parameters: gradients land where a one-process run puts them
    block_params = {id(p) for p in block.parameters()}
    assert {id(p) for p in units.pre.parameters()} | {id(p) for p in units.post.parameters()} == block_params
    assert not list(units.attention.parameters())
    assert {n for n, _ in units.pre.named_parameters()} == {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias"}
    _assert_units_equal_block(block, units, make_inputs, [(2, 8), (1, 5), (3, 19)])  # one capture, any shape
    x = torch.randn(1, 4, 32, dtype=torch.float64)
    attention_inputs, carried = units.run_pre(x)
    assert [tuple(t.shape) for t in attention_inputs] == [(1, 4, 4, 8)] * 3  # q, k, v by heads
    # what crossed a process boundary arrives contiguous: the units restore the layout the capture saw
    moved = [t.contiguous() for t in attention_inputs]
    output = units.run_attention(*moved).contiguous()
    assert torch.equal(units.run_post(output, *carried), block(x))


def test_transformers_llama_layer_cut_at_its_attention_interface():
    pytest.importorskip("transformers")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    def config(implementation):
        return LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation=implementation,
        )

    torch.manual_seed(0)
    layer = LlamaDecoderLayer(config("sdpa"), 0).double()
    rope = LlamaRotaryEmbedding(config("sdpa"))

    def make_inputs(b, s):
        x = torch.randn(b, s, 32, dtype=torch.float64, requires_grad=True)
        cos, sin = rope(x, torch.arange(s)[None].expand(b, s))
        return (x,), {"position_embeddings": (cos.double(), sin.double()), "attention_mask": None}, x

    units = split_block_at_attention(layer, *make_inputs(2, 8)[:2])
    _assert_units_equal_block(layer, units, make_inputs, [(2, 8), (1, 11)])
    eager = LlamaDecoderLayer(config("eager"), 0).double()
    with pytest.raises(BlockNotSplittable, match="no attention call.*attn_implementation='sdpa'"):
        split_block_at_attention(eager, *make_inputs(2, 8)[:2])


class _TwoAttentions(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).unsqueeze(1)
        y = F.scaled_dot_product_attention(q, q, q)
        return F.scaled_dot_product_attention(y, y, y).squeeze(1) + x


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        q = self.proj(x).unsqueeze(1)
        if q.sum() > 0:  # a branch on values: no graph serves every batch
            q = q * 2
        return F.scaled_dot_product_attention(q, q, q).squeeze(1)


def test_a_size_fixed_by_the_example_is_refused_with_what_to_do():
    block = GPT(n_layer=1, n_embd=16, n_head=2).double().blocks[0]
    units = split_block_at_attention(block, (torch.randn(1, 6, 16, dtype=torch.float64),))  # batch 1: fixed
    with pytest.raises(BlockNotSplittable, match="at least 2"):
        units(torch.randn(2, 6, 16, dtype=torch.float64))


@pytest.mark.parametrize(("block", "reason"), [(_TwoAttentions(), "2 attention calls"), (_DataDependent(), "could not capture")])
def test_blocks_that_cannot_be_cut_are_refused(block, reason):
    with pytest.raises(BlockNotSplittable, match=reason):
        split_block_at_attention(block, (torch.randn(2, 6, 8),))


def test_chunked_mlp_runs_post_attentions_mlp_in_sequence_chunks():
    """HelixPipe's chunked MLP: the MLP part of the post-attention graph runs chunk by chunk (same values
    up to summation order, same parameters, gradients too); a block without such a submodule is refused."""
    torch.manual_seed(0)
    block = GPT(n_layer=2, n_embd=32, n_head=4).double().blocks[0]
    units = split_block_at_attention(block, (torch.randn(2, 8, 32, dtype=torch.float64),))
    chunked = units.chunk_mlp(3)
    calls = []
    chunked.post.chunked_mlp.inner.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[-2]))
    x = torch.randn(2, 10, 32, dtype=torch.float64, requires_grad=True)
    attention_inputs, carried = units.run_pre(x)
    out = units.run_attention(*attention_inputs)
    whole, pieces = units.run_post(out, *carried), chunked.run_post(out, *carried)
    assert calls == [3, 3, 3, 1]
    torch.testing.assert_close(pieces, whole, atol=1e-14, rtol=0)
    grads = [torch.autograd.grad(y.pow(2).sum(), block.mlp.c_fc.weight)[0] for y in (whole, pieces)]
    torch.testing.assert_close(grads[1], grads[0], atol=1e-13, rtol=0)
    with pytest.raises(ValueError, match="no submodule named \\['ffn'\\]"):
        units.chunk_mlp(3, names=("ffn",))
