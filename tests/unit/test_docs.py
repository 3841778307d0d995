"""The documentation: README.md is a front page, the reference is the MkDocs site under
docs/. The site builds with warnings as errors (a broken link or anchor, a page left out of
the nav), every relative link of the README and the pages reaches a file and a heading, and
every YAML block that is an rftstream config loads and validates as `rftstream config
explain` does. The code-block helpers here are shared with
tests/integration/test_doc_commands.py, which runs or checks every command block."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = sorted(DOCS.rglob("*.md"))
MARKDOWN = [README, *PAGES]

README_MAX_LINES = 160
# the quick start's two commands, exactly as benchmarks/startup.py and CI run the first
QUICK_START = (
    "python3 -m venv .venv && .venv/bin/pip install -qq rust-just && .venv/bin/just up     "
    "# set up, then `rftstream up` on the embedded default",
    "python3 -m venv .venv && .venv/bin/pip install -qq rust-just && .venv/bin/just test   "
    "# set up, then the whole test suite",
)

FENCE_RE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# an HTML comment on the line right above a fence: `<!-- not-run: why -->`, `<!-- fragment: why -->`
MARKER_RE = re.compile(r"^<!--\s*(?P<kind>[a-z-]+)\s*(?::\s*(?P<reason>.*?))?\s*-->$")
MARKERS = ("not-run", "fragment")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str  # the info string's first word: bash, yaml, python, text, ...
    info: str  # the whole info string (e.g. `text title="nats-server.conf"`)
    text: str
    marker: str | None = None  # not-run / fragment: the comment right above the fence
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def title(self) -> str:
        m = re.search(r'title="([^"]*)"', self.info)
        return m.group(1) if m else ""


def code_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, with the marker comment right above it (if any)."""
    lines = path.read_text().splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.group("fence"), m.group("info").strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{path.relative_to(ROOT)}:{start + 1}: unclosed code fence"
        i += 1
        marker = reason = None
        above = lines[start - 1].strip() if start > 0 else ""
        mm = MARKER_RE.match(above)
        if mm:
            assert mm.group("kind") in MARKERS, (
                f"{path.relative_to(ROOT)}:{start}: unknown marker {mm.group('kind')!r} "
                f"(known: {', '.join(MARKERS)})"
            )
            marker, reason = mm.group("kind"), (mm.group("reason") or "").strip()
        blocks.append(
            Block(
                path=path,
                line=start + 1,
                lang=info.split()[0] if info else "",
                info=info,
                text="\n".join(body) + "\n",
                marker=marker,
                reason=reason or "",
            )
        )
    return blocks


def all_blocks() -> list[Block]:
    return [b for path in MARKDOWN for b in code_blocks(path)]


# --- the site -----------------------------------------------------------------------------


