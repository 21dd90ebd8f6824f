"""What running the unchanged step costs on a pipeline stage, beside the same work in plain PyTorch.

One process, one thread, the GPT of ``bench_throughput.py`` (8 blocks, h=128, 4 heads, vocabulary
256) on a microbatch of 4 x 128 tokens. A pipeline rank runs the user's ``training_step`` as it is
(``model/stage_runner.py``): the code before the blocks under the placeholder mode, the other
stages' blocks as placeholders, its own blocks for real, and on the last stage the code after them
(head, loss, ``self.log``) with the loss counter watching. A hand-split torch stage runs only its
modules. Both are timed here on the same microbatch, alternating, forward only (the backward is the
same autograd graph either way):

  first stage   lightning-pipe: ``training_step`` until block 3 ends the stage;
                plain: embeddings + dropout + blocks 0-3.
  last stage    lightning-pipe: ``training_step`` from a received activation, blocks 4-7, head,
                loss and the logged value (other stages' parameters on the meta device, as a
                pipeline rank holds them); plain: blocks 4-7 + final norm + head + cross-entropy.

Each row splits a microbatch's forward at the first block's start and the last block's end
(``before``, ``blocks``, ``after``); medians over ``--rounds`` rounds (the first ten not counted).
A 1F1B step of ``bench_throughput.py`` runs 4 microbatches through the last stage on the critical
path, so 4 x (``before`` + ``after`` differences) is what the step pays there.

It also times one replayed ``self.log`` call (the strategy replays the step's logs on every rank),
as Lightning does it and with its no-op move skipped (``strategies/_lightning_compat.logged_values_in_place``).

Run: ``python benchmarks/bench_stage_overhead.py`` (about 30 seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt.model import GPT, Block  # noqa: E402
from lightning_pipe.model import StageRunner, StageSpan, find_blocks  # noqa: E402
from lightning_pipe.model.loss_counting import LossCounter  # noqa: E402
from lightning_pipe.strategies._lightning_compat import logged_values_in_place  # noqa: E402

STAMPS: dict[str, float] = {}
_block_forward = Block.forward


def _stamped_forward(self: Block, x: torch.Tensor) -> torch.Tensor:
    STAMPS.setdefault("first", time.perf_counter())
    out = _block_forward(self, x)
    STAMPS["last"] = time.perf_counter()
    return out


def _split(start: float, end: float) -> tuple[float, float, float]:
    return STAMPS["first"] - start, STAMPS["last"] - STAMPS["first"], end - STAMPS["last"]


def _log_call_microseconds(rounds: int) -> dict[bool, float]:
    """Median microseconds of one ``self.log`` into Lightning's result collection, as the strategy replays
    it each step on every rank, with and without skipping the no-op move, alternated."""
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    results, value = _ResultCollection(training=True), torch.tensor(1.5)
    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for in_place in (round_ % 2 == 0, round_ % 2 == 1):
            start = time.perf_counter()
            with logged_values_in_place() if in_place else contextlib.nullcontext():
                results.log("training_step", "train_loss", value, on_step=True, batch_size=4)
            times[in_place].append(time.perf_counter() - start)
    return {key: statistics.median(values[10:]) * 1e6 for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=300)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    Block.forward = _stamped_forward  # before the runner wraps the blocks: both paths pay the stamps
    plain = GPT(vocab_size=256, n_layer=8, n_head=4, n_embd=128)
    staged, last = copy.deepcopy(plain), copy.deepcopy(plain)
    batch = torch.randint(0, 256, (4, 129))
    x, y = batch[:, :-1], batch[:, 1:]
    hidden = torch.randn(4, 128, 128)

    first_runner = StageRunner(staged, find_blocks(staged), device=torch.device("cpu"))
    last_runner = StageRunner(last, find_blocks(last), device=torch.device("cpu"))
    for module in (last.wte, last.wpe, *last.blocks[:4]):
        module.to("meta")
    last_runner.parameters_changed()
    for module in (*staged.blocks[4:], staged.ln_f, staged.lm_head):
        module.to("meta")
    first_runner.parameters_changed()

    def plain_first() -> None:
        h = plain.drop(plain.wte(x) + plain.wpe(torch.arange(x.size(1))))
        for block in plain.blocks[:4]:
            h = block(h)

    def lp_first() -> None:
        first_runner.run("training_step", (batch, 0), StageSpan(0, 0, 4, 8))

    def plain_last() -> None:
        h = hidden.detach().requires_grad_(True)
        for block in plain.blocks[4:]:
            h = block(h)
        logits = plain.lm_head(plain.ln_f(h))
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def lp_last() -> None:
        counter = LossCounter()
        result = last_runner.run(
            "training_step", (batch, 0), StageSpan(1, 4, 8, 8),
            receive=lambda metas: [hidden.detach().requires_grad_(True)], observers=(counter,),
        )
        counter.record(result.step_output, [call.value for call in result.logs])

    rows = {
        "first stage, plain": plain_first, "first stage, lightning-pipe": lp_first,
        "last stage, plain": plain_last, "last stage, lightning-pipe": lp_last,
    }
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in rows}
    names = list(rows)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 else reversed(names):
            STAMPS.clear()
            start = time.perf_counter()
            rows[name]()
            times[name].append(_split(start, time.perf_counter()))

    log_us = _log_call_microseconds(args.rounds)
    table = Table(title="One microbatch's forward on a stage, ms (median)")
    for column in ("stage, run by", "before the blocks", "blocks", "after the blocks", "total", "overhead"):
        table.add_column(column, justify="right" if column != "stage, run by" else "left")
    medians = {
        name: [statistics.median(t[i] for t in kept) * 1e3 for i in range(3)]
        for name, kept in ((name, values[10:]) for name, values in times.items())
    }
    for name, (before, blocks, after) in medians.items():
        reference = medians[name.split(",")[0] + ", plain"]
        overhead = (before - reference[0]) + (after - reference[2])
        table.add_row(name, f"{before:.3f}", f"{blocks:.3f}", f"{after:.3f}", f"{before + blocks + after:.3f}",
                      "" if name.endswith("plain") else f"{overhead:+.3f}")
    Console().print(table)
    print(
        f"One replayed `self.log` call (Lightning's result collection, alternated): {log_us[False]:.0f} us as "
        f"Lightning does it, {log_us[True]:.0f} us with the no-op move skipped (`logged_values_in_place`)."
    )
    print(
        f"How: `python benchmarks/bench_stage_overhead.py --rounds {args.rounds}` on {platform.machine()}, torch "
        f"{torch.__version__}, 1 thread; overhead = (before + after) minus plain's, per microbatch."
    )


if __name__ == "__main__":
    main()
