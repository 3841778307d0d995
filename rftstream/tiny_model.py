"""The embedded tiny model: built locally in seconds, no model hub needed.

:func:`ensure_tiny_model` builds (once) and caches a Hugging Face model
directory (``config.json``, ``model.safetensors``, tokenizer files with a chat
template) that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load:

* Tokenizer: one token per character of printable ASCII plus ``\\n`` (other
  characters: one token per UTF-8 byte), and the special tokens ``<|pad|>``,
  ``<|im_start|>``, ``<|im_end|>`` (eos) and ``<|endoftext|>``; the files load
  as ``Qwen2Tokenizer`` with identical ids. Qwen-like chat template:
  ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message, then
  ``<|im_start|>assistant\\n`` for the generation prompt.
* Model: a ``Qwen2ForCausalLM`` with 2 layers, hidden size 64, 4 heads
  (2 KV heads), tied embeddings, 128 positions.
* Briefly trained: a few seconds of supervised training on the built-in
  arithmetic taskset (``"a+b="`` for single digits, in the chat format that
  ``math_workflow`` uses by default: one user message, no system prompt). The
  targets are a label mixture: the correct sum with probability
  ``p_correct``, a near miss (±1, ±2) with ``p_near``, any number in 0..18 with
  ``p_uniform``. Training minimises the *expected* cross-entropy under that
  mixture exactly (all answers of a prompt packed into one sequence as a
  prefix tree with a 4-D attention mask), so the model's answer distribution
  converges to the mixture: at temperature 1 it answers in the right format
  (a number, then ``<|im_end|>``) and is right about 15-20% of the time, with
  the correct answer in its support for every prompt. Reinforcement learning
  has to sharpen that.

The build is deterministic (fixed seeds, deterministic algorithms, one torch
thread: the kernels are too small to gain from more, and on a busy 2-core
machine OpenMP spin-waits made a 2-thread build 5x slower; the caller's RNG
state and thread count are restored, but the thread count is process-wide while
the build runs) and atomic: it is written to a temporary directory and renamed
into place, so concurrent processes never see half a model. It takes about 6 s
on 2 CPU cores. Blocking: call it from a worker thread in async code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHAT_TEMPLATE",
    "SPECIAL_TOKENS",
    "arithmetic_problems",
    "build_tiny_model",
    "build_tokenizer",
    "ensure_tiny_model",
    "tiny_model_version",
]

RECIPE_VERSION = 1

PAD, IM_START, IM_END, ENDOFTEXT = "<|pad|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END, ENDOFTEXT]

# Qwen2's pre-tokenizer split (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX).
_QWEN2_SPLIT = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_RECIPE: dict[str, Any] = {
    "recipe_version": RECIPE_VERSION,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
    "p_correct": 0.20,
    "p_near": 0.20,
    "p_uniform": 0.60,
    "answer_range": [0, 18],
    "steps": 300,
    "lr": 5e-3,
    "warmup_steps": 20,
    "prompts_per_step": 25,
    "seed": 2,
    "threads": 1,
}

_MARKER = "rftstream_tiny.json"


# ---------------------------------------------------------------------------
# Public helpers
# ---------------------------------------------------------------------------


def arithmetic_problems() -> list[tuple[str, str]]:
    """The built-in arithmetic problems: ``("a+b=", "a+b")`` for a, b in 0..9 (100, fixed order)."""
    return [(f"{a}+{b}=", str(a + b)) for a in range(10) for b in range(10)]


def tiny_model_version() -> str:
    """A short hash of everything that determines the built model (the cache key).

    Reads the installed transformers version from its metadata: importing
    transformers takes a second or two, and a cached model needs no import.
    """
    import importlib.metadata

    payload = {
        "recipe": _RECIPE,
        "template": CHAT_TEMPLATE,
        "vocab": SPECIAL_TOKENS,
        "split": _QWEN2_SPLIT,
        "transformers_major": importlib.metadata.version("transformers").split(".")[0],
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]


def ensure_tiny_model(
    cache_dir: str | Path | None = None, *, progress: Callable[[str], None] | None = None
) -> Path:
    """Return the directory of the tiny model, building it first if it is not cached.

    The model lives in ``<cache>/tiny-<version>``, where ``<cache>`` is
    ``cache_dir``, else ``$RFTSTREAM_CACHE``, else ``~/.cache/rftstream``.
    Blocks for a few seconds on the first call (CPU training); later calls
    only check the directory. Concurrent builders serialise on a lock file
    and the result appears by an atomic rename.
    """
    say = progress or (lambda _msg: None)
    final = _cache_root(cache_dir) / f"tiny-{tiny_model_version()}"
    return build_once(
        final,
        _complete,
        lambda tmp: build_tiny_model(tmp, progress=say),
        say,
        "the tiny model (one-time, a few seconds)",
    )


def build_once(
    final: Path,
    complete: Callable[[Path], bool],
    build: Callable[[Path], object],
    say: Callable[[str], None],
    what: str,
) -> Path:
    """``final`` once ``complete(final)``, else built there by ``build(tmp)`` first: into a
    temporary directory beside it, renamed into place (an incomplete leftover of a
    killed build is replaced), concurrent builders serialised on a lock file. Blocks."""
    if complete(final):
        return final
    root = final.parent
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / f".{final.name}.lock"):
        if complete(final):
            return final
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=root))
        try:
            say(f"building {what} in {final}")
            build(tmp)
            if final.exists():  # incomplete leftover from a killed build
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}-stale-", dir=root))
                os.replace(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    say(f"ready: {final}")
    return final


def build_tokenizer() -> Any:
    """The character-level tokenizer with the chat template (a ``PreTrainedTokenizerFast``).

    The pipeline is exactly the one ``Qwen2Tokenizer`` builds (NFC, Qwen's
    split regex, byte-level mapping, BPE) with an empty merge list, so every
    character is one token whichever class loads the files: ``AutoTokenizer``
    picks ``Qwen2Tokenizer`` for a ``qwen2`` config and gets the same ids.
    Vocabulary: the special tokens, then the 256 byte symbols (printable ASCII
    and ``\\n`` are the ones the model is trained on; other bytes keep any
    UTF-8 text lossless).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + _byte_symbols())}
    model = models.BPE(
        vocab=vocab,
        merges=[],
        dropout=None,
        unk_token=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    tok = Tokenizer(model)
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=int(_RECIPE["max_position_embeddings"]),
    )


