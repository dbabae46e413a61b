"""Every code block of docs/ and README.md runs, so the documentation cannot rot.

One test per block (id ``page:line``, so a failure names the block); the convention is in
``tests/docs/blocks.py``. A page's blocks share one directory (a fresh one per page, holding a
copy of the repository's ``examples/`` as a reader's checkout would) and one Python namespace,
and run in order: selecting a single block with ``-k`` first runs the blocks above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.docs import blocks

# A page whose markers are malformed fails its own test (below) instead of breaking collection.
ALL: list[blocks.Block] = []
BROKEN: dict[str, str] = {}
for _path in blocks.pages():
    try:
        ALL += blocks.parse(_path)
    except blocks.MarkerError as _err:
        BROKEN[_path.relative_to(blocks.REPO).as_posix()] = str(_err)
RUNNABLE = blocks.runnable(ALL)
BASH_TIMEOUT_S = 240
# Counted for the terminal summary (tests/docs/conftest.py): what this run executed.
EXECUTED: dict[str, int] = {"python": 0, "bash": 0, "file": 0, "skipped": 0}


@dataclasses.dataclass
class Page:
    dir: Path
    ns: dict[str, Any]
    ran: set[str] = dataclasses.field(default_factory=set)  # ids of the blocks that have run
    servers: list[subprocess.Popen] = dataclasses.field(default_factory=list)  # background blocks
    broken: str | None = None  # the id of a block that failed: the later ones cannot run


_PAGES: dict[str, Page] = {}


SERVER_READY_S = 180


def _start_server(block: blocks.Block, page: Page, env: dict[str, str]) -> None:
    """A ``<!-- background: READY -->`` block: start it as a reader would in another terminal
    and wait until its output shows READY."""
    log_path = page.dir / f".background-{block.line}.log"
    log = open(log_path, "w")
    proc = subprocess.Popen(["bash", "-c", "exec " + block.code.strip()], cwd=page.dir,
                            env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own group: SIGINT reaches it alone
    log.close()
    page.servers.append(proc)
    deadline = time.monotonic() + SERVER_READY_S
    while time.monotonic() < deadline:
        out = log_path.read_text(errors="replace")
        if block.background in out:
            return
        if proc.poll() is not None:
            raise AssertionError(f"{block.id}: exited {proc.returncode} before printing "
                                 f"{block.background!r}:\n{out[-3000:]}")
        time.sleep(0.2)
    raise AssertionError(f"{block.id}: no {block.background!r} within {SERVER_READY_S} s:\n"
                         f"{log_path.read_text(errors='replace')[-3000:]}")


def _stop_servers(page: Page) -> None:
    """Ctrl-C, as the reader would; SIGKILL only if it does not stop within a minute."""
    for proc in page.servers:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    page.servers.clear()


@pytest.fixture(scope="session", autouse=True)
def _servers_stop_at_the_end():
    yield
    for page in _PAGES.values():
        _stop_servers(page)


@pytest.fixture(scope="session")
def docs_env(tmp_path_factory) -> dict[str, str]:
    """Environment for every block: the venv's commands first on PATH, and a discovery
    directory and compilation cache of this test run's own (no user state read or written)."""
    root = tmp_path_factory.mktemp("docs-env")
    return {
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "XSHARE_RUNTIME_DIR": str(root / "runtimes"),
        "XSHARE_COMPILATION_CACHE": str(root / "xla-cache"),
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def _page(block: blocks.Block, tmp_path_factory) -> Page:
    page = _PAGES.get(block.page)
    if page is None:
        name = re.sub(r"[^A-Za-z0-9]+", "-", block.page).strip("-")
        d = tmp_path_factory.mktemp(name)
        shutil.copytree(blocks.REPO / "examples", d / "examples")
        page = _PAGES[block.page] = Page(dir=d, ns={"__name__": "__main__"})
    return page


@contextlib.contextmanager
def _inside(page: Page, env: dict[str, str]):
    """The reader's session: cwd = the page's directory, importable, with the docs' env."""
    old_cwd, old_env = os.getcwd(), {k: os.environ.get(k) for k in env}
    os.chdir(page.dir)
    os.environ.update(env)
    sys.path.insert(0, str(page.dir))
    try:
        yield
    finally:
        sys.path.remove(str(page.dir))
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        os.chdir(old_cwd)


def _run(block: blocks.Block, page: Page, env: dict[str, str]) -> None:
    if block.kind == "file":
        target = page.dir / block.title
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code, encoding="utf-8")
        sys.modules.pop(target.stem, None)  # a later import reads this version of the file
        EXECUTED["file"] += 1
    elif block.kind == "python":
        with _inside(page, env):
            if block.code.lstrip().startswith(">>>"):  # a session transcript: its outputs are checked
                _doctest(block, page.ns)
            else:
                exec(compile(block.code, block.id, "exec"), page.ns)
        EXECUTED["python"] += 1
    elif block.kind == "bash" and block.background:
        _start_server(block, page, env)
        EXECUTED["bash"] += 1
    elif block.kind == "bash":
        proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=page.dir,
                              env={**os.environ, **env}, capture_output=True, text=True,
                              timeout=BASH_TIMEOUT_S)
        assert proc.returncode == 0, (
            f"{block.id}: exit {proc.returncode}\n--- block ---\n{block.code}"
            f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}")
        EXECUTED["bash"] += 1


