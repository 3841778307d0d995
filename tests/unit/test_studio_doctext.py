"""Units: docstring markup as the studio's form shows it (text runs and code runs)."""

from __future__ import annotations

import inspect
import re

import msgspec
import pytest

import rftstream.config.schema as schema
from rftstream.studio.doctext import doc_parts, doc_plain
from rftstream.studio.forms import form_sections

LEFTOVER = re.compile(r"``|:[a-z]+(:[a-z]+)*:`")  # an inline literal or a role left as markup


@pytest.mark.parametrize(
    ("text", "parts"),
    [
        ("``name``: the run", [("code", "name"), ("text", ": the run")]),
        ("see :class:`~a.b.C`.", [("text", "see "), ("code", "C"), ("text", ".")]),
        ("see :class:`a.b.C`", [("text", "see "), ("code", "a.b.C")]),
        (":mod:`rftstream.weights`", [("code", "rftstream.weights")]),
        (
            ":func:`~rftstream.presentation.plot.ema` and :meth:`RunLock.update`",
            [
                ("code", "ema"),
                ("text", " and "),
                ("code", "RunLock.update"),
            ],
        ),
        (":py:class:`~x.Y`", [("code", "Y")]),
        (":data:`!NOLINK`", [("code", "NOLINK")]),
        (":func:`the loader <rftstream.config.load_config>`", [("code", "the loader")]),
        (":func:`<rftstream.config.load_config>`", [("code", "rftstream.config.load_config")]),
        ("`single` quotes", [("code", "single"), ("text", " quotes")]),
        ("a `link`_ here", [("text", "a link here")]),
        # a literal may hold single backquotes
        ("``a `b` c``", [("code", "a `b` c")]),
        # unmatched backquotes stay; whitespace (docstring indentation) collapses
        ("it's `half\n      open", [("text", "it's `half open")]),
        ("", []),
    ],
)
def test_markup_becomes_text_and_code_runs(text: str, parts: list[tuple[str, str]]) -> None:
    assert doc_parts(text) == parts


def test_html_characters_stay_verbatim_for_the_page_to_set_as_text() -> None:
    # the page sets each run with textContent, so <, > and & are never parsed as HTML
    parts = doc_parts("``RFT_<RUN>_WEIGHTS`` & <b>not bold</b> ``a&amp;b``")
    assert parts == [
        ("code", "RFT_<RUN>_WEIGHTS"),
        ("text", " & <b>not bold</b> "),
        ("code", "a&amp;b"),
    ]
    assert doc_plain(":class:`~x.Y` & <z>") == "Y & <z>"


def test_no_schema_docstring_shows_markup() -> None:
    """Every config Struct's docstring, and every form section's help, reads as plain text
    and code: no double backquotes or roles left in any run."""
    structs = [
        cls
        for _, cls in inspect.getmembers(schema, inspect.isclass)
        if issubclass(cls, msgspec.Struct) and cls.__doc__
    ]
    assert len(structs) > 20
    for cls in structs:
        for kind, text in doc_parts(cls.__doc__ or ""):
            assert not LEFTOVER.search(text), (cls.__name__, kind, text)
    sections = {s.key: s for s in form_sections()}
    sync = sections["synchronizer"]
    assert ("code", "RFT_<RUN>_WEIGHTS") in sync.help_parts
    assert ("code", "rftstream.weights") in sync.help_parts  # a :mod: role
    assert ("code", "LoRAConfig") in sections["model"].help_parts  # a :class: role
    for s in sections.values():
        assert s.help == "".join(text for _, text in s.help_parts)
        assert not LEFTOVER.search(s.help), s.key
        assert "`" not in s.help, s.key
