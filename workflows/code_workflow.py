"""``code_workflow``: the model writes Python, the task's tests run it in the sandbox.

A row holds the problem (``format.prompt_key``) and its tests under
``format.response_key`` (default ``answer``; ``workflow_args.tests_key``
overrides it), in one of two shapes:

* assertion tests: a list of Python snippets (``["assert add(1, 2) == 3",
  ...]``) or one string of them (one test per non-blank line);
* I/O tests: ``{"inputs": [...], "outputs": [...]}`` (stdin → expected stdout,
  compared token by token after stripping whitespace), as in APPS /
  CodeContests.

The code is the last fenced block of the reply (```` ```python ```` or plain
```` ``` ````), else the whole reply. ``code_reward`` (registered in
``REWARD_FUNCTIONS``, usable with any single-turn workflow) runs it with
:func:`workflows.sandbox.run_python` and returns ``{"accuracy": passed /
total}`` (``partial_credit: false``: 1.0 only if every test passes).
``reward_fn_args``: ``timeout`` (seconds per sandbox run, default 4),
``memory_limit_mb`` (default 512), ``partial_credit`` (default true).

Assertion tests run in one sandbox process: the solution is executed as a
module (``__name__ == "solution"``), then each test in its namespace, and a
per-run random marker line reports which passed, so output the solution
prints cannot forge a result by accident. I/O tests run one process each.
``code_workflow`` scores the group's replies concurrently in worker threads.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

import anyio
import anyio.to_thread

from rftstream.errors import WorkflowError
from rftstream.experience import Experience
from rftstream.workflow import WORKFLOWS, Task
from workflows.math_workflow import SimpleWorkflow
from workflows.rewards import REWARD_FUNCTIONS, RewardFn
from workflows.sandbox import run_python

__all__ = ["CODE_PROMPT", "CodeReward", "CodeWorkflow", "extract_code", "run_tests"]

CODE_PROMPT = (
    "Solve the problem in Python. Reply with the complete solution in one ```python code block."
)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

_HARNESS = """\
import json as _json, sys as _sys, traceback as _tb
_ns = {"__name__": "solution"}
_ok = True
try:
    with open("solution.py", encoding="utf-8") as _f:
        exec(compile(_f.read(), "solution.py", "exec"), _ns)
except BaseException:
    _tb.print_exc()
    _ok = False
with open("tests.json", encoding="utf-8") as _f:
    _tests = _json.load(_f)
_passed = []
for _t in _tests:
    if not _ok:
        _passed.append(False)
        continue
    try:
        exec(compile(_t, "test", "exec"), _ns)
        _passed.append(True)
    except BaseException:
        _tb.print_exc(limit=1)
        _passed.append(False)
