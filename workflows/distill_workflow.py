"""On-policy distillation workflows: ``on_policy_distill_workflow``, ``on_policy_distill_math_workflow``.

As Trinity-RFT's ``on_policy_distill_workflow.py``: the student (the rollout
model) answers the task ``repeat_times`` times in one call, then the teacher
(the first of ``explorer.auxiliary_models``, served here from its
``model_path``) scores every response: for each response token the teacher's
``log p(token | prompt, earlier response tokens)`` under
``log_softmax(logits / workflow_args.temperature)`` (default 1). The values go
to ``exp.info["teacher_logprobs"]`` (one float per response token), where the
``on_policy_distill`` and ``jsd`` advantage functions read them; each
experience also gets the metric ``kl_divergence`` = sum over response tokens
of ``student - teacher`` log-prob (the student's are the rollout log-probs).

Rewards: ``on_policy_distill_workflow`` gives reward 0 (the advantage comes
from the teacher alone), unless the taskset names a reward function
(``default_reward_fn_type``), which then scores as in ``simple_workflow``.
``on_policy_distill_math_workflow`` prompts and scores as
``math_boxed_workflow`` (a ``\\boxed{}`` answer, ``math_boxed_reward``), the
reward Trinity-RFT's math variant reports as accuracy.

The teacher must share the student's tokenizer (its log-probs are taken on the
student's token ids); a token id outside the teacher's vocabulary is a
:class:`~rftstream.errors.WorkflowError`. Teacher and student forward passes
run in their engines' worker threads; ``run_async`` never blocks the loop.
"""

from __future__ import annotations

from typing import Any

import anyio
import anyio.to_thread
import torch

from rftstream.errors import WorkflowError
from rftstream.experience import Experience
from rftstream.workflow import WORKFLOWS, Task, scores_inline
from workflows.math_workflow import MathBoxedWorkflow, SimpleWorkflow

__all__ = [
    "TEACHER_LOGPROBS_KEY",
    "OnPolicyDistillMathWorkflow",
    "OnPolicyDistillWorkflow",
    "response_slice",
]

TEACHER_LOGPROBS_KEY = "teacher_logprobs"


def response_slice(exp: Experience, sequence_logprobs: torch.Tensor) -> torch.Tensor:
    """The response part of the log-probs of ``exp.tokens[1:]`` (``ModelWrapper.logprobs``).

    Element ``i`` of ``sequence_logprobs`` scores token ``i + 1``, so the response
    tokens (from ``prompt_length``) are elements ``prompt_length - 1`` onwards.
    Raises :class:`WorkflowError` naming the experience when the result is not one
    value per response token.
    """
    out = sequence_logprobs.reshape(-1)[exp.prompt_length - 1 :].to(torch.float32)
    if out.numel() != exp.response_length:
        raise WorkflowError(
            f"experience {exp.eid.uid}: the teacher scored {out.numel()} response tokens, "
            f"the response has {exp.response_length} (tokens {len(exp.tokens)}, "
            f"prompt_length {exp.prompt_length})"
        )
    return out


@WORKFLOWS.register_module("on_policy_distill_workflow")
class OnPolicyDistillWorkflow(SimpleWorkflow):
    """The student answers, the teacher (auxiliary model 0) scores each response token.

    ``workflow_args``: ``temperature`` (default 1.0) divides the teacher's logits.
    Raises :class:`WorkflowError` at construction when there is no auxiliary
    model, or when the first one has no model wrapper (an external ``base_url``
    server: its token log-probs cannot be asked for).
    """

    # Trinity-RFT's base distillation workflow scores nothing: reward 0 unless a
    # reward fn is named in the taskset
    reward_from_taskset_only: bool = True

    def __init__(
        self,
        *,
        task: Task,
        model: Any,
        auxiliary_models: list[Any] | None = None,
        auxiliary_model_wrappers: list[Any] | None = None,
    ) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        wrappers = (
            list(auxiliary_model_wrappers)
            if auxiliary_model_wrappers is not None
            else self.auxiliary_model_wrappers
        )
        if not wrappers:
            raise WorkflowError(
                f"{type(self).__name__}: on-policy distillation needs a teacher: set "
                "explorer.auxiliary_models[0] (model_path of a model with the student's "
                "tokenizer)"
            )
        if wrappers[0] is None:
            raise WorkflowError(
                f"{type(self).__name__}: explorer.auxiliary_models[0] is an external "
                "base_url server; the teacher's log-probs of the student's tokens need a "
                "model served here: set its model_path instead"
            )
        self.auxiliary_model_wrappers = wrappers
        self.teacher = wrappers[0]

    def reset(self, task: Task) -> None:
        """Take the next task; reads ``workflow_args.temperature`` (must be > 0)."""
        super().reset(task)
        self.temperature = float(self.workflow_args.get("temperature", 1.0))
        if not self.temperature > 0:
            raise WorkflowError(
                f"buffer.explorer_input.taskset.workflow_args.temperature must be > 0, "
                f"got {self.temperature}"
            )

    # ------------------------------------------------------------ running
    def run(self) -> list[Experience]:
        """Blocking form (worker thread): student rollouts, teacher scores, rewards."""
        responses = self.generate()
        for exp in responses:
            self._check_vocabulary(exp)
            self._record(exp, self.teacher.logprobs(exp.tokens, temperature=self.temperature))
        return self.score(responses)

    async def run_async(self) -> list[Experience]:
        """Async form: awaits both engines; a slow reward fn runs in a worker thread."""
        responses = await self.generate_async()
        for exp in responses:
            self._check_vocabulary(exp)
            scores = await self.teacher.logprobs_async(exp.tokens, temperature=self.temperature)
            self._record(exp, scores)
        texts = (e.response_text or "" for e in responses)
        if self._skips_reward() or scores_inline(self.reward_fn, texts, self.truth):
            return self.score(responses)
        return await anyio.to_thread.run_sync(self.score, responses, abandon_on_cancel=True)

    def score_one(self, exp: Experience) -> None:
        """Reward 0 (see the module docstring) or the reward fn's, as ``simple_workflow``."""
        if self._skips_reward():
            exp.reward = 0.0
            return
        super().score_one(exp)

    # ------------------------------------------------------------ helpers
    def _skips_reward(self) -> bool:
        return self.reward_from_taskset_only and self.task.reward_fn is None

    def _check_vocabulary(self, exp: Experience) -> None:
        vocab = len(self.teacher.tokenizer)
        top = int(torch.as_tensor(exp.tokens).max()) if exp.tokens is not None else -1
        if top >= vocab:
            raise WorkflowError(
                f"experience {exp.eid.uid}: token id {top} is outside the teacher's vocabulary "
                f"({vocab} tokens); explorer.auxiliary_models[0] must share the student's "
                "tokenizer"
            )

    @staticmethod
    def _record(exp: Experience, sequence_logprobs: torch.Tensor) -> None:
        teacher = response_slice(exp, sequence_logprobs)
        exp.info[TEACHER_LOGPROBS_KEY] = teacher.tolist()
        if exp.logprobs is not None and exp.logprobs.numel() == teacher.numel():
            student = exp.logprobs.to(torch.float32)
            exp.metrics["kl_divergence"] = float((student - teacher).sum())


@WORKFLOWS.register_module("on_policy_distill_math_workflow")
class OnPolicyDistillMathWorkflow(OnPolicyDistillWorkflow, MathBoxedWorkflow):
    """Distillation on math tasks: ``math_boxed_workflow``'s prompt and reward, plus the
    teacher's log-probs (Trinity-RFT's ``on_policy_distill_math_workflow``)."""

    reward_from_taskset_only = False
