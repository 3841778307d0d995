"""``env_workflow``: multi-turn episodes with a text environment, one Experience per episode.

The model plays ``repeat_times`` episodes of the task's environment (see
:mod:`workflows.envs`), concurrently. An episode is one growing token
sequence: the chat-template prompt (``format.system_prompt``, then the
environment's first observation as the user turn), then, turn after turn,
the tokens the model sampled and the tokens of the environment's reply (the
end of the assistant turn, the observation as a user turn and the next
assistant header, exactly as the model's chat template renders them). The
model's tokens are never re-tokenised: each turn continues from the exact
token ids so far, so the Experience has

* ``tokens`` = the whole episode, ``prompt_length`` = the first prompt,
* ``action_mask`` 1 exactly on the tokens the model generated (its end-of-turn
  token included when it produced one) and 0 on the environment's,
* ``logprobs`` the sampling log-probabilities on the model's tokens, 0 on the
  environment's (``allowed_logprobs`` / ``banned_ids`` alike where a turn was
  sampled under ``rollout_args.min_tokens``; ``info["logprobs_exact"]`` False
  when any turn's logprobs were not the engine convention's),
* ``reward`` the episode's return (sum of step rewards), and
  ``messages`` the conversation, ``info`` / ``metrics`` the episode's
  ``env_steps``, ``env_done``, ``truncated`` and ``env_return`` (``info`` also
  ``step_rewards`` and each turn's ``turn_finish_reasons``).

``workflow_args``: ``env_type`` (a name in :data:`~workflows.envs.ENVS`,
default ``guess_number``), ``env_args`` (constructor arguments; a row's keys
the constructor accepts are added, see ``TextEnv.from_task``),
``max_env_steps`` (default 10), ``action_pattern`` (a regex whose first
group is the action sent to the environment, e.g. ``<action>(.*?)</action>``;
default the whole reply). ``rollout_args.max_tokens`` bounds one turn; the
whole episode's response part (model plus environment tokens) is bounded by
``model.max_response_tokens`` and by the model's context: an episode that
would exceed either ends early (``truncated``).

Generation goes straight to the rollout engine with token ids
(``model.engine.generate``), since ``ModelWrapper.chat`` would re-render and
re-tokenise the conversation.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import anyio
import anyio.to_thread
import torch

from rftstream.engines.base import SamplingParams
from rftstream.errors import WorkflowError
from rftstream.experience import Experience
from rftstream.workflow import WORKFLOWS, Task, Workflow
from workflows.envs import ENVS, normalize_step

__all__ = ["EnvWorkflow", "TokenTrajectory"]

_PLACEHOLDER = "\x00rftstream-turn\x00"


class TokenTrajectory:
    """Token ids of one episode with the model-vs-environment mask and the logprobs."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt_ids = list(prompt_ids)
        self.response_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.allowed: list[float] = []  # log(1 - p(banned)) per token, 0 where no ban
        self.banned: set[tuple[int, ...]] = set()  # the banned ids of the replies with a ban

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def add_model(
        self,
        ids: list[int],
        logprobs: list[float],
        allowed: list[float] | None = None,
        banned: list[int] | None = None,
    ) -> None:
        """A reply's tokens (trained on), their logprobs and, where the engine sampled
        them under a ban (``Completion.allowed_logprobs`` / ``banned_ids``), its banned mass."""
        if len(ids) != len(logprobs):
            raise WorkflowError(f"engine returned {len(ids)} tokens but {len(logprobs)} logprobs")
        self.response_ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        if allowed is not None and banned is not None and len(allowed) == len(ids):
            self.allowed += [float(x) for x in allowed]
            self.banned.add(tuple(int(t) for t in banned))
        else:
            self.allowed += [0.0] * len(ids)

    def add_env(self, ids: list[int]) -> None:
        self.response_ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.allowed += [0.0] * len(ids)

    def ban_fields(self) -> dict[str, Any]:
        """``allowed_logprobs`` / ``banned_ids`` of the episode's experience (empty when no
        reply was sampled under a ban, or when replies banned different tokens: then
        ``logprobs_exact`` False, one list cannot say which were banned where)."""
        if not self.banned:
            return {}
        if len(self.banned) > 1:
            return {"logprobs_exact": False}
        return {
            "allowed_logprobs": torch.tensor(self.allowed, dtype=torch.float32),
            "banned_ids": list(next(iter(self.banned))),
        }


