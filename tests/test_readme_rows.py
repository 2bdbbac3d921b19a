"""Every row of the README's parallelism table is a config that validates on the 8 devices it is
written for: the flags shown, over the config they name (configs/default.py when none)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re

import pytest

from jaxdist import config as config_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rows() -> dict[str, str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("## Choosing a parallelism strategy", 1)[1].split("\n\n", 3)[2]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`--config"):
            rows[cells[0]] = cells[1].strip("`")
    return rows


ROWS = _rows()


def _config(flags: str):
    path = (re.findall(r"--config=(\S+)", flags) or ["configs/default.py"])[0]
    spec = importlib.util.spec_from_file_location("cfg", os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.unlock()
    for key, value in re.findall(r"--config\.(\S+?)=(\S+)", flags):
        node, *rest = key.split(".")
        target = c[node]
        for part in rest[:-1]:
            target = target[part]
        try:
            value = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            pass  # a string: ring, int8, 1f1b, ...
        target[rest[-1]] = value
    return c


def test_the_table_has_its_rows():
    assert len(ROWS) >= 10 and "context parallel (Llama)" in ROWS, sorted(ROWS)


@pytest.mark.parametrize("name", list(ROWS))
def test_each_row_validates_on_8_devices(name):
    config_lib.validate(_config(ROWS[name]), 8)
