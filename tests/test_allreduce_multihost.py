"""grad_sync.algorithm across 2 processes × 4 devices: hierarchical and ring equal one process's XLA.

The 2-process runs are `scripts/launch.py` + the real `train.py` (tests/test_multihost.py's
harness); the hybrid mesh puts data=4 over 2 hosts (mesh.dcn_data=2), so `hierarchical` reduces
within each host, sends only its half-shard across, and the layout record shows which of its
phases cross hosts (tier dcn) and which stay inside one (tier ici).
"""

from __future__ import annotations

import pytest

from tests.test_multihost import (
    DATA_TENSOR,
    _env,
    assert_losses_match,
    assert_training_moves,
    in_parallel,
    losses,
    records,
    train_cmd,
)

HYBRID = (*DATA_TENSOR, "--config.mesh.dcn_data=2", "--config.checkpoint.every=0")
STEPS = "--config.train.steps=4"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("allreduce_mp")
    w = {name: root / name for name in ("ref", "hierarchical", "ring")}
    in_parallel(
        (train_cmd(w["ref"], *DATA_TENSOR, "--config.checkpoint.every=0", STEPS), _env(None, None)),
        *[
            (
                train_cmd(w[a], *HYBRID, f"--config.grad_sync.algorithm={a}", STEPS, processes=2),
                _env(None, None),
            )
            for a in ("hierarchical", "ring")
        ],
    )
    return w


@pytest.mark.parametrize("algorithm", ["hierarchical", "ring"])
def test_two_processes_equal_one_process_xla(runs, algorithm):
    ref = losses(runs["ref"])
    assert_training_moves(ref)
    assert_losses_match(losses(runs[algorithm]), ref, [1, 2, 3, 4])


def test_hierarchical_sends_only_its_shard_across_hosts(runs):
    layout = records(runs["hierarchical"])[0]
    assert layout["processes"] == 2
    permutes = {
        p["tier"]: p for p in layout["collective_phases"] if p["kind"] == "collective-permute"
    }
    # data = 2 hosts × 2 devices: ring reduce-scatter + all-gather inside each host (2 steps of
    # S/2), ring all-reduce of the S/2 shard across the hosts (2 steps of S/4).
    assert permutes["ici"]["steps"] == 2 and permutes["dcn"]["steps"] == 2
    assert permutes["ici"]["busiest_bytes"] == pytest.approx(2 * permutes["dcn"]["busiest_bytes"])
    ring = records(runs["ring"])[0]
    ring_dcn = [p for p in ring["collective_phases"] if p["tier"] == "dcn"]
    # A flat ring over 4 devices on 2 hosts: every step crosses a host boundary somewhere.
    assert sum(p["steps"] for p in ring_dcn if p["kind"] == "collective-permute") == 6