def _byte_symbols() -> list[str]:
    """The byte-level (GPT-2) symbol of every byte value 0..255, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def build_tiny_model(
    out_dir: str | Path, *, progress: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Build, train and save the tiny model into ``out_dir`` (no caching, no atomicity). Blocks.

    Returns the metadata also written to ``rftstream_tiny.json`` (recipe,
    build time, the exact expected accuracy at temperature 1).
    """
    from rftstream.model_loading import quiet_progress_bars

    say = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _deterministic(int(_RECIPE["threads"]), int(_RECIPE["seed"])):
        tokenizer = build_tokenizer()
        model = _new_model(len(tokenizer), tokenizer)
        batch = _tree_batch(tokenizer)
        _train(model, batch, say)
        expected = _expected_accuracy(model, batch)
        model.eval()
        with quiet_progress_bars():
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
        _set_tokenizer_class(out, "Qwen2Tokenizer")
    meta = {
        "version": tiny_model_version(),
        "recipe": _RECIPE,
        "expected_accuracy": round(expected, 4),
        "build_seconds": round(time.perf_counter() - t0, 2),
    }
    (out / _MARKER).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    say(f"tiny model trained in {meta['build_seconds']} s; expected accuracy {expected:.3f}")
    return meta


# ---------------------------------------------------------------------------
# Build internals
# ---------------------------------------------------------------------------


