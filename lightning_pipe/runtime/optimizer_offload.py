"""Optimizer offload (SPipe): per-stage optimizers on the host, stepping asynchronously during backward.

For every stage a rank runs, the stage's master weights (fp32 for 16-bit parameters, else the
parameter's own dtype) and the optimizer state live in host memory, in an optimizer of the user's
class with the user's hyperparameters (read from the user's optimizer at every step, so learning-rate
schedulers keep working). A post-accumulate-grad hook counts the gradients each parameter receives;
when every parameter of a stage has received all of them (one per microbatch), that stage's
gradients are final: they are copied to the host and the stage's step is submitted to a worker
thread, so it runs while the rank's other stages, and the other ranks, are still in backward.
:meth:`StageOptimizers.finish` waits for the steps and copies the updated weights back into the
device parameters before the next forward. Each device gradient is dropped (``grad = None``) once
copied, so the user's own optimizer, still called by Lightning, skips these parameters.

Loss scaling: with ``loss_scale`` given, a stage's step unscales its gradients and checks them; if
any stage on any rank (``agree``) found a non-finite gradient, every stage that already stepped is
restored from a snapshot taken just before its step, so the whole update is undone exactly as if it
had been skipped (SPipe §2.4 inverts the update arithmetically; the snapshot is exact at the cost of
a second host copy of the stage's state).

On CUDA, host buffers are pinned and gradient copies run on a side stream; on CPU they are real
copies into host buffers. Not supported: gradient clipping, data-parallel gradient averaging and tied
parameters (all need every stage's gradients before any step), repartitioning that moves parameters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer


@dataclass
class StageStep:
    """What one stage's asynchronous step did in the last step (for tests and monitors).

    Attributes:
        stage: the stage.
        launched: ``time.perf_counter()`` when its gradients were final and the step was submitted.
        started: when the worker thread began the step.
        finished: when it ended.
        found_inf: whether its unscaled gradients held a non-finite value.
        stepped: whether the optimizer step ran (False if skipped for a non-finite gradient).
    """

    stage: int
    launched: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    found_inf: bool = False
    stepped: bool = False


@dataclass
class _Stage:
    params: list[nn.Parameter]
    masters: list[Tensor]
    optimizer: Optimizer
    groups: list[int]  # index of the user's param group of each parameter
    counts: dict[int, int] = field(default_factory=dict)
    future: Future | None = None
    record: StageStep | None = None


def _as_state(key: str, value: Any, master: Tensor) -> Any:
    """A loaded state value as the host optimizer keeps it (torch's policy, with the master as parameter)."""
    if not isinstance(value, Tensor):
        return value
    if key == "step" or not value.is_floating_point():
        return value.detach().to("cpu").clone()
    return value.detach().to(device="cpu", dtype=master.dtype).clone()


def _host_copy(tensor: Tensor, dtype: torch.dtype, pin: bool) -> Tensor:
    host = torch.empty(tensor.shape, dtype=dtype, device="cpu", pin_memory=pin)
    host.copy_(tensor.detach(), non_blocking=pin)
    return host


class StageOptimizers:
    """Host-resident optimizers, one per stage, stepping as soon as the stage's gradients are final.

    Args:
        optimizer: the user's optimizer (its class and hyperparameters are used; its state for the
            given parameters moves to the host and is removed from it).
        stage_params: per stage, the real parameters of that stage on this rank.
        master_dtype: dtype of host master weights for 16-bit parameters (wider parameters keep their
            own dtype, so results are bit-identical to the device optimizer).
        workers: threads running stage steps.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        stage_params: dict[int, Sequence[nn.Parameter]],
        master_dtype: torch.dtype = torch.float32,
        workers: int = 1,
    ) -> None:
        self.user_optimizer = optimizer
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="stage-optimizer")
        self._lock = threading.Lock()
        self._stages: dict[int, _Stage] = {}
        self._hooks = []
        self._expected = 0
        self._armed = False
        self._loss_scale: float | None = None
        self.records: dict[int, StageStep] = {}
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        for stage, params in stage_params.items():
            params = [p for p in params if p.requires_grad and id(p) in group_of]
            if not params:
                continue
            device = params[0].device
            pin = device.type == "cuda"
            masters = []
            for p in params:
                dtype = master_dtype if p.dtype in (torch.float16, torch.bfloat16) else p.dtype
                master = _host_copy(p, dtype, pin)
                masters.append(master)
            groups = [group_of[id(p)] for p in params]
            host_groups = []
            for index, group in enumerate(optimizer.param_groups):
                members = [m for m, g in zip(masters, groups) if g == index]
                if members:
                    host_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": members})
            host = type(optimizer)(host_groups)  # every hyperparameter is in the groups
            for p, master in zip(params, masters):  # existing state moves to the host
                state = optimizer.state.pop(p, None)
                if state:
                    host.state[master] = {k: v.detach().to("cpu").clone() if isinstance(v, Tensor) else v for k, v in state.items()}
            self._stages[stage] = _Stage(list(params), masters, host, groups)
            for p in params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(stage)))

    @property
    def stages(self) -> tuple[int, ...]:
        """Stages with a host optimizer."""
        return tuple(self._stages)

    def host_optimizer(self, stage: int) -> Optimizer:
        """The host optimizer of ``stage`` (its state, for checkpoints and tests)."""
        return self._stages[stage].optimizer

    def masters(self, stage: int) -> list[Tensor]:
        """Host master weights of ``stage``, in the order of its parameters."""
        return self._stages[stage].masters

    # --- checkpoints ------------------------------------------------------------------------------

    def _user_indices(self) -> dict[int, int]:
        """Index of each parameter in the user's optimizer (torch's state-dict numbering), by id."""
        params = [p for group in self.user_optimizer.param_groups for p in group["params"]]
        return {id(p): index for index, p in enumerate(params)}

    def state_dict(self) -> dict[str, dict[int, Any]]:
        """This rank's share of the optimizer state, numbered like the user's optimizer, on the CPU.

        Call it between steps (no stage step running). Returns ``{"state": {index: per-parameter
        state}, "master_weights": {index: master}}``: ``state`` is what torch's single-process
        optimizer would hold for that parameter; ``master_weights`` only lists masters wider than their
        parameter (fp32 masters of 16-bit parameters), which the parameter cannot restore.
        """
        index_of = self._user_indices()
        state: dict[int, Any] = {}
        masters: dict[int, Tensor] = {}
        for entry in self._stages.values():
            for p, master in zip(entry.params, entry.masters):
                index = index_of[id(p)]
                values = entry.optimizer.state.get(master)
                if values:
                    state[index] = {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in values.items()}
                if master.dtype != p.dtype:
                    masters[index] = master.detach().clone()
        return {"state": state, "master_weights": masters}

    def load_state_dict(self, state_dict: dict[str, dict[int, Any]]) -> None:
        """Load the entries of this rank's parameters from a (full or partial) :meth:`state_dict`.

        Entries of other parameters are ignored. Floating-point state is cast to the master's dtype
        (as torch's optimizers cast to their parameter's), ``step`` is kept as saved. A master without a
        saved value stays the copy of its (already restored) parameter.
        """
        index_of = self._user_indices()
        saved_state = state_dict.get("state", {})
        saved_masters = state_dict.get("master_weights", {})
        for entry in self._stages.values():
            for p, master in zip(entry.params, entry.masters):
                index = index_of[id(p)]
                if index in saved_masters:
                    with torch.no_grad():
                        master.copy_(saved_masters[index])
                values = saved_state.get(index)
                if values:
                    entry.optimizer.state[master] = {k: _as_state(k, v, master) for k, v in values.items()}
                else:
                    entry.optimizer.state.pop(master, None)

    # --- one optimizer step ----------------------------------------------------------------------

    def start_step(self, num_accumulations: int, loss_scale: float | None = None) -> None:
        """Arm the hooks: a parameter's gradient is final after ``num_accumulations`` accumulations.

        Args:
            num_accumulations: backward passes accumulating into each gradient this step (microbatches).
            loss_scale: the loss scale to divide gradients by, and to check for overflow; None: no
                scaling, no checks.
        """
        self._expected = num_accumulations
        self._loss_scale = loss_scale
        self.records = {}
        for stage in self._stages.values():
            stage.counts = {}
            stage.future = None
            stage.record = None
        self._armed = True

    def _make_hook(self, stage: int) -> Callable[[Tensor], None]:
        def hook(param: Tensor) -> None:
            if not self._armed:
                return
            entry = self._stages[stage]
            with self._lock:
                entry.counts[id(param)] = entry.counts.get(id(param), 0) + 1
                done = entry.future is None and all(entry.counts.get(id(p), 0) >= self._expected for p in entry.params)
            if done:
                self._launch(stage)

        return hook

    def _launch(self, stage: int) -> None:
        entry = self._stages[stage]
        record = StageStep(stage, launched=time.perf_counter())
        grads = []
        event = None
        for p, master in zip(entry.params, entry.masters):
            if p.grad is None:
                grads.append(None)
                continue
            if p.grad.device.type == "cuda":
                grads.append(_host_copy(p.grad, master.dtype, pin=True))
                event = torch.cuda.Event()
                event.record()
            else:
                grads.append(p.grad.detach().to(master.dtype, copy=True))
            p.grad = None  # the user's optimizer skips it; the host optimizer owns this step
        self._sync_hyperparameters(entry)
        entry.record = record
        self.records[stage] = record
        entry.future = self._pool.submit(self._step, entry, grads, event, self._loss_scale, record)

    def _sync_hyperparameters(self, entry: _Stage) -> None:
        user_groups = self.user_optimizer.param_groups
        wanted = sorted(set(entry.groups))
        for host_group, index in zip(entry.optimizer.param_groups, wanted):
            for key, value in user_groups[index].items():
                if key != "params":
                    host_group[key] = value

    @staticmethod
    def _step(entry: _Stage, grads: list[Tensor | None], event, loss_scale: float | None, record: StageStep):
        record.started = time.perf_counter()
        if event is not None:
            event.synchronize()
        for master, grad in zip(entry.masters, grads):
            master.grad = grad
        snapshot = None
        if loss_scale is not None:
            for grad in grads:
                if grad is not None:
                    grad.div_(loss_scale)
            record.found_inf = any(g is not None and not bool(torch.isfinite(g).all()) for g in grads)
            if not record.found_inf:  # keep what is needed to undo the step if another stage overflowed
                snapshot = (
                    [m.detach().clone() for m in entry.masters],
                    {id(m): {k: v.clone() if isinstance(v, Tensor) else v for k, v in entry.optimizer.state.get(m, {}).items()}
                     for m in entry.masters},
                )
        if not record.found_inf:
            with torch.no_grad():
                entry.optimizer.step()
            record.stepped = True
        for master in entry.masters:
            master.grad = None
        record.finished = time.perf_counter()
        return snapshot

    def finish(self, agree: Callable[[bool], bool] | None = None) -> bool:
        """Wait for every stage's step; undo all of them on an overflow; copy weights back.

        Stages whose gradients never all arrived (a parameter unused by some microbatch) step now.

        Args:
            agree: given this rank's "some stage overflowed", returns whether any rank's did (a
                collective over the pipeline); None: this rank alone decides.

        Returns:
            True if the step was skipped for a non-finite gradient.
        """
        for stage, entry in self._stages.items():
            if entry.future is None:
                self._launch(stage)
        snapshots = {stage: entry.future.result() for stage, entry in self._stages.items()}
        self._armed = False
        overflow = any(r.found_inf for r in self.records.values())
        if agree is not None:
            overflow = agree(overflow)
        if overflow:
            for stage, entry in self._stages.items():
                snapshot = snapshots[stage]
                if entry.record.stepped and snapshot is not None:
                    self._restore(entry, snapshot)
                    entry.record.stepped = False
            return True
        with torch.no_grad():
            for entry in self._stages.values():
                for p, master in zip(entry.params, entry.masters):
                    p.copy_(master, non_blocking=p.device.type == "cuda")
        return False

    @staticmethod
    def _restore(entry: _Stage, snapshot) -> None:
        values, states = snapshot
        with torch.no_grad():
            for master, value in zip(entry.masters, values):
                master.copy_(value)
        for master in entry.masters:
            saved = states[id(master)]
            if saved:
                entry.optimizer.state[master] = saved
            else:
                entry.optimizer.state.pop(master, None)

    def close(self) -> None:
        """Remove the hooks and stop the worker threads."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._pool.shutdown(wait=True)
