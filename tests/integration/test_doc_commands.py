"""Every command block of README.md and docs/*.md (fenced `bash`) runs here, or is checked in
a cheap form that proves it valid; none is skipped silently.

Each block must pass `bash -n`. Then, command by command (continuation lines joined, `&&`
chains split, a trailing `&` dropped):

* run for real, and must exit 0: `--help`, `rftstream config explain`, `rftstream debug
  workflow` (the tiny model), `just --list`, `python -c`, `python -m venv` (into a temporary
  directory), `python -m rftstream.nats_server.cluster` (started until it is ready, then stopped),
  `source .venv/bin/activate`, `mkdocs build`;
* checked: any other `rftstream` command is parsed by rftstream's own parser, its `--config`
  file (when the docs name a file of this repository) loaded and validated with its
  `--set`s and `--plugin-dir`s, a registered operator built with its `--args`; `just
  RECIPE` must be a recipe of `just --summary`; a `nats` command must use the streams,
  subjects, consumers and KV keys rftstream creates (rftstream/subjects.py); a `nats-server`
  flag must be one `nats-server --help` lists; `pip install` extras must exist in
  pyproject.toml and packages be installed; `torchrun` arguments parse with torchrun's
  parser, and what it launches with rftstream's (so must what `srun` runs); `python
  benchmarks/X.py` answers `--help`.

A block that can be neither carries `<!-- not-run: why -->` right above its fence; they are
listed and must stay few. `text` blocks titled `nats-server.conf` are server configs and
must pass `nats-server -t`.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.unit.test_docs import ROOT, Block, all_blocks

pytestmark = pytest.mark.integration

BIN = Path(sys.executable).parent  # the environment's bin: `.venv/bin` after `just setup`
BASH_BLOCKS = [b for b in all_blocks() if b.lang in {"bash", "console"}]
CHECKED_BLOCKS = [b for b in BASH_BLOCKS if b.marker != "not-run"]
NOT_RUN_BLOCKS = [b for b in BASH_BLOCKS if b.marker == "not-run"]
CONF_BLOCKS = [b for b in all_blocks() if b.lang == "text" and b.title == "nats-server.conf"]
DOC_RUN = "default"  # the run id the docs' `nats` commands use: `rftstream up`'s default run
MAX_NOT_RUN_SHARE = 0.1


@dataclass(frozen=True)
class Command:
    block: Block
    line: int  # line in the file
    text: str  # the command as written (continuations joined, comment dropped)
    argv: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.block.path.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Plan:
    kind: str  # "run" (for real, exit 0) or "check" (a cheap form that proves it valid)
    how: str
    act: Callable[[Command, Ctx], None]


@dataclass
class Ctx:
    tmp: Path
    request: pytest.FixtureRequest  # for fixtures a plan needs (the tiny model)


def _strip_comment(line: str) -> str:
    """``line`` without its trailing ``# comment`` (a ``#`` outside quotes after a blank)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i].rstrip()
    return line.rstrip()


def shell_text(block: Block) -> str:
    """The shell input of ``block``: a `bash` block whole; of a `console` block, the lines
    after a `$ ` prompt (the rest is output), blanked so that line numbers hold."""
    if block.lang != "console":
        return block.text
    return "".join(
        (line[2:] if line.startswith("$ ") else "") + "\n" for line in block.text.splitlines()
    )


def commands(block: Block) -> list[Command]:
    """The shell commands of ``block``, in order."""
    out: list[Command] = []
    lines = shell_text(block).splitlines()
    i = 0
    while i < len(lines):
        start = i
        text = _strip_comment(lines[i])
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1].rstrip() + " " + _strip_comment(lines[i]).strip()
        i += 1
        if not text.strip():
            continue
        line = block.line + 1 + start
        if text.startswith("export "):  # `$(cat FILE)` is one word to the shell, not to shlex
            out.append(Command(block, line, text.strip(), ("export",)))
            continue
        part: list[str] = []
        for token in [*shlex.split(text), "&&"]:
            if token in {"&&", "||", ";", "&"}:
                if part:
                    out.append(Command(block, line, text.strip(), tuple(part)))
                part = []
            else:
                part.append(token)
    return out


# --- tools the checks share --------------------------------------------------------------------


def _tool(name: str) -> Path:
    """``.venv/bin/NAME`` (the running environment's bin), which setup must have made."""
    path = BIN / name
    assert path.exists(), f"{path} does not exist: `just setup` installs it"
    return path


