"""Text environments for multi-turn workflows, on a gym-like protocol.

An environment is any object with

* ``reset() -> observation`` (a string; a gymnasium-style ``(observation,
  info)`` pair is accepted too), and
* ``step(action: str) -> (observation, reward, done, info)`` (gymnasium's
  five-tuple ``(observation, reward, terminated, truncated, info)`` is
  accepted too), and optionally ``close()``.

:class:`TextEnv` is a convenient base; register environments with
``@ENVS.register_module("name")`` and select them with
``workflow_args.env_type`` of ``env_workflow``. A workflow builds one
environment per rollout with ``ENVS.get(name).from_task(raw_task,
**env_args)``: the default ``from_task`` passes the row's keys that the
constructor accepts (plus ``env_args``), so the rollouts of one task play the
same game. Environments here are pure Python and cheap (``fast = True``: their
``step`` runs on the event loop); a slow or blocking environment leaves
``fast`` False and its calls run in a worker thread.

Built-in: ``guess_number`` (find a hidden integer from "higher"/"lower"
hints) and ``frozen_lake`` (walk a small grid to the goal without falling in a
hole; deterministic, as gymnasium's ``FrozenLake-v1`` with ``is_slippery=False``).
"""

from __future__ import annotations

import inspect
import random
import re
from typing import Any

from rftstream.errors import WorkflowError
from rftstream.plugins.registry import Registry

__all__ = ["ENVS", "FrozenLakeEnv", "GuessNumberEnv", "TextEnv", "normalize_step"]


class TextEnv:
    """Base class of text environments (the protocol is in the module docstring)."""

    fast: bool = True

    @classmethod
    def from_task(cls, raw_task: dict[str, Any], **env_args: Any) -> TextEnv:
        """Build an environment for one task: ``env_args`` plus the row's keys that
        ``__init__`` accepts (the row wins)."""
        params = inspect.signature(cls.__init__).parameters
        kwargs = dict(env_args)
        kwargs.update({k: v for k, v in raw_task.items() if k in params and k != "self"})
        try:
            return cls(**kwargs)
        except TypeError as exc:
            raise WorkflowError(f"cannot build environment {cls.__name__}: {exc}") from exc

    def reset(self) -> str:
        raise NotImplementedError

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        raise NotImplementedError

    def close(self) -> None:
        """Release resources (nothing by default)."""


ENVS: Registry[type[Any]] = Registry("environments")


def normalize_step(result: Any) -> tuple[str, float, bool, dict[str, Any]]:
    """``(observation, reward, done, info)`` from a gym four-tuple or a gymnasium five-tuple."""
    if not isinstance(result, tuple) or len(result) not in (4, 5):
        raise WorkflowError(
            "env.step(action) must return (observation, reward, done, info) or "
            f"(observation, reward, terminated, truncated, info), got {result!r:.200}"
        )
    if len(result) == 5:
        obs, reward, terminated, truncated, info = result
        done = bool(terminated) or bool(truncated)
    else:
        obs, reward, done, info = result
    return str(obs), float(reward or 0.0), bool(done), dict(info or {})


@ENVS.register_module("guess_number")
class GuessNumberEnv(TextEnv):
    """Guess a hidden integer in ``[low, high]`` within ``max_guesses`` tries.

    The row gives ``target`` (else one is drawn from ``seed``, so all rollouts
    of a task share it). Each action's first integer is the guess; the
    observation answers ``Higher.``, ``Lower.`` or ``Correct!`` (``Say a
    number.`` when there is none). Reward 1.0 for the right guess, else 0;
    the episode ends on it or after ``max_guesses``.
    """

    def __init__(
        self,
        target: int | None = None,
        low: int = 0,
        high: int = 9,
        max_guesses: int = 4,
        seed: int = 0,
    ) -> None:
        if low > high:
            raise WorkflowError(f"guess_number: low {low} > high {high}")
        self.low, self.high, self.max_guesses = int(low), int(high), int(max_guesses)
        self.target = int(target) if target is not None else random.Random(seed).randint(low, high)
        self.guesses = 0

    def reset(self) -> str:
        self.guesses = 0
        return f"Guess my number ({self.low}-{self.high})."

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.guesses += 1
        found = re.search(r"-?\d+", action or "")
        out_of_tries = self.guesses >= self.max_guesses
        info: dict[str, Any] = {"guesses": self.guesses}
        if found is None:
            return "Say a number.", 0.0, out_of_tries, {**info, "valid": False}
        guess = int(found.group())
        if guess == self.target:
            return "Correct!", 1.0, True, {**info, "valid": True, "won": True}
        hint = "Higher." if guess < self.target else "Lower."
        return hint, 0.0, out_of_tries, {**info, "valid": True}


@ENVS.register_module("frozen_lake")
class FrozenLakeEnv(TextEnv):
    """A deterministic FrozenLake on a text grid.

    ``desc`` is the map, rows joined by ``/`` or a list of rows (``S`` start,
    ``F`` frozen, ``H`` hole, ``G`` goal; default the 4x4 map of gymnasium).
    Actions: the first of ``left``/``down``/``right``/``up`` (or ``L``/``D``/
    ``R``/``U``) in the reply. The observation is the grid with ``P`` for the
    player. Reward 1.0 at the goal; the episode ends at the goal, in a hole
    or after ``max_steps``; moves into the border leave the player in place.
    """

    MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
    _ACTION = re.compile(r"\b(left|down|right|up|[LDRU])\b", re.IGNORECASE)

    def __init__(self, desc: str | list[str] = "SFFF/FHFH/FFFH/HFFG", max_steps: int = 20) -> None:
        rows = desc.split("/") if isinstance(desc, str) else list(desc)
        if not rows or len({len(r) for r in rows}) != 1:
            raise WorkflowError(f"frozen_lake: desc must be equal-length rows, got {desc!r}")
        self.grid = [list(r.upper()) for r in rows]
        starts = [(i, j) for i, r in enumerate(self.grid) for j, c in enumerate(r) if c == "S"]
        if len(starts) != 1:
            raise WorkflowError(f"frozen_lake: desc needs exactly one S, got {desc!r}")
        self.start = starts[0]
        self.pos = self.start
        self.max_steps = int(max_steps)
        self.steps = 0

    def render(self) -> str:
        return "\n".join(
            "".join("P" if (i, j) == self.pos else c for j, c in enumerate(row))
            for i, row in enumerate(self.grid)
        )

    def reset(self) -> str:
        self.pos, self.steps = self.start, 0
        return self.render()

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.steps += 1
        found = self._ACTION.search(action or "")
        truncated = self.steps >= self.max_steps
        if found is None:
            return self.render(), 0.0, truncated, {"valid": False}
        word = found.group(1).lower()
        word = {"l": "left", "d": "down", "r": "right", "u": "up"}.get(word, word)
        di, dj = self.MOVES[word]
        i = min(max(self.pos[0] + di, 0), len(self.grid) - 1)
        j = min(max(self.pos[1] + dj, 0), len(self.grid[0]) - 1)
        self.pos = (i, j)
        cell = self.grid[i][j]
        if cell == "G":
            return self.render(), 1.0, True, {"valid": True, "won": True}
        if cell == "H":
            return self.render(), 0.0, True, {"valid": True, "won": False}
        return self.render(), 0.0, truncated, {"valid": True}
