"""Reward functions, as in Trinity-RFT: ``RewardFn`` subclasses registered in ``REWARD_FUNCTIONS``.

A reward function is called as ``fn(response=..., truth=..., **kwargs)`` and
returns a dict of named scores (``{"accuracy": 1.0}``); a workflow uses their
sum as the reward and records each as a metric. Pure functions, no I/O.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from fractions import Fraction
from typing import Any

from rftstream.registry import Registry

__all__ = [
    "REWARD_FUNCTIONS",
    "AccuracyReward",
    "MathReward",
    "RewardFn",
    "extract_answer",
    "math_equal",
]


class RewardFn(ABC):
    """Scores one response against the truth.

    Subclasses take their options (``buffer.explorer_input.taskset.reward_fn_args``)
    as constructor keyword arguments. ``fast = True`` declares the function
    cheap enough to call on the event loop; otherwise async workflows call it
    in a worker thread.
    """

    fast: bool = False

    @abstractmethod
    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        """Return named scores; the reward is their sum."""


REWARD_FUNCTIONS: Registry[type[RewardFn]] = Registry("reward_functions")


# ---------------------------------------------------------------------------
# Answer extraction and comparison
# ---------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")


def _last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        rest = text[start + len("\\boxed") :].strip()
        return rest.split()[0] if rest else None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


def extract_answer(text: str | None) -> str | None:
    """The final answer in ``text``: the last ``\\boxed{}``, else the last ``<answer>``
    tag, else the last number; ``None`` if there is none."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip()
    numbers = _NUMBER.findall(text)
    if numbers:
        return numbers[-1].strip()
    return None


def _normalize(text: str) -> str:
    s = text.strip().strip("$").strip()
    s = _FRAC.sub(r"(\1)/(\2)", s)
    for junk in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\%",
        "%",
        "\\$",
        "$",
        "\\text{",
        "\\mathrm{",
    ):
        s = s.replace(junk, "")
    s = s.replace("{", "").replace("}", "").replace(" ", "")
    return s.rstrip(".")


def _to_number(text: str) -> float | None:
    s = _normalize(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace("(", "").replace(")", "")
    try:
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError):
        pass
    try:
        return float(s)
    except ValueError:
        return None


def _as_number(text: str) -> float | None:
    value = _to_number(text)
    if value is None:
        inner = _NUMBER.findall(text)
        if len(inner) == 1:
            value = _to_number(inner[0])
    return value


def math_equal(prediction: str | None, truth: str | None) -> bool:
    """Numerically equal (relative 1e-6) when both parse as numbers, else equal after normalisation."""
    if prediction is None or truth is None:
        return False
    a, b = _as_number(prediction), _as_number(truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    return _normalize(prediction) == _normalize(truth)


# ---------------------------------------------------------------------------
# Built-in reward functions
# ---------------------------------------------------------------------------


@REWARD_FUNCTIONS.register_module("math_reward")
class MathReward(RewardFn):
    """``{"accuracy": 1.0}`` if the response's final answer equals the truth, else 0.0.

    The answer is the last ``\\boxed{}``, else the last ``<answer>...</answer>``,
    else the last number of the response. The truth may itself be a solution
    text (GSM8K's ``#### 72``): its final answer is extracted the same way.
    """

    fast = True

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        if truth is None:
            return {"accuracy": 0.0}
        truth_text = str(truth)
        if _as_number(truth_text) is None:
            truth_text = extract_answer(truth_text) or truth_text
        return {"accuracy": 1.0 if math_equal(extract_answer(response), truth_text) else 0.0}


@REWARD_FUNCTIONS.register_module("accuracy_reward")
class AccuracyReward(RewardFn):
    """``{"accuracy": 1.0}`` if the response equals the truth exactly after stripping whitespace."""

    fast = True

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        if truth is None:
            return {"accuracy": 0.0}
        return {"accuracy": 1.0 if (response or "").strip() == str(truth).strip() else 0.0}
