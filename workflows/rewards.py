"""Reward functions, as in Trinity-RFT: ``RewardFn`` subclasses registered in ``REWARD_FUNCTIONS``.

A reward function is built with ``buffer.explorer_input.taskset.reward_fn_args``
as keyword arguments, then called as ``fn(response=..., truth=..., **kwargs)``
and returns a dict of named scores (``{"accuracy": 1.0}``); a workflow uses
their sum as the reward and records each as a metric. Pure functions, no I/O.

Registered names (Trinity-RFT's, with its argument names where it has them):

==================== ===================================================================
``accuracy_reward``  ``answer_parser=None, normalize=False`` → ``accuracy``: the (parsed)
                     response equals the truth, exactly after stripping whitespace, or
                     after :func:`normalize_answer` (and numerically) with ``normalize``.
``math_reward``      ``answer_parser=None, pattern=None, format_score_coef=0.1,
                     use_math_verify=True`` → ``accuracy`` (final answer: last
                     ``\\boxed{}``, else last ``<answer>``, else last number; compared
                     numerically, after normalisation, then with math-verify when it is
                     installed), plus ``format_score`` (±coef) when ``pattern`` is set.
``math_boxed_reward`` ``with_think=False, format_score_coef=0.1, use_math_verify=True`` →
                     ``accuracy`` of the last ``\\boxed{}`` only (none: 0) against the
                     truth's final answer (as for ``math_reward``: GSM8K's ``#### 72``, a
                     box, an ``<answer>`` tag), and
                     ``format_score`` = -coef when ``with_think`` and the
                     ``<think></think>`` pair is malformed, else 0. ``with_think`` and
                     ``format_score_coef`` may also come per call (``math_boxed_workflow``
                     passes its ``workflow_args``).
``format_reward``    ``pattern=None, format_score_coef=0.1`` → ``format_score``: +coef if the
                     response matches ``pattern`` (default: ``<think>\\n…\\n</think>\\n
                     <answer>\\n…\\n</answer>``), else -coef.
``countdown_reward`` ``format_score=0.1, score=1.0`` → ``score``: ``score`` if the last
                     ``<answer>…</answer>`` is an arithmetic expression (``+ - * /``,
                     parentheses) using each given number exactly once and equal to the
                     target, ``format_score`` if there is such a tag otherwise, else 0.
                     The truth is ``{"target": t, "numbers": [...]}`` (a dict or its JSON;
                     ``nums`` is accepted for ``numbers``).
==================== ===================================================================

``answer_parser`` is a callable ``str -> str | None``, the name of one in
:data:`ANSWER_PARSERS` (``final_answer``, ``boxed``, ``answer_tag``,
``last_number``, ``strip``) or a dotted path to one.

math-verify (``pip install math-verify``) is used when importable, with its
signal-based timeouts disabled (they only work on the main thread, and reward
functions run in worker threads); inputs that could make sympy run for ever
(power towers, huge exponents, factorials) are never handed to it, and answers
that compare as plain numbers or equal strings never reach it. Without it, the
comparison is numeric, then on normalised strings.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from rftstream.errors import RegistryError, WorkflowError
from rftstream.plugins.registries import REWARD_FUNCTIONS
from rftstream.plugins.registry import Registry

__all__ = [
    "ANSWER_PARSERS",
    "REWARD_FUNCTIONS",
    "AccuracyReward",
    "CountdownReward",
    "FormatReward",
    "MathDAPOReward",
    "MathBoxedReward",
    "MathReward",
    "RewardFn",
    "evaluate_equation",
    "extract_answer",
    "extract_answer_tag",
    "extract_boxed",
    "extract_last_number",
    "math_equal",
    "normalize_answer",
]


class RewardFn(ABC):
    """Scores one response against the truth.

    Subclasses take their options (``buffer.explorer_input.taskset.reward_fn_args``)
    as constructor keyword arguments. ``fast = True`` declares the function
    cheap enough to call on the event loop; otherwise async workflows call it
    in a worker thread, unless :meth:`fast_for` says that these responses are
    cheap to score (a thread hop costs more than scoring a short answer).
    """

    fast: bool = False

    @abstractmethod
    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        """Return named scores; the reward is their sum."""

    def fast_for(self, response: str, truth: str | None = None) -> bool:
        """True when scoring ``response`` against ``truth`` is cheap enough for the event
        loop (a few microseconds of Python); ``fast`` by default. Must not block."""
        return self.fast


# ---------------------------------------------------------------------------
# Answer extraction
# ---------------------------------------------------------------------------

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*-?\d+(?:\.\d+)?)?|-?\.\d+")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
_FRAC = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_TEXT_WRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\s*\{([^{}]*)\}")


def extract_boxed(text: str | None) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) of ``text``, braces balanced.

    ``\\boxed 5`` (no braces) gives ``5``; an unclosed brace or no box gives ``None``.
    """
    if not text:
        return None
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    cmd = "\\boxed" if text.startswith("\\boxed", start) else "\\fbox"
    rest = text[start + len(cmd) :]
    stripped = rest.lstrip()
    if not stripped.startswith("{"):
        if rest[:1].isspace() and stripped:
            return stripped.split()[0].rstrip("$.,")
        return None
    brace = start + len(cmd) + (len(rest) - len(stripped))
    depth = 0
    for i in range(brace, len(text)):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            continue  # \{ and \} are literal braces: skipped with the next check
        if ch in "{}" and i > 0 and text[i - 1] == "\\":
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i]
    return None


