"""A host's link goes down mid-run on the emulated cluster (`launch.py --network_fault`).

Issue 30 item 6 (a), through `scripts/network_fault.py` with 3 emulated hosts (the fewest that
leave a multi-host job, over the network, to restart on; each host costs one JAX process's start
and compile on a 2-core machine, so not 4 here: docs/MULTIHOST.md has the 4-host row). Skips in
one line where namespaces cannot be made.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from jaxdist import checkpoint
from jaxdist.network import namespaces
from tests.test_multihost import ROOT, records
from tests.test_netem import _env_no_cache, clean, needs_namespaces  # noqa: F401 (fixture)

pytestmark = [pytest.mark.slow, pytest.mark.bitwise]  # two programs' parameters to the bit

HANG_S = 15


@needs_namespaces
def test_link_down_is_named_and_the_elastic_restart_equals_a_resumed_run(tmp_path, clean):  # noqa: F811
    """Host 2's link goes down after step 5 is reported: the watchdog names process 2 (its host's
    switch port lost its carrier) within `--hang_s`, the job restarts on hosts 0 and 1 from its
    newest checkpoint and finishes; its losses after the resume and its final parameters equal, to
    the bit, those of a 2-host run started from a copy of that checkpoint."""
    before = set(namespaces.leftovers())
    work, out = tmp_path / "nf", tmp_path / "row.json"
    cmd = [sys.executable, "scripts/network_fault.py", "--hosts=3", "--steps=8", "--every=2"]
    cmd += ["--fault_step=5", f"--hang_s={HANG_S}", f"--workdir={work}", f"--out={out}"]
    done = subprocess.run(
        cmd, cwd=ROOT, env=_env_no_cache(), capture_output=True, text=True, timeout=900
    )
    log = (work / "elastic.log").read_text()
    row = json.loads(out.read_text())
    assert row["elastic_rc"] == 0, log[-4000:]
    assert row["reference_rc"] == 0, (work / "reference.log").read_text()[-4000:]
    assert (
        f"launch.py: process 2 made no progress for {HANG_S} s (--hang_s): it is cut off "
        "(host2's link is down: its switch port has no carrier) at step" in log
    ), log[-4000:]
    assert row["detect_s"] <= HANG_S + 5, row
    assert "launch.py: leaving out host2" in log
    assert "on 2 process(es) (those that remain) (restart 1 of 1)" in log, log[-4000:]
    assert set(namespaces.leftovers()) <= before

    elastic, reference = work / "elastic", work / "reference"
    layouts = [r for r in records(elastic) if r.get("kind") == "layout"]
    assert [(r["devices"], r["processes"]) for r in layouts] == [(3, 3), (2, 2)], layouts
    resumed = int(re.search(r"\] resumed from \S+ at step (\d+)", log).group(1))
    assert 2 <= resumed <= 5 and resumed % 2 == 0, resumed
    assert sorted(checkpoint.committed_steps(reference / "checkpoints"))[0] == resumed

    def after_resume(workdir):
        recs = records(workdir)
        last = max(i for i, r in enumerate(recs) if r.get("kind") == "layout")
        return {r["step"]: (r["loss"], r["grad_norm"]) for r in recs[last:] if "loss" in r}

    got, want = after_resume(elastic), after_resume(reference)
    assert sorted(got) == list(range(resumed + 1, 9)), sorted(got)
    assert got == want
    params = {
        name: checkpoint.read_arrays(str(w / "checkpoints"), step=8, prefix="params")
        for name, w in (("elastic", elastic), ("reference", reference))
    }
    assert params["elastic"] and sorted(params["elastic"]) == sorted(params["reference"])
    for k, v in params["elastic"].items():
        assert v.tobytes() == params["reference"][k].tobytes(), k
    assert row["equal_params"] and row["equal_losses"], row
    assert done.returncode == 0, done.stdout + done.stderr
