"""Reading a step's loss normalisation and deciding microbatch weights (no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_pipe.model.loss_counting import MEAN, SUM, LossCounter
from lightning_pipe.runtime.loss_weights import DeferredNormalization, decide, raw_weight, upfront_weights


def _record(step):
    counter = LossCounter()
    with counter:
        returned, logged = step()
    return counter.record(returned, logged)


def _logits_and_labels(counted: int, n: int = 6, classes: int = 4):
    torch.manual_seed(counted)
    labels = torch.randint(0, classes, (n,))
    labels[counted:] = -100
    return torch.randn(n, classes, dtype=torch.float64, requires_grad=True), labels


def test_cross_entropy_mean_counts_the_targets_not_ignored():
    logits, labels = _logits_and_labels(2)
    record = _record(lambda: (F.cross_entropy(logits, labels) * 0.5, []))
    assert record.returned.kind == MEAN and record.returned.factor == 0.5
    assert record.count_of(record.returned).item() == 2
    assert raw_weight(record, 3).item() == 2


def test_class_weights_and_modules_count_weighted_targets():
    logits, labels = _logits_and_labels(3)
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    record = _record(lambda: (torch.nn.CrossEntropyLoss(weight=weight, ignore_index=-100)(logits, labels), []))
    assert record.count_of(record.returned).item() == pytest.approx(weight[labels[:3]].sum().item())


def test_a_sum_divided_by_its_counted_targets_is_a_mean():
    logits, labels = _logits_and_labels(4)
    step = lambda: (F.cross_entropy(logits, labels, reduction="sum") / (labels != -100).sum(), [])  # noqa: E731
    record = _record(step)
    assert record.returned.kind == MEAN and record.count_of(record.returned).item() == 4


def test_logged_copies_are_traced_and_combinations_are_not():
    logits, labels = _logits_and_labels(2)

    def step():
        loss = F.cross_entropy(logits, labels)
        return loss + 0.1 * logits.pow(2).mean(), [loss.detach()]

    record = _record(step)
    assert record.returned is None and len(record.logged) == 1


def test_counted_means_are_weighted_by_their_counts():
    records = [_record(lambda c=c: (F.cross_entropy(*_logits_and_labels(c)), [])) for c in (1, 5)]
    decided = decide(records, [3, 3], [raw_weight(r, 3) for r in records], deferred=True)
    assert decided.weights == pytest.approx([1 / 6, 5 / 6]) and decided.normalizer == 6 and decided.by_tokens


def test_a_mixed_loss_with_uneven_counts_is_refused():
    def step(c):
        logits, labels = _logits_and_labels(c)
        return F.cross_entropy(logits, labels) + logits.mean(), []

    records = [_record(lambda c=c: step(c)) for c in (1, 5)]
    with pytest.raises(ValueError, match=r"calls `F.cross_entropy\(reduction='mean'\)`, which averages over \[1.0, 5.0\]"):
        decide(records, [3, 3], [3.0, 3.0], deferred=True)


def test_a_sum_not_divided_by_samples_is_refused():
    records = [_record(lambda c=c: (F.cross_entropy(*_logits_and_labels(c), reduction="sum"), [])) for c in (2, 2)]
    assert records[0].returned.kind == SUM
    with pytest.raises(ValueError, match=r"loss_weights='sum'"):
        decide(records, [3, 3], [3.0, 3.0], deferred=True)
    per_sample = [_record(lambda: (F.mse_loss(torch.ones(3, 2), torch.zeros(3, 2), reduction="sum") / 3, []))] * 2
    assert decide(per_sample, [3, 3], [3.0, 3.0], deferred=True).weights == [0.5, 0.5]


def test_counted_means_with_optimizer_offload_must_be_proportional_to_samples():
    records = [_record(lambda c=c: (F.cross_entropy(*_logits_and_labels(c)), [])) for c in (1, 5)]
    with pytest.raises(ValueError, match="optimizer_offload=True"):
        decide(records, [3, 3], [0.5, 0.5], deferred=False)


def test_deferred_normalization_keeps_earlier_gradients():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([1.0, 1.0])
    deferred = DeferredNormalization([p])
    deferred.begin()
    assert p.grad is None
    p.grad = torch.tensor([4.0, 8.0])
    deferred.end(4.0)
    assert torch.equal(p.grad, torch.tensor([2.0, 3.0]))


def test_transformers_causal_lm_loss_is_traced_to_its_counted_labels():
    """transformers' `labels=` loss (ForCausalLMLoss: shift, then F.cross_entropy with -100) is a
    counted mean; its count is the shifted labels that are not -100."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 32, (2, 6))
    labels = ids.clone()
    labels[0, 3:] = -100
    record = _record(lambda: (model(input_ids=ids, labels=labels).loss, []))
    assert record.returned is not None and record.returned.kind == MEAN
    assert record.count_of(record.returned).item() == (labels[:, 1:] != -100).sum().item()


