"""A rollout engine on vLLM (CUDA GPU): ``explorer.rollout_model.engine_type: vllm``.

:class:`VLLMEngine` wraps vLLM's asynchronous engine (``AsyncLLM``, the V1
engine behind ``vllm.AsyncLLMEngine``) built from ``AsyncEngineArgs``. vLLM
batches concurrent requests itself (continuous batching, prefix caching), so
:meth:`VLLMEngine.run` only marks the engine as served; requests go straight
to vLLM. ``vllm`` is imported lazily: without it (``pip install
'rftstream[vllm]'``, which needs a CUDA GPU) constructing the engine raises
:class:`~rftstream.errors.RftError` naming the extra, and importing this module
never fails.

vLLM API this module is written against (vLLM >= 0.10.2, the V1 engine; the
version-specific pieces are marked ``# vLLM-version:``):

* ``AsyncLLM.from_engine_args(AsyncEngineArgs(...))``; ``generate(prompt,
  sampling_params, request_id)`` an async generator of ``RequestOutput``
  (``output_kind=FINAL_ONLY``: one final output); ``abort(request_id)``;
  ``collective_rpc(method, args=...)``; ``reset_prefix_cache()``;
  ``shutdown()``; ``model_config.max_model_len``.
* ``AsyncEngineArgs(worker_extension_cls=...)`` mixes
  :class:`RftWorkerExtension` into every worker; its method is reached by name
  through ``collective_rpc`` and updates the weights in place with the model's
  own ``load_weights(weights=[(hf_name, tensor), ...])`` (the loader vLLM uses
  at start-up, so HF checkpoint names, stacked qkv / gate-up projections and
  tensor-parallel sharding are handled by vLLM).
* ``AsyncEngineArgs.logprobs_mode`` (0.10.2+): see below. Older versions
  without the field still run, with the caveat below.

Log-probability convention (``rftstream.engines.base``:
``log_softmax(logits / temperature)[token]`` before top-k / top-p, greedy:
``log_softmax(logits)``). vLLM's default (``raw_logprobs``) is the raw
model's ``log_softmax(logits)``, i.e. temperature 1, which cannot be rescaled
afterwards (that needs the whole vocabulary). The engine therefore starts vLLM
with ``logprobs_mode="processed_logprobs"``: the logprob of the sampled token
from the logits vLLM actually sampled from, after temperature AND after top-k /
top-p truncation (renormalised over the kept tokens). So:

* greedy (``temperature == 0``), or no top-k / top-p filter: vLLM's value IS
  the convention (exact, up to GPU numerics);
* a top-k / top-p filter at a temperature > 0: vLLM's value is the truncated,
  renormalised one (>= ours); the completion carries
  ``info["logprobs_exact"] = False`` (as the ``openai`` engine does) and the
  trainer's recomputation should be preferred;
* vLLM without ``logprobs_mode``: raw logprobs, exact only at temperature 1
  or 0 without filters; other completions are flagged the same way;
* ``min_tokens`` > 0 at a temperature > 0: the tokens drawn while the end tokens
  were banned need the banned mass to be weighted right (``Completion.allowed_logprobs``,
  which the ``transformers`` engine records) and vLLM returns only the sampled token's
  logprob, so these completions are flagged too (the trainer then gives them no
  behaviour weight rather than a wrong one).

:meth:`VLLMEngine.score` uses ``prompt_logprobs``, which vLLM always computes
from the raw logits (temperature 1): exact for ``temperature`` 1 (or 0, which
means 1); any other temperature raises :class:`RftError` rather than return a
different quantity.

Weights (:meth:`VLLMEngine.load_weights`) are updated in place between
requests: a read/write gate lets in-flight requests finish, holds new ones
back, every worker loads the tensors from safetensors files (a state dict is
first written to one temporary file, in ``/dev/shm`` when it has room), then
vLLM's prefix cache is reset (its KV blocks were computed by the old weights)
and the version is set. Every :class:`Completion` carries the version that
generated all of it.

Cancelling a :meth:`VLLMEngine.generate` caller aborts its vLLM requests
(``engine.abort``, in a shielded scope so the abort itself cannot be
cancelled). ``n > 1`` is submitted as ``n`` requests of ``n = 1`` (with seeds
``seed + i`` when a seed is given), so every sample can be aborted and greedy
requests with ``n > 1`` work on every vLLM version; greedy ``n > 1`` samples
once and repeats the completion.

vLLM runs on asyncio: use the engine from anyio's asyncio backend (it raises
:class:`RftError` under trio). Construction blocks for the model load and
vLLM's start-up (tens of seconds): build it in a worker thread, as
``create_engine`` callers do. Extra ``AsyncEngineArgs`` come from
``engine_kwargs`` or, as JSON, from the ``RFTSTREAM_VLLM_ENGINE_ARGS``
environment variable (``engine_kwargs`` win).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import anyio
import torch
from anyio.abc import TaskStatus

from rftstream.engines.base import (
    Completion,
    RolloutEngine,
    SamplingParams,
    TokenScores,
    eos_ids,
    prompt_ids,
    score_ids,
    strip_module_prefix,
)
from rftstream.errors import RftError

log = logging.getLogger(__name__)

__all__ = [
    "ENGINE_ARGS_ENV",
    "MIN_VLLM_VERSION",
    "RftWorkerExtension",
    "VLLMEngine",
    "import_vllm",
]

T = TypeVar("T")

MIN_VLLM_VERSION = "0.10.2"
ENGINE_ARGS_ENV = "RFTSTREAM_VLLM_ENGINE_ARGS"
WORKER_EXTENSION = f"{__name__}.RftWorkerExtension"
_RPC_LOAD = "rftstream_load_weights"  # method of RftWorkerExtension, called by name
_IGNORED = {"batch_wait_ms", "device", "torch_threads"}  # transformers-engine keys
_GREEDY_EPS = 1e-5  # vLLM samples greedily below this temperature (its _SAMPLING_EPS)
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
_LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")


def import_vllm() -> Any:
    """``import vllm``, or :class:`RftError` naming the extra to install."""
    try:
        import vllm
    except (ImportError, OSError) as exc:  # OSError: a vLLM whose CUDA libraries are missing
        raise RftError(
            "explorer.rollout_model.engine_type 'vllm' needs the vLLM package, which cannot be "
            f"imported here ({type(exc).__name__}: {exc}). Install the extra with "
            f"`pip install 'rftstream[vllm]'` (vLLM >= {MIN_VLLM_VERSION}; it needs a CUDA GPU), "
            "or use engine_type 'transformers'"
        ) from exc
    return vllm


# ---------------------------------------------------------------------------
# Worker side (runs inside vLLM's worker processes)
# ---------------------------------------------------------------------------


def _worker_model(worker: Any) -> Any:
    """The ``nn.Module`` a vLLM worker runs.

    # vLLM-version: V1 GPU workers (and V0's) hold a model runner with
    # ``get_model()`` (newer: unwraps CUDA-graph wrappers) and ``.model`` (the
    # attribute vLLM's RLHF example ``examples/offline_inference/rlhf_utils.py``
    # uses). Try both.
    """
    runner = getattr(worker, "model_runner", None)
    model = None
    if runner is not None:
        get_model = getattr(runner, "get_model", None)
        model = get_model() if callable(get_model) else getattr(runner, "model", None)
    if model is None and callable(getattr(worker, "get_model", None)):
        model = worker.get_model()
    if model is None or not hasattr(model, "load_weights"):
        raise RuntimeError(
            f"rftstream: cannot find the model (with load_weights) of vLLM worker "
            f"{type(worker).__name__}; this vLLM version is not supported"
        )
    return model


class RftWorkerExtension:
    """Mixed into vLLM's worker class (``AsyncEngineArgs.worker_extension_cls``).

    ``self`` is the worker. Its methods run in the worker processes and are
    called by name through ``collective_rpc``.
    """

    def rftstream_load_weights(self, files: list[str]) -> dict[str, Any]:
        """Load every tensor of the safetensors ``files`` into the model, in place.

        Names are Hugging Face checkpoint names (a DeepSpeed/DDP ``module.``
        prefix is dropped). Returns the number of tensors read and the model
        parameters the files did not cover (when the model's ``load_weights``
        reports what it loaded).
        """
        from safetensors import safe_open

        model = _worker_model(self)
        count = 0

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for path in files:
                with safe_open(path, framework="pt", device="cpu") as f:
                    for name in f.keys():
                        count += 1
                        yield strip_module_prefix(name), f.get_tensor(name)

        with torch.no_grad():
            loaded = model.load_weights(weights=weights())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        missing: list[str] = []
        # as vLLM's own loader: models report the parameters they loaded; quantized
        # models have parameters no checkpoint tensor names, so they are not checked
        quantized = getattr(getattr(self, "model_config", None), "quantization", None)
        if isinstance(loaded, (set, frozenset, list, tuple)) and not quantized:
            got = set(loaded)
            missing = sorted(n for n, _ in model.named_parameters() if n not in got)
        return {"tensors": count, "missing": missing}


# ---------------------------------------------------------------------------
# Engine side
# ---------------------------------------------------------------------------


class _Gate:
    """Many readers (requests) or one writer (a weight load); a waiting writer holds new readers back."""

    def __init__(self) -> None:
        self._cond = anyio.Condition()
        self._readers = 0
        self._writing = False
        self._writers_waiting = 0

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        async with self._cond:
            while self._writing or self._writers_waiting:
                await self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self._readers -= 1
                    self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                while self._writing or self._readers:
                    await self._cond.wait()
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()
            self._writing = True
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                async with self._cond:
                    self._writing = False
                    self._cond.notify_all()


class _Tracked:
    """An in-flight call: ``aclose`` / the end of ``run`` cancel its scope with a reason."""

    __slots__ = ("scope", "reason")

    def __init__(self) -> None:
        self.scope = anyio.CancelScope()
        self.reason: str | None = None


def _first_error(exc: BaseException) -> BaseException:
    """The first leaf of an exception group (anyio task groups raise groups), else ``exc``."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc


