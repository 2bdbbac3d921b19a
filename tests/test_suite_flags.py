"""The suite's XLA:CPU code-generation flags (tests/conftest.py) keep the bitwise tests meaningful.

The `bitwise` tests compare two programs to the bit; under the elemental fusion emitter that holds
only with the LLVM module in one piece, so the session never has the one flag without the other,
and a run that asks for the emitter with a split module is refused before any test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import _FUSION_EMITTERS, _ONE_PIECE

ROOT = Path(__file__).resolve().parents[1]


def test_the_elemental_emitter_comes_only_with_the_module_in_one_piece():
    flags = os.environ.get("XLA_FLAGS", "").split()
    assert _FUSION_EMITTERS not in flags or _ONE_PIECE in flags, flags


def test_bitwise_tests_refuse_the_elemental_emitter_with_a_split_module():
    env = {k: v for k, v in os.environ.items() if k != "JAXDIST_TEST_FAST_CODEGEN"}
    env["XLA_FLAGS"] = f"{_FUSION_EMITTERS} --xla_cpu_parallel_codegen_split_count=32"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
        + ["--collect-only", "-m", "bitwise", "tests/test_gpt.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 4, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert f"or the elemental one with {_ONE_PIECE}" in proc.stdout + proc.stderr
