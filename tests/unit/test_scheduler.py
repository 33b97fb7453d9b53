"""The engine's learning-rate scheduler (``session.engine(..., scheduler=)``): stepped with every committed update,
kept across a rebuilt optimizer, and its numbers moved between ranks with their types. Local: no process group."""

from __future__ import annotations

import pytest
import torch

from pliant.worker.contract import Engine, EngineError
from pliant.worker.engines import _numbers, _refill


class _Plain(Engine):
    """The base engine's update path over a plain module (no process group)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 1)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)

    def forward_backward(self, batch: object, loss_fn: object) -> float:
        raise NotImplementedError

    def update(self) -> None:
        self.model(torch.ones(2, 4)).sum().backward()
        self.apply_update()


def _cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=5)


def test_the_engine_steps_its_scheduler_once_per_update() -> None:
    engine = _Plain()
    engine.use_scheduler(_cosine)
    reference = _cosine(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    for _ in range(7):
        engine.update()
        reference.optimizer.step()
        reference.step()
    assert engine.scheduler.last_epoch == 7
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(reference.get_last_lr()[0])


def test_a_rebuilt_optimizer_keeps_the_schedule_and_its_learning_rate() -> None:
    engine = _Plain()
    engine.use_scheduler(_cosine)
    for _ in range(3):
        engine.update()
    lr, state = engine.optimizer.param_groups[0]["lr"], engine.scheduler.state_dict()
    assert lr != pytest.approx(0.1), "mid-cycle"
    engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=0.1, momentum=0.9)  # as ZeRO / FSDP2 re-forming
    engine.rebind_scheduler()
    assert engine.scheduler.optimizer is engine.optimizer
    assert engine.optimizer.param_groups[0]["lr"] == pytest.approx(lr), "not reset to the first step's"
    assert engine.scheduler.state_dict() == state


def test_a_scheduler_stepped_on_a_metric_is_refused_with_the_fix() -> None:
    engine = _Plain()
    with pytest.raises(EngineError, match="ReduceLROnPlateau cannot be stepped once per step by the engine"):
        engine.use_scheduler(lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    assert engine.scheduler is None


def test_a_schedulers_numbers_travel_with_their_types() -> None:
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    sources = [torch.optim.lr_scheduler.LinearLR(opt, 0.1, total_iters=3), torch.optim.lr_scheduler.StepLR(opt, 2)]
    state = torch.optim.lr_scheduler.SequentialLR(opt, sources, [3]).state_dict()
    numbers: list[float] = []
    _numbers(state, numbers)
    assert len(numbers) > 10
    shifted = _refill(state, iter(n + 1 for n in numbers))
    assert shifted["last_epoch"] == state["last_epoch"] + 1 and type(shifted["last_epoch"]) is int
    assert type(shifted["_schedulers"][0]["_is_initial"]) is bool
    assert shifted["_schedulers"][1]["_last_lr"][0] == pytest.approx(state["_schedulers"][1]["_last_lr"][0] + 1)
    assert _refill(state, iter(numbers)) == state