def _run(argv: list[str], *, timeout: float = 60, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", **(env or {})},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{shlex.join(argv)} exited {proc.returncode}:\n{output[-3000:]}"
    return output


@cache
def _just_recipes() -> frozenset[str]:
    return frozenset(_run([str(_tool("just")), "--summary"]).split())


@cache
def _nats_server_help() -> str:
    proc = subprocess.run(
        [str(_tool("nats-server")), "--help"], capture_output=True, text=True, timeout=30
    )
    return proc.stdout + proc.stderr


@cache
def _extras() -> frozenset[str]:
    """rftstream's extras, as installed from pyproject.toml."""
    extras = importlib.metadata.metadata("rftstream").get_all("Provides-Extra") or []
    return frozenset(extras)


def _program(argv: tuple[str, ...]) -> str:
    """The program's name: ``.venv/bin/just`` -> ``just`` (checking the file exists)."""
    first = argv[0]
    if first.startswith(".venv/bin/"):
        _tool(first.removeprefix(".venv/bin/"))
        return first.removeprefix(".venv/bin/")
    return first


# --- rftstream -------------------------------------------------------------------------------------


def _rftstream_exe() -> list[str]:
    script = BIN / "rftstream"
    return [str(script)] if script.exists() else [sys.executable, "-m", "rftstream.cli"]


def _check_rftstream_args(args: list[str], where: str) -> None:
    """Parse ``args`` with rftstream's parser; load the config it names (when it is a file
    of this repository) as the command would, with its --set and --plugin-dir; build a
    registered operator with its --args."""
    from rftstream.cli import build_parser, load_run_config

    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{where}: rftstream {shlex.join(args)}: refused ({exc})") from None
    config = getattr(ns, "config", None)
    plugin_dirs = [d for d in getattr(ns, "plugin_dir", None) or [] if (ROOT / d).is_dir()]
    for d in getattr(ns, "plugin_dir", None) or []:
        assert (ROOT / d).is_dir() or not d.startswith("examples"), f"{where}: no directory {d}"
    if plugin_dirs:
        from rftstream.plugins.loader import load_plugins

        load_plugins([ROOT / d for d in plugin_dirs])
    if config and (ROOT / config).is_file():
        from rftstream.config.explain import explain_file

        _, errors = explain_file(config, list(ns.set))
        assert not errors, f"{where}: {config}: {errors}"
    elif config:  # a placeholder (run.yaml, C): but a path into the repository must exist
        assert not config.startswith(("examples/", "benchmarks/", "tests/")), (
            f"{where}: no file {config}"
        )
    elif ns.command in {"up", "explorer", "operator", "trainer"}:
        load_run_config(ns)  # the embedded default with the --set keys
    if ns.command == "operator" and ns.operator and ":" not in ns.operator:
        from rftstream.experience_pipeline import EXPERIENCE_OPERATORS

        EXPERIENCE_OPERATORS.get(ns.operator)(**json.loads(ns.args))


def _plan_rftstream(args: list[str]) -> Plan:
    if "--help" in args or "-h" in args:
        return Plan("run", "--help", lambda c, x: _run([*_rftstream_exe(), *args]))
    if args[:2] == ["config", "explain"]:
        return Plan(
            "run",
            "explains a repository config",
            lambda c, x: _expect_in(_run([*_rftstream_exe(), *args]), "ok", c),
        )
    if args[:2] == ["debug", "workflow"]:

        def debug(c: Command, x: Ctx) -> None:
            model = Path(x.request.getfixturevalue("tiny_model_path"))
            cache_env = {"RFTSTREAM_CACHE": str(model.parent)}
            _run([*_rftstream_exe(), *args], timeout=180, env=cache_env)

        return Plan("run", "one task through its workflow, on the tiny model", debug)
    return Plan(
        "check",
        "parsed by rftstream's parser, its config loaded",
        lambda c, x: _check_rftstream_args(args, c.where),
    )


def _expect_in(output: str, text: str, c: Command) -> None:
    assert text in output, f"{c.where}: {text!r} not in the output:\n{output[-2000:]}"


# --- nats, nats-server ------------------------------------------------------------------------------


def _nats_names() -> SimpleNamespace:
    from rftstream import subjects
    from rftstream.subjects import RunNames

    n = RunNames(DOC_RUN)
    stage = r"[a-z0-9_-]{1,32}"
    subject_res = [
        re.escape(n.tasks_subject),
        *(re.escape(w) for w in (n.exp_wildcard, n.dlq_wildcard, n.metrics_wildcard)),
        re.escape(n.weights_wildcard),
        re.escape(n.exp_subject("raw")).replace("raw", stage),
        re.escape(n.dlq_subject("raw")).replace("raw", stage),
        re.escape(n.metrics_subject("x")).removesuffix("x") + r"[A-Za-z0-9_-]+",
    ]
    keys = [v for k, v in vars(subjects).items() if k.startswith("KV_") and isinstance(v, str)]
    key_res = [re.sub(r"\\\{[a-z_]+\\\}", r"[A-Za-z0-9_.-]+", re.escape(k)) for k in keys]
    return SimpleNamespace(
        streams=set(n.streams),
        consumers={n.trainer_consumer, n.explorer_consumer},
        bucket=n.kv_bucket,
        subject=re.compile("|".join(f"(?:{s})" for s in subject_res)),
        key=re.compile("|".join(f"(?:{k})" for k in key_res)),
    )


def _check_nats(argv: list[str], c: Command) -> None:
    """A `nats` (NATS CLI) command names what rftstream creates for the run `default`."""
    names = _nats_names()
    words: list[str] = []
    it = iter(argv)
    for word in it:
        if word in {"--server", "-s"}:
            assert next(it).startswith("nats://"), c.where
        elif word == "--translate":
            _check_rftstream_args(shlex.split(next(it))[1:], c.where)
        else:
            words.append(word)
    n = 1 if words[0] == "sub" else 2
    verb, rest = " ".join(words[:n]), words[n:]
    if verb == "stream ls":
        assert not rest, c.where
    elif verb in {"stream info", "stream view", "consumer ls"}:
        assert rest and rest[0] in names.streams, f"{c.where}: not a stream of the run: {rest}"
    elif verb == "consumer info":
        assert rest[0] in names.streams, f"{c.where}: not a stream of the run: {rest[0]}"
        assert rest[1] in names.consumers or rest[1].startswith("op_"), f"{c.where}: {rest[1]}"
    elif verb == "sub":
        assert names.subject.fullmatch(rest[0]), f"{c.where}: not a subject of the run: {rest[0]}"
    elif verb == "kv ls":
        assert rest == [names.bucket], f"{c.where}: not the run's bucket: {rest}"
    elif verb == "kv get":
        assert rest[0] == names.bucket, f"{c.where}: not the run's bucket: {rest[0]}"
        assert names.key.fullmatch(rest[1]), f"{c.where}: not a KV key rftstream writes: {rest[1]}"
    else:
        raise AssertionError(f"{c.where}: no check for `nats {verb}`: add one")


def _up_nats_hint() -> list[str]:
    """The NATS CLI lines `rftstream up` prints for the default run on its embedded server."""
    from rftstream.launch.up import nats_cli_hint
    from rftstream.subjects import RunNames

    run = SimpleNamespace(names=RunNames(DOC_RUN))
    auth = Path("runs") / DOC_RUN / "nats" / "password"
    return nats_cli_hint("nats://127.0.0.1:4222", run, auth)


def _normal(line: str) -> str:
    return " ".join(re.sub(r"nats://127\.0\.0\.1:\d+", "nats://URL", line).split())


def _check_export(c: Command) -> None:
    assert _normal(c.text) in {_normal(x) for x in _up_nats_hint()}, (
        f"{c.where}: not the line `rftstream up` prints: {c.text}"
    )


def _check_nats_server_flags(argv: list[str], c: Command) -> None:
    help_text = _nats_server_help()
    for word in argv:
        if word.startswith("-"):
            assert re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", help_text), (
                f"{c.where}: nats-server knows no flag {word}"
            )