@WORKFLOWS.register_module("env_workflow")
class EnvWorkflow(Workflow):
    """Multi-turn episodes against a gym-like text environment; see the module docstring."""

    can_reset = True
    can_repeat = True

    def __init__(
        self, *, task: Task, model: Any, auxiliary_models: list[Any] | None = None
    ) -> None:
        super().__init__(task=task, model=model, auxiliary_models=auxiliary_models)
        self.reset(task)

    def reset(self, task: Task) -> None:
        self.task = task
        self.is_eval = task.is_eval
        self.repeat_times = task.repeat_times
        self.run_id_base = 0
        self.raw_task = task.raw_task
        self.rollout_args = task.rollout_args
        fa = task.format_args
        self.system_prompt = fa.system_prompt
        self.chat_template = fa.chat_template
        wa = dict(task.workflow_args)
        self.env_type = str(wa.get("env_type", "guess_number"))
        self.env_args = dict(wa.get("env_args") or {})
        self.max_env_steps = int(wa.get("max_env_steps", 10))
        pattern = wa.get("action_pattern")
        try:
            self.action_regex = re.compile(pattern, re.DOTALL) if pattern else None
        except re.error as exc:
            raise WorkflowError(
                f"buffer.explorer_input.taskset.workflow_args.action_pattern: {exc}"
            ) from exc
        try:
            self.env_cls = ENVS.get(self.env_type)
        except Exception as exc:
            raise WorkflowError(
                f"buffer.explorer_input.taskset.workflow_args.env_type: {exc}"
            ) from exc

    # ------------------------------------------------------------ helpers
    def make_env(self) -> Any:
        """A fresh environment for one episode (same game for every rollout of the task)."""
        row = {"seed": self.task.index, **self.raw_task}
        from_task = getattr(self.env_cls, "from_task", None)
        if from_task is not None:
            return from_task(row, **self.env_args)
        return self.env_cls(**self.env_args)

    def parse_action(self, reply: str) -> str:
        if self.action_regex is None:
            return reply.strip()
        found = self.action_regex.search(reply)
        if found is None:
            return ""
        return (found.group(1) if found.groups() else found.group(0)).strip()

    @contextlib.contextmanager
    def _tokenizer(self) -> Any:
        # HF fast tokenizers are not safe for concurrent use: share the wrapper's lock.
        lock = getattr(self.model, "_tok_lock", None)
        with lock if lock is not None else contextlib.nullcontext():
            yield self.model.tokenizer

    def _render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        with self._tokenizer() as tok:
            return tok.apply_chat_template(
                messages, tokenize=False, chat_template=self.chat_template, **kwargs
            )

    def _encode(self, text: str) -> list[int]:
        with self._tokenizer() as tok:
            return list(tok.encode(text, add_special_tokens=False))

    def env_turn_ids(
        self, messages: list[dict[str, Any]], observation: str, model_ids: list[int]
    ) -> list[int]:
        """Token ids that follow the model's reply: end of its turn, the observation as
        a user turn, the next assistant header (as the chat template renders them).

        ``messages`` ends with the assistant reply; ``model_ids`` are its tokens (an
        end-of-turn special token the model produced is not repeated; a reply cut
        by ``max_tokens`` gets the template's end-of-turn here, as environment tokens).
        """
        head = [*messages[:-1], {"role": "assistant", "content": _PLACEHOLDER}]
        prefix = self._render(head, continue_final_message=True)
        full = self._render(
            [*head, {"role": "user", "content": observation}], add_generation_prompt=True
        )
        if not full.startswith(prefix) or not prefix.endswith(_PLACEHOLDER):
            raise WorkflowError(
                "env_workflow: the chat template does not render a conversation as a prefix of "
                "its continuation; set format.chat_template to one that does"
            )
        ids = self._encode(full[len(prefix) :])
        if ids and model_ids and ids[0] == model_ids[-1]:
            with self._tokenizer() as tok:
                special = set(getattr(tok, "all_special_ids", ()) or ())
            if ids[0] in special:
                ids = ids[1:]  # the model already closed its turn (eos == end-of-turn token)
        return ids

    def _context_limit(self) -> int:
        engine = getattr(self.model, "engine", None)
        return int(getattr(engine, "max_model_len", 0) or 1 << 30)

    def _response_budget(self) -> int:
        return int(getattr(self.model, "max_response_tokens", None) or 1 << 30)

    # ------------------------------------------------------------ running
    async def run_async(self) -> list[Experience]:
        """Play ``repeat_times`` episodes concurrently; one Experience each."""
        results: list[Experience | None] = [None] * self.repeat_times

        async def one(i: int) -> None:
            results[i] = await self.run_episode(i)

        async with anyio.create_task_group() as tg:
            for i in range(self.repeat_times):
                tg.start_soon(one, i)
        return [e for e in results if e is not None]

    async def _env_call(self, env: Any, name: str, *args: Any) -> Any:
        fn = getattr(env, name)
        if getattr(env, "fast", False):
            return fn(*args)
        return await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)

    async def run_episode(self, index: int = 0) -> Experience:
        """One episode (see the module docstring). Blocks only on the engine and the env."""
        env = self.make_env()
        try:
            return await self._play(env, index)
        finally:
            close = getattr(env, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    async def _play(self, env: Any, index: int) -> Experience:
        first = await self._env_call(env, "reset")
        if isinstance(first, tuple):  # gymnasium: (observation, info)
            first = first[0]
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": str(first)})
        prompt_text = self._render(messages, add_generation_prompt=True)
        traj = TokenTrajectory(self._encode(prompt_text))
        max_prompt = getattr(self.model, "max_prompt_tokens", None)
        if max_prompt is not None and len(traj.prompt_ids) > int(max_prompt):
            raise WorkflowError(
                f"env_workflow: the first prompt has {len(traj.prompt_ids)} tokens, more than "
                f"model.max_prompt_tokens={max_prompt}"
            )
        limit = min(self._context_limit(), len(traj.prompt_ids) + self._response_budget())
        ra = self.rollout_args
        total, steps, done, truncated = 0.0, 0, False, False
        versions: list[int] = []
        step_rewards: list[float] = []
        finishes: list[str] = []
        exact = True  # every reply's logprobs follow the engine convention
        while steps < self.max_env_steps:
            room = limit - len(traj)
            if room < 1:
                if steps == 0:
                    raise WorkflowError(
                        f"env_workflow: the first prompt ({len(traj)} tokens) leaves no room "
                        f"to reply in the model's context ({self._context_limit()} tokens)"
                    )
                truncated = True
                break
            want = ra.max_tokens if ra.max_tokens is not None else room
            params = SamplingParams(
                n=1,
                temperature=float(ra.temperature),
                top_p=float(ra.top_p),
                top_k=int(ra.top_k),
                max_tokens=max(1, min(int(want), room)),
                min_tokens=int(ra.min_tokens),
            )
            (comp,) = await self.model.engine.generate(traj.ids, params)
            traj.add_model(
                list(comp.token_ids), list(comp.logprobs), comp.allowed_logprobs, comp.banned_ids
            )
            exact &= comp.info.get("logprobs_exact", True) is not False
            versions.append(int(comp.model_version))
            finishes.append(comp.finish_reason)
            with self._tokenizer() as tok:
                reply = tok.decode(comp.token_ids, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            obs, reward, done, info = normalize_step(
                await self._env_call(env, "step", self.parse_action(reply))
            )
            steps += 1
            total += reward
            step_rewards.append(reward)
            if done or steps >= self.max_env_steps:
                break
            env_ids = self.env_turn_ids(messages, obs, list(comp.token_ids))
            if len(traj) + len(env_ids) + 1 > limit:
                truncated = True  # no room for the observation and another reply
                break
            traj.add_env(env_ids)
            messages.append({"role": "user", "content": obs})
        with self._tokenizer() as tok:
            response_text = tok.decode(traj.response_ids, skip_special_tokens=False)
        episode = {
            "env_steps": float(steps),
            "env_done": float(done),
            "truncated": float(truncated),
            "env_return": total,
        }
        ban = traj.ban_fields()
        if ban.pop("logprobs_exact", True) is False:
            exact = False
        exp = Experience(
            tokens=torch.tensor(traj.ids, dtype=torch.int32),
            prompt_length=len(traj.prompt_ids),
            logprobs=torch.tensor(traj.logprobs, dtype=torch.float32),
            action_mask=torch.tensor(traj.mask, dtype=torch.bool),
            reward=total,
            response_text=response_text,
            prompt_text=prompt_text,
            messages=messages,
            model_version=min(versions) if versions else int(self.model.model_version),
            info={
                **episode,
                "finish_reason": finishes[-1] if finishes else "length",
                "turn_finish_reasons": finishes,
                "step_rewards": step_rewards,
                "env_type": self.env_type,
                "episode": index,
                **({} if exact else {"logprobs_exact": False}),
            },
            metrics=dict(episode),
            **ban,
        )
        exp.eid.run = self.run_id_base + index
        return exp
