"""Regrouping units between layouts on 4 real gloo processes: parameters, optimizer state, gradient sums."""

from __future__ import annotations

import itertools
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_pipe.planning.layout import Layout, unit_holders
from lightning_pipe.planning.regroup import plan_regroup, replica_groups
from lightning_pipe.runtime.regroup import UnitTensors, create_rank_groups, regroup_units

NUM_BLOCKS = 8
WORLD = 4
# 4x1 -> 2x2 -> 1x4 -> uneven widths -> back, every step a different layout
LAYOUTS = [
    Layout((0, 2, 4, 6, 8), (1, 1, 1, 1)),
    Layout((0, 4, 8), (2, 2)),
    Layout((0, 8), (4,)),
    Layout((0, 3, 5, 8), (2, 1, 1)),
    Layout((0, 5, 8), (1, 3)),
    Layout((0, 1, 6, 8), (1, 2, 1)),
    Layout((0, 2, 4, 6, 8), (1, 1, 1, 1)),
]


def _parameters(unit: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(unit)
    return {f"unit{unit}.weight": torch.randn(3, 2, generator=generator, dtype=torch.float64)}


def _partial(unit: int, rank: int, step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * unit + rank)
    return {f"unit{unit}.weight": torch.randn(3, 2, generator=generator, dtype=torch.float64)}


def _state(unit: int) -> dict[str, dict]:
    return {f"unit{unit}.weight": {"step": torch.tensor(3.0), "exp_avg": _parameters(unit)[f"unit{unit}.weight"] * 0.1}}


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        groups = create_rank_groups(replica_groups(LAYOUTS))
        first = unit_holders(LAYOUTS[0], NUM_BLOCKS)
        units = {
            u: UnitTensors(_parameters(u), _partial(u, rank, 0), _state(u))
            for u, ranks in enumerate(first)
            if rank in ranks
        }
        record = []
        for step, (old, new) in enumerate(itertools.pairwise(LAYOUTS), start=1):
            plan = plan_regroup(old, new, NUM_BLOCKS)
            after = unit_holders(new, NUM_BLOCKS)
            units = regroup_units(units, plan.moves, dict(enumerate(after)), rank)
            record.append({u: (t.parameters, t.gradients, t.optimizer_state) for u, t in units.items()})
            for unit in units.values():  # more of the window: every holder adds a partial
                name = next(iter(unit.parameters))
                u = int(name[4 : name.index(".")])
                unit.gradients = {n: g + _partial(u, rank, step)[n] for n, g in unit.gradients.items()}
        # every stage's replica group sums over exactly its members
        sums = {}
        for ranks, group in groups.items():
            if rank in ranks:
                value = torch.tensor([float(rank)])
                dist.all_reduce(value, group=group)
                sums[ranks] = float(value)
        torch.save({"record": record, "sums": sums}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_regrouping_keeps_parameters_state_and_gradient_sums(tmp_path) -> None:
    mp.spawn(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # the window's gradient of every unit: the partials every holder added, step by step
    expected = {
        u: sum(_partial(u, r, 0)[f"unit{u}.weight"] for r in ranks)
        for u, ranks in enumerate(unit_holders(LAYOUTS[0], NUM_BLOCKS))
    }
    for step, layout in enumerate(LAYOUTS[1:]):
        holders = unit_holders(layout, NUM_BLOCKS)
        for unit, ranks in enumerate(holders):
            name = f"unit{unit}.weight"
            held = [parts[r]["record"][step].get(unit) for r in range(WORLD)]
            assert [r for r in range(WORLD) if held[r] is not None] == list(ranks), (step, unit)
            total = sum(held[r][1][name] for r in ranks)
            torch.testing.assert_close(total, expected[unit], atol=1e-12, rtol=0)
            for r in ranks:
                torch.testing.assert_close(held[r][0][name], _parameters(unit)[name], atol=0, rtol=0)
                torch.testing.assert_close(held[r][2][name]["exp_avg"], _state(unit)[name]["exp_avg"], atol=0, rtol=0)
            expected[unit] = expected[unit] + sum(_partial(unit, r, step + 1)[name] for r in ranks)
    for rank, part in enumerate(parts):
        for ranks, value in part["sums"].items():
            assert rank in ranks and value == sum(ranks)
