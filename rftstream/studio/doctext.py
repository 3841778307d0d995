"""Docstring markup (reStructuredText, as the config schema's docstrings write it) as
readable text for the studio's form.

Pure functions, no I/O. :func:`doc_parts` splits a docstring into runs of plain text
and code: ````name```` and ```name``` become code, Sphinx roles become the code of
what they name (``:class:`~a.b.C``` -> ``C``, ``:mod:`a.b``` -> ``a.b``, ``:func:`T
<a.f>``` -> ``T``). The page builds one DOM node per part (a text node or a
``<code>`` element, its text set with ``textContent``), so nothing in a docstring is
ever parsed as HTML (``<RUN>`` and ``&`` show as written).
"""

from __future__ import annotations

import re
from typing import Literal

__all__ = ["DocPart", "doc_parts", "doc_plain"]

DocKind = Literal["text", "code"]
DocPart = tuple[DocKind, str]

# one alternation, tried left to right at each position: an inline literal first (it may
# hold single backquotes), then a role (``:py:class:`...```), then interpreted text
# (```name```, ```name`_`` a hyperlink reference: plain text)
_MARKUP = re.compile(
    r"``(?P<literal>.+?)``"
    r"|:(?P<role>[A-Za-z][\w+-]*(?::[A-Za-z][\w+-]*)*):`(?P<target>[^`]+)`"
    r"|`(?P<single>[^`]+)`(?P<link>__?)?"
)
# an explicit title: ``:func:`the title <a.b.f>```
_TITLED = re.compile(r"^(?P<title>.*?)\s*<(?P<target>[^<>]+)>$", re.DOTALL)


def _role_text(target: str) -> str:
    """What a role shows: the explicit title, else the target (``~``: only its last
    dotted name; a leading ``!``, no link, dropped)."""
    target = target.strip()
    titled = _TITLED.match(target)
    if titled and titled.group("title"):
        return titled.group("title")
    if titled:
        target = titled.group("target").strip()
    target = target.lstrip("!")
    if target.startswith("~"):
        target = target[1:].rsplit(".", 1)[-1]
    return target


def doc_parts(text: str) -> list[DocPart]:
    """``text`` (a docstring) as ``[(kind, text), ...]``: ``"text"`` runs and ``"code"``
    runs, whitespace collapsed to single spaces, adjacent text runs merged, no empty run.
    Unmatched backquotes stay as they are; ``<`` and ``&`` are kept verbatim (the caller
    escapes, or sets them as DOM text)."""
    text = " ".join(text.split())
    parts: list[DocPart] = []

    def add(kind: DocKind, s: str) -> None:
        if not s:
            return
        if kind == "text" and parts and parts[-1][0] == "text":
            parts[-1] = ("text", parts[-1][1] + s)
        else:
            parts.append((kind, s))

    pos = 0
    for m in _MARKUP.finditer(text):
        add("text", text[pos : m.start()])
        pos = m.end()
        if m.group("literal") is not None:
            add("code", m.group("literal"))
        elif m.group("role") is not None:
            add("code", _role_text(m.group("target")))
        elif m.group("link"):
            add("text", _role_text(m.group("single")))
        else:
            add("code", m.group("single"))
    add("text", text[pos:])
    return parts


def doc_plain(text: str) -> str:
    """``text`` with its markup removed (code runs as their bare text)."""
    return "".join(s for _, s in doc_parts(text))