# --- python, pip, torchrun, mkdocs, ... -------------------------------------------------------------


def _run_cluster(args: list[str], c: Command, x: Ctx) -> None:
    """`python -m rftstream.nats_server.cluster DIR &`: started (its store under tmp) until it says
    it is ready, then stopped with SIGTERM, as Ctrl-C would."""
    store = x.tmp / "cluster"
    argv = [sys.executable, "-u", *args[:-1], str(store)]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        os.set_blocking(proc.stdout.fileno(), False)
        out, deadline = b"", time.monotonic() + 60
        while b"cluster ready" not in out and time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            out += proc.stdout.read() or b""
            time.sleep(0.1)
        assert b"cluster ready" in out, f"{c.where}: {out.decode(errors='replace')}"
        assert out.count(b"nats://127.0.0.1:") >= 3, out
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, f"{c.where}: the cluster did not stop cleanly"


def _plan_python(argv: list[str]) -> Plan:
    args = argv[1:]
    if args[:2] == ["-m", "venv"]:
        return Plan(
            "run",
            "makes a venv (into tmp, without pip)",
            lambda c, x: _run([sys.executable, "-m", "venv", "--without-pip", str(x.tmp / "venv")]),
        )
    if args[:2] == ["-m", "rftstream.nats_server.cluster"]:
        return Plan(
            "run", "started until ready, then stopped", lambda c, x: _run_cluster(args, c, x)
        )
    if args[:1] == ["-c"]:
        return Plan("run", "runs", lambda c, x: _run([sys.executable, *args]))
    if args and args[0].endswith(".py"):
        script = ROOT / args[0]
        return Plan(
            "check",
            "the script answers --help",
            lambda c, x: _run([sys.executable, str(script), "--help"], timeout=120),
        )
    if args[:1] == ["-m"]:
        return Plan(
            "check",
            "the module exists",
            lambda c, x: (
                importlib.util.find_spec(args[1]) or pytest.fail(f"{c.where}: no {args[1]}")
            ),
        )
    raise AssertionError(f"no plan for python {shlex.join(args)}")