class VLLMEngine(RolloutEngine):
    """Rollouts from vLLM's async engine on CUDA GPUs (see the module docstring).

    Options (``create_engine("vllm", path, **kwargs)``): ``tensor_parallel_size``,
    ``gpu_memory_utilization``, ``max_model_len`` (``None``: the model's),
    ``dtype`` (``"auto"``, ``"bfloat16"``, ...; ``model.dtype``), ``seed``,
    ``enforce_eager`` (no CUDA graphs / compilation: faster start, slower
    decoding), ``enable_prefix_caching``, ``max_batch_size`` (vLLM's
    ``max_num_seqs``: sequences per engine step; ``None``: vLLM's default),
    ``default_max_tokens`` (when a request gives none), ``max_logprobs`` (the
    largest ``top_logprobs`` :meth:`score` accepts), ``logprobs_mode``
    (``"processed_logprobs"``; ``"raw_logprobs"`` gives vLLM's default),
    ``trust_remote_code``, ``tokenizer_path``, ``weights_tmp_dir`` (where a state
    dict is written for the workers; default ``/dev/shm`` when it has room, else
    the temp dir) and ``engine_kwargs`` (more ``AsyncEngineArgs``). The
    transformers-only keys ``batch_wait_ms``, ``device`` and ``torch_threads``
    are accepted and ignored. Raises :class:`RftError` when vLLM is missing,
    rejects an argument or cannot start.

    ``stats`` counts ``requests`` (generate calls served), ``sequences``
    (completions), ``generated_tokens``, ``scored`` (score calls),
    ``aborted`` (vLLM requests aborted because their caller went away or
    failed) and ``weight_loads``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
        dtype: str = "auto",
        seed: int = 42,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        max_batch_size: int | None = None,
        default_max_tokens: int = 512,
        max_logprobs: int = 20,
        logprobs_mode: str = "processed_logprobs",
        trust_remote_code: bool = False,
        tokenizer_path: str | None = None,
        weights_tmp_dir: str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        **ignored: Any,
    ) -> None:
        unknown = sorted(set(ignored) - _IGNORED)
        if unknown:
            raise RftError(f"engine_type vllm: unknown argument(s) {unknown}")
        vllm = import_vllm()  # first: without vLLM nothing else is worth loading
        if int(tensor_parallel_size) < 1:
            raise RftError(
                "explorer.rollout_model.tensor_parallel_size must be >= 1, "
                f"got {tensor_parallel_size}"
            )
        if not 0.0 < float(gpu_memory_utilization) <= 1.0:
            raise RftError(
                f"vLLM gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if logprobs_mode not in _LOGPROBS_MODES:
            raise RftError(
                f"vLLM logprobs_mode must be one of {list(_LOGPROBS_MODES)}, got {logprobs_mode!r}"
            )
        self.model_path = str(model_path)
        self.default_max_tokens = int(default_max_tokens)
        self.max_logprobs = int(max_logprobs)
        self.weights_tmp_dir = weights_tmp_dir
        self._vllm = vllm
        self._load_hf_side(tokenizer_path or self.model_path, trust_remote_code)

        args: dict[str, Any] = {
            "model": self.model_path,
            "tokenizer": tokenizer_path or self.model_path,
            "tensor_parallel_size": int(tensor_parallel_size),
            "gpu_memory_utilization": float(gpu_memory_utilization),
            "dtype": _DTYPE_ALIASES.get(str(dtype), str(dtype)),
            "seed": int(seed),
            "enforce_eager": bool(enforce_eager),
            "enable_prefix_caching": bool(enable_prefix_caching),
            "max_logprobs": self.max_logprobs,
            "trust_remote_code": bool(trust_remote_code),
            "worker_extension_cls": WORKER_EXTENSION,
            "disable_log_stats": True,
        }
        if max_model_len:
            args["max_model_len"] = int(max_model_len)
        if max_batch_size:
            args["max_num_seqs"] = int(max_batch_size)
        fields = {f.name for f in dataclasses.fields(vllm.AsyncEngineArgs)}
        # vLLM-version: per-request INFO logs are off by default from 0.10.2
        # (enable_log_requests); older versions had disable_log_requests.
        if "enable_log_requests" in fields:
            args["enable_log_requests"] = False
        elif "disable_log_requests" in fields:
            args["disable_log_requests"] = True
        # vLLM-version: logprobs_mode exists from 0.10 ("processed_logprobs" from 0.10.2).
        if "logprobs_mode" in fields:
            args["logprobs_mode"] = logprobs_mode
        elif logprobs_mode != "raw_logprobs":
            log.warning(
                "vLLM %s has no logprobs_mode: sampled-token logprobs are the raw model's "
                "(exact only at temperature 1 or 0); upgrade to vLLM >= %s",
                getattr(vllm, "__version__", "?"),
                MIN_VLLM_VERSION,
            )
        args.update(_env_engine_args())
        args.update(dict(engine_kwargs or {}))
        bad = sorted(set(args) - fields)
        if bad:
            raise RftError(
                f"vLLM {getattr(vllm, '__version__', '?')} does not know the engine argument(s) "
                f"{bad} (AsyncEngineArgs)"
            )
        self.logprobs_processed = args.get("logprobs_mode") == "processed_logprobs"
        self.engine_args = dict(args)
        try:
            engine_args = vllm.AsyncEngineArgs(**args)
            self._engine: Any = _async_engine_class(vllm).from_engine_args(engine_args)
        except Exception as exc:  # noqa: BLE001 - vLLM raises many kinds; all mean "cannot start"
            raise RftError(
                f"cannot start vLLM for model.model_path {self.model_path!r}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        model_config = getattr(self._engine, "model_config", None)
        self.max_model_len = int(
            getattr(model_config, "max_model_len", 0)
            or max_model_len
            or self._hf_max_positions
            or 1 << 30
        )
        self._version = 0
        self._gate = _Gate()
        self._inflight: set[_Tracked] = set()
        self._closed = False
        self._running = False
        self._stopped = False
        self._stop_event: anyio.Event | None = None
        self.stats: dict[str, int] = {
            "requests": 0,
            "sequences": 0,
            "generated_tokens": 0,
            "scored": 0,
            "aborted": 0,
            "weight_loads": 0,
        }

    def _load_hf_side(self, tokenizer_path: str, trust_remote_code: bool) -> None:
        """Tokenizer (the workflow-facing one), eos ids and vocabulary size, as the transformers engine reads them."""
        from rftstream.model_loading import hf_classes, load_tokenizer

        try:
            self._tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
            (AutoConfig, GenerationConfig) = hf_classes("AutoConfig", "GenerationConfig")
            cfg = AutoConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as exc:
            raise RftError(
                f"model.model_path: cannot load a model from {self.model_path!r}: {exc}"
            ) from exc
        try:
            gen_eos = GenerationConfig.from_pretrained(self.model_path).eos_token_id
        except (OSError, ValueError):
            gen_eos = None
        text_cfg = getattr(cfg, "get_text_config", lambda: cfg)()
        self.eos_token_ids = eos_ids(
            self._tokenizer.eos_token_id, getattr(text_cfg, "eos_token_id", None), gen_eos
        )
        self.vocab_size = int(getattr(text_cfg, "vocab_size", 0) or len(self._tokenizer))
        self._hf_max_positions = int(getattr(text_cfg, "max_position_embeddings", 0) or 0)

    # ------------------------------------------------------------ properties
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def model_version(self) -> int:
        return self._version

    @property
    def vllm_engine(self) -> Any:
        """The underlying vLLM ``AsyncLLM`` (``None`` after :meth:`aclose`)."""
        return self._engine

    # ------------------------------------------------------------ generate
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams
    ) -> list[Completion]:
        """Sample ``params.n`` completions of one prompt (see the module docstring).

        Raises :class:`RftError` when the prompt does not fit the context, the
        engine is closed or stopped, or vLLM fails. Cancelling the caller
        aborts its vLLM requests.
        """
        prompt = prompt_ids(prompt_token_ids, self.max_model_len)
        self._check_usable()
        want = params.max_tokens if params.max_tokens is not None else self.default_max_tokens
        max_new = max(0, min(int(want), self.max_model_len - len(prompt)))
        if max_new == 0:
            return [
                Completion([], [], "length", model_version=self._version) for _ in range(params.n)
            ]
        greedy = params.temperature < _GREEDY_EPS
        sps = [self._sampling_params(params, max_new, i) for i in range(1 if greedy else params.n)]
        outputs, version = await self._serve(lambda: self._submit(prompt, sps))
        exact = self._logprobs_exact(params, greedy)
        comps = [self._completion(out, version, exact) for out in outputs]
        if greedy and params.n > 1:  # one greedy sample, repeated
            comps = [comps[0]] + [
                Completion(
                    list(comps[0].token_ids),
                    list(comps[0].logprobs),
                    comps[0].finish_reason,
                    model_version=version,
                    info=dict(comps[0].info),
                )
                for _ in range(params.n - 1)
            ]
        self.stats["requests"] += 1
        self.stats["sequences"] += len(comps)
        self.stats["generated_tokens"] += sum(len(c.token_ids) for c in comps)
        return comps

    def _sampling_params(self, params: SamplingParams, max_new: int, index: int) -> Any:
        from vllm.sampling_params import RequestOutputKind

        stop = [s for s in (params.stop or []) if s]
        vocab_filter = 0 < params.top_k < self.vocab_size
        return self._make_sampling_params(
            n=1,
            temperature=max(float(params.temperature), 0.0),
            top_p=float(params.top_p),
            top_k=int(params.top_k) if vocab_filter else -1,  # -1: off on every vLLM version
            max_tokens=int(max_new),
            min_tokens=min(int(params.min_tokens), int(max_new)),
            seed=None if params.seed is None else int(params.seed) + index,
            stop=stop or None,
            stop_token_ids=sorted(set(params.stop_token_ids or ()) | self.eos_token_ids),
            logprobs=0,  # the sampled token's logprob only
            detokenize=bool(stop),  # text is only needed to match stop strings
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def _make_sampling_params(self, **kw: Any) -> Any:
        """``vllm.SamplingParams(**kw)``; drops ``detokenize`` where vLLM has no such field."""
        cls = self._vllm.SamplingParams
        fields = getattr(cls, "__struct_fields__", None)  # a msgspec Struct in vLLM's V1 era
        if fields is not None and "detokenize" not in fields:
            kw.pop("detokenize", None)
        return cls(**kw)

    def _logprobs_exact(self, params: SamplingParams, greedy: bool) -> bool:
        """Whether vLLM's sampled-token logprobs follow the engine convention (module docstring)."""
        if greedy:
            return True
        if 0 < params.top_k < self.vocab_size or params.top_p < 1.0 or params.min_tokens > 0:
            return False
        return self.logprobs_processed or abs(params.temperature - 1.0) < 1e-6

    def _completion(self, out: Any, version: int, exact: bool) -> Completion:
        if len(out.outputs) != 1:
            raise RftError(f"vLLM returned {len(out.outputs)} completions for a request of n=1")
        c = out.outputs[0]
        ids = [int(t) for t in c.token_ids]
        steps = c.logprobs
        lps: list[float] = []
        if steps is not None and len(steps) == len(ids):
            for tok, step in zip(ids, steps, strict=True):
                entry = step.get(tok) if step else None
                if entry is None:
                    break
                lps.append(float(entry.logprob))
        if len(lps) != len(ids):  # vLLM left some out: never seen, but do not invent numbers
            lps, exact = [0.0] * len(ids), False
        reason = c.finish_reason
        if reason == "abort":
            raise RftError("vLLM aborted the request")
        return Completion(
            token_ids=ids,
            logprobs=lps,
            finish_reason="length" if reason == "length" else "stop",
            model_version=version,
            info={} if exact else {"logprobs_exact": False},
        )

    # ------------------------------------------------------------ score
    async def score(
        self,
        token_ids: list[int],
        *,
        start: int = 1,
        temperature: float = 1.0,
        top_logprobs: int = 0,
    ) -> TokenScores:
        """Logprobs of ``token_ids[start:]`` from vLLM's ``prompt_logprobs`` (one prefill).

        vLLM computes prompt logprobs at temperature 1 only: ``temperature``
        must be 1 (or ``<= 0``, which means 1), else :class:`RftError`.
        ``top_logprobs`` is at most ``max_logprobs``.
        """
        ids = score_ids(token_ids, self.max_model_len)
        start = max(1, int(start))
        k = max(0, int(top_logprobs))
        if temperature > 0 and abs(float(temperature) - 1.0) > 1e-6:
            raise RftError(
                f"the vLLM engine cannot score at temperature {temperature}: vLLM's prompt "
                "logprobs are computed at temperature 1 (score with temperature=1)"
            )
        if k > self.max_logprobs:
            raise RftError(
                f"top_logprobs {k} exceeds the vLLM engine's max_logprobs {self.max_logprobs}"
            )
        self._check_usable()
        if start >= len(ids):
            return TokenScores([], [] if k > 0 else None)
        from vllm.sampling_params import RequestOutputKind

        sp = self._make_sampling_params(
            n=1,
            temperature=0.0,
            max_tokens=1,
            prompt_logprobs=k,  # k alternatives (0: the given token only) per position
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        outputs, _ = await self._serve(lambda: self._submit(ids, [sp]))
        plp = outputs[0].prompt_logprobs
        if plp is None or len(plp) < len(ids):
            raise RftError("vLLM returned no prompt logprobs")
        chosen: list[float] = []
        alts: list[list[tuple[int, float]]] | None = [] if k > 0 else None
        for i in range(start, len(ids)):
            entry = plp[i]
            own = entry.get(ids[i]) if entry else None
            if own is None:
                raise RftError(f"vLLM returned no logprob for prompt position {i}")
            chosen.append(float(own.logprob))
            if alts is not None:
                ranked = sorted(
                    (
                        (int(r.rank), -float(r.logprob), int(tid))
                        for tid, r in entry.items()
                        if r.rank is not None and r.rank <= k
                    ),
                )
                alts.append([(tid, -neg) for _, neg, tid in ranked[:k]])
        self.stats["scored"] += 1
        return TokenScores(chosen, alts)

    # ------------------------------------------------------------ requests
    def _check_usable(self) -> None:
        if self._closed or self._engine is None:
            raise RftError("rollout engine is closed")
        if self._stopped:
            raise RftError("rollout engine stopped (its run() task ended)")
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            raise RftError(
                "the vLLM engine needs the asyncio event loop (anyio backend 'asyncio')"
            ) from None

    async def _serve(self, work: Callable[[], Awaitable[T]]) -> tuple[T, int]:
        """Run ``work`` as a reader of the weights; returns its result and the weight version.

        ``aclose`` / the end of ``run`` cancel it with a reason, raised here as
        :class:`RftError`; the caller's own cancellation propagates.
        """
        self._check_usable()
        tracked = _Tracked()
        self._inflight.add(tracked)
        try:
            with tracked.scope:
                async with self._gate.read():
                    self._check_usable()  # closed while waiting for a weight load
                    version = self._version
                    result = await work()
                    return result, version
        finally:
            self._inflight.discard(tracked)
        raise RftError(tracked.reason or "rollout engine stopped before serving the request")

    async def _submit(self, prompt: list[int], sps: list[Any]) -> list[Any]:
        """One vLLM request per sampling params, concurrently; their final ``RequestOutput``s.

        On any exception (the caller's cancellation included) every request is
        aborted in a shielded scope before it propagates; vLLM's own errors
        become :class:`RftError`.
        """
        ids = [f"rft-{uuid.uuid4().hex}" for _ in sps]
        results: list[Any] = [None] * len(sps)

        async def one(i: int) -> None:
            final = None
            async for out in self._engine.generate({"prompt_token_ids": prompt}, sps[i], ids[i]):
                final = out
            if final is None:
                raise RftError("vLLM ended the request without an output")
            results[i] = final

        try:
            async with anyio.create_task_group() as tg:
                for i in range(len(sps)):
                    tg.start_soon(one, i)
        except Exception as exc:
            with anyio.CancelScope(shield=True):
                await self._abort(ids)
            err = _first_error(exc)
            if isinstance(err, RftError):
                raise err from exc
            raise RftError(f"vLLM request failed: {type(err).__name__}: {err}") from exc
        except BaseException:  # cancelled: the caller went away, or aclose / run ended
            with anyio.CancelScope(shield=True):
                await self._abort(ids)
            raise
        return results

    async def _abort(self, request_ids: list[str]) -> None:
        engine = self._engine
        if engine is None:
            return
        for rid in request_ids:  # vLLM-version: abort() takes one id before 0.11
            try:
                await engine.abort(rid)
            except Exception as exc:  # noqa: BLE001 - best effort: the engine may be shutting down
                log.debug("vLLM abort of %s failed: %s", rid, exc)
        self.stats["aborted"] += len(request_ids)

    # ------------------------------------------------------------ weights
    async def load_weights(
        self,
        state_dict: Mapping[str, torch.Tensor] | str | os.PathLike[str],
        version: int,
        *,
        partial: bool = False,
    ) -> None:
        """Update the weights in place between requests, then set :attr:`model_version`.

        ``partial``: the tensors are only the ones that changed (a LoRA run's merged
        layers; ``sync_method: jetstream``): parameters they leave out keep their values
        instead of failing the coverage check.

        ``state_dict``: tensors by Hugging Face name (written to one temporary
        safetensors file the workers read), or the path of a safetensors file
        or of a directory of them (read by the workers directly). Waits for
        the requests in flight and holds new ones back meanwhile; resets vLLM's
        prefix cache. Raises :class:`RftError` (version unchanged) when the
        workers fail or the tensors leave model parameters uncovered; vLLM may
        have replaced part of the weights by then.
        """
        if self._closed or self._engine is None:
            raise RftError("rollout engine is closed")
        tmp: Path | None = None
        if isinstance(state_dict, (str, os.PathLike)):
            files = _weight_files(Path(state_dict))
        else:
            if not state_dict:
                raise RftError("load_weights: empty state dict")
            tmp = await anyio.to_thread.run_sync(self._write_temp, dict(state_dict))
            files = [str(tmp)]
        try:
            async with self._gate.write():
                if self._closed or self._engine is None:
                    raise RftError("rollout engine is closed")
                await self._load_files(files, partial=partial)
                self._version = int(version)
                self.stats["weight_loads"] += 1
        finally:
            if tmp is not None:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(_unlink, tmp)

    async def _load_files(self, files: list[str], *, partial: bool = False) -> None:
        try:
            results = await self._engine.collective_rpc(_RPC_LOAD, args=(files,))
        except Exception as exc:  # noqa: BLE001 - whatever the workers raised
            raise RftError(
                f"load_weights: the vLLM workers could not load {files}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        for res in results or []:
            missing = (res or {}).get("missing") or []
            if missing and not partial:
                raise RftError(
                    f"load_weights: the weights do not cover {len(missing)} parameter(s) of the "
                    f"vLLM model at {self.model_path!r}, e.g. {missing[:5]}"
                )
        await self._reset_prefix_cache()

    async def _reset_prefix_cache(self) -> None:
        """Drop cached KV blocks (computed by the old weights). Retries while aborted requests drain."""
        for _ in range(50):
            ok = await self._engine.reset_prefix_cache()
            if ok is None or ok:  # vLLM-version: returns a bool from 0.9, None before
                return
            await anyio.sleep(0.02)
        log.warning("vLLM did not reset its prefix cache after a weight load")

    def _write_temp(self, state_dict: dict[str, torch.Tensor]) -> Path:
        """Worker thread: the tensors as one safetensors file (CPU, contiguous, unshared)."""
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in state_dict.items():
            t = value.detach()
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or t.numel() == 0:  # tied / shared tensors: safetensors wants copies
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
            tensors[strip_module_prefix(key)] = t
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        fd, name = tempfile.mkstemp(
            prefix="rftstream-vllm-weights-", suffix=".safetensors", dir=self._tmp_dir(size)
        )
        os.close(fd)
        try:
            save_file(tensors, name)
        except BaseException:
            _unlink(Path(name))
            raise
        return Path(name)

    def _tmp_dir(self, size: int) -> str:
        if self.weights_tmp_dir:
            return self.weights_tmp_dir
        shm = "/dev/shm"
        try:
            if os.path.isdir(shm) and shutil.disk_usage(shm).free > size * 1.1 + (256 << 20):
                return shm
        except OSError:
            pass
        return tempfile.gettempdir()

    # ------------------------------------------------------------ lifecycle
    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until :meth:`aclose` or cancellation (vLLM schedules the requests itself).

        Start it in the owner's task group like every engine. When it ends,
        the requests in flight fail with :class:`RftError` (their vLLM
        requests are aborted) and later calls raise.
        """
        if self._running:
            raise RftError("VLLMEngine.run() is already running")
        self._running = True
        self._stopped = False
        self._stop_event = anyio.Event()
        task_status.started()
        try:
            if not self._closed:
                await self._stop_event.wait()
        finally:
            self._running = False
            self._stopped = True
            self._fail_inflight("rollout engine stopped before serving the request")

    async def aclose(self) -> None:
        """Fail the calls in flight (aborting their vLLM requests) and shut vLLM down. Idempotent.

        vLLM's shutdown (ending its engine-core and worker processes) runs on
        the event loop and can block it for a few seconds.
        """
        self._closed = True
        self._fail_inflight("rollout engine is closed")
        if self._stop_event is not None:
            self._stop_event.set()
        with anyio.move_on_after(5):  # let the failed calls run their (shielded) aborts
            while self._inflight:
                await anyio.sleep(0.01)
        engine, self._engine = self._engine, None
        if engine is not None:
            try:
                engine.shutdown()
            except Exception as exc:  # noqa: BLE001 - closing anyway
                log.warning("vLLM shutdown failed: %s", exc)

    def _fail_inflight(self, reason: str) -> None:
        for tracked in list(self._inflight):
            if tracked.reason is None:  # the first reason given stands
                tracked.reason = reason
            tracked.scope.cancel()


def _async_engine_class(vllm: Any) -> Any:
    """vLLM's async engine class.

    # vLLM-version: the V1 ``AsyncLLM`` (what ``vllm.AsyncLLMEngine`` aliases
    # from 0.10 on, and with VLLM_USE_V1=1 before); ``vllm.AsyncLLMEngine`` if
    # the module moved.
    """
    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:
        return vllm.AsyncLLMEngine
    return AsyncLLM


def _env_engine_args() -> dict[str, Any]:
    raw = os.environ.get(ENGINE_ARGS_ENV, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise RftError(f"{ENGINE_ARGS_ENV} must be a JSON object: {exc}") from exc
    if not isinstance(value, dict):
        raise RftError(f"{ENGINE_ARGS_ENV} must be a JSON object, got {type(value).__name__}")
    return value


def _weight_files(path: Path) -> list[str]:
    if path.is_file() and path.suffix == ".safetensors":
        return [str(path.resolve())]
    if path.is_dir():
        files = sorted(str(p.resolve()) for p in path.glob("*.safetensors"))
        if files:
            return files
    raise RftError(
        f"load_weights: {str(path)!r} is neither a .safetensors file nor a directory of them"
    )


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):
        path.unlink()
