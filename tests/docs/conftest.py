"""The documentation tests' summary line: how many code blocks this run executed."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    module = __import__("sys").modules.get("tests.docs.test_code_blocks")
    if module is None:
        return
    n = module.EXECUTED
    if not any(n.values()):
        return
    terminalreporter.write_line(
        f"docs: {n['python'] + n['bash']} code blocks executed ({n['python']} python, {n['bash']} bash), "
        f"{n['file']} file blocks written, {n['skipped']} marked no-run")
