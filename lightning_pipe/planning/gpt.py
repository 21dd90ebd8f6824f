"""Analytic cost model of a GPT-style decoder from its shape and the device's speed.

Standard counts (Narayanan et al., 2021; Korthikanti et al., 2022), per transformer layer, for a
microbatch of ``T`` tokens whose sequences have squared lengths summing to ``Q``:

- forward FLOPs ``24 * h^2 * T + 4 * h * Q`` (QKV, projection and MLP matmuls; ``Q K^T`` and
  ``A V``, counted without the causal halving), backward twice the forward;
- parameters ``12 * h^2 + 13 * h``;
- activations kept for backward ``34 * h * T`` bytes with 16-bit activations, plus ``5 * a * Q``
  for the attention scores and softmax unless flash attention keeps them out of memory.

``pre`` is the token embedding (``vocab * h`` parameters, negligible compute), ``post`` the final
norm, the untied LM head (``2 * h * vocab * T`` forward FLOPs) and the loss, which keeps fp32 logits
(``4 * vocab`` bytes per token) for backward. Seconds are FLOPs divided by
``device_flops * efficiency``. Memory for mixed precision with Adam: parameters and gradients in the
parameter dtype, and ``optimizer_bytes_per_parameter`` (12: fp32 master copy and two moments). With
``full_recompute`` a layer keeps only its input (``2 * h`` bytes per token) and its backward costs
three forwards instead of two.
"""

from __future__ import annotations

from lightning_pipe.planning.cost_model import CostModel, LinearCost, UnitCost


def gpt_cost_model(
    num_layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    *,
    params_dtype_bytes: int = 2,
    device_flops: float = 312e12,
    efficiency: float = 0.5,
    flash_attention: bool = True,
    activation_bytes_per_token: float | None = None,
    full_recompute: bool = False,
    optimizer_bytes_per_parameter: float = 12.0,
    unit_overhead_seconds: float = 0.0,
    latency: float = 10e-6,
    bandwidth: float = 50e9,
) -> CostModel:
    """Cost model of a GPT-style decoder with ``num_layers`` identical blocks.

    Args:
        num_layers: transformer layers (the blocks).
        hidden: model width ``h``.
        heads: attention heads ``a`` (only matters without flash attention).
        vocab: vocabulary size.
        params_dtype_bytes: bytes per parameter and per gradient (2 for bf16).
        device_flops: peak FLOP/s of one device (312e12: A100 bf16 dense).
        efficiency: fraction of the peak reached (model FLOPs utilization).
        flash_attention: if True, attention scores are not stored (no quadratic memory term).
        activation_bytes_per_token: bytes a layer keeps per token; default ``34 * h`` (16-bit
            activations, no recomputation), or ``2 * h`` with ``full_recompute``.
        full_recompute: model full activation recomputation of every layer: a layer keeps only its
            16-bit input (``2 * h`` bytes per token) and its backward recomputes the forward first
            (three forwards' worth of FLOPs instead of two).
        optimizer_bytes_per_parameter: optimizer state per parameter (12 for mixed-precision Adam).
        unit_overhead_seconds: fixed seconds per unit and microbatch, forward (backward: twice).
        latency: seconds per point-to-point message between stages.
        bandwidth: bytes per second between stages (50e9: the paper's InfiniBand).

    Returns:
        A :class:`CostModel` with units ``[pre, block_0 .. block_{n-1}, post]``.

    Raises:
        ValueError: for non-positive sizes or speeds.
    """
    for name, value in (("num_layers", num_layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
        if value < 1:
            raise ValueError(f"`{name}` must be >= 1, got {value}.")
    if not device_flops > 0 or not 0 < efficiency <= 1:
        raise ValueError(
            f"`device_flops` must be > 0 and `efficiency` in (0, 1], got device_flops={device_flops}, efficiency={efficiency}."
        )
    h = float(hidden)
    rate = device_flops * efficiency
    per_parameter = 2.0 * params_dtype_bytes + optimizer_bytes_per_parameter
    default_saved = 2.0 * h if full_recompute else 34.0 * h
    saved_per_token = default_saved if activation_bytes_per_token is None else float(activation_bytes_per_token)

    def unit(
        name: str,
        token_flops: float,
        square_flops: float,
        params: float,
        saved: LinearCost,
        out: float,
        recompute: bool = False,
    ) -> UnitCost:
        factor = 3.0 if recompute else 2.0
        return UnitCost(
            name=name,
            forward=LinearCost(unit_overhead_seconds, token_flops / rate, square_flops / rate),
            backward=LinearCost(
                factor * unit_overhead_seconds, factor * token_flops / rate, factor * square_flops / rate
            ),
            saved_bytes=saved,
            output_bytes_per_token=out,
            parameter_bytes=params * params_dtype_bytes,
            gradient_bytes=params * params_dtype_bytes,
            optimizer_bytes=params * (per_parameter - 2.0 * params_dtype_bytes),
        )

    activation_out = 2.0 * h  # 16-bit hidden state crosses stage boundaries
    pre = unit("pre", 0.0, 0.0, vocab * h, LinearCost(), activation_out)
    blocks = [
        unit(
            f"block.{i}",
            24.0 * h * h,
            4.0 * h,
            12.0 * h * h + 13.0 * h,
            LinearCost(0.0, saved_per_token, 0.0 if flash_attention or full_recompute else 5.0 * heads),
            activation_out,
            full_recompute,
        )
        for i in range(num_layers)
    ]
    post = unit("post", 2.0 * h * vocab, 0.0, vocab * h + 2.0 * h, LinearCost(0.0, 2.0 * h + 4.0 * vocab), 0.0)
    return CostModel(units=(pre, *blocks, post), latency=latency, bandwidth=bandwidth)


def gpt_1_3b(**options: float | bool) -> CostModel:
    """GPT 1.3B: 24 layers, hidden 2048, 16 heads, vocabulary 50257 (options as :func:`gpt_cost_model`)."""
    return gpt_cost_model(24, 2048, 16, 50257, **options)


def gpt_7b(**options: float | bool) -> CostModel:
    """GPT 7B: 32 layers, hidden 4096, 32 heads, vocabulary 32000 (options as :func:`gpt_cost_model`)."""
    return gpt_cost_model(32, 4096, 32, 32000, **options)
