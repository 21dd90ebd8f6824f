"""Milliseconds to build a family's program, uncached and cached, for one or two checkouts.

The preset families (gpipe, 1f1b, interleaved_1f1b, looped_bfs) are built by the DSL's engine and
validated, then kept in a cache (docs/schedules.md, "One source per family"). This prints, per family
and size, the median of 15 builds with the caches cleared and the mean of 1000 repeated builds, in a
fresh process per checkout (``--before DIR``: an older checkout, e.g.
``git archive <commit> | tar -x -C DIR``, whose generators had no cache).

    python benchmarks/program_build_time.py --before /tmp/old
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CASES = [(name, v, p, m) for name, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("looped_bfs", 2))
         for p, m in ((4, 8), (8, 32))]


def worker() -> None:
    """Time every case with the checkout on ``sys.path``; one JSON line per case."""
    from lightning_pipe.schedules import Schedule, dsl

    caches = [getattr(dsl, name) for name in ("_build_cached", "_build_preset") if hasattr(dsl, name)]
    for name, v, p, m in CASES:
        schedule, uncached = Schedule(name, v), []
        for _ in range(15):
            for cache in caches:
                cache.cache_clear()
            started = time.perf_counter()
            schedule.build(p, m)
            uncached.append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(1000):
            schedule.build(p, m)
        repeated = (time.perf_counter() - started) / 1000
        print(json.dumps({"case": [name, v, p, m], "uncached": statistics.median(uncached), "repeated": repeated}))


def measure(source: Path) -> list[dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(source))
    out = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    if sys.argv[1:] == ["--worker"]:
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="an older checkout to time as well")
    args = parser.parse_args()
    before = measure(args.before.resolve()) if args.before else None
    after = measure(HERE)
    print("| family | stages per rank | ranks | microbatches | " + ("before: uncached / repeated ms | " if before else "")
          + "after: uncached / repeated ms |")
    print("|---" * (6 if before else 5) + "|")
    for k, row in enumerate(after):
        name, v, p, m = row["case"]
        cells = [before[k], row] if before else [row]
        print(f"| {name} | {v} | {p} | {m} | " + " | ".join(
            f"{c['uncached'] * 1e3:.2f} / {c['repeated'] * 1e3:.4f}" for c in cells) + " |")
    print(f"How: python {' '.join(sys.argv)} on {os.cpu_count()} CPU cores, 1-minute load {os.getloadavg()[0]:.2f}.")


if __name__ == "__main__":
    main()
