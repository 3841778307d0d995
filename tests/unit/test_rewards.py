"""Reward functions against hand-written expected values (pure; math-verify on and off)."""

from __future__ import annotations

import json
import sys
import threading
from typing import Any

import pytest

from rftstream.errors import WorkflowError
from rftstream.workflow import resolve_reward_fn
from workflows import REWARD_FUNCTIONS
from workflows.rewards import (
    evaluate_equation,
    extract_answer,
    extract_answer_tag,
    extract_boxed,
    extract_last_number,
    math_equal,
    normalize_answer,
)


def reward(name: str, **args: Any) -> Any:
    return resolve_reward_fn(name, args)


@pytest.fixture
def no_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import math_verify`` fails, as when it is not installed."""
    for mod in [m for m in sys.modules if m == "math_verify" or m.startswith("math_verify.")]:
        monkeypatch.setitem(sys.modules, mod, None)
    monkeypatch.setitem(sys.modules, "math_verify", None)


def test_registered_names() -> None:
    for name in (
        "accuracy_reward",
        "math_reward",
        "math_boxed_reward",
        "format_reward",
        "countdown_reward",
        "code_reward",
    ):
        assert name in REWARD_FUNCTIONS


# ---------------------------------------------------------------------------
# extraction
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{7}.", "7"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),  # deeper nesting
        ("first \\boxed{1} then \\boxed{2}", "2"),  # the last one
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are content
        ("\\boxed 5.", "5"),  # brace-less form
        ("\\fbox{3}", "3"),
        ("\\boxed{unclosed", None),
        ("no box here", None),
        ("", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_boxed(text) == expected


def test_other_extractors() -> None:
    assert extract_answer_tag("<answer> 1 </answer> x <ANSWER>2</ANSWER>") == "2"
    assert extract_answer_tag("<answer>open") is None
    assert extract_last_number("a 3, then -4.5 and 1,000") == "1,000"
    assert extract_last_number("none") is None
    # boxed beats the tag beats the last number
    assert extract_answer("<answer>3</answer> \\boxed{4} 5") == "4"
    assert extract_answer("<answer>3</answer> 5") == "3"
    assert extract_answer("it is 5") == "5"
    assert extract_answer("nothing") is None


def test_normalize_answer() -> None:
    assert normalize_answer("  The $\\text{Answer}$. ") == "the answer"
    assert normalize_answer("1,000") == "1000"
    assert normalize_answer("x = $5$ or \\$5") == "x = 5 or \\$5"
    assert normalize_answer("\\left( 1, 2 \\right)") == "( 1, 2 )"
    assert normalize_answer(None) == ""


# ---------------------------------------------------------------------------
# accuracy_reward: exact vs normalised
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response,truth,exact,normalised",
    [
        ("7", "7", 1.0, 1.0),
        (" 7\n", "7", 1.0, 1.0),
        ("7.0", "7", 0.0, 1.0),
        ("Paris.", "paris", 0.0, 1.0),
        ("$1,000$", "1000", 0.0, 1.0),
        ("New  York", "new york", 0.0, 1.0),
        ("8", "7", 0.0, 0.0),
        ("", "7", 0.0, 0.0),
    ],
)
def test_accuracy_reward_exact_and_normalised(
    response: str, truth: str, exact: float, normalised: float
) -> None:
    assert reward("accuracy_reward")(response=response, truth=truth) == {"accuracy": exact}
    assert reward("accuracy_reward", normalize=True)(response=response, truth=truth) == {
        "accuracy": normalised
    }


def test_accuracy_reward_answer_parser() -> None:
    fn = reward("accuracy_reward", answer_parser="boxed")
    assert fn(response="so \\boxed{7}", truth="\\boxed{7}") == {"accuracy": 1.0}
    assert fn(response="so \\boxed{7}", truth="7") == {"accuracy": 1.0}  # unparsable truth: as is
    assert fn(response="7", truth="7") == {"accuracy": 0.0}  # no box in the response
    fn = reward("accuracy_reward", answer_parser=lambda s: s.split("=")[-1].strip())
    assert fn(response="3+4 = 7", truth="7") == {"accuracy": 1.0}
    fn = reward("accuracy_reward", answer_parser="workflows.rewards.extract_answer_tag")
    assert fn(response="<answer>7</answer>", truth="7") == {"accuracy": 1.0}
    assert reward("accuracy_reward")(response="7", truth=None) == {"accuracy": 0.0}
    with pytest.raises(WorkflowError, match="answer_parser"):
        reward("accuracy_reward", answer_parser="no_such_parser")
    with pytest.raises(WorkflowError, match="reward_fn_args"):
        reward("accuracy_reward", no_such_arg=1)


# ---------------------------------------------------------------------------
# math_reward and math_equal, with and without math-verify
# ---------------------------------------------------------------------------

# (response, truth, with math-verify, without math-verify)
MATH_CASES = [
    ("so the result is \\boxed{7}.", "7", 1.0, 1.0),
    ("<think>3+4</think><answer>7</answer>", "7", 1.0, 1.0),
    ("the answer is 7", "7", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0, 1.0),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0, 1.0),
    ("It is 1,000.", "1000", 1.0, 1.0),
    ("\\boxed{8} although 7", "7", 0.0, 0.0),
    ("no idea", "7", 0.0, 0.0),
    ("", "7", 0.0, 0.0),
    ("72 clips", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0, 1.0),
    ("\\boxed{x^2+1}", "x^2 + 1", 1.0, 1.0),  # equal after normalisation
    ("\\boxed{1+x^2}", "x^2+1", 1.0, 0.0),  # symbolic: needs math-verify
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\sqrt{2}/2", 1.0, 0.0),
    ("\\boxed{\\sqrt{2}/2}", "\\boxed{\\frac{\\sqrt{2}}{2}}", 1.0, 0.0),  # boxed truth
    ("\\boxed{2x}", "x^2+1", 0.0, 0.0),
    ("\\boxed{9^{9^{9}}}", "3", 0.0, 0.0),  # never handed to sympy (it would not finish)
]


@pytest.mark.parametrize("response,truth,with_mv,without_mv", MATH_CASES)
def test_math_reward_with_math_verify(
    response: str, truth: str, with_mv: float, without_mv: float
) -> None:
    assert reward("math_reward")(response=response, truth=truth) == {"accuracy": with_mv}


@pytest.mark.parametrize("response,truth,with_mv,without_mv", MATH_CASES)
def test_math_reward_fallback_without_math_verify(
    no_math_verify: None, response: str, truth: str, with_mv: float, without_mv: float
) -> None:
    assert reward("math_reward")(response=response, truth=truth) == {"accuracy": without_mv}


def test_math_reward_use_math_verify_off_and_in_threads() -> None:
    fn = reward("math_reward", use_math_verify=False)
    assert fn(response="\\boxed{1+x^2}", truth="x^2+1") == {"accuracy": 0.0}
    # math-verify's own timeouts use signals (main thread only): ours are off, so threads work
    out: list[Any] = []
    t = threading.Thread(
        target=lambda: out.append(reward("math_reward")(response="\\boxed{1+x^2}", truth="x^2+1"))
    )
    t.start()
    t.join()
    assert out == [{"accuracy": 1.0}]


def test_math_reward_format_pattern() -> None:
    good = "<think>\n3+4\n</think>\n<answer>\n7\n</answer>"
    fn = reward("math_reward", pattern="default")
    assert fn(response=good, truth="7") == {"accuracy": 1.0, "format_score": 0.1}
    assert fn(response="7", truth="7") == {"accuracy": 1.0, "format_score": -0.1}
    fn = reward("math_reward", pattern=r"^\d+$", format_score_coef=0.5)
    assert fn(response="7", truth="8") == {"accuracy": 0.0, "format_score": 0.5}
    assert reward("math_reward")(response="7", truth=None) == {"accuracy": 0.0}


def test_math_equal() -> None:
    assert math_equal("0.33333", "1/3") is False  # relative tolerance 1e-6
    assert math_equal("0.3333333", "1/3") is True
    assert math_equal("-3", "-3.0") is True
    assert math_equal(None, "1") is False and math_equal("1", None) is False
    assert math_equal("", "") is False


# ---------------------------------------------------------------------------
# math_boxed_reward
# ---------------------------------------------------------------------------


def test_math_boxed_reward() -> None:
    fn = reward("math_boxed_reward")
    assert fn(response="\\boxed{7}", truth="7") == {"accuracy": 1.0, "format_score": 0.0}
    assert fn(response="\\boxed{7}", truth="\\boxed{7}") == {"accuracy": 1.0, "format_score": 0.0}
    # no box: 0, even when the right number is there
    assert fn(response="the answer is 7", truth="7") == {"accuracy": 0.0, "format_score": 0.0}
    assert fn(response="\\boxed{\\frac{14}{2}}", truth="7") == {
        "accuracy": 1.0,
        "format_score": 0.0,
    }
    # the think check, from the constructor or per call
    think = reward("math_boxed_reward", with_think=True, format_score_coef=0.2)
    assert think(response="<think>x</think> \\boxed{7}", truth="7") == {
        "accuracy": 1.0,
        "format_score": 0.0,
    }
    assert think(response="\\boxed{7}", truth="7") == {"accuracy": 1.0, "format_score": -0.2}
    assert think(response="</think><think> \\boxed{7}", truth="7")["format_score"] == -0.2
    assert fn(response="\\boxed{7}", truth="7", with_think=True, format_score_coef=0.1) == {
        "accuracy": 1.0,
        "format_score": -0.1,
    }


# (response, truth, with math-verify, without): the truth may be a whole GSM8K solution
GSM8K = "Natalia sold 48/2 = 24 clips in May.\nNatalia sold 48+24 = 72 clips.\n#### 72"
BOXED_CASES = [
    ("so \\boxed{72}.", GSM8K, 1.0, 1.0),
    ("\\boxed{71}", GSM8K, 0.0, 0.0),
    ("72", GSM8K, 0.0, 0.0),  # no box: 0, even with the right number
    ("\\boxed{1000}", "so the total is $1,000.\n#### 1,000", 1.0, 1.0),
    ("\\boxed{\\frac{1}{2}}", "half of it\n#### 0.5", 1.0, 1.0),
    ("\\boxed{-3}", "#### -3", 1.0, 1.0),
    ("\\boxed{7}", "<answer>7</answer>", 1.0, 1.0),
    ("\\boxed{1+x^2}", "it is \\boxed{x^2+1}", 1.0, 0.0),  # symbolic: math-verify only
    ("\\boxed{1+x^2}", "#### x^2+1", 1.0, 0.0),
]


@pytest.mark.parametrize("response,truth,with_mv,without_mv", BOXED_CASES)
def test_math_boxed_reward_final_answer_of_the_truth_with_math_verify(
    response: str, truth: str, with_mv: float, without_mv: float
) -> None:
    from workflows.rewards import _load_math_verify

    assert _load_math_verify() is not None  # the test extra installs math-verify
    assert reward("math_boxed_reward")(response=response, truth=truth) == {
        "accuracy": with_mv,
        "format_score": 0.0,
    }


@pytest.mark.parametrize("response,truth,with_mv,without_mv", BOXED_CASES)
def test_math_boxed_reward_final_answer_of_the_truth_without_math_verify(
    no_math_verify: None, response: str, truth: str, with_mv: float, without_mv: float
) -> None:
    from workflows.rewards import _load_math_verify

    assert _load_math_verify() is None  # really absent
    assert reward("math_boxed_reward")(response=response, truth=truth) == {
        "accuracy": without_mv,
        "format_score": 0.0,
    }


# ---------------------------------------------------------------------------
# format_reward
# ---------------------------------------------------------------------------


def test_format_reward() -> None:
    fn = reward("format_reward")
    assert fn(response="<think>\nwhy\n</think>\n<answer>\n7\n</answer>") == {"format_score": 0.1}
    assert fn(response="<think>why</think><answer>7</answer>") == {"format_score": -0.1}
    assert fn(response="7") == {"format_score": -0.1}
    fn = reward("format_reward", pattern=r"^<answer>.*</answer>$", format_score_coef=1.0)
    assert fn(response="<answer>7</answer>", truth="ignored") == {"format_score": 1.0}
    with pytest.raises(WorkflowError, match="invalid regex"):
        reward("format_reward", pattern="(")


# ---------------------------------------------------------------------------
# countdown_reward
# ---------------------------------------------------------------------------

TRUTH = {"target": 24, "numbers": [3, 5, 2, 4]}


@pytest.mark.parametrize(
    "response,expected",
    [
        ("<think>..</think><answer>(3 + 5) * (4 - 2) + 8 * 0</answer>", 0.1),  # extra numbers
        ("<answer>(5 - 3 + 4) * 2 * 2</answer>", 0.1),  # 2 used twice, 4 fine: wrong multiset
        ("<answer>(3 + 5) * (4 - 2)</answer>", 0.1),  # = 16: numbers right, value wrong
        ("<answer>(5 + 3 - 2) * 4</answer>", 1.0),  # = 24
        ("<answer>4 * (5 + 3 - 2)</answer>", 1.0),
        ("<answer>5*4 + 3 - 2 + 0</answer>", 0.1),
        ("<answer>(3 + 5 + 4) * 2</answer>", 1.0),
        ("<answer>3 / (5 - 5) + 2 + 4</answer>", 0.1),  # wrong numbers
        ("<answer>__import__('os')</answer>", 0.1),  # not arithmetic
        ("(5 + 3 - 2) * 4", 0.0),  # no answer tag
        ("<answer>1</answer> then <answer>(5 + 3 - 2) * 4</answer>", 1.0),  # the last tag
    ],
)
def test_countdown_reward(response: str, expected: float) -> None:
    fn = reward("countdown_reward")
    assert fn(response=response, truth=TRUTH) == {"score": expected}
    assert fn(response=response, truth=json.dumps(TRUTH)) == {"score": expected}


def test_countdown_reward_args_and_truth_forms() -> None:
    fn = reward("countdown_reward", format_score=0.0, score=2.0)
    assert fn(response="<answer>(5 + 3 - 2) * 4</answer>", truth=TRUTH) == {"score": 2.0}
    assert fn(response="<answer>5 + 3 + 2 + 4</answer>", truth=TRUTH) == {"score": 0.0}
    nums = {"target": 3, "nums": [6, 2]}  # TinyZero's key
    assert reward("countdown_reward")(response="<answer>6/2</answer>", truth=nums) == {"score": 1.0}
    assert reward("countdown_reward")(response="<answer>6/0</answer>", truth=nums) == {"score": 0.1}
    with pytest.raises(WorkflowError, match="target"):
        reward("countdown_reward")(response="<answer>1</answer>", truth="7")


def test_evaluate_equation_is_safe() -> None:
    assert evaluate_equation("(1 + 2) / 3") == 1.0
    assert evaluate_equation("-3 + 4") == 1.0
    assert evaluate_equation("2 ** 3") is None  # `**` parses, but power is not allowed
    assert evaluate_equation("1 / 0") is None
    assert evaluate_equation("1 +") is None
    assert evaluate_equation("abs(1)") is None
    assert evaluate_equation("") is None
    assert evaluate_equation("1" * 300) is None


def test_plain_decimals_parse_as_the_general_path_does() -> None:
    """``_to_number``'s shortcut for plain decimals (no latex normalisation) gives the
    general path's value: the exact fraction rounded once, None past 64 characters."""
    import random
    from fractions import Fraction

    from workflows.rewards import _to_number

    rng = random.Random(0)
    for _ in range(2000):
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 70)))
        decimals = "".join(rng.choice("0123456789") for _ in range(rng.randint(0, 30)))
        text = ("-" if rng.random() < 0.3 else "") + digits + (f".{decimals}" if decimals else "")
        want = float(Fraction(text)) if len(text) <= 64 else None
        assert _to_number(text) == want, text
    assert _to_number("1,000") == 1000.0 and _to_number("3/4") == 0.75  # the general path