def _doctest(block: blocks.Block, ns: dict[str, Any]) -> None:
    """A ``>>>`` block runs like a doctest in the page's namespace; each shown output must match
    (whitespace-normalized, ``...`` as a wildcard)."""
    import doctest

    test = doctest.DocTestParser().get_doctest(block.code, ns, block.id, block.page, block.line)
    flags = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    runner = doctest.DocTestRunner(optionflags=flags)
    out: list[str] = []
    runner.run(test, out=out.append, clear_globs=False)
    ns.update(test.globs)  # DocTest ran on a copy; what it defined is the page's, as after exec
    assert runner.failures == 0, "".join(out)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=[pytest.mark.slow] if b.slow else [])
                                   for b in RUNNABLE])
def test_block(block: blocks.Block, docs_env, tmp_path_factory):
    if block.skip:
        EXECUTED["skipped"] += 1
        pytest.skip(f"no-run: {block.skip}")
    page = _page(block, tmp_path_factory)
    for other in _PAGES.values():  # a page's servers live while its own blocks run
        if other is not page:
            _stop_servers(other)
    if page.broken:
        pytest.fail(f"not run: {page.broken}, earlier on the page, failed")
    if block.id in page.ran:  # ran already, as a block above one selected before it
        return
    # The blocks above it first, as a reader runs them. A slow block above runs only for a slow
    # block (writers put slow blocks where no fast block after them needs what they make), so
    # `-m "not slow"` does leave their time out.
    above = [b for b in RUNNABLE if b.page == block.page and b.line < block.line
             and not b.skip and (block.slow or not b.slow)]
    for earlier in [b for b in above if b.id not in page.ran] + [block]:
        try:
            _run(earlier, page, docs_env)
        except BaseException:
            page.broken = earlier.id
            raise
        page.ran.add(earlier.id)


@pytest.mark.parametrize("block", [b for b in RUNNABLE if b.kind == "file"],
                         ids=lambda b: b.id)
def test_file_block_is_used_later_on_its_page(block: blocks.Block):
    """A file the reader saves is exercised by a block that runs after it (by name, or by
    module name for a .py file); otherwise it would be a block no test runs."""
    name = Path(block.title)
    later = [b for b in RUNNABLE if b.page == block.page and b.line > block.line and not b.skip]
    pattern = re.compile(rf"\b({re.escape(name.as_posix())}|{re.escape(name.stem)})\b")
    assert block.skip or any(pattern.search(b.code) for b in later), (
        f"{block.id}: the file {block.title!r} is used by no later block of its page")


def test_there_are_pages_and_blocks_to_run():
    assert blocks.pages(), "no documentation pages found"
    assert RUNNABLE, "no runnable code block in the documentation"


_NONE_BROKEN = pytest.param(None, marks=pytest.mark.skip("every page's markers are well formed"))


@pytest.mark.parametrize("page", sorted(BROKEN) or [_NONE_BROKEN])
def test_page_markers_are_well_formed(page):
    pytest.fail(BROKEN[page])  # a malformed no-run marker, naming the page and line


def test_the_collector_reads_the_convention(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "p.md").write_text(
        "# t\n\n```python\nx = 1\n```\n\n<!-- no-run: needs a GPU -->\n```bash\nnvidia-smi\n```\n\n"
        "- item\n\n    ```toml title=\"spec.toml\"\n    [runtime]\n    ```\n\n"
        "```text\nprose\n```\n~~~~py\ny = 2\n~~~~\n", encoding="utf-8")
    got = blocks.collect(tmp_path)
    assert [(b.line, b.kind, b.skip, b.title) for b in got] == [
        (3, "python", None, None), (8, "bash", "needs a GPU", None), (14, "file", None, "spec.toml"),
        (18, "prose", None, None), (21, "python", None, None)]
    assert got[2].code == "[runtime]\n"
    (tmp_path / "docs" / "p.md").write_text("<!-- no-run: -->\n```bash\nx\n```\n", encoding="utf-8")
    with pytest.raises(blocks.MarkerError, match=re.escape("p.md:1: '<!-- no-run: -->' needs a reason")):
        blocks.collect(tmp_path)
    (tmp_path / "docs" / "p.md").write_text("<!-- no-run: GPU -->\n\ntext\n", encoding="utf-8")
    with pytest.raises(blocks.MarkerError, match="not followed by a code fence"):
        blocks.collect(tmp_path)


def test_a_transcript_block_checks_its_outputs(tmp_path):
    ns: dict[str, Any] = {}
    good = blocks.Block("p.md", 1, "python", None, ">>> x = 2\n>>> x + 1\n3\n", None)
    _doctest(good, ns)
    assert ns["x"] == 2  # names stay in the page's namespace, for the blocks after it
    bad = blocks.Block("p.md", 5, "python", None, ">>> x + 1\n4\n", None)
    with pytest.raises(AssertionError, match=r"Expected:\s+4\s+Got:\s+3"):
        _doctest(bad, ns)
