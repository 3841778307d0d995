"""Run untrusted Python in a subprocess with wall-time, CPU, memory and output limits.

:func:`run_python` writes the code to ``main.py`` in a fresh temporary
directory, runs it there with the current interpreter in isolated mode
(``python -I``: no ``PYTHON*`` variables, no user site, no script directory
tricks) and returns a :class:`SandboxResult` (stdout, stderr, exit code,
timeout / memory / output-limit flags, duration). The child:

* gets a minimal environment (``PATH``, ``LANG``, ``HOME``/``TMPDIR`` = its
  directory, one-thread BLAS settings, plus ``env``): nothing of the parent's
  environment, so no tokens, keys or credentials, is inherited;
* runs in its own session (process group), killed as a whole (``SIGKILL``)
  when ``timeout`` seconds of wall time have passed;
* has ``resource.setrlimit`` limits, set by a small bootstrap interpreter
  that then ``exec``s the real one on ``main.py`` (limits survive ``exec``):
  ``RLIMIT_AS`` = ``memory_limit_mb`` (allocations beyond it fail with
  ``MemoryError``), ``RLIMIT_CPU`` = ``cpu_time_limit`` (default: ``timeout``
  rounded up, plus one second), ``RLIMIT_FSIZE`` = ``max_output_bytes`` (for
  every file it writes, its stdout and stderr included: they go to files,
  so an endless ``print`` loop cannot fill the parent's memory), ``RLIMIT_CORE`` = 0.
  Not a ``preexec_fn``: forking with one takes the import lock and the
  ``logging`` lock in the parent, and deadlocks with another thread that
  imports while it logs (DeepSpeed's start-up does);
* its directory is deleted afterwards.

This contains accidents (endless loops, runaway allocations, floods of
output, stray files), not attackers: the code runs as the same user with
network and file-system access. Run the explorer in a container or VM when
the code comes from a model you do not trust.

:func:`run_python` blocks (up to ``timeout`` plus a little); async code calls
:func:`run_python_async`, which runs it in a worker thread. If that caller is
cancelled, the thread is abandoned and the child still ends at its timeout.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.lowlevel import RunVar

__all__ = ["SandboxResult", "run_python", "run_python_async"]

_SANDBOX_THREADS = 32  # concurrent sandbox runs per event loop (each is a child process)
_limiter_var: RunVar[anyio.CapacityLimiter] = RunVar("rftstream_sandbox_limiter")


@dataclass
class SandboxResult:
    """What a sandboxed run did.

    ``exit_code`` is the child's return code (negative: killed by that
    signal; ``None``: it could not be started). ``timed_out``: the wall-time
    or CPU-time limit ended it. ``memory_exceeded``: it died of
    ``MemoryError`` under the memory limit. ``output_truncated``: stdout or
    stderr reached ``max_output_bytes`` (the child was stopped by
    ``SIGXFSZ`` if it went on writing).
    """

    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    output_truncated: bool = False
    duration: float = 0.0

    @property
    def ok(self) -> bool:
        """Exited with status 0 within its limits."""
        return self.exit_code == 0 and not self.timed_out and not self.memory_exceeded


# Runs in the child: set the limits (argv: memory, cpu, fsize; "-" for none), then
# exec the interpreter on the rest of argv (``main.py`` and its arguments).
_BOOTSTRAP = """\
import os, resource, sys
_, memory, cpu, fsize, *rest = sys.argv
if memory != "-":
    resource.setrlimit(resource.RLIMIT_AS, (int(memory), int(memory)))
if cpu != "-":
    resource.setrlimit(resource.RLIMIT_CPU, (int(cpu), int(cpu) + 1))
