"""The code blocks of the documentation (docs/**/*.md and README.md), as the test suite runs them.

The convention every page follows (docs/contributing.md says it to writers):

- a fenced ```python block runs; a page's python blocks run in order in one namespace, in a
  fresh temporary directory of the page's own, like a reader pasting them into one session;
- a fenced ```bash (or ```sh / ```shell) block runs in that same directory with ``bash -e``;
- a block whose fence carries ``title="NAME"`` (mkdocs-material's file caption, e.g.
  ```toml title="sweep.toml") is a file the reader saves: it is written to NAME, not run, and a
  later block of the page must use it;
- ``<!-- no-run: REASON -->`` on the line before a fence skips that block (a GPU, a cluster, a
  server that runs until stopped); REASON is required;
- ``<!-- slow -->`` on the line before a fence marks a block that takes more than a few
  seconds (``pytest.mark.slow``: the full run runs it, ``-m "not slow"`` leaves it out); put
  such blocks where no later block of the page needs what they make;
- ``<!-- background: READY -->`` on the line before a ```bash fence starts it in the background
  (a server: ``xshare serve``) and goes on once its output shows READY; it is stopped with
  SIGINT when its page's blocks are done (or at the end of the run);
- any other fence (```text, ```console, ```toml without a title, ...) is prose.

Parsing is plain text and tolerant of what other writers add (indented fences inside lists,
admonitions and content tabs, ~~~ fences, longer fences, attribute lists).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUN_PYTHON = {"python", "py", "python3"}
RUN_SHELL = {"bash", "sh", "shell"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_NO_RUN = re.compile(r"^\s*<!--\s*no-run\s*:\s*(?P<reason>.*?)\s*-->\s*$")
# a line that is only an HTML comment mentioning no-run (prose that quotes the marker inline is not)
_NO_RUN_LOOSE = re.compile(r"^\s*<!--.*\bno[-_ ]?run\b.*-->\s*$", re.IGNORECASE)
_SLOW = re.compile(r"^\s*<!--\s*slow\s*-->\s*$")
_BACKGROUND = re.compile(r"^\s*<!--\s*background\s*:\s*(?P<ready>.*?)\s*-->\s*$")
_TITLE = re.compile(r"""title\s*=\s*(?:"([^"]*)"|'([^']*)')""")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str          # path relative to the repository, e.g. "docs/tutorials/first-shared-device.md"
    line: int          # 1-based line of the opening fence
    lang: str          # the info string's first word, lower case ("" if none)
    title: str | None  # title="NAME" of a file block
    code: str
    skip: str | None   # the no-run reason, if any
    slow: bool = False  # <!-- slow -->: left out of `pytest -m "not slow"`
    background: str | None = None  # <!-- background: READY -->: a server, started and left running

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def kind(self) -> str:
        """'file', 'python', 'bash', or 'prose'."""
        if self.title:
            return "file"
        if self.lang in RUN_PYTHON:
            return "python"
        if self.lang in RUN_SHELL:
            return "bash"
        return "prose"


class MarkerError(ValueError):
    """A no-run marker that is malformed (no reason, or not in front of a fence)."""


def pages(repo: Path = REPO) -> list[Path]:
    docs = sorted((repo / "docs").rglob("*.md")) if (repo / "docs").is_dir() else []
    readme = repo / "README.md"
    return ([readme] if readme.is_file() else []) + docs


def parse(path: Path, repo: Path = REPO) -> list[Block]:
    """Every fenced block of one markdown file, in order."""
    rel = path.relative_to(repo).as_posix()
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m or m["info"].strip().startswith(("`", "~")):
            _check_stray_marker(rel, lines, i)
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and set(close) == {fence[0]}:
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        i += 1  # past the closing fence (or the end of an unclosed one: markdown closes it there)
        lang = re.split(r"[\s{]", info.lstrip("{. "), maxsplit=1)[0].lower() if info else ""
        title = _TITLE.search(info)
        skip, slow, background = _markers(rel, lines, start)
        blocks.append(Block(page=rel, line=start + 1, lang=lang,
                            title=(title[1] or title[2]) if title else None,
                            code="\n".join(body) + "\n", skip=skip, slow=slow, background=background))
    return blocks


def _markers(rel: str, lines: list[str], fence: int) -> tuple[str | None, bool, str | None]:
    """(no-run reason, slow, background ready text) from the HTML comment lines right above
    the fence at ``fence``."""
    j = fence - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    reason, slow, background = None, False, None
    while j >= 0 and lines[j].strip().startswith("<!--") and lines[j].strip().endswith("-->"):
        m = _NO_RUN.match(lines[j])
        if m:
            if not m["reason"]:
                raise MarkerError(f"{rel}:{j + 1}: '<!-- no-run: -->' needs a reason after the colon, "
                                  "e.g. '<!-- no-run: needs a GPU -->'")
            reason = m["reason"]
        elif _SLOW.match(lines[j]):
            slow = True
        elif _BACKGROUND.match(lines[j]):
            background = _BACKGROUND.match(lines[j])["ready"]
            if not background:
                raise MarkerError(f"{rel}:{j + 1}: '<!-- background: -->' needs the text the server "
                                  "prints when it is ready, e.g. '<!-- background: listening on -->'")
        elif _NO_RUN_LOOSE.search(lines[j]):
            raise MarkerError(f"{rel}:{j + 1}: {lines[j].strip()!r} is not a no-run marker; write it "
                              "exactly as '<!-- no-run: REASON -->' on the line before the fence")
        j -= 1
    return reason, slow, background


def _check_stray_marker(rel: str, lines: list[str], i: int) -> None:
    """A no-run marker must sit right before a fence, or it silently skips nothing."""
    if not _NO_RUN_LOOSE.search(lines[i]):
        return
    j = i + 1
    while j < len(lines) and not lines[j].strip():
        j += 1
    if j >= len(lines) or not _FENCE.match(lines[j]):
        raise MarkerError(f"{rel}:{i + 1}: a no-run marker that is not followed by a code fence")


def collect(repo: Path = REPO) -> list[Block]:
    return [b for page in pages(repo) for b in parse(page, repo)]


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.kind != "prose"]