def extract_answer_tag(text: str | None) -> str | None:
    """Content of the last ``<answer>...</answer>`` of ``text`` (stripped), or ``None``."""
    if not text:
        return None
    tags = _ANSWER_TAG.findall(text)
    return tags[-1].strip() if tags else None


def extract_last_number(text: str | None) -> str | None:
    """The last number of ``text`` (``-3``, ``1,000``, ``2.5``, ``3/4``), or ``None``."""
    if not text:
        return None
    numbers = _NUMBER.findall(text)
    return numbers[-1].strip() if numbers else None


def extract_answer(text: str | None) -> str | None:
    """The final answer in ``text``: the last ``\\boxed{}``, else the last ``<answer>``
    tag (a box inside it wins), else the last number; ``None`` if there is none."""
    if not text:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tag = extract_answer_tag(text)
    if tag is not None:
        return tag
    return extract_last_number(text)


ANSWER_PARSERS: Registry[Callable[[str], str | None]] = Registry("answer_parsers")
ANSWER_PARSERS.register_module("final_answer", extract_answer)
ANSWER_PARSERS.register_module("boxed", extract_boxed)
ANSWER_PARSERS.register_module("answer_tag", extract_answer_tag)
ANSWER_PARSERS.register_module("last_number", extract_last_number)
ANSWER_PARSERS.register_module("strip", lambda text: text.strip() if text is not None else None)


def _resolve_parser(spec: Any) -> Callable[[str], Any] | None:
    """``answer_parser``: None, a callable, a name in ANSWER_PARSERS, or a dotted path."""
    if spec is None or callable(spec):
        return spec
    if isinstance(spec, str):
        try:
            fn = ANSWER_PARSERS.get(spec)
        except RegistryError:
            fn = None
        if callable(fn):
            return fn
    raise WorkflowError(
        "buffer.explorer_input.taskset.reward_fn_args.answer_parser: expected one of "
        f"{ANSWER_PARSERS.names()}, a dotted path to a function or a callable, got {spec!r}"
    )


# ---------------------------------------------------------------------------
# Normalisation and comparison
# ---------------------------------------------------------------------------


def _strip_latex(text: str) -> str:
    s = text.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):
        s = _TEXT_WRAP.sub(r"\1", s)
    return s


def _normalize(text: str) -> str:
    """Aggressive normalisation for math answers (fractions, braces, spaces, units' junk gone)."""
    s = _strip_latex(text).strip("$").strip()
    s = _FRAC.sub(r"(\1)/(\2)", s)
    for junk in (
        "\\left",
        "\\right",
        "\\!",
        "\\,",
        "\\;",
        "\\:",
        "\\%",
        "%",
        "\\$",
        "$",
        "^\\circ",
    ):
        s = s.replace(junk, "")
    s = s.replace("{", "").replace("}", "").replace(" ", "")
    return s.rstrip(".")