def test_a_factor_that_changes_between_microbatches_is_refused():
    records = [_record(lambda c=c: (F.cross_entropy(*_logits_and_labels(c)) / c, [])) for c in (2, 4)]
    with pytest.raises(ValueError, match=r"times a factor that differs between microbatches \(\[0.5, 0.25\]\)"):
        decide(records, [3, 3], [raw_weight(r, 3) for r in records], deferred=True)


def test_a_loss_that_is_a_mean_in_some_microbatches_only_is_refused():
    means = _record(lambda: (F.cross_entropy(*_logits_and_labels(2)), []))
    other = _record(lambda: (torch.ones(()), []))
    with pytest.raises(ValueError, match=r"in some microbatches but not in others \(microbatches \[0\] of 2\)"):
        decide([means, other], [3, 3], [2.0, 3.0], deferred=True)


def test_user_weights_are_normalised_and_checked():
    assert upfront_weights(lambda mb: mb, [1.0, 3.0], [2, 2]) == [0.25, 0.75]
    assert upfront_weights("sum", [None, None], [2, 2]) == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"`loss_weights` returned \[-1.0, 3.0\]"):
        upfront_weights(lambda mb: mb, [-1.0, 3.0], [2, 2])


def test_deferred_normalization_scales_dense_and_sparse_gradients_alike():
    """Dense gradients are scaled in one foreach call; a sparse embedding's gradient cannot be, and is
    scaled on its own: every gradient ends as this step's divided by the normalizer."""
    embedding, linear = torch.nn.Embedding(5, 3, sparse=True), torch.nn.Linear(3, 2)
    params = [*embedding.parameters(), *linear.parameters()]
    deferred = DeferredNormalization(params)
    deferred.begin()
    linear(embedding(torch.tensor([1, 2, 2]))).sum().backward()
    expected = [p.grad.to_dense() / 4 for p in params]
    deferred.end(4.0)
    assert embedding.weight.grad.is_sparse
    for p, want in zip(params, expected):
        assert torch.equal(p.grad.to_dense(), want)


def test_loss_arguments_are_read_as_signature_bind_reads_them():
    import inspect

    from lightning_pipe.model.loss_counting import _arguments

    logits, labels = _logits_and_labels(3)
    weight = torch.ones(4, dtype=torch.float64)
    calls = [
        (F.cross_entropy, (logits, labels), {}),
        (F.cross_entropy, (logits, labels, weight), {"ignore_index": 1, "reduction": "sum"}),
        (F.cross_entropy, (), {"input": logits, "target": labels, "label_smoothing": 0.1}),
        (F.nll_loss, (logits, labels, None, None, -100, None, "mean"), {}),
        (F.mse_loss, (logits,), {"target": logits.detach()}),
    ]
    for func, args, kwargs in calls:
        assert _arguments(func, args, kwargs) == dict(inspect.signature(func).bind(*args, **kwargs).arguments)


def test_deferred_normalization_divides_by_what_the_losses_were_not_divided_by_already():
    """Losses divided by ``expected`` upfront: what remains is expected / normalizer, and nothing when
    the guess was right (the gradient is left as the backward made it)."""
    p = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    p.grad = torch.tensor([1.0, 1.0], dtype=torch.float64)
    deferred = DeferredNormalization([p], expected=8.0)
    deferred.begin()
    this_step = torch.tensor([0.5, 0.25], dtype=torch.float64)  # sum of the losses' gradients / 8
    p.grad = this_step.clone()
    deferred.end(8.0)
    assert torch.equal(p.grad, torch.tensor([1.5, 1.25], dtype=torch.float64))

    p.grad = None
    deferred = DeferredNormalization([p], expected=8.0)
    deferred.begin()
    p.grad = this_step.clone()
    before = p.grad
    deferred.end(8.0)
    assert p.grad is before and torch.equal(p.grad, this_step)  # no earlier gradient, no multiplication

    p.grad = None
    deferred = DeferredNormalization([p], expected=8.0)
    deferred.begin()
    p.grad = this_step.clone()
    deferred.end(4.0)  # the guess was wrong: twice as much remains
    assert torch.equal(p.grad, this_step * 2)
