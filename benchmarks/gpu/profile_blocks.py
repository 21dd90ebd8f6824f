"""Measure GPT blocks on a GPU and fit the planner's cost model from the measurements.

For a GPT-1.3B-like block (h=2048, 16 heads) and a GPT-7B-like block (h=4096, 32 heads), both the
example GPT's pre-LayerNorm block (``examples/gpt/model.py``: fused QKV, causal SDPA, 4h GELU MLP)
in bfloat16, and for the LM head with its loss, this script times forward and backward with CUDA
events over microbatches of 512 to 32k tokens (one long sequence, or several shorter ones), counts
the bytes autograd keeps for backward (saved-tensor hooks, one count per storage), fits
``constant + a * tokens + b * sum_squared_lengths`` to each (``planning.fit``), and writes

* the raw samples and fits, with the device and torch version, and
* a cost model per size (``CostModel`` JSON) whose blocks and head are the measured fits (embedding
  and memory of parameters/optimizer from the analytic model), which the simulated benchmarks read
  with ``--profile``.

Run: ``python benchmarks/gpu/profile_blocks.py --out benchmarks/results/gpu_profile.json``
(needs CUDA; about two minutes on an H100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import Block
from lightning_pipe.planning import gpt as gpt_models
from lightning_pipe.planning.cost_model import CostModel, MicrobatchShape
from lightning_pipe.planning.fit import fit_linear_cost

SIZES = {  # name: (hidden, heads, vocab, layers, analytic model)
    "gpt_1_3b": (2048, 16, 50257, 24, gpt_models.gpt_1_3b),
    "gpt_7b": (4096, 32, 32000, 32, gpt_models.gpt_7b),
}
# (sequences, length): tokens from 512 to 32k, with equal tokens at different lengths so the fit can
# tell the per-token from the quadratic term.
GRID = [(1, 512), (2, 512), (8, 512), (1, 1024), (4, 1024), (1, 2048), (2, 2048), (1, 4096), (4, 4096),
        (8, 2048), (1, 8192), (2, 8192), (1, 16384), (1, 32768)]
HEAD_GRID = [(1, 512), (1, 2048), (2, 2048), (1, 4096), (4, 4096), (1, 8192)]


class Head(nn.Module):
    """Final LayerNorm, LM head and cross-entropy loss: the ``post`` unit of a GPT."""

    def __init__(self, hidden: int, vocab: int) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def saved_bytes(run, *inputs) -> tuple[object, int]:
    """Run ``run()`` and count the bytes autograd saves for backward (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        if not isinstance(tensor, nn.Parameter):
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run(*inputs)
    return out, sum(storages.values())


def time_forward_backward(module: nn.Module, make_inputs, repeats: int) -> tuple[float, float, int, int]:
    """Median forward and backward seconds, saved bytes and peak extra bytes of one microbatch."""
    forward_times, backward_times = [], []
    kept, peak = 0, 0
    for i in range(repeats + 2):
        inputs = make_inputs()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, middle, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        start.record()
        out, kept = saved_bytes(module, *inputs)
        middle.record()
        loss = out if out.dim() == 0 else out.float().square().mean()
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        if i >= 2:  # warm-up: allocator, cuDNN/cuBLAS heuristics
            forward_times.append(start.elapsed_time(middle) / 1e3)
            backward_times.append(middle.elapsed_time(end) / 1e3)
        module.zero_grad(set_to_none=True)
    forward_times.sort()
    backward_times.sort()
    return forward_times[len(forward_times) // 2], backward_times[len(backward_times) // 2], kept, peak


def _inputs(unit: str, sequences: int, length: int, hidden: int, vocab: int, device: torch.device) -> tuple:
    """A microbatch for ``unit``: hidden states (and, for the head, targets)."""
    x = torch.randn(sequences, length, hidden, device=device, dtype=torch.bfloat16, requires_grad=True)
    if unit == "block":
        return (x,)
    return (x, torch.randint(0, vocab, (sequences, length), device=device))


def profile_size(name: str, repeats: int, max_tokens: int) -> dict:
    hidden, heads, vocab, layers, analytic = SIZES[name]
    device = torch.device("cuda")
    block = Block(hidden, heads, dropout=0.0).to(device, torch.bfloat16)
    head = Head(hidden, vocab).to(device, torch.bfloat16)
    samples = {"block": [], "post": []}
    for unit, module, grid in (("block", block, GRID), ("post", head, HEAD_GRID)):
        for sequences, length in grid:
            if sequences * length > max_tokens:
                continue

            make_inputs = partial(_inputs, unit, sequences, length, hidden, vocab, device)
            fwd, bwd, kept, peak = time_forward_backward(module, make_inputs, repeats)
            samples[unit].append(
                {"sequences": sequences, "length": length, "forward_s": fwd, "backward_s": bwd,
                 "saved_bytes": kept, "peak_bytes": peak}
            )
            print(f"  {name} {unit:5s} {sequences:2d} x {length:6d}: fwd {fwd * 1e3:8.3f} ms  bwd {bwd * 1e3:8.3f} ms  "
                  f"saved {kept / 2**20:9.1f} MiB  peak {peak / 2**20:9.1f} MiB", flush=True)
    fits = {}
    for unit, rows in samples.items():
        shapes = [MicrobatchShape.from_lengths([r["length"]] * r["sequences"]) for r in rows]
        fits[unit] = {
            key: dataclasses.asdict(fit_linear_cost(shapes, [r[column] for r in rows], holdout_fraction=0.25))
            for key, column in (("forward", "forward_s"), ("backward", "backward_s"), ("saved_bytes", "saved_bytes"))
        }
    model = measured_cost_model(analytic(), fits)
    block_flops = 24.0 * hidden * hidden  # per token, forward, without attention scores
    achieved = block_flops / fits["block"]["forward"]["cost"]["per_token"] if fits["block"]["forward"]["cost"]["per_token"] else 0.0
    return {"hidden": hidden, "heads": heads, "vocab": vocab, "layers": layers, "samples": samples, "fits": fits,
            "block_forward_tflops_per_token_term": achieved / 1e12, "cost_model": model.to_dict()}


def measured_cost_model(analytic: CostModel, fits: dict) -> CostModel:
    """The analytic model with every block and the head replaced by the measured fits."""
    from lightning_pipe.planning.cost_model import LinearCost

    def cost(fit: dict) -> LinearCost:
        return LinearCost(**fit["cost"])

    units = []
    for unit in analytic.units:
        kind = "block" if unit.name.startswith("block") else unit.name
        if kind in fits:
            unit = dataclasses.replace(
                unit, forward=cost(fits[kind]["forward"]), backward=cost(fits[kind]["backward"]),
                saved_bytes=cost(fits[kind]["saved_bytes"]),
            )
        units.append(unit)
    return dataclasses.replace(analytic, units=tuple(units))


def load_measured_models(path: str | Path) -> tuple[str, dict[str, CostModel]]:
    """The device name and the measured cost model per size (``"1.3b"``, ``"7b"``) of a profile this
    script wrote; for the simulated benchmarks' ``--profile`` option."""
    data = json.loads(Path(path).read_text())
    short = {"gpt_1_3b": "1.3b", "gpt_7b": "7b"}
    return data["device"], {short[name]: CostModel.from_dict(size["cost_model"]) for name, size in data["sizes"].items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_profile.json"))
    parser.add_argument("--sizes", nargs="+", default=list(SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=32768)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("profile_blocks.py needs a CUDA device.")
    torch.backends.cuda.matmul.allow_tf32 = True
    started = time.time()
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "dtype": "bfloat16",
        "sizes": {name: profile_size(name, args.repeats, args.max_tokens) for name in args.sizes},
    }
    result["seconds"] = time.time() - started
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"device {result['device']}, torch {result['torch']}; wrote {args.out} in {result['seconds']:.0f} s")
    for name, size in result["sizes"].items():
        for unit, fit in size["fits"].items():
            f, b = fit["forward"], fit["backward"]
            print(f"{name} {unit}: forward {f['cost']} (held-out error {f['relative_error']:.1%}), "
                  f"backward {b['cost']} (error {b['relative_error']:.1%})")


if __name__ == "__main__":
    main()