def normalize_answer(text: str | None) -> str:
    """A short answer in canonical form: LaTeX wrappers (``$``, ``\\text{}``) and
    ``\\left``/``\\right`` gone, whitespace collapsed, lower case, no trailing period,
    no thousands separators in numbers (``"  The $\\text{Answer}$. "`` → ``"the answer"``)."""
    if text is None:
        return ""
    s = re.sub(r"(?<!\\)\$", "", _strip_latex(str(text)))
    for junk in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:"):
        s = s.replace(junk, "")
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)
    s = " ".join(s.split()).lower()
    return s.rstrip(".").strip()


_PLAIN_DECIMAL = re.compile(r"-?\d+(?:\.\d+)?")


def _to_number(text: str) -> float | None:
    if len(text) <= 64 and _PLAIN_DECIMAL.fullmatch(text):
        return float(text)  # the common case, as below but without the latex normalisation
    s = _normalize(text)
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    s = s.replace("(", "").replace(")", "")
    if len(s) > 64:
        return None
    try:
        return float(Fraction(s))
    except (ValueError, ZeroDivisionError, OverflowError):
        pass
    try:
        value = float(s)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def _as_number(text: str) -> float | None:
    value = _to_number(text)
    if value is None:
        inner = _NUMBER.findall(text)
        if len(inner) == 1 and len(text) <= 32:
            value = _to_number(inner[0])
    return value


# Inputs sympy may never finish with: power towers, huge exponents, factorials.
_MV_MAX_CHARS = 200
_POWER_TOWER = re.compile(r"\^\s*\{?[^{}]*\^|\*\*[^*]*\*\*")
_BIG_EXPONENT = re.compile(r"(?:\^|\*\*)\s*\{?\s*-?\d{4,}")
_FACTORIAL = re.compile(r"\d{3,}\s*!|!\s*!|\\binom|\\uparrow")


def _safe_for_math_verify(text: str) -> bool:
    return (
        len(text) <= _MV_MAX_CHARS
        and not _POWER_TOWER.search(text)
        and not _BIG_EXPONENT.search(text)
        and not _FACTORIAL.search(text)
    )


def _load_math_verify() -> Any:
    """The ``math_verify`` module, or ``None`` when it is not installed (imported lazily)."""
    try:
        import math_verify
        import math_verify.grader
        import math_verify.parser
    except ImportError:
        return None
    # Timeouts are off (see the module docstring): silence its one-time warning about that.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


def _math_verify_equal(prediction: str, truth: str) -> bool | None:
    """math-verify's verdict on two extracted answers; ``None`` when it cannot judge."""
    mv = _load_math_verify()
    if mv is None or not (_safe_for_math_verify(prediction) and _safe_for_math_verify(truth)):
        return None
    try:
        gold = mv.parse(f"\\boxed{{{truth}}}", parsing_timeout=None)
        pred = mv.parse(f"\\boxed{{{prediction}}}", parsing_timeout=None)
        if not gold or not pred:
            return None
        return bool(mv.verify(gold, pred, timeout_seconds=None))
    except Exception:  # noqa: BLE001 - math-verify / sympy may raise anything on odd input
        return None


def math_equal(prediction: str | None, truth: str | None, *, use_math_verify: bool = True) -> bool:
    """True if two extracted answers are the same: numerically (relative 1e-6) when both
    parse as numbers, else equal after normalisation, else equivalent for math-verify
    (when installed and ``use_math_verify``)."""
    if prediction is None or truth is None:
        return False
    prediction, truth = str(prediction).strip(), str(truth).strip()
    if not prediction or not truth:
        return False
    a, b = _as_number(prediction), _as_number(truth)
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-9)
    if _normalize(prediction) == _normalize(truth):
        return True
    if use_math_verify:
        return bool(_math_verify_equal(prediction, truth))
    return False


def _truth_answer(truth: Any) -> str:
    """The final answer of a truth that may be a whole solution (GSM8K's ``#### 72``, a box)."""
    text = str(truth).strip()
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    tag = extract_answer_tag(text)
    if tag is not None:
        return tag
    if _as_number(text) is None and _is_sentence(text):
        return extract_last_number(text) or text
    return text


def _is_sentence(text: str) -> bool:
    """Prose rather than a math expression: three or more words, one of them a plain word."""
    return len(text.split()) >= 3 and re.search(r"(?<![\\a-zA-Z])[a-zA-Z]{3,}\b", text) is not None


