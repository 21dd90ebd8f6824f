"""Simulated step time of HelixPipe against 1F1B and ZB-H1 on a 7B GPT at 32k to 128k tokens.

The paper's setting (shared/papers/helixpipe-attention-parallel-pp, §5): the 7B GPT of its Table 3
(32 layers, h = 4096), one pipeline stage per node of 8 GPUs (sequence parallel inside the node, so a
stage computes at 8 GPUs' speed), ``p`` = 2, 4 or 8 stages, ``m = 2p`` microbatches of one sequence.
Per-layer FLOPs are the paper's Table 1 (pre-attention ``6bsh^2``, attention ``4bhs^2`` forward and
``8bhs^2`` backward with no weight gradient, post-attention ``18bsh^2``; backward B and W each equal to
the forward for the linear parts); ``--causal`` halves the attention FLOPs (what flash attention with
a causal mask computes). Seconds are FLOPs over 8 x 148 TFLOP/s at 50% (H20-class).

Schedules, each a real program of ``lightning_pipe.schedules`` run by its simulator:

* ``1f1b``: ``L/p`` layers per stage, backward twice the forward, nothing recomputed;
* ``zb_h1``: the same with the backward split into I (input gradients: everything attention costs) and
  W (weight gradients of the linear parts);
* ``helix``: ``schedules.helix`` (two-fold FILO, folds as separate actions, recomputation without
  attention as ``RECOMPUTE`` actions of the units).

Communication (``--bandwidth`` GB/s per node, 0 = free): 1F1B and ZB-H1 send ``bsh`` per stage
boundary, HelixPipe ``2bsh`` per hop (attention input and residual; output and residual), fp16. The
simulator overlaps a transfer with whatever the receiving rank runs before the receive.

Not modelled: the embedding, head and loss; the QKV weight transfer; memory (1F1B's stage 0 holds
``16bshL`` of activations, which does not fit at 128k without recomputation: the baselines here are
faster than they could run, so the comparison is conservative for HelixPipe). The paper measured
+26% over the best baseline at 128k on 8 stages (64 H20).

Run: ``python benchmarks/simulated_helix.py`` (a few seconds on 2 CPU cores).

``--joint`` adds what the joint planner (``planning.plan_joint``) chooses among ``1f1b``, ``zb_h1``,
``helix`` and ``spipe`` for the same model and sizes, priced from a per-unit cost model
(``planning.gpt_cost_model`` at the same device speed and link; its split of a block into pre-attention,
attention and post-attention is ``planning/split_costs.py``'s), over the exact partition search for the
whole-stage families, without a memory budget, down to short sequences where HelixPipe should lose.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_pipe.schedules import ActionCosts, helix, resolve_schedule, simulate, validate  # noqa: E402

LAYERS, HIDDEN = 32, 4096
SPEED = 8 * 148e12 * 0.5  # one stage = one node of 8 GPUs


def _table(values, m):
    return tuple(tuple(float(v) for _ in range(m)) for v in values)


def layer_seconds(seq: int, causal: bool) -> dict[str, float]:
    """Per-layer forward/backward seconds of the parts for one sequence (b = 1)."""
    s, h = seq, HIDDEN
    attention = 4 * s * s * h * (0.5 if causal else 1.0)
    return {
        "pre": 6 * s * h * h / SPEED,
        "attn": attention / SPEED,
        "attn_backward": 2 * attention / SPEED,
        "post": 18 * s * h * h / SPEED,
    }


def baseline(family: str, p: int, m: int, seq: int, causal: bool, bandwidth: float) -> float:
    """Makespan of 1F1B or ZB-H1 with L/p layers per stage."""
    t = layer_seconds(seq, causal)
    per_stage = LAYERS // p
    forward = per_stage * (t["pre"] + t["attn"] + t["post"])
    weight = per_stage * (t["pre"] + t["post"])
    input_gradient = per_stage * (t["pre"] + t["attn_backward"] + t["post"])
    message = 2.0 * seq * HIDDEN  # bsh in fp16
    costs = ActionCosts(
        forward=_table([forward] * p, m),
        backward=_table([input_gradient + weight] * p, m),
        backward_input=_table([input_gradient] * p, m),
        backward_weight=_table([weight] * p, m),
        activation_bytes=_table([message] * p, m),
        bandwidth=bandwidth * 1e9 if bandwidth else float("inf"),
    )
    return simulate(resolve_schedule(family).build(p, m), costs, record_events=False).makespan


def helix_makespan(p: int, m: int, seq: int, causal: bool, bandwidth: float) -> float:
    """Makespan of the HelixPipe program (two-fold, recomputation without attention)."""
    t = layer_seconds(seq, causal)
    program = validate(helix(p, m, layers_per_rank=LAYERS // p, folds=2))
    forward, backward = [], []
    for stage in range(program.num_stages):
        if stage % 2:
            forward.append(t["attn"])
            backward.append(t["attn_backward"])
        else:
            part = t["pre"] if stage == 0 else t["post"] if stage == program.num_stages - 1 else t["pre"] + t["post"]
            forward.append(part)
            backward.append(2 * part)  # its RECOMPUTE charges one more forward
    message = 2 * 2.0 * seq * HIDDEN  # 2bsh in fp16 per hop
    costs = ActionCosts(
        forward=_table(forward, m),
        backward=_table(backward, m),
        activation_bytes=_table([message] * program.num_stages, m),
        bandwidth=bandwidth * 1e9 if bandwidth else float("inf"),
    )
    return simulate(program, costs, record_events=False).makespan


def joint_choices(p: int, seq: int, causal: bool, bandwidth: float) -> tuple[str, float, float, float]:
    """The joint planner's family for ``m = 2p`` sequences of ``seq`` tokens, its simulated step, the best
    whole-stage family's step and helix's step."""
    from lightning_pipe.planning import gpt_cost_model
    from lightning_pipe.planning.joint import JointConfig, plan_joint

    model = gpt_cost_model(
        LAYERS, HIDDEN, 32, 32000, device_flops=SPEED, efficiency=1.0, bandwidth=bandwidth * 1e9 if bandwidth else float("inf"),
        latency=0.0,
    )
    if causal:  # halve the quadratic (attention) term of every block
        from dataclasses import replace

        from lightning_pipe.planning.cost_model import LinearCost

        def halved(cost: LinearCost) -> LinearCost:
            return LinearCost(cost.constant, cost.per_token, cost.per_squared_length / 2)

        units = [model.units[0], *(replace(u, forward=halved(u.forward), backward=halved(u.backward)) for u in model.units[1:-1]),
                 model.units[-1]]
        model = replace(model, units=tuple(units))
    # zero-bubble's W computes the linear parts' weight gradients only (Table 1): at long sequences far
    # less than half a backward, which the cost model's default split (half each) would assume
    from dataclasses import replace as replaced

    from lightning_pipe.schedules.costs import SplitBackward

    attention = 0.5 if causal else 1.0
    weight = 24.0 * HIDDEN / (48.0 * HIDDEN + 8.0 * attention * seq)
    model = replaced(model, split_backward=SplitBackward(1.0 - weight, weight, 1.0 - weight, weight))

    def best(*families: str) -> tuple[str, float]:
        config = JointConfig(families=families, microbatch_counts=(2 * p,), microbatching=("even",))
        joint = plan_joint(model, [seq] * (2 * p), p, None, config=config)
        return joint.plan.schedule.name, joint.step_seconds

    # separate searches for the columns: in the joint one, families beaten by a bound are pruned, not priced
    chosen, step = best("1f1b", "zb_h1", "helix", "spipe")
    return chosen, step, best("1f1b", "zb_h1")[1], best("helix")[1]


def main() -> None:
    """Print one row per (stages, sequence length): makespans and HelixPipe's speedup over the best."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seq", type=int, nargs="+", default=[32768, 65536, 98304, 131072])
    parser.add_argument("--causal", action="store_true", help="halve the attention FLOPs (causal mask)")
    parser.add_argument("--bandwidth", type=float, default=100.0, help="GB/s between stages (0: free)")
    parser.add_argument("--joint", action="store_true", help="also print the joint planner's choice per size")
    args = parser.parse_args()
    print(f"7B GPT (L={LAYERS}, h={HIDDEN}), m = 2p, {'causal' if args.causal else 'full'} attention, "
          f"{args.bandwidth or 'free'} GB/s")
    print(f"{'p':>2} {'seq':>7} {'1f1b s':>8} {'zb_h1 s':>8} {'helix s':>8} {'helix vs best':>13}")
    for p in args.stages:
        m = 2 * p
        for seq in args.seq:
            one = baseline("1f1b", p, m, seq, args.causal, args.bandwidth)
            zb = baseline("zb_h1", p, m, seq, args.causal, args.bandwidth)
            hx = helix_makespan(p, m, seq, args.causal, args.bandwidth)
            print(f"{p:>2} {seq // 1024:>6}k {one:>8.2f} {zb:>8.2f} {hx:>8.2f} {min(one, zb) / hx - 1:>+12.0%}")
    if not args.joint:
        return
    print("\nThe joint planner's choice (plan_joint over 1f1b, zb_h1, helix, spipe; per-unit GPT cost model, m = 2p):")
    print(f"{'p':>2} {'seq':>7} {'chosen':>7} {'step s':>8} {'best whole-stage s':>18} {'helix s':>8} {'helix vs whole':>14}")
    for p in args.stages:
        for seq in sorted({4096, 16384, *args.seq}):
            chosen, step, whole, hx = joint_choices(p, seq, args.causal, args.bandwidth)
            print(f"{p:>2} {seq // 1024:>6}k {chosen:>7} {step:>8.2f} {whole:>18.2f} {hx:>8.2f} {whole / hx - 1:>+13.0%}")


if __name__ == "__main__":
    main()
