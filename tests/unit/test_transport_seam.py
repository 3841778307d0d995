"""Only the NATS transport package imports nats-py: everything else in rftstream goes
through :mod:`rftstream.bus.transport` (and so runs on the in-memory transport too)."""

from __future__ import annotations

import ast
from pathlib import Path

import rftstream

ROOT = Path(rftstream.__file__).parent
NATS_PACKAGE = ROOT / "bus" / "jetstream"


def _imports_nats(tree: ast.AST) -> list[int]:
    """Line numbers of every ``import nats...`` / ``from nats... import`` (at any depth:
    inside functions and TYPE_CHECKING blocks too)."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(name == "nats" or name.startswith("nats.") for name in names):
            lines.append(node.lineno)
    return lines


def test_only_the_nats_transport_imports_nats() -> None:
    offenders = {}
    for path in sorted(ROOT.rglob("*.py")):
        if NATS_PACKAGE in path.parents:
            continue
        lines = _imports_nats(ast.parse(path.read_text(), str(path)))
        if lines:
            offenders[str(path.relative_to(ROOT.parent))] = lines
    assert offenders == {}, f"nats imported outside {NATS_PACKAGE.relative_to(ROOT.parent)}"


def test_the_check_sees_every_kind_of_nats_import() -> None:
    src = (
        "import nats\n"
        "import nats.js.errors as e\n"
        "from nats.aio.msg import Msg\n"
        "def f():\n"
        "    from nats import js\n"
        "import natsort\n"
        "from .nats import x\n"
    )
    assert _imports_nats(ast.parse(src)) == [1, 2, 3, 5]
    assert _imports_nats(ast.parse((NATS_PACKAGE / "transport.py").read_text()))
