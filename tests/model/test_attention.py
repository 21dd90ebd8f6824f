"""Packed attention: SDPA calls over a packed row attend within each sequence, per device's kernel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_pipe.model.attention import (
    FLASH_ATTN,
    MASKED_SDPA,
    VARLEN_ATTN,
    PackedAttention,
    block_diagonal_mask,
    select_attention_backend,
    varlen_attention,
)

LENGTHS = [3, 5, 1, 4]


def _qkv(dtype=torch.float64, device="cpu", heads=4, kv_heads=2, requires_grad=False):
    torch.manual_seed(0)
    T = sum(LENGTHS)
    make = lambda h: torch.randn(1, h, T, 8, dtype=dtype, device=device, requires_grad=requires_grad)  # noqa: E731
    return make(heads), make(kv_heads), make(kv_heads)


def _cu(device="cpu"):
    return torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _per_sequence(q, k, v, causal):
    cu = _cu().tolist()
    parts = [
        F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=causal, enable_gqa=True)
        for a, b in zip(cu[:-1], cu[1:])
    ]
    return torch.cat(parts, dim=2)


def test_block_diagonal_mask():
    mask = block_diagonal_mask(torch.tensor([0, 2, 5]), causal=True)
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)
    assert torch.equal(block_diagonal_mask(torch.tensor([0, 2, 5]), causal=False)[3], torch.tensor([0, 0, 1, 1, 1]).bool())


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_in_the_context_attends_within_each_sequence_forward_and_backward(causal):
    q, k, v = _qkv(requires_grad=True)
    with PackedAttention(_cu()) as mode:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    assert mode.calls == {MASKED_SDPA: 1}
    expected = _per_sequence(q, k, v, causal)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    want = torch.autograd.grad(expected.square().sum(), (q, k, v))
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=0)


def test_calls_with_their_own_mask_or_another_length_are_left_alone():
    q, k, v = _qkv(kv_heads=4)
    mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
    with PackedAttention(_cu()) as mode:
        with_mask = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        shorter = F.scaled_dot_product_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True)
    assert mode.calls == {}
    torch.testing.assert_close(with_mask, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(shorter, F.scaled_dot_product_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], is_causal=True))


def test_backend_per_device():
    assert select_attention_backend(torch.device("cpu"), torch.bfloat16) == MASKED_SDPA
    assert select_attention_backend(torch.device("cuda"), torch.float32) == MASKED_SDPA  # no half precision: no flash kernel
    assert select_attention_backend(torch.device("cuda"), torch.bfloat16) in (FLASH_ATTN, VARLEN_ATTN, MASKED_SDPA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash kernels need a CUDA device (none here)")
@pytest.mark.parametrize("backend", [FLASH_ATTN, VARLEN_ATTN])
def test_cuda_kernels_match_per_sequence_attention(backend):
    if backend == FLASH_ATTN:
        pytest.importorskip("flash_attn", reason="flash-attn is not installed (the `cuda` extra)")
    q, k, v = _qkv(dtype=torch.bfloat16, device="cuda", heads=4, kv_heads=4)
    cu = _cu("cuda")
    out = varlen_attention(q, k, v, cu, max(LENGTHS), causal=True, backend=backend)
    expected = _per_sequence(q.float(), k.float(), v.float(), causal=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_slices_attending_to_stored_keys_and_values_equal_the_whole_sequence_forward_and_backward():
    """Three slices of one sequence through a projection and causal SDPA: slice outputs equal the whole
    sequence's; backwards last slice first, each applying the key/value gradients later slices left,
    give the whole sequence's parameter gradients."""
    from lightning_pipe.model.attention import KeyValueStore, SlicedAttention

    torch.manual_seed(0)
    T, C, H = 11, 8, 2
    x = torch.randn(1, T, C, dtype=torch.float64)
    proj = torch.nn.Linear(C, 3 * C).double()

    def attend(part):
        q, k, v = proj(part).split(C, dim=2)
        q, k, v = (t.view(1, -1, H, C // H).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    whole = attend(x)
    whole.square().sum().backward()
    want = [p.grad.clone() for p in proj.parameters()]
    proj.zero_grad()

    store, bounds, outputs = KeyValueStore(), [0, 5, 9, 11], []
    for index, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        with SlicedAttention(store, sample=0, index=index, context=a, block=0):
            outputs.append(attend(x[:, a:b]))
    torch.testing.assert_close(torch.cat(outputs, dim=2), whole, atol=1e-12, rtol=0)
    for index in reversed(range(3)):
        roots, grads = store.pop_roots(0, index, range(1))
        assert len(roots) == (2 if index < 2 else 0)  # the last slice's keys/values feed nobody
        torch.autograd.backward([outputs[index].square().sum(), *roots], [None, *grads])
    for p, w in zip(proj.parameters(), want):
        torch.testing.assert_close(p.grad, w, atol=1e-12, rtol=0)


def test_slices_refuse_non_causal_attention():
    from lightning_pipe.model.attention import KeyValueStore, SlicedAttention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="without `is_causal=True`: only causal attention can be cut into slices"):
        with SlicedAttention(KeyValueStore(), 0, 0, 0, 0):
            F.scaled_dot_product_attention(q, q, q)
