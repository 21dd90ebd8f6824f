"""A real CPU run: HelixPipe and SPipe (runtime/split_executor.py) against 1F1B (the strategy's executor).

Two gloo processes, the GPT example (float32, 4 layers) at a sequence length where attention
weighs, ``m = 4`` microbatches of 2 sequences; each schedule runs ``--steps`` timed steps after one warm-up, the
median step time is printed. HelixPipe runs the module's own ``training_step`` around the blocks cut
at their attention (``StepHelixStages``), two-fold FILO with recomputation without attention; SPipe
runs 2 forward stages split into 4 backward stages on parameters in shared memory, with per-stage
host optimizers (``StageOptimizers``, SGD) stepping during the backward; 1F1B runs two stages of two
blocks, alone and with the same host optimizers (``1f1b+offload``). The optimizer step is timed only
where it is offloaded (inside the step). On 2 shared CPU cores the numbers say that it runs and roughly what
it costs, not how it would compare on GPUs (use ``simulated_helix.py`` for that).

Run: ``python benchmarks/bench_helix.py [--seq 512] [--steps 3]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from examples.gpt.model import GPT  # noqa: E402
from lightning_pipe.model import StageRunner, StageSpan, analyze_units, find_blocks, owned_units, shard_module  # noqa: E402
from lightning_pipe.runtime import PipelineExecutor, PointToPoint, StepWork  # noqa: E402
from lightning_pipe.runtime.helix import StepHelixStages, split_stack  # noqa: E402
from lightning_pipe.runtime.optimizer_offload import StageOptimizers  # noqa: E402
from lightning_pipe.runtime.spipe import SPipeStages, share_parameters  # noqa: E402
from lightning_pipe.runtime.split_executor import SplitPlacementExecutor  # noqa: E402
from lightning_pipe.schedules import helix, resolve_schedule, spipe  # noqa: E402

MICROBATCHES = 4
_FORKED: dict = {}


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=256, block_size=4096, n_layer=4, n_head=4, n_embd=64)


def _worker(rank: int, world: int, init_file: str, out_dir: str, schedule: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, batch = _FORKED["model"], _FORKED["batch"]
        model.log = lambda *args, **kwargs: None
        microbatches = [(mb, 0) for mb in batch.chunk(MICROBATCHES)]
        scales = [1.0 / MICROBATCHES] * MICROBATCHES
        stack = find_blocks(model)
        if schedule == "helix":
            stages = StepHelixStages(StageRunner(model, stack), _FORKED["units"])
            executor = SplitPlacementExecutor(stages, PointToPoint(), list(range(world)), rank, torch.device("cpu"))
            program = helix(world, MICROBATCHES, layers_per_rank=stack.num_blocks // world, folds=2)

            def step() -> None:
                executor.run(program, microbatches, scales)
        elif schedule == "spipe":
            program = spipe(world, MICROBATCHES, stages_per_rank=1, backward_split=2)

            def embed(batch):
                tokens = batch[:, :-1]
                return model.drop(model.wte(tokens) + model.wpe(torch.arange(tokens.size(1))))

            def head_loss(hidden, batch):
                logits = model.lm_head(model.ln_f(hidden))
                return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))

            stages = SPipeStages(embed, stack.blocks, head_loss, program.num_stages)
            executor = SplitPlacementExecutor(stages, PointToPoint(), list(range(world)), rank, torch.device("cpu"))
            ends = ([model.wte, model.wpe], [model.ln_f, model.lm_head])
            mine = [q for q in range(program.num_stages) if program.backward_rank(q, 0) == rank]
            optimizers = StageOptimizers(
                torch.optim.SGD(model.parameters(), lr=1e-3),
                {q: [p for m in stages.stage_modules(q, *ends) for p in m.parameters()] for q in mine},
            )
            plain = [mb for mb, _ in microbatches]

            def step() -> None:
                optimizers.start_step(MICROBATCHES)
                executor.run(program, plain, scales)
                dist.barrier()
                optimizers.finish()
        else:
            boundaries = (0, 2, 4)
            program = resolve_schedule("1f1b").build(world, MICROBATCHES)
            stages = program.stages_of(rank)
            shard_module(model, analyze_units(model, stack), owned_units(boundaries, stages), torch.device("cpu"))
            spans = {s: StageSpan(s, boundaries[s], boundaries[s + 1], stack.num_blocks) for s in stages}
            runner = PipelineExecutor(StageRunner(model, stack), PointToPoint(), list(range(world)), rank, torch.device("cpu"))

            offload = None
            if schedule == "1f1b+offload":
                offload = StageOptimizers(
                    torch.optim.SGD([p for p in model.parameters() if not p.is_meta], lr=1e-3),
                    {s: [p for p in model.parameters() if not p.is_meta] for s in stages},
                )

            def step() -> None:
                if offload is not None:
                    offload.start_step(MICROBATCHES)
                runner.run(program, spans, StepWork("training_step", microbatches, scales))
                if offload is not None:
                    offload.finish()

        times = []
        for _ in range(steps + 1):
            dist.barrier()
            start = time.perf_counter()
            step()
            dist.barrier()
            times.append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
        if rank == 0:
            Path(out_dir, f"{schedule}.txt").write_text(str(statistics.median(times[1:])))
    finally:
        dist.destroy_process_group()


def main() -> None:
    """Time both schedules and print their median step times."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 256, (2 * MICROBATCHES, args.seq + 1), generator=generator)
    results = {}
    for schedule in ("1f1b", "1f1b+offload", "helix", "spipe"):
        model = share_parameters(_model()) if schedule == "spipe" else _model()
        _FORKED.update(model=model, batch=batch)
        if schedule == "helix":
            _FORKED["units"] = split_stack(model, find_blocks(model), "training_step", ((batch[:2]), 0))
        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(
                _worker, args=(2, os.path.join(tmp, "init"), tmp, schedule, args.steps), nprocs=2, join=True,
                start_method="fork",
            )
            results[schedule] = float(Path(tmp, f"{schedule}.txt").read_text())
        _FORKED.clear()
    print(f"GPT example, 4 layers, h=64, seq {args.seq}, {MICROBATCHES} microbatches of 2 sequences, 2 ranks (gloo, CPU)")
    for schedule, seconds in results.items():
        print(f"{schedule:>12}: {seconds * 1000:8.1f} ms per step (median of {args.steps})")


if __name__ == "__main__":
    main()