def _set_tokenizer_class(out: Path, name: str) -> None:
    """Name the class ``AutoTokenizer`` picks anyway for a qwen2 config (same ids, see above)."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = name
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _cache_root(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("RFTSTREAM_CACHE")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "rftstream"


def _complete(path: Path) -> bool:
    return (path / _MARKER).is_file() and (path / "model.safetensors").is_file()


@contextlib.contextmanager
def _build_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _deterministic(threads: int, seed: int) -> Iterator[None]:
    """Fixed threads, seed and deterministic kernels; the caller's settings come back after."""
    prev_threads = torch.get_num_threads()
    prev_det = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
            torch.set_num_threads(prev_threads)


def _new_model(vocab_size: int, tokenizer: Any) -> Any:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    r = _RECIPE
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=r["hidden_size"],
        intermediate_size=r["intermediate_size"],
        num_hidden_layers=r["num_hidden_layers"],
        num_attention_heads=r["num_attention_heads"],
        num_key_value_heads=r["num_key_value_heads"],
        max_position_embeddings=r["max_position_embeddings"],
        rope_theta=r["rope_theta"],
        tie_word_embeddings=True,
        bos_token_id=tokenizer.convert_tokens_to_ids(IM_START),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    config._attn_implementation = "eager"
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _answer_distribution(truth: int) -> dict[str, float]:
    """The label mixture for one problem: correct / near miss / uniform over the answer range."""
    lo, hi = _RECIPE["answer_range"]
    values = range(lo, hi + 1)
    dist = {v: _RECIPE["p_uniform"] / len(values) for v in values}
    dist[truth] += _RECIPE["p_correct"]
    near = [
        (truth + d, w)
        for d, w in ((-1, 2.0), (1, 2.0), (-2, 1.0), (2, 1.0))
        if lo <= truth + d <= hi
    ]
    total_w = sum(w for _, w in near)
    for v, w in near:
        dist[v] += _RECIPE["p_near"] * w / total_w
    return {str(v): p for v, p in dist.items()}


class _TreeBatch:
    """All prompts, each followed by the prefix tree of its possible answers.

    Row ``k`` is ``prompt_k + [last char of every trie node]``; the 4-D mask
    lets a node see the prompt, its ancestors and itself. ``targets`` hold the
    next-token distribution at the prompt's last token (root) and at every
    node, ``weights`` the probability of reaching that position.
    """

    def __init__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        mask: torch.Tensor,
        targets: torch.Tensor,
        weights: torch.Tensor,
        prompt_len: int,
        nodes: list[str],
        truths: list[str],
        eos: int,
    ) -> None:
        self.input_ids = input_ids
        self.position_ids = position_ids
        self.mask = mask
        self.targets = targets
        self.weights = weights
        self.prompt_len = prompt_len
        self.nodes = nodes
        self.truths = truths
        self.eos = eos


