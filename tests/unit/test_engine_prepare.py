"""A newcomer's optimizer, built and given its state tensors before it meets its world (``Engine.prepare``)."""

from __future__ import annotations

import pytest
import torch

from pliant.worker.engines import DDPEngine, ZeroEngine


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(5, 4, generator=g)
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
        (torch.optim.Adam, {"lr": 0.01}),
        (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1}),
    ],
)
def test_prepare_creates_the_state_without_moving_the_parameters(cls: type, kwargs: dict) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = DDPEngine.prepare(model, cls, kwargs, torch.device("cpu"))
    assert optimizer is not None
    assert all(optimizer.state[p] for p in model.parameters()), "every parameter's state tensors exist"
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}),
        (torch.optim.Adam, {"lr": 0.01}),
    ],
)
def test_a_prepared_optimizer_cleared_trains_as_a_fresh_one(cls: type, kwargs: dict) -> None:
    """No peer held state (a fresh start of a later generation): the session clears the prepared state, and training
    is then exactly a fresh optimizer's (the zero-rate step must leave no trace: Adam's step count, SGD's dampening)."""
    fresh_model = _model()
    fresh = _steps(fresh_model, cls(fresh_model.parameters(), **kwargs))
    model = _model()
    optimizer = DDPEngine.prepare(model, cls, kwargs, torch.device("cpu"))
    assert optimizer is not None
    optimizer.state.clear()
    assert all(torch.equal(a, b) for a, b in zip(fresh, _steps(model, optimizer), strict=True))


@pytest.mark.timeout(30)
def test_an_optimizer_that_cannot_step_without_a_closure_is_prepared_later() -> None:
    assert DDPEngine.prepare(_model(), torch.optim.LBFGS, {"lr": 0.1}, torch.device("cpu")) is None


@pytest.mark.timeout(30)
def test_zero_prepares_nothing_before_its_group_exists() -> None:
    assert ZeroEngine.prepare(_model(), torch.optim.SGD, {"lr": 0.1}, torch.device("cpu")) is None
