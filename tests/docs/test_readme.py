"""What the README promises a newcomer stays true: short, the two commands exactly as CI runs
them, a layout table that matches the package tree, and links that resolve."""

from __future__ import annotations

import re

from tests.docs import blocks

REPO = blocks.REPO
README = (REPO / "README.md").read_text(encoding="utf-8")
MAIN_JOB = ("python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
            "xshare launch examples/sweep.toml")
TESTS = ("python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[test]' && "
         "python -m pytest -q")


def test_readme_reads_in_two_minutes():
    assert len(README.encode()) <= 8 * 1024, f"README.md is {len(README.encode())} bytes; keep it under 8 KiB"


def test_the_two_commands_are_there_and_ci_runs_the_test_command():
    shell = [b.code.strip() for b in blocks.parse(REPO / "README.md") if b.kind == "bash"]
    assert MAIN_JOB in shell and TESTS in shell
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert TESTS in ci.splitlines(), ".ci/run must run exactly the README's test command"


def test_the_layout_table_matches_the_package_tree():
    listed = set(re.findall(r"^\| `([^`]+)/` \|", README, flags=re.M))
    inits = [*(REPO / "xshare").glob("*/__init__.py"), *(REPO / "xshare" / "runtime").glob("*/__init__.py")]
    packages = {p.parent.relative_to(REPO).as_posix() for p in inits}
    top = {"xshare", "models", "examples", "benchmarks", "docs", "tests"}
    assert packages | top == listed, (
        f"README's layout table lists {sorted(listed)}; the tree has {sorted(packages | top)}")


def test_relative_links_resolve():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if "://" in target:
            continue
        assert (REPO / target).exists(), f"README links to {target}, which does not exist"
