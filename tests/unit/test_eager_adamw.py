"""EagerAdamW: torch's AdamW update, state and state_dict, without the torch.compile guards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rftstream.training.eager_adamw import EagerAdamW
from rftstream.training.policy_trainer import _steps_optimizer_as_given


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(cls: type[torch.optim.Optimizer], steps: int, **kw: object) -> torch.nn.Module:
    model = _model(0)
    opt = cls(model.parameters(), **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


@pytest.mark.parametrize(
    "kw",
    [
        {"lr": 1e-2, "weight_decay": 0.1, "foreach": True},
        {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.0, "foreach": False},
        {"lr": 1e-2, "amsgrad": True, "foreach": True},
    ],
)
def test_the_update_is_torchs_adamw(kw: dict) -> None:
    ours, torchs = _train(EagerAdamW, 5, **kw), _train(torch.optim.AdamW, 5, **kw)
    for (name, a), (_, b) in zip(ours.named_parameters(), torchs.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    assert not torch.equal(next(_model(0).parameters()), next(ours.parameters()))  # it moved


def test_state_dict_loads_into_torchs_adamw_and_back() -> None:
    model = _model(0)
    opt = EagerAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    theirs = torch.optim.AdamW(_model(0).parameters(), lr=1e-2, weight_decay=0.1)
    theirs.load_state_dict(opt.state_dict())
    assert int(theirs.state_dict()["state"][0]["step"]) == 1
    again = EagerAdamW(_model(0).parameters(), lr=1e-2)
    again.load_state_dict(theirs.state_dict())
    assert again.param_groups[0]["weight_decay"] == 0.1


def test_the_step_records_no_graph_and_differentiable_is_refused() -> None:
    model = _model(0)
    opt = EagerAdamW(model.parameters(), lr=1e-2)
    model(torch.ones(2, 6)).sum().backward()
    with torch.enable_grad():
        opt.step()
    assert all(p.grad_fn is None for p in model.parameters())
    with pytest.raises(ValueError, match="differentiable"):
        EagerAdamW(model.parameters(), differentiable=True)


def test_no_dynamo_import() -> None:
    code = (
        "import sys, torch\n"
        "from rftstream.training.eager_adamw import EagerAdamW\n"
        "m = torch.nn.Linear(3, 2)\n"
        "opt = EagerAdamW(m.parameters(), lr=0.1, foreach=True)\n"
        "opt.add_param_group({'params': [torch.nn.Parameter(torch.zeros(2))]})\n"
        "for _ in range(2):\n"
        "    opt.zero_grad(); m(torch.ones(1, 3)).sum().backward(); opt.step()\n"
        "opt.load_state_dict(opt.state_dict())\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=dict(os.environ),
        cwd=Path(__file__).resolve().parents[2],
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False", out.stdout + out.stderr


@pytest.mark.parametrize(
    "ds_config,expected",
    [
        ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": False}}, True),
        ({}, True),
        ({"zero_optimization": {"stage": 2}}, False),  # ZeRO accepts the classes it knows
        ({"zero_optimization": {"stage": 0}, "bf16": {"enabled": True}}, False),
        ({"fp16": {"enabled": True}}, False),
        ({"bf16": True}, False),  # a bare flag
        ({"amp": {"enabled": True}}, False),
    ],
)
def test_used_where_deepspeed_steps_the_optimizer_as_given(ds_config: dict, expected: bool) -> None:
    assert _steps_optimizer_as_given(ds_config) is expected
