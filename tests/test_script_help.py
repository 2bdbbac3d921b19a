"""Every argparse script prints its `--help`, subcommands included.

argparse expands `%` in help strings (`%(default)s`), so a literal `%` in a help text turns
`--help` into a traceback. Each script runs in this process until it calls `parse_args`; the parser
it built is then formatted whole, with every subcommand's parser. Nothing else of the script runs.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import runpy
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(p for p in (ROOT / "scripts").glob("*.py") if "ArgumentParser(" in p.read_text())


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__("parse_args reached")
        self.parser = parser


def _subparsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += [sub, *_subparsers(sub)]
    return found


def _parser_of(script: pathlib.Path, monkeypatch) -> argparse.ArgumentParser:
    def stop(self, *args, **kwargs):
        raise _Parsed(self)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", stop)
    monkeypatch.setattr(sys, "argv", [str(script)])
    monkeypatch.setattr(
        os, "environ", dict(os.environ)
    )  # scripts may set flags before importing jax
    monkeypatch.setattr(
        sys, "path", [str(script.parent), *sys.path]
    )  # as `python scripts/X.py` has
    with pytest.raises(_Parsed) as parsed:
        runpy.run_path(str(script), run_name="__main__")
    return parsed.value.parser


def test_every_argparse_script_is_listed():
    names = {p.name for p in SCRIPTS}
    assert {"launch.py", "hf.py", "ckpt.py", "sample.py", "eval.py"} <= names, names


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_help_formats(script, monkeypatch):
    parser = _parser_of(script, monkeypatch)
    for p in [parser, *_subparsers(parser)]:
        text = p.format_help()
        assert text.startswith("usage:"), text[:200]


def test_a_bare_percent_in_help_is_what_this_catches():
    parser = argparse.ArgumentParser(prog="x")
    parser.add_argument("--loss", help="e.g. loss=0.1%]")
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