def _check_pip(argv: list[str], c: Command) -> None:
    assert argv[1] == "install", f"{c.where}: pip {argv[1]}"
    for word in argv[2:]:
        if word.startswith("-"):
            continue
        m = re.fullmatch(r"(?P<name>[A-Za-z0-9_.-]+)(?:\[(?P<extras>[^\]]+)\])?(?P<spec>.*)", word)
        assert m, f"{c.where}: {word}"
        name, extras = m.group("name"), m.group("extras")
        if name in {".", "rftstream"}:
            missing = set((extras or "").split(",")) - _extras() - {""}
            assert not missing, f"{c.where}: pyproject.toml has no extra {missing}"
        else:
            importlib.metadata.version(name)  # installed by setup


def _check_torchrun(argv: list[str], c: Command) -> None:
    from torch.distributed.run import get_args_parser

    ns = get_args_parser().parse_args(argv[1:])
    assert ns.module and ns.training_script == "rftstream.cli", f"{c.where}: {argv}"
    _check_rftstream_args(list(ns.training_script_args), c.where)


def _check_srun(argv: list[str], c: Command) -> None:
    """``srun [--opt=value ...] python -m rftstream.cli ...``: rftstream's arguments parse
    (srun's own options must be written ``--opt=value``)."""
    rest = argv[1:]
    while rest and rest[0].startswith("-"):
        rest = rest[1:]
    assert rest[:3] == ["python", "-m", "rftstream.cli"] or rest[:1] == ["rftstream"], (
        f"{c.where}: srun runs {rest[:3]}, not rftstream"
    )
    _check_rftstream_args(rest[3:] if rest[0] == "python" else rest[1:], c.where)


def _run_source(argv: list[str], c: Command) -> None:
    assert argv[1] == ".venv/bin/activate", c.where
    out = _run(
        ["bash", "-c", f"source {shlex.quote(str(_tool('activate')))} && command -v rftstream"]
    )
    assert out.strip() == str(BIN / "rftstream"), out


def _plan_mkdocs(args: list[str]) -> Plan:
    if args[:1] == ["build"]:
        return Plan(
            "run",
            "builds the site (into tmp)",
            lambda c, x: _run(
                [sys.executable, "-m", "mkdocs", *args, "--site-dir", str(x.tmp / "site")],
                timeout=300,
            ),
        )
    return Plan(
        "check",
        "answers --help",
        lambda c, x: _run([sys.executable, "-m", "mkdocs", *args, "--help"]),
    )