_sys.stdout.flush()
print("\\n" + MARKER + _json.dumps(_passed), flush=True)
"""


def extract_code(text: str | None) -> str:
    """The last fenced code block of ``text`` (a ``python``-tagged one preferred), else ``text``."""
    if not text:
        return ""
    blocks = _FENCE.findall(text)
    if not blocks:
        return text.strip()
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1].strip()


def _parse_tests(tests: Any) -> tuple[str, Any]:
    """``("assert", [snippets])`` or ``("io", (inputs, outputs))``."""
    if isinstance(tests, str):
        stripped = tests.strip()
        if stripped.startswith(("{", "[")):
            try:
                return _parse_tests(json.loads(stripped))
            except json.JSONDecodeError:
                pass
        return "assert", [line for line in tests.splitlines() if line.strip()]
    if isinstance(tests, dict):
        inputs, outputs = tests.get("inputs"), tests.get("outputs")
        if not isinstance(inputs, list) or not isinstance(outputs, list):
            raise WorkflowError(
                f"code tests as a dict need lists `inputs` and `outputs`, got keys {sorted(tests)}"
            )
        if len(inputs) != len(outputs):
            raise WorkflowError(f"code tests: {len(inputs)} inputs but {len(outputs)} outputs")
        return "io", ([str(x) for x in inputs], [str(y) for y in outputs])
    if isinstance(tests, (list, tuple)) and all(isinstance(t, str) for t in tests):
        return "assert", list(tests)
    raise WorkflowError(
        "code tests must be a list of assertion snippets, a string of them, or "
        f"{{'inputs': [...], 'outputs': [...]}}; got {type(tests).__name__}"
    )


def run_tests(
    code: str, tests: Any, *, timeout: float = 4.0, memory_limit_mb: int | None = 512
) -> list[bool]:
    """Which of ``tests`` (see the module docstring) ``code`` passes. Blocks."""
    kind, spec = _parse_tests(tests)
    if kind == "io":
        inputs, outputs = spec
        passed = []
        for stdin, expected in zip(inputs, outputs, strict=True):
            res = run_python(code, stdin=stdin, timeout=timeout, memory_limit_mb=memory_limit_mb)
            passed.append(res.ok and res.stdout.split() == expected.split())
        return passed
    if not spec:
        return []
    marker = f"@@rft-tests-{secrets.token_hex(8)}@@"
    harness = _HARNESS.replace("MARKER", json.dumps(marker))
    res = run_python(
        harness,
        files={"solution.py": code, "tests.json": json.dumps(spec)},
        timeout=timeout,
        memory_limit_mb=memory_limit_mb,
    )
    for line in reversed(res.stdout.splitlines()):
        if line.startswith(marker):
            try:
                verdicts = json.loads(line[len(marker) :])
            except json.JSONDecodeError:
                break
            if isinstance(verdicts, list) and len(verdicts) == len(spec):
                return [v is True for v in verdicts]
            break
    return [False] * len(spec)


@REWARD_FUNCTIONS.register_module("code_reward")
class CodeReward(RewardFn):
    """``{"accuracy": fraction of tests passed}`` (or all-or-nothing); blocks on the sandbox."""

    fast = False

    def __init__(
        self, timeout: float = 4.0, memory_limit_mb: int | None = 512, partial_credit: bool = True
    ) -> None:
        self.timeout = float(timeout)
        self.memory_limit_mb = memory_limit_mb
        self.partial_credit = bool(partial_credit)

    def __call__(self, response: str, truth: Any = None, **kwargs: Any) -> dict[str, float]:
        if truth is None:
            return {"accuracy": 0.0}
        passed = run_tests(
            extract_code(response),
            truth,
            timeout=self.timeout,
            memory_limit_mb=self.memory_limit_mb,
        )
        if not passed:
            return {"accuracy": 0.0}
        if self.partial_credit:
            return {"accuracy": sum(passed) / len(passed)}
        return {"accuracy": float(all(passed))}


@WORKFLOWS.register_module("code_workflow")
class CodeWorkflow(SimpleWorkflow):
    """Write code, run the task's tests in the sandbox; see the module docstring.

    Without ``format.system_prompt`` a default one asks for a fenced Python
    block (``""`` for none).
    """

    default_reward_fn = "code_reward"

    def reset(self, task: Task) -> None:
        super().reset(task)
        if self.system_prompt is None:
            self.system_prompt = CODE_PROMPT

    def get_truth(self, task: Task) -> Any:
        key = task.workflow_args.get("tests_key") or task.format_args.response_key
        return task.raw_task.get(key)

    async def run_async(self) -> list[Experience]:
        """One batched model call, then every reply's tests in parallel worker threads."""
        responses = await self.generate_async()
        if getattr(self.reward_fn, "fast", False):
            return self.score(responses)
        for i, exp in enumerate(responses):
            exp.eid.run = self.run_id_base + i

        async def one(exp: Experience) -> None:
            await anyio.to_thread.run_sync(self.score_one, exp, abandon_on_cancel=True)

        async with anyio.create_task_group() as tg:
            for exp in responses:
                tg.start_soon(one, exp)
        return responses

    def score_one(self, exp: Experience) -> None:
        """Score as ``simple_workflow`` does, and keep the extracted code in ``info["code"]``."""
        super().score_one(exp)
        exp.info["code"] = extract_code(exp.response_text)