def _nav_pages(nav: object) -> list[str]:
    """The page files a mkdocs ``nav`` names, in order."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in _nav_pages(value)]
    return []


def test_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert not re.search(r"^WARNING\b", output, re.M), output
    for page in PAGES:
        rel = page.relative_to(DOCS).with_suffix("")
        html = site / ("index.html" if rel.name == "index" else rel / "index.html")
        assert html.is_file(), f"{page.relative_to(ROOT)} was not rendered ({html})"
    assert (site / "img" / "vs_trl_accuracy.png").is_file()


def test_mkdocs_config_is_strict_and_lists_every_page() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    assert config["theme"]["name"] == "material"
    nav = _nav_pages(config["nav"])
    assert len(nav) == len(set(nav)), f"a page is in the nav twice: {nav}"
    pages = {str(p.relative_to(DOCS)) for p in PAGES}
    assert set(nav) == pages, (
        f"not in the nav: {sorted(pages - set(nav))}; in the nav, not in docs/: "
        f"{sorted(set(nav) - pages)}"
    )
    # mkdocs turns these into warnings, and --strict into errors
    assert set(config["validation"].values()) == {"warn"}
    assert {"omitted_files", "unrecognized_links", "anchors"} <= set(config["validation"])


# --- the README -----------------------------------------------------------------------------


def test_readme_is_a_front_page_with_the_two_quick_start_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"
    quick = next(b for b in code_blocks(README) if b.lang == "bash")
    assert quick.text.splitlines() == list(QUICK_START), "the quick start's first block changed"
    heading = lines.index("## Quick start")
    assert heading < quick.line, "the two commands are the Quick start section's block"
    # every page of the docs is reachable from the front page
    linked = {m.group("target").split("#")[0] for m in _links(README)}
    assert {str(p.relative_to(ROOT)) for p in PAGES} <= linked


# --- links ------------------------------------------------------------------------------------

LINK_RE = re.compile(r"!?\[(?P<text>[^\]]*)\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def _prose(path: Path, *, code_spans: bool = False) -> str:
    """The Markdown of ``path`` without code blocks, and without code spans unless
    ``code_spans`` (links in code are text)."""
    out, fence = [], None
    for line in path.read_text().splitlines():
        m = FENCE_RE.match(line)
        if fence is None and m:
            fence = m.group("fence")
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
            continue
        out.append(line if code_spans else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(out)


def _links(path: Path) -> list[re.Match[str]]:
    return list(LINK_RE.finditer(_prose(path)))


def slugify(text: str) -> str:
    """A heading's anchor as MkDocs' toc makes it (Python-Markdown's default slugify, on the
    heading's text without its code-span backticks); GitHub gives the same for headings
    without runs of punctuation."""
    from markdown.extensions.toc import slugify as md_slugify

    return md_slugify(text.replace("`", ""), "-")


def anchors(path: Path) -> set[str]:
    """The anchors of every heading of ``path`` (repeated slugs get ``_1``, ``_2``, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(path, code_spans=True).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = slugify(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}_{n}")
    return out


@pytest.mark.parametrize("path", MARKDOWN, ids=[str(p.relative_to(ROOT)) for p in MARKDOWN])
def test_relative_links_reach_a_file_and_a_heading(path: Path) -> None:
    broken = []
    for m in _links(path):
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
            continue
        if path.is_relative_to(DOCS) and not dest.is_relative_to(DOCS):
            broken.append(f"{target}: outside docs/ (name the file in a code span instead)")
            continue
        if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{path.relative_to(ROOT)}: " + "; ".join(broken)


# --- blocks -------------------------------------------------------------------------------------

COMMAND_LANGS = {"bash", "console"}
KNOWN_LANGS = COMMAND_LANGS | {"yaml", "python", "text"}


def test_every_code_block_says_what_it_holds() -> None:
    """Commands are `bash`, configs `yaml`, code `python`, output and the rest `text`: a
    block without a language would escape the checks."""
    bad = [
        f"{b.where} ({b.lang or 'no language'})" for b in all_blocks() if b.lang not in KNOWN_LANGS
    ]
    assert not bad, bad
    for b in all_blocks():
        if b.marker:
            assert b.reason, f"{b.where}: <!-- {b.marker}: ... --> must say why"
        if b.marker == "fragment":
            assert b.lang in {"yaml", "python"}, f"{b.where}: only yaml/python blocks are fragments"


YAML_BLOCKS = [b for b in all_blocks() if b.lang == "yaml"]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_yaml_blocks_are_configs_that_load(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A YAML block is an rftstream config: it loads and validates exactly as `rftstream config
    explain` (and `up --config`) do. A fragment (`<!-- fragment: why -->`, e.g. naming a CA
    file of your machine) is converted with the schema, keys and types checked, not validated."""
    from rftstream.config import load_config
    from rftstream.config.explain import explain_file

    data = yaml.safe_load(block.text)
    assert isinstance(data, dict) and data, f"{block.where}: not a mapping"
    for var in re.findall(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)", block.text):
        monkeypatch.setenv(var, "doc-secret")
    monkeypatch.setenv("RFTSTREAM_CHECKPOINTS", str(tmp_path / "ckpt"))
    monkeypatch.chdir(ROOT)  # paths in the configs are relative to the repository, as in the docs
    path = tmp_path / "config.yaml"
    path.write_text(block.text)
    if block.marker == "fragment":
        load_config(path, validate=False)
        return
    _, errors = explain_file(str(path), [])
    assert not errors, f"{block.where}: {errors}"


PYTHON_BLOCKS = [b for b in all_blocks() if b.lang == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[b.where for b in PYTHON_BLOCKS])
def test_python_blocks_compile(block: Block) -> None:
    """(tests/integration/test_doc_commands.py runs them; fragments: their imports.)"""
    import ast

    compile(block.text, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