def plan(c: Command) -> Plan:
    """How ``c`` is run or checked here. Raises when no handler knows it."""
    argv = list(c.argv)
    while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
        argv.pop(0)  # VAR=value before a command, or an assignment alone
    if not argv:
        return Plan("check", "a shell assignment (bash -n)", lambda c, x: None)
    prog = _program(tuple(argv))
    args = argv[1:]
    if prog == "export":
        return Plan("check", "the line `rftstream up` prints", lambda c, x: _check_export(c))
    if prog == "rftstream":
        return _plan_rftstream(args)
    if prog == "just":
        if args in (["--list"], ["--summary"]):
            return Plan("run", args[0], lambda c, x: _run([str(_tool("just")), *args]))
        recipe = next(a for a in args if not a.startswith("-"))
        return Plan(
            "check",
            "a recipe of `just --summary`",
            lambda c, x: recipe in _just_recipes() or pytest.fail(f"{c.where}: no recipe {recipe}"),
        )
    if prog in {"python", "python3"}:
        return _plan_python(argv)
    if prog in {"pip", "pip3"}:
        return Plan("check", "extras exist, packages installed", lambda c, x: _check_pip(argv, c))
    if prog == "nats":
        return Plan("check", "names rftstream creates", lambda c, x: _check_nats(args, c))
    if prog == "nats-server":
        return Plan(
            "check", "flags nats-server knows", lambda c, x: _check_nats_server_flags(args, c)
        )
    if prog == "torchrun":
        return Plan(
            "check",
            "parsed by torchrun's and rftstream's parsers",
            lambda c, x: _check_torchrun(argv, c),
        )
    if prog == "srun":
        return Plan(
            "check", "what it runs parsed by rftstream's parser", lambda c, x: _check_srun(argv, c)
        )
    if prog == "source":
        return Plan("run", "activates the venv", lambda c, x: _run_source(argv, c))
    if prog == "mkdocs":
        return _plan_mkdocs(args)
    raise AssertionError(
        f"{c.where}: no way to run or check `{prog}` here: add one to {Path(__file__).name}, "
        "or mark the block <!-- not-run: why -->"
    )


# --- the tests ---------------------------------------------------------------------------------------


def test_every_command_is_run_or_checked() -> None:
    """Every command of every unmarked block has a plan; few blocks are marked not-run, each
    saying why. Prints the tally (pytest -s)."""
    from collections import Counter

    tally: Counter[tuple[str, str]] = Counter()
    for block in CHECKED_BLOCKS:
        cmds = commands(block)
        assert cmds, f"{block.where}: a bash block without a command"
        for c in cmds:
            p = plan(c)
            tally[p.kind, p.how] += 1
    for block in NOT_RUN_BLOCKS:
        assert block.reason, f"{block.where}: <!-- not-run: ... --> must say why"
    share = len(NOT_RUN_BLOCKS) / max(1, len(BASH_BLOCKS))
    assert share <= MAX_NOT_RUN_SHARE, [f"{b.where}: {b.reason}" for b in NOT_RUN_BLOCKS]
    runs = sum(n for (kind, _), n in tally.items() if kind == "run")
    print(
        f"\ndoc command blocks: {len(BASH_BLOCKS)} ({len(NOT_RUN_BLOCKS)} not run); commands "
        f"run {runs}, checked {sum(tally.values()) - runs}"
        + "".join(f"\n  {n:3d} {kind:5s} {how}" for (kind, how), n in sorted(tally.items()))
        + "".join(f"\n  not run: {b.where}: {b.reason}" for b in NOT_RUN_BLOCKS)
    )
    assert runs >= 5


_RAN: set[tuple[str, ...]] = set()  # commands run for real (and passed) this session


@pytest.mark.parametrize("block", CHECKED_BLOCKS, ids=[b.where for b in CHECKED_BLOCKS])
def test_command_block(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository
    monkeypatch.setenv("RFTSTREAM_CHECKPOINTS", str(tmp_path / "ckpt"))
    _run(["bash", "-n", "-c", shell_text(block)])
    ctx = Ctx(tmp_path, request)
    for c in commands(block):
        p = plan(c)
        if p.kind == "run" and c.argv in _RAN:  # the same command in another block: ran once
            continue
        p.act(c, ctx)
        _RAN.add(c.argv)


def test_the_nats_commands_up_prints_are_in_the_docs() -> None:
    """What `rftstream up` prints for the NATS CLI is what the docs show (with the run's
    names), so a renamed stream or consumer shows up here."""
    documented = {_normal(c.text) for b in CHECKED_BLOCKS for c in commands(b)}
    missing = [line for line in _up_nats_hint() if _normal(line) not in documented]
    assert not missing, missing


@pytest.mark.parametrize("block", CONF_BLOCKS, ids=[b.where for b in CONF_BLOCKS])
def test_nats_server_configs_are_valid(block: Block, tmp_path: Path) -> None:
    conf = tmp_path / "nats-server.conf"
    conf.write_text(block.text)
    env = {v: "doc-secret" for v in re.findall(r"\$([A-Z][A-Z0-9_]*)", block.text)}
    _run([str(_tool("nats-server")), "-c", str(conf), "-t"], env=env)


PYTHON_BLOCKS = [b for b in all_blocks() if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_blocks_run(block: Block) -> None:
    """A Python block runs as it is; a fragment's imports do."""
    code = block.text
    if block.marker == "fragment":
        code = "\n".join(
            line for line in code.splitlines() if re.match(r"(from \S+ )?import ", line)
        )
    _run([sys.executable, "-c", code], timeout=120)