# ---------------------------------------------------------------------------
# Built-in reward functions
# ---------------------------------------------------------------------------

THINK_ANSWER_PATTERN = r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$"


@REWARD_FUNCTIONS.register_module("accuracy_reward")
class AccuracyReward(RewardFn):
    """``{"accuracy": 1.0}`` if the response equals the truth, else 0.0.

    Exact (after stripping surrounding whitespace) by default; with
    ``normalize=True`` both sides go through :func:`normalize_answer` and equal
    numbers match too (``"7.0"`` = ``"7"``, ``"$1,000$"`` = ``"1000"``). With an
    ``answer_parser`` the parser is applied to both sides first.
    """

    fast = True

    def __init__(self, answer_parser: Any = None, normalize: bool = False) -> None:
        self.answer_parser = _resolve_parser(answer_parser)
        self.normalize = bool(normalize)

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        if truth is None:
            return {"accuracy": 0.0}
        pred: Any = response or ""
        gold: Any = str(truth)
        if self.answer_parser is not None:
            pred, parsed_gold = self.answer_parser(pred), self.answer_parser(gold)
            gold = parsed_gold if parsed_gold is not None else gold
            if pred is None:
                return {"accuracy": 0.0}
        pred, gold = str(pred), str(gold)
        if not self.normalize:
            return {"accuracy": float(pred.strip() == gold.strip())}
        a, b = normalize_answer(pred), normalize_answer(gold)
        same = a == b
        if not same:
            x, y = _to_number(a), _to_number(b)
            same = x is not None and y is not None and math.isclose(x, y, rel_tol=1e-9)
        return {"accuracy": float(same)}


@REWARD_FUNCTIONS.register_module("format_reward")
class FormatReward(RewardFn):
    """``{"format_score": +format_score_coef}`` if the response matches ``pattern``
    (``re.match``, DOTALL and MULTILINE), else ``-format_score_coef``.

    The default pattern is Trinity-RFT's (after open-r1):
    ``<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>``.
    """

    fast = True

    def __init__(self, pattern: str | None = None, format_score_coef: float = 0.1) -> None:
        self.pattern = pattern or THINK_ANSWER_PATTERN
        try:
            self._regex = re.compile(self.pattern, re.DOTALL | re.MULTILINE)
        except re.error as exc:
            raise WorkflowError(
                f"buffer.explorer_input.taskset.reward_fn_args.pattern: invalid regex {self.pattern!r}: {exc}"
            ) from exc
        self.format_score_coef = float(format_score_coef)

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        ok = self._regex.match(response or "") is not None
        return {"format_score": self.format_score_coef if ok else -self.format_score_coef}


@REWARD_FUNCTIONS.register_module("math_reward")
class MathReward(RewardFn):
    """``{"accuracy": 1.0}`` if the response's final answer equals the truth, else 0.0.

    The answer is the last ``\\boxed{}``, else the last ``<answer>...</answer>``,
    else the last number of the response (or what ``answer_parser`` returns).
    The truth may itself be a solution text (GSM8K's ``#### 72``, a boxed
    answer): its final answer is used. Comparison: :func:`math_equal`.
    With ``pattern`` set (a regex, or ``"default"`` for ``<think>``/``<answer>``
    tags) a :class:`FormatReward` ``format_score`` is added, as in Trinity-RFT
    (which always adds it; here it is opt-in, so that plain answers keep 0/1
    rewards).
    """

    fast = False  # math-verify may take milliseconds: async workflows call it in a thread ...

    def __init__(
        self,
        answer_parser: Any = None,
        pattern: str | None = None,
        format_score_coef: float = 0.1,
        use_math_verify: bool = True,
    ) -> None:
        self.answer_parser = _resolve_parser(answer_parser) or extract_answer
        self.format_reward = (
            FormatReward(None if pattern == "default" else pattern, format_score_coef)
            if pattern
            else None
        )
        self.use_math_verify = bool(use_math_verify)

    def fast_for(self, response: str, truth: str | None = None) -> bool:
        """... unless math-verify is off or not needed: the answer and the truth are both
        numbers, or either is missing (about 10 microseconds for a short answer). Only the
        built-in answer parser is known to be cheap."""
        if self.answer_parser is not extract_answer or self.format_reward is not None:
            return False
        if not self.use_math_verify or truth is None:
            return True
        answer = extract_answer(response or "")
        if answer is None or not answer.strip():
            return True
        return _as_number(answer.strip()) is not None and (
            _as_number(_truth_answer(truth)) is not None
        )

    def __call__(self, response: str, truth: str | None = None, **kwargs: Any) -> dict[str, float]:
        scores: dict[str, float] = {"accuracy": 0.0}
        if truth is not None:
            answer = self.answer_parser(response or "")
            equal = math_equal(answer, _truth_answer(truth), use_math_verify=self.use_math_verify)
            scores["accuracy"] = float(equal)
        if self.format_reward is not None:
            scores.update(self.format_reward(response))
        return scores


