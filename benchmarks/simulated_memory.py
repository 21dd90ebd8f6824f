"""Simulated step time against the memory budget: no recompute, full, keep-attention, the planner's plans.

A 7B-like GPT (32 layers, h=4096, 32 heads, vocabulary 32000; bf16 activations, flash attention,
mixed-precision Adam: 16 bytes of static state per parameter) on 4 and 8 pipeline stages (1F1B,
uniform partition, 2 microbatches per stage, one sequence per microbatch), at 8k to 128k tokens per
sequence, plus one long-tailed batch mixing lengths. For each memory budget per device, every
policy's step time is the simulated makespan (``lightning_pipe.schedules.simulate`` with the
recompute and offload costs of ``planning.memory_planner.step_seconds``); a policy whose predicted
peak (``planning.memory_model.predict_memory``: static + saved activations alive + one-block
recompute/reload transient) exceeds the budget is OOM.

Policies: ``none`` (keep everything), ``full`` (every block recomputed), ``keep_attn`` (every block
recomputed except attention, HelixPipe), ``planner`` (the MILP's fastest plan per (stage,
microbatch) among none/full/keep-attention), ``planner+offload`` (offload allowed too, host link
25 GB/s; host memory is not limited, its peak is printed).

Saved bytes per token of a block are MEASURED, not assumed: the benchmark first probes the GPT block
of ``examples/gpt/model.py`` in bf16 at small widths (h = 64 .. 256) with the same saved-tensor
hooks the strategy uses, fits ``bytes/token = alpha * h + beta * heads`` per mode, and scales to the
7B shape. Times come from ``planning.gpt.gpt_cost_model`` (A100-class: 312 TFLOP/s at 50%).

How it was run (numbers in docs/memory.md)::

    python benchmarks/simulated_memory.py --plot docs/img/memory_budget.png

on 2 CPU cores; ``--quick`` runs one small configuration.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from lightning_pipe.planning.cost_model import LinearCost, MicrobatchShape  # noqa: E402
from lightning_pipe.planning.gpt import gpt_cost_model  # noqa: E402
from lightning_pipe.planning.memory_model import (  # noqa: E402
    MemoryPlan,
    MemoryProfile,
    UnitMemory,
    predict_memory,
)
from lightning_pipe.planning.memory_planner import MemoryBudgetError, plan_memory, step_seconds  # noqa: E402
from lightning_pipe.schedules import resolve_schedule  # noqa: E402

GIB = 2**30
LAYERS, HIDDEN, HEADS, VOCAB = 32, 4096, 32, 32000
MODES = ("none", "full", "keep_attention")


def measure_block_coefficients() -> dict[str, tuple[float, float]]:
    """Probe the example GPT block in bf16; per mode ``(alpha, beta)`` of ``bytes/token = alpha*h + beta*heads``."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
    from examples.gpt.model import GPT

    from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks
    from lightning_pipe.runtime.memory import MemoryRuntime
    from lightning_pipe.profiling.memory_profile import measure_stages
    from lightning_pipe.strategies.memory import build_profile

    rows, values = [], {m: [] for m in MODES}
    for hidden, heads in ((64, 1), (128, 2), (128, 4), (256, 4)):
        torch.manual_seed(0)
        model = GPT(vocab_size=256, block_size=1024, n_layer=2, n_head=heads, n_embd=hidden).to(torch.bfloat16)
        model.log = lambda *args, **kwargs: None
        stack = find_blocks(model)
        probes = [(torch.randint(0, 256, (b, t + 1)), 0) for b, t in ((2, 256), (1, 256), (2, 128))]
        records = measure_stages(
            StageRunner(model, stack), MemoryRuntime(stack.blocks, "cpu"), "training_step", probes,
            [StageSpan(0, 0, 2, 2)], list(model.parameters()), torch.device("cpu"),
        )
        profile = build_profile(records, model, analyze_units(model, stack), 8.0)
        rows.append([hidden, heads])
        for mode in MODES:
            values[mode].append(profile.units[1].saved[mode].per_token)
    matrix = np.array(rows, dtype=float)
    return {m: tuple(np.linalg.lstsq(matrix, np.array(values[m]), rcond=None)[0]) for m in MODES}


def gpt7b_profile(coefficients: dict[str, tuple[float, float]]) -> MemoryProfile:
    """The 7B shape with measured per-token block bytes; ``post`` keeps 4h + 2V bytes per token (measured form)."""
    block_params = 12 * HIDDEN**2 + 13 * HIDDEN
    saved = {m: LinearCost(0.0, a * HIDDEN + b * HEADS) for m, (a, b) in coefficients.items()}
    units = [UnitMemory("pre", {"none": LinearCost()}, 2.0 * VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN)]
    units += [UnitMemory(f"block.{i}", saved, 2.0 * block_params, block_params, HIDDEN) for i in range(LAYERS)]
    units += [UnitMemory("post", {"none": LinearCost(0.0, 4.0 * HIDDEN + 2.0 * VOCAB)}, 2.0 * VOCAB * HIDDEN, VOCAB * HIDDEN, HIDDEN)]
    return MemoryProfile(tuple(units), static_bytes_per_parameter_byte=8.0)  # 16 bytes per bf16 parameter


