"""What zero-bubble's split backward costs over one full backward, on the benchmark GPT's blocks.

One process, one thread: the blocks of ``bench_throughput.py``'s GPT (h=128, 4 heads) on a
microbatch of 4 x 128 tokens, as a middle stage of 1, 2 and 3 blocks (inputs that require
gradients, a given output gradient). Each round times, on fresh forwards, the split pair
(``runtime/split_backward.backward_input``, ``I``, then ``WeightPass.run``, ``W``) and one
``torch.autograd.backward`` (``B``), alternating; gradients accumulate over four microbatches and are
cleared, as in a step. The table gives medians over ``--rounds`` rounds (the first five not counted).
FLOPs split exactly (tests/runtime/test_split_backward.py); what ``I + W - B`` shows is the split's
own work: the graph analysis, the gradients kept for ``W``, its accumulation, memory traffic.

Run: ``python benchmarks/bench_split_backward.py`` (about 20 seconds); to compare two versions of the
library, run it in a checkout of each, one after the other.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import GPT  # noqa: E402
from lightning_pipe.runtime.split_backward import backward_input  # noqa: E402


def measure(blocks: nn.Module, rounds: int) -> dict[str, float]:
    """Median milliseconds of I, W and B over ``rounds`` alternated rounds."""
    x, grad = torch.randn(4, 128, 128), torch.randn(4, 128, 128)
    times: dict[str, list[float]] = {"I": [], "W": [], "B": []}
    for index in range(rounds + 5):
        leaf = x.detach().requires_grad_(True)
        output = blocks(leaf)
        started = time.perf_counter()
        _, weight_pass = backward_input([output], [grad], [leaf])
        middle = time.perf_counter()
        weight_pass.run()
        ended = time.perf_counter()
        leaf = x.detach().requires_grad_(True)
        output = blocks(leaf)
        begun = time.perf_counter()
        torch.autograd.backward([output], [grad])
        done = time.perf_counter()
        if index >= 5:
            times["I"].append(middle - started)
            times["W"].append(ended - middle)
            times["B"].append(done - begun)
        if index % 4 == 3:  # a step's accumulation of four microbatches, then cleared
            blocks.zero_grad(set_to_none=True)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 3], help="blocks per stage")
    parser.add_argument("--rounds", type=int, default=60)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT(vocab_size=256, block_size=1024, n_layer=max(args.blocks), n_head=4, n_embd=128).train()
    table = Table(title="Split backward (I + W) against one backward (B), ms per microbatch")
    for column in ("blocks", "I", "W", "I + W", "B", "I + W - B", "(I + W) / B"):
        table.add_column(column, justify="right")
    for count in args.blocks:
        m = measure(nn.Sequential(*list(model.blocks)[:count]), args.rounds)
        split = m["I"] + m["W"]
        table.add_row(
            str(count), f"{m['I']:.3f}", f"{m['W']:.3f}", f"{split:.3f}", f"{m['B']:.3f}", f"{split - m['B']:.3f}",
            f"{split / m['B']:.3f}",
        )
    console = Console()
    console.print(table)
    revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    console.print(
        f"How: `python benchmarks/bench_split_backward.py --rounds {args.rounds}` at {revision.strip() or '?'} on "
        f"{platform.machine()}, torch {torch.__version__}, 1 thread; medians of {args.rounds} alternated rounds."
    )


if __name__ == "__main__":
    main()