def _tree_batch(tokenizer: Any) -> _TreeBatch:
    problems = arithmetic_problems()
    dists = [_answer_distribution(int(ans)) for _, ans in problems]
    nodes = sorted(
        {a[:i] for d in dists for a in d for i in range(1, len(a) + 1)}, key=lambda s: (len(s), s)
    )
    node_index = {n: i for i, n in enumerate(nodes)}
    eos = tokenizer.eos_token_id
    vocab = len(tokenizer)

    def cid(ch: str) -> int:
        return int(tokenizer.convert_tokens_to_ids(ch))

    prompts = []
    for question, _ in problems:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    lp = len(prompts[0])
    if any(len(p) != lp for p in prompts):
        raise RuntimeError("tiny model build: arithmetic prompts must have equal token length")
    width = lp + len(nodes)
    n_loss = 1 + len(nodes)  # root + nodes: the last n_loss positions
    input_ids = torch.tensor([p + [cid(n[-1]) for n in nodes] for p in prompts], dtype=torch.long)
    position_ids = torch.tensor([list(range(lp)) + [lp + len(n) - 1 for n in nodes]] * len(prompts))
    allow = torch.zeros(width, width, dtype=torch.bool)
    for i in range(lp):
        allow[i, : i + 1] = True
    for j, n in enumerate(nodes):
        row = lp + j
        allow[row, :lp] = True
        for k in range(1, len(n) + 1):
            allow[row, lp + node_index[n[:k]]] = True
    mask = torch.zeros(width, width)
    mask[~allow] = torch.finfo(torch.float32).min
    targets = torch.zeros(len(prompts), n_loss, vocab)
    weights = torch.zeros(len(prompts), n_loss)
    for k, dist in enumerate(dists):
        for ans, p in dist.items():
            targets[k, 0, cid(ans[0])] += p
        weights[k, 0] = 1.0
        for j, n in enumerate(nodes):
            mass = sum(p for a, p in dist.items() if a.startswith(n))
            if mass <= 0:
                continue
            for a, p in dist.items():
                if a == n:
                    targets[k, 1 + j, eos] += p / mass
                elif a.startswith(n):
                    targets[k, 1 + j, cid(a[len(n)])] += p / mass
            weights[k, 1 + j] = mass
    truths = [ans for _, ans in problems]
    return _TreeBatch(input_ids, position_ids, mask, targets, weights, lp, nodes, truths, int(eos))


def _tree_logprobs(model: Any, batch: _TreeBatch, idx: torch.Tensor) -> torch.Tensor:
    n_loss = batch.targets.shape[1]
    mask = batch.mask[None, None].expand(len(idx), 1, -1, -1)
    out = model(
        input_ids=batch.input_ids[idx],
        attention_mask=mask,
        position_ids=batch.position_ids[idx],
        use_cache=False,
        logits_to_keep=n_loss,
    )
    return torch.log_softmax(out.logits.float(), dim=-1)


def _train(model: Any, batch: _TreeBatch, say: Callable[[str], None]) -> None:
    steps = int(_RECIPE["steps"])
    warmup = int(_RECIPE["warmup_steps"])
    per_step = int(_RECIPE["prompts_per_step"])
    opt = torch.optim.AdamW(
        model.parameters(), lr=float(_RECIPE["lr"]), betas=(0.9, 0.98), weight_decay=0.0
    )

    def lr_factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup) * 0.5 * (1.0 + math.cos(math.pi * step / steps))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    gen = torch.Generator().manual_seed(int(_RECIPE["seed"]))
    n = batch.input_ids.shape[0]
    model.train()
    order = torch.randperm(n, generator=gen)
    cursor = 0
    for step in range(steps):
        if cursor + per_step > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + per_step]
        cursor += per_step
        logprobs = _tree_logprobs(model, batch, idx)
        loss = -((logprobs * batch.targets[idx]).sum(-1) * batch.weights[idx]).sum() / len(idx)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if (step + 1) % 100 == 0:
            say(f"tiny model: step {step + 1}/{steps}, loss {loss.item():.4f}")


@torch.no_grad()
def _expected_accuracy(model: Any, batch: _TreeBatch) -> float:
    """Exact mean probability (temperature 1) of sampling the correct answer then eos."""
    model.eval()
    idx = torch.arange(batch.input_ids.shape[0])
    logprobs = _tree_logprobs(model, batch, idx)
    node_index = {n: i for i, n in enumerate(batch.nodes)}
    total = 0.0
    for k, truth in enumerate(batch.truths):
        # position 0 is the root; node j sits at position 1 + j
        lp = float(logprobs[k, 0, batch.input_ids[k, batch.prompt_len + node_index[truth[0]]]])
        for i in range(1, len(truth)):
            parent = 1 + node_index[truth[:i]]
            lp += float(
                logprobs[
                    k, parent, batch.input_ids[k, batch.prompt_len + node_index[truth[: i + 1]]]
                ]
            )
        leaf = 1 + node_index[truth]
        lp += float(logprobs[k, leaf, batch.eos])
        total += math.exp(lp)
    return total / len(batch.truths)