def run_policies(stages: int, lengths: list[int], budget: float, profile: MemoryProfile, cost_model) -> dict:
    program = resolve_schedule("1f1b").build(stages, len(lengths))
    per = LAYERS // stages
    boundaries = tuple(range(0, LAYERS + 1, per))
    shapes = [MicrobatchShape.from_lengths([n]) for n in lengths]
    out = {}
    for name, plan in (
        ("none", MemoryPlan()),
        ("full", MemoryPlan.from_options("full")),
        ("keep_attn", MemoryPlan.from_options("keep_attention")),
    ):
        prediction = predict_memory(program, boundaries, shapes, plan, profile)
        fits = prediction.fits(budget)
        seconds = step_seconds(program, boundaries, shapes, profile, plan, cost_model=cost_model)
        out[name] = (seconds if fits else None, max(prediction.peak_bytes), 0.0)
    for name, options in (("planner", ("full", "keep_attention")), ("planner+offload", ("full", "keep_attention", "offload"))):
        try:
            result = plan_memory(program, boundaries, shapes, profile, budget, cost_model=cost_model, options=options)
            out[name] = (result.step_seconds, max(result.prediction.peak_bytes), max(result.prediction.host_peak_bytes))
        except MemoryBudgetError:
            out[name] = (None, None, 0.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of step time vs budget")
    parser.add_argument("--quick", action="store_true", help="one small configuration (smoke test)")
    parser.add_argument(
        "--profile", help="a GPU profile from benchmarks/gpu/profile_blocks.py: a second table priced by its measured 7B costs"
    )
    args = parser.parse_args()
    started = time.perf_counter()

    coefficients = measure_block_coefficients()
    print("measured saved bytes per token of one block (bf16): " + ", ".join(
        f"{m}: {a:.2f}*h + {b:.1f}*heads" for m, (a, b) in coefficients.items()))
    profile = gpt7b_profile(coefficients)
    sources = {"FLOP model (A100-class 312 TFLOP/s at 50%)": gpt_cost_model(
        LAYERS, HIDDEN, HEADS, VOCAB, device_flops=312e12, efficiency=0.5)}
    if args.profile:
        from benchmarks.gpu.profile_blocks import load_measured_models

        device, measured = load_measured_models(args.profile)
        sources[f"measured on {device} ({args.profile})"] = measured["7b"]

    stage_counts = (4,) if args.quick else (4, 8)
    seqs = {"8k": 8192, "32k": 32768, "128k": 131072} if args.quick else {
        "8k": 8192, "16k": 16384, "32k": 32768, "64k": 65536, "128k": 131072, "mixed": None}
    budgets = (48, 80) if args.quick else (40, 48, 56, 64, 72, 80)
    policies = ("none", "full", "keep_attn", "planner", "planner+offload")
    first_results = None
    for costs, cost_model in sources.items():
        results = {}
        for stages in stage_counts:
            microbatches = 2 * stages
            for label, length in seqs.items():
                if length is None:  # long tail: one 128k, one 64k, two 32k, the rest 8k-16k
                    lengths = [131072, 65536, 32768, 32768] + [16384, 8192] * ((microbatches - 4) // 2)
                else:
                    lengths = [length] * microbatches
                for budget in budgets:
                    results[(stages, label, budget)] = run_policies(stages, lengths, budget * GIB, profile, cost_model)
        first_results = first_results or results
        print(f"\nstep seconds priced by: {costs}")
        print_table(results, policies)

    print(
        f"\nmachine: {platform.machine()} {platform.system()}, python {platform.python_version()}, torch {torch.__version__}; "
        f"command: python {' '.join(sys.argv)}; wall {time.perf_counter() - started:.1f} s"
    )
    if args.plot:
        plot(first_results, stage_counts, list(seqs), budgets, policies, args.plot)


def print_table(results: dict, policies: tuple[str, ...]) -> None:
    """One markdown row per (stages, sequence, budget): each policy's seconds, the planner's gain."""
    header = "| stages | seq | budget GiB | " + " | ".join(f"{p} s" for p in policies) + " | planner vs best fixed | offload host GiB |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for (stages, label, budget), row in results.items():
        cells = ["OOM" if row[p][0] is None else f"{row[p][0]:.2f}" for p in policies]
        fixed = [row[p][0] for p in ("none", "full", "keep_attn") if row[p][0] is not None]
        gain = "" if not fixed or row["planner"][0] is None else f"{min(fixed) / row['planner'][0]:.2f}x"
        host = row["planner+offload"][2]
        print(f"| {stages} | {label} | {budget} | " + " | ".join(cells) + f" | {gain} | {host / GIB:.0f} |")


def plot(results, stage_counts, seqs, budgets, policies, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [s for s in ("8k", "32k", "128k", "mixed") if s in seqs]
    fig, axes = plt.subplots(len(stage_counts), len(shown), figsize=(4 * len(shown), 3.3 * len(stage_counts)), squeeze=False)
    styles = {"none": "k-o", "full": "C3-s", "keep_attn": "C1-^", "planner": "C0-D", "planner+offload": "C2--x"}
    for i, stages in enumerate(stage_counts):
        for j, label in enumerate(shown):
            ax = axes[i][j]
            for p in policies:
                xs = [b for b in budgets if results[(stages, label, b)][p][0] is not None]
                ys = [results[(stages, label, b)][p][0] for b in xs]
                if xs:
                    ax.plot(xs, ys, styles[p], label=p, markersize=4, linewidth=1.2)
            ax.set_title(f"{stages} stages, {label} tokens/seq", fontsize=10)
            ax.set_xlabel("memory budget per GPU (GiB)")
            if j == 0:
                ax.set_ylabel("simulated step time (s)")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("7B GPT, 1F1B, 2 microbatches per stage: step time vs memory budget (missing point = does not fit)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