def _think_ok(text: str) -> bool:
    """Exactly one ``<think>`` and one ``</think>``, in that order."""
    if text.count("<think>") != 1 or text.count("</think>") != 1:
        return False
    return text.find("<think>") < text.find("</think>")


@REWARD_FUNCTIONS.register_module("math_boxed_reward")
class MathBoxedReward(RewardFn):
    """Accuracy of the last ``\\boxed{}`` answer (no box: 0), plus a think-format penalty.

    The truth may be a whole solution: its final answer is compared (GSM8K's
    ``#### 72``, its last box, its ``<answer>`` tag; see :class:`MathReward`),
    with or without math-verify.

    Returns ``{"accuracy": 0 or 1, "format_score": 0 or -format_score_coef}``;
    the penalty applies only with ``with_think`` when the response lacks one
    well-ordered ``<think>...</think>`` pair. ``with_think`` and
    ``format_score_coef`` given to the call override the constructor's.
    """

    fast = False

    def __init__(
        self,
        with_think: bool = False,
        format_score_coef: float = 0.1,
        use_math_verify: bool = True,
        **kwargs: Any,
    ) -> None:
        self.with_think = bool(with_think)
        self.format_score_coef = float(format_score_coef)
        self.use_math_verify = bool(use_math_verify)

    def __call__(
        self,
        response: str,
        truth: str | None = None,
        with_think: bool | None = None,
        format_score_coef: float | None = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        text = response or ""
        accuracy = 0.0
        if truth is not None:
            boxed = extract_boxed(text)
            if boxed is not None:
                accuracy = float(
                    math_equal(boxed, _truth_answer(truth), use_math_verify=self.use_math_verify)
                )
        think = self.with_think if with_think is None else bool(with_think)
        coef = self.format_score_coef if format_score_coef is None else float(format_score_coef)
        format_score = -coef if think and not _think_ok(text) else 0.0
        return {"accuracy": accuracy, "format_score": format_score}


# ---------------------------------------------------------------------------
# Countdown
# ---------------------------------------------------------------------------

_EQUATION_CHARS = re.compile(r"^[\d+\-*/().\s]+$")
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def evaluate_equation(equation: str) -> float | None:
    """The value of an arithmetic expression of numbers, ``+ - * /`` and parentheses;
    ``None`` if it is not one, divides by zero or is too long. Never calls ``eval``."""
    if not equation or len(equation) > 256 or not _EQUATION_CHARS.match(equation):
        return None
    try:
        tree = ast.parse(equation.strip(), mode="eval")
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            value = ev(node.operand)
            return -value if isinstance(node.op, ast.USub) else value
        raise ValueError(f"not allowed: {type(node).__name__}")

    try:
        value = ev(tree)
    except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
        return None
    return float(value)


def _countdown_truth(truth: Any) -> tuple[float, list[int]] | None:
    data = truth
    if isinstance(truth, (str, bytes)):
        try:
            data = json.loads(truth)
        except (json.JSONDecodeError, TypeError):
            return None
    if not isinstance(data, dict) or "target" not in data:
        return None
    numbers = data.get("numbers", data.get("nums"))
    if numbers is None:
        return None
    try:
        return float(data["target"]), [int(n) for n in numbers]
    except (TypeError, ValueError):
        return None


@REWARD_FUNCTIONS.register_module("countdown_reward")
class CountdownReward(RewardFn):
    """The Countdown game's reward (TinyZero's, as in Trinity-RFT): ``{"score": ...}``.

    ``score`` when the last ``<answer>...</answer>`` holds an equation that uses
    every given number exactly once and evaluates to the target (within
    1e-5); ``format_score`` when there is an answer tag but the equation is
    wrong, uses other numbers or does not parse; 0 without an answer tag. The
    truth is ``{"target": ..., "numbers": [...]}`` or its JSON text.
    """

    fast = True

    def __init__(self, format_score: float = 0.1, score: float = 1.0) -> None:
        self.format_score = float(format_score)
        self.score = float(score)

    def __call__(self, response: str, truth: Any = None, **kwargs: Any) -> dict[str, float]:
        parsed = _countdown_truth(truth)
        if parsed is None:
            raise WorkflowError(
                f"countdown_reward: the truth must be {{'target': ..., 'numbers': [...]}} "
                f"(or its JSON), got {truth!r}"
            )
        target, numbers = parsed
        equation = extract_answer_tag(response)
        if equation is None:
            return {"score": 0.0}
        used = sorted(int(n) for n in re.findall(r"\d+", equation))
        if used != sorted(numbers):
            return {"score": self.format_score}
        value = evaluate_equation(equation)
        if value is None or abs(value - target) >= 1e-5:
            return {"score": self.format_score}
        return {"score": self.score}


@REWARD_FUNCTIONS.register_module("math_dapo_reward")
class MathDAPOReward(RewardFn):
    """DAPO's rule-based math reward with its overlong shaping, as Trinity-RFT's ``math_dapo_reward``.

    Returns ``{"accuracy": +1.0 or -1.0, "format_score": penalty}`` (the reward
    is their sum). The answer is the last ``\\boxed{}`` after any ``</think>``
    (else that whole text), compared with the truth's final answer by
    :func:`math_equal`. With ``enable_overlong_penalty`` the penalty is 0 up to
    ``max_response_length - cache_length`` response tokens, then falls linearly
    to ``-penalty_factor`` at ``max_response_length`` and stays there beyond
    (DAPO, section 3.4). Raises :class:`WorkflowError` naming the argument when
    the penalty is enabled without its three settings.
    """

    fast = False

    def __init__(
        self,
        enable_overlong_penalty: bool | None = None,
        penalty_factor: float | None = None,
        max_response_length: int | None = None,
        cache_length: int | None = None,
        use_math_verify: bool = True,
    ) -> None:
        self.enable_overlong_penalty = bool(enable_overlong_penalty)
        if self.enable_overlong_penalty:
            for name, value in (
                ("penalty_factor", penalty_factor),
                ("max_response_length", max_response_length),
                ("cache_length", cache_length),
            ):
                if value is None:
                    raise WorkflowError(
                        f"buffer.explorer_input.taskset.reward_fn_args.{name}: required by "
                        "math_dapo_reward when enable_overlong_penalty is true"
                    )
            if int(max_response_length) <= int(cache_length):  # type: ignore[arg-type]
                raise WorkflowError(
                    "buffer.explorer_input.taskset.reward_fn_args.max_response_length: must be "
                    f"greater than cache_length ({max_response_length} <= {cache_length})"
                )
        self.penalty_factor = float(penalty_factor or 0.0)
        self.max_response_length = int(max_response_length or 0)
        self.cache_length = int(cache_length or 0)
        self.use_math_verify = bool(use_math_verify)

    def overlong_penalty(self, response_length: int) -> float:
        """The shaping term for a response of ``response_length`` tokens (<= 0)."""
        expected = self.max_response_length - self.cache_length
        if response_length <= expected:
            return 0.0
        if response_length > self.max_response_length:
            return -self.penalty_factor
        return (expected - response_length) / self.cache_length * self.penalty_factor

    def __call__(
        self,
        response: str,
        truth: str | None = None,
        response_token: Any = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        text = (response or "").split("</think>")[-1]
        answer = extract_boxed(text)
        if answer is None:
            answer = text.strip()
        correct = truth is not None and math_equal(
            answer, _truth_answer(truth), use_math_verify=self.use_math_verify
        )
        penalty = 0.0
        if self.enable_overlong_penalty:
            length = len(response_token) if response_token is not None else 0
            penalty = self.overlong_penalty(length)
        return {"accuracy": 1.0 if correct else -1.0, "format_score": penalty}
