"""What a new length costs: steps whose microbatches each have a new length vs one fixed length.

lightning-pipe (2 processes, 1F1B, the ``DecoderLM`` of ``bench_varlen.py``) trains on batches of
``--batch`` sequences in ``--microbatches`` microbatches. In every row a step computes the same
number of positions:

  fixed         every sequence ``--length`` tokens: one shape for the whole run.
  new-lengths   the sequences of microbatch ``i`` have ``--length + d_i`` real tokens, right-padded
                to the batch's longest, with offsets ``d_i`` that sum to zero and never repeat (below),
                so every microbatch has a length not seen before; each microbatch is cut to its
                own length (``trim_padding``), activations carry their shapes, and later stages
                predict the shapes of the blocks before them (``model/shape_rules.py``).
  probe-always  as ``new-lengths`` with shape prediction switched off in the worker (the behaviour
                before shape rules: a meta-device probe of every earlier block per new length).

Lengths are never seen twice in a run: microbatch offsets come in pairs ``+a, -a`` (a step computes
as many positions as a fixed one) with every ``a`` in ``1..--spread`` used once.

``--interleave`` (the mode to quote) runs one fit of trios instead: a step at new lengths, then two
steps of the same shapes, and compares each new-length step with the second of its trio (a step like
the one before it, as at a fixed length): paired medians of wall and CPU time over ``--trios`` trios,
free of the machine's drift from one process to the next. The same steps then run in one process of
plain torch: what a new shape costs torch's kernels and allocator themselves. ``--shape-rules off``
shows what the benchmark reports when a new length does cost something (a meta-device probe per earlier
block and new length).

Without ``--interleave`` the rows alternate in fresh processes, order flipping every pair, ``--pairs``
times (``fixed`` then differs in more than newness: its microbatches all have one length, where a
1F1B step of unequal microbatches is paced by the heaviest in its warm-up and cool-down); the table gives the median step time of each row and the median over pairs of each row's time
relative to ``fixed``, and the same for the CPU seconds of a step (both ranks' processes): rows run one
after the other carry the shared machine's drift in wall time (rounds of one row apart by 10-40% under
other tenants' load), far less in CPU time.

    python benchmarks/bench_new_lengths.py --interleave
    python benchmarks/bench_new_lengths.py --pairs 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from benchmarks.bench_varlen import DecoderLM, pad, token_loss  # noqa: E402
from benchmarks.harness import StepTimer, run_ranks  # noqa: E402

CONFIGS = ("fixed", "new-lengths", "probe-always")


def fresh_offsets(steps: int, microbatches: int, spread: int, seed: int) -> list[list[int]]:
    """Per step, one length offset per microbatch: pairs ``+a, -a`` (so a step computes as many
    positions as a fixed one), every ``a`` in ``1..spread`` used once in the run, so no microbatch
    length repeats and nothing keyed on a length can be reused."""
    if microbatches % 2:
        raise SystemExit("--microbatches must be even: offsets come in pairs +a, -a that keep a step's positions.")
    needed = steps * microbatches // 2
    if needed > spread:
        raise SystemExit(f"{steps} varying steps need {needed} distinct offsets; raise --spread to {needed} "
                         "or run fewer steps.")
    generator = torch.Generator().manual_seed(seed)
    pool = (torch.randperm(spread, generator=generator) + 1).tolist()
    per_step = []
    for step in range(steps):
        values = pool[step * microbatches // 2:(step + 1) * microbatches // 2]
        offsets = [sign * value for value in values for sign in (1, -1)]
        per_step.append([offsets[i] for i in torch.randperm(microbatches, generator=generator).tolist()])
    return per_step


def batch_of(args: argparse.Namespace, offsets: list[int], generator: torch.Generator) -> dict:
    """A right-padded batch whose microbatch ``i`` holds sequences of ``--length + offsets[i]`` real tokens."""
    per_mb = args.batch // args.microbatches
    real = [args.length + offsets[i // per_mb] for i in range(args.batch)]
    return pad(real, max(real), generator)


def make_batches(args: argparse.Namespace, varying: bool) -> list[dict]:
    generator = torch.Generator().manual_seed(args.seed)
    steps = args.warmup + args.steps
    offsets = fresh_offsets(steps, args.microbatches, args.spread, args.seed) if varying else [
        [0] * args.microbatches] * steps
    return [batch_of(args, step_offsets, generator) for step_offsets in offsets]


def interleaved_plan(args: argparse.Namespace) -> list[tuple[int, str]]:
    """``(trio, role)`` of every step of the interleaved fit: trios of a step at new lengths (``new``),
    then two steps at the same shapes (``again``: the step after a change, and ``steady``: a step like
    the one before, as at a fixed length). Trios below 0 are warm-up, not counted."""
    return [(trio, role) for trio in range(-2, args.trios) for role in ("new", "again", "steady")]


def run_torch_reference(args: argparse.Namespace) -> None:
    """The interleaved fit's steps in one process of plain torch (no pipeline, no Lightning): each
    microbatch cut to its own length, forward and backward one after the other, AdamW. What a new
    shape costs torch's own kernels and allocator, which no framework on top can save."""
    import time

    torch.set_num_threads(1)
    plan = interleaved_plan(args)
    offsets = fresh_offsets(sum(role == "new" for _, role in plan), args.microbatches, args.spread, args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    model = DecoderLM(args.layers, args.width, args.heads)
    optimizer = model.configure_optimizers()
    per_mb = args.batch // args.microbatches
    seconds, cpu_seconds = [], []
    for index in range(len(plan)):
        batch = batch_of(args, offsets[index // 3], generator)
        start, cpu_start = time.perf_counter(), time.process_time()
        for first in range(0, args.batch, per_mb):
            rows = slice(first, first + per_mb)
            length = int(batch["attention_mask"][rows].sum(1).max())
            microbatch = {key: value[rows, :length] for key, value in batch.items()}
            logits = model(microbatch["input_ids"], microbatch["attention_mask"])
            (token_loss(logits, microbatch["labels"]) / args.microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - start)
        cpu_seconds.append(time.process_time() - cpu_start)
    measured = {"seconds": seconds, "cpu_seconds": cpu_seconds}
    Path(args.out, f"{args.worker}-rank0.json").write_text(json.dumps(measured))


def run_worker(args: argparse.Namespace) -> None:
    from lightning_pipe import ElasticPipelineStrategy

    if args.worker == "torch-reference":
        run_torch_reference(args)
        return

    if args.worker == "probe-always" or args.shape_rules == "off":
        from lightning_pipe.model.shape_rules import ShapeRules

        ShapeRules.predict = lambda self, block, arguments: None  # the behaviour before shape rules
    torch.set_num_threads(1)
    if args.worker == "interleaved":
        plan = interleaved_plan(args)
        offsets = fresh_offsets(sum(role == "new" for _, role in plan), args.microbatches, args.spread, args.seed)
        generator = torch.Generator().manual_seed(args.seed)
        batches = [batch_of(args, offsets[index // 3], generator) for index in range(len(plan))]
        warmup = 0
    else:
        batches, warmup = make_batches(args, varying=args.worker != "fixed"), args.warmup

    def save(trainer, seconds: list[float]) -> None:
        measured = {"seconds": seconds, "cpu_seconds": timer.cpu_seconds}
        Path(args.out, f"{args.worker}-rank{trainer.global_rank}.json").write_text(json.dumps(measured))

    timer = StepTimer(warmup, save)

    trainer = L.Trainer(
        accelerator="cpu", devices=2, max_steps=len(batches), limit_val_batches=0, num_sanity_val_steps=0,
        strategy=ElasticPipelineStrategy(pipeline_parallel_size=2, num_microbatches=args.microbatches),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[timer], use_distributed_sampler=False,
    )
    torch.manual_seed(args.seed)
    trainer.fit(DecoderLM(args.layers, args.width, args.heads), torch.utils.data.DataLoader(batches, batch_size=None))


def launch(config: str, args: argparse.Namespace, out: str) -> tuple[float, float]:
    """Median step seconds of ``config`` (slowest rank per step) and median CPU seconds per step (both
    ranks' processes together), run in fresh processes."""
    wall, cpu = per_step(config, args, out)
    return statistics.median(wall), statistics.median(cpu)


def per_step(config: str, args: argparse.Namespace, out: str, ranks: int = 2) -> tuple[list[float], list[float]]:
    """Every timed step's seconds (its slowest rank) and CPU seconds (all ranks' processes together)
    of ``config``, run in fresh processes."""
    results = run_ranks(__file__, config, out, args, ranks=ranks, names=(
        "steps", "warmup", "batch", "microbatches", "length", "spread", "layers", "width", "heads", "seed", "trios", "shape_rules"))
    wall = [max(pair) for pair in zip(*(r["seconds"] for r in results))]
    return wall, [sum(pair) for pair in zip(*(r["cpu_seconds"] for r in results))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--length", type=int, default=96, help="mean real length of a sequence")
    parser.add_argument("--spread", type=int, default=48,
                        help="largest offset of a microbatch's length (offsets 1..spread are each used once)")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--interleave", action="store_true",
                        help="one fit, one pair of processes: each step at new lengths beside a step at the same shapes")
    parser.add_argument("--trios", type=int, default=22,
                        help="with --interleave: counted trios (new lengths, same shapes again, same shapes steady)")
    parser.add_argument("--shape-rules", choices=("on", "off"), default="on",
                        help="with --interleave, off: probe every new length as before shape rules (what the "
                             "benchmark sees when a new length does cost something)")
    parser.add_argument("--worker", choices=(*CONFIGS, "interleaved", "torch-reference"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    from rich.console import Console
    from rich.table import Table

    load_before = os.getloadavg()[0]
    varying_steps = args.trios + 2 if args.interleave else args.warmup + args.steps
    fresh_offsets(varying_steps, args.microbatches, args.spread, args.seed)  # enough new lengths? Else says what to change.
    if args.interleave:
        interleaved(args, load_before)
        return
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    cpu: dict[str, list[float]] = {c: [] for c in CONFIGS}
    with tempfile.TemporaryDirectory() as out:
        for pair in range(args.pairs):
            for config in CONFIGS if pair % 2 == 0 else CONFIGS[::-1]:
                wall, cpu_seconds = launch(config, args, out)
                times[config].append(wall)
                cpu[config].append(cpu_seconds)
                print(f"pair {pair}: {config:13s} {wall * 1e3:8.1f} ms/step, CPU {cpu_seconds * 1e3:8.1f} ms/step", flush=True)
    table = Table(title="What a new length per microbatch costs (lightning-pipe, pp=2, 1F1B)")
    for column in (
        "rows", "median ms/step", "vs fixed (median over pairs)", "per pair", "CPU ms/step (2 ranks)", "CPU vs fixed",
    ):
        table.add_column(column, justify="left" if column == "rows" else "right")
    for config in CONFIGS:
        ratios = [t / f for t, f in zip(times[config], times["fixed"])]
        cpu_ratios = [c / f for c, f in zip(cpu[config], cpu["fixed"])]
        table.add_row(config, f"{statistics.median(times[config]) * 1e3:.1f}", f"{statistics.median(ratios):.3f}",
                      " ".join(f"{r:.3f}" for r in ratios), f"{statistics.median(cpu[config]) * 1e3:.1f}",
                      f"{statistics.median(cpu_ratios):.3f}")
    Console(width=140).print(table)
    print(f"How: `python {' '.join(sys.argv)}` on {os.cpu_count()} CPU cores ({platform.machine()}), torch "
          f"{torch.__version__}, gloo, 2 processes x 1 thread; DecoderLM layers={args.layers} width={args.width}; "
          f"{args.batch} sequences of {args.length}+-{args.spread} tokens, {args.microbatches} microbatches, "
          f"{args.steps} timed steps after {args.warmup}; 1-minute load before: {load_before:.2f}.")


def interleaved(args: argparse.Namespace, load_before: float) -> None:
    """Steps at new lengths beside steps of the same shapes, in one fit; paired medians. The same steps
    in plain torch (one process) beside it: what a new shape costs torch's kernels themselves."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="What a new length per microbatch costs: steps at new lengths beside steps of the same "
                        "shapes, in one run")
    for column in ("run", "step", "median ms", "median CPU ms", "vs steady (paired median)", "CPU vs steady",
                   "pairs above 1"):
        table.add_column(column, justify="left" if column in ("run", "step") else "right")
    with tempfile.TemporaryDirectory() as out:
        for config, words, ranks in (("interleaved", "lightning-pipe, pp=2, 1F1B", 2),
                                     ("torch-reference", "plain torch, 1 process", 1)):
            wall, cpu = per_step(config, args, out, ranks)
            by_trio: dict[int, dict[str, tuple[float, float]]] = {}
            for (trio, role), seconds, cpu_seconds in zip(interleaved_plan(args), wall, cpu):
                if trio >= 0:
                    by_trio.setdefault(trio, {})[role] = (seconds, cpu_seconds)
            trios = list(by_trio.values())
            for role, step in (("new", "new lengths"), ("again", "same shapes, just after"),
                               ("steady", "same shapes again")):
                ratios = [trio[role][0] / trio["steady"][0] for trio in trios]
                cpu_ratios = [trio[role][1] / trio["steady"][1] for trio in trios]
                table.add_row(words if role == "new" else "", step,
                              f"{statistics.median(trio[role][0] for trio in trios) * 1e3:.1f}",
                              f"{statistics.median(trio[role][1] for trio in trios) * 1e3:.1f}",
                              f"{statistics.median(ratios):.3f}", f"{statistics.median(cpu_ratios):.3f}",
                              "" if role == "steady" else f"{sum(r > 1 for r in ratios)}/{len(ratios)}")
    Console(width=150).print(table)
    print(f"How: `python {' '.join(sys.argv)}` on {os.cpu_count()} CPU cores ({platform.machine()}), torch "
          f"{torch.__version__}, gloo, 1 thread per process (CPU: all processes); DecoderLM layers={args.layers} "
          f"width={args.width}; {args.batch} sequences in {args.microbatches} microbatches; every trio: one step whose "
          f"microbatches have {args.length}+-a real tokens with every a in 1..{args.spread} used once in the run "
          f"(lengths never seen before), then two steps of the same shapes; shape rules {args.shape_rules}; "
          f"{args.trios} trios after 2 warm-up trios; the pipeline first, then plain torch; 1-minute load before: "
          f"{load_before:.2f}.")

if __name__ == "__main__":
    main()