if fsize != "-":
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(fsize), int(fsize)))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", *rest])
"""


def _limited_command(
    python: str,
    memory_bytes: int | None,
    cpu_seconds: int | None,
    fsize_bytes: int | None,
    script: list[str],
) -> list[str]:
    """``python`` running ``script`` (``main.py`` and its arguments) under the limits."""
    limits = ["-" if v is None else str(v) for v in (memory_bytes, cpu_seconds, fsize_bytes)]
    return [python, "-I", "-c", _BOOTSTRAP, *limits, *script]


def _child_env(home: Path, extra: dict[str, str] | None) -> dict[str, str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": str(home),
        "TMPDIR": str(home),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    if extra:
        env.update({str(k): str(v) for k, v in extra.items()})
    return env


def _read(path: Path, limit: int) -> tuple[str, bool]:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return "", False
    return data[:limit].decode("utf-8", errors="replace"), len(data) >= limit


def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout: float = 5.0,
    memory_limit_mb: int | None = 512,
    cpu_time_limit: float | None = None,
    max_output_bytes: int = 1 << 20,
    files: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
    python: str | None = None,
) -> SandboxResult:
    """Run ``code`` as ``main.py`` in a fresh directory under the limits above. Blocks.

    ``files`` are written next to it first (relative names only); ``args``
    become ``sys.argv[1:]``; ``stdin`` is fed to it. ``memory_limit_mb=None``
    or ``cpu_time_limit=0`` lift that limit. Never raises for anything the
    code does; raises ``ValueError`` for bad arguments.
    """
    if timeout <= 0:
        raise ValueError(f"sandbox timeout must be > 0, got {timeout}")
    if max_output_bytes <= 0:
        raise ValueError(f"sandbox max_output_bytes must be > 0, got {max_output_bytes}")
    cpu = cpu_time_limit if cpu_time_limit is not None else math.ceil(timeout) + 1
    cpu_seconds = max(1, math.ceil(cpu)) if cpu else None
    memory_bytes = int(memory_limit_mb) * (1 << 20) if memory_limit_mb else None

    root = Path(tempfile.mkdtemp(prefix="rft-sandbox-"))
    try:
        work = root / "work"
        work.mkdir()
        (work / "main.py").write_text(code, encoding="utf-8")
        for name, content in (files or {}).items():
            target = (work / name).resolve()
            if work.resolve() not in target.parents:
                raise ValueError(f"sandbox file name must be relative and inside: {name!r}")
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        (root / "stdin").write_text(stdin, encoding="utf-8")
        out_path, err_path = root / "stdout", root / "stderr"
        cmd = _limited_command(
            python or sys.executable,
            memory_bytes,
            cpu_seconds,
            max_output_bytes,
            ["main.py", *(args or [])],
        )
        t0 = time.perf_counter()
        result = SandboxResult()
        with (
            open(root / "stdin", "rb") as fin,
            open(out_path, "wb") as fout,
            open(err_path, "wb") as ferr,
        ):
            try:
                proc = subprocess.Popen(
                    cmd,
                    cwd=work,
                    env=_child_env(work, env),
                    stdin=fin,
                    stdout=fout,
                    stderr=ferr,
                    close_fds=True,
                    start_new_session=True,
                )
            except OSError as exc:
                return SandboxResult(stderr=f"could not start the sandbox: {exc}", duration=0.0)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                result.timed_out = True
                _kill_group(proc)
                proc.wait()
            finally:
                if proc.poll() is None:  # cancelled or interrupted while waiting
                    _kill_group(proc)
                    proc.wait()
        result.duration = time.perf_counter() - t0
        result.exit_code = proc.returncode
        result.stdout, trunc_out = _read(out_path, max_output_bytes)
        result.stderr, trunc_err = _read(err_path, max_output_bytes)
        result.output_truncated = trunc_out or trunc_err or proc.returncode == -signal.SIGXFSZ
        if proc.returncode == -signal.SIGXCPU:
            result.timed_out = True  # the soft CPU limit (the hard one is a SIGKILL, second below)
        elif proc.returncode == -signal.SIGKILL and cpu_seconds is not None:
            result.timed_out = (
                True  # not killed by us, so by the hard CPU limit (or the OOM killer)
            )
        result.memory_exceeded = memory_bytes is not None and "MemoryError" in result.stderr[-4096:]
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass


def _sandbox_limiter() -> anyio.CapacityLimiter:
    try:
        return _limiter_var.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(_SANDBOX_THREADS)
        _limiter_var.set(limiter)
        return limiter


async def run_python_async(code: str, **kwargs: object) -> SandboxResult:
    """:func:`run_python` in a worker thread (at most 32 at once); see the module docstring."""
    return await anyio.to_thread.run_sync(
        lambda: run_python(code, **kwargs),  # type: ignore[arg-type]
        abandon_on_cancel=True,
        limiter=_sandbox_limiter(),
    )
