"""docs/reference/cli.md is generated from the argument parsers and must match them."""

from __future__ import annotations

import importlib.util
import re

from tests.docs import blocks

SCRIPT = blocks.REPO / "docs" / "_gen" / "cli_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("cli_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_cli_page_matches_the_parsers():
    gen = _generator()
    assert gen.PAGE.read_text(encoding="utf-8") == gen.render(), (
        "docs/reference/cli.md is stale: run python docs/_gen/cli_reference.py")


def test_the_cli_page_names_every_subcommand_and_option():
    import argparse

    from xshare.cli.main import build_parser

    page = _generator().render()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        section = page.split(f"## xshare {name}\n", 1)[1].split("\n## ", 1)[0]
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert re.search(rf"`{re.escape(option)}`", section), f"xshare {name} {option}"
