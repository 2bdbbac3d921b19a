"""Multi-process plumbing: cluster detection from the environment, and scripts/launch.py end to end.

The launcher tests start real 2-process JAX jobs on CPU (gloo collectives), each a few seconds.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from jaxdist import ConfigError, distributed
from jaxdist.distributed import ClusterSpec, detect, expand_nodelist
from tests.helpers import env_without_cluster

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "scripts" / "launch.py"


def _clean_env(**extra: str) -> dict[str, str]:
    env = env_without_cluster()
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


# ---------------------------------------------------------------------------------------------
# Slurm hostlists.


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node001", ["node001"]),
        ("a1,b2", ["a1", "b2"]),
        ("node[001-004,007]", ["node001", "node002", "node003", "node004", "node007"]),
        ("gpu[8-11]", ["gpu8", "gpu9", "gpu10", "gpu11"]),
        ("gpu[08-11]", ["gpu08", "gpu09", "gpu10", "gpu11"]),
        ("x[1-2],y,z[5]", ["x1", "x2", "y", "z5"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("node[1-2].cluster", ["node1.cluster", "node2.cluster"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["node[1-3", "node1-3]", "node[3-1]", "node[a-b]", "", " , "])
def test_expand_nodelist_rejects_malformed(bad):
    with pytest.raises(ConfigError, match="nodelist"):
        expand_nodelist(bad)


# ---------------------------------------------------------------------------------------------
# detect(): one case per source.

SLURM = {
    "SLURM_JOB_ID": "12345",
    "SLURM_PROCID": "3",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_JOB_NUM_NODES": "4",
    "SLURM_STEP_NODELIST": "node[007-009,012]",
    "SLURM_JOB_NODELIST": "node[001-012]",
}


def test_single_process_by_default():
    assert detect({}) == ClusterSpec(None, 1, 0, None, "single")
    assert detect({"JAXDIST_NUM_PROCESSES": "1"}).source == "single"
    assert not detect({}).is_multiprocess


def test_launcher_variables():
    env = {"JAXDIST_COORDINATOR": "127.0.0.1:5555", "JAXDIST_NUM_PROCESSES": "2"}
    env["JAXDIST_PROCESS_ID"] = "1"
    assert detect(env) == ClusterSpec("127.0.0.1:5555", 2, 1, None, "env")
    # A bare host takes JAXDIST_COORDINATOR_PORT; local device ids come through as a tuple.
    env.update(JAXDIST_COORDINATOR="head", JAXDIST_COORDINATOR_PORT="7000")
    env["JAXDIST_LOCAL_DEVICE_IDS"] = "2,3"
    assert detect(env) == ClusterSpec("head:7000", 2, 1, (2, 3), "env")


def test_slurm():
    spec = detect(SLURM)
    # First host of the step (not the job), and JAX's per-job port 61440 + job_id % 4096.
    assert spec == ClusterSpec(f"node007:{61440 + 12345 % 4096}", 4, 3, None, "slurm")


def test_slurm_port_override_and_job_nodelist_fallback():
    env = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}
    env["JAXDIST_COORDINATOR_PORT"] = "9000"
    assert detect(env).coordinator_address == "node001:9000"


def test_slurm_one_task_per_gpu_pins_local_device():
    env = dict(SLURM, SLURM_NTASKS="8", SLURM_JOB_NUM_NODES="2")
    assert detect(env).local_device_ids == (1,)
    assert detect(dict(env, CUDA_VISIBLE_DEVICES="0,1,2,3")).local_device_ids == (1,)
    # Slurm already bound GPUs to the task (--gpus-per-task): leave its choice alone.
    assert detect(dict(env, CUDA_VISIBLE_DEVICES="1")).local_device_ids is None
    assert detect(dict(env, SLURM_GPUS_PER_TASK="2")).local_device_ids is None
    # One task per node drives all of the node's GPUs.
    assert detect(dict(env, SLURM_NTASKS="2", SLURM_PROCID="1")).local_device_ids is None


def test_slurm_without_nodelist_names_the_fix():
    env = {k: v for k, v in SLURM.items() if "NODELIST" not in k}
    with pytest.raises(ConfigError, match="JAXDIST_COORDINATOR"):
        detect(env)
    assert detect(dict(env, JAXDIST_COORDINATOR="login1:1")).source == "slurm"


def test_kubernetes_jobset():
    env = {
        "JOB_COMPLETION_INDEX": "2",
        "JAXDIST_NUM_PROCESSES": "4",
        "JOBSET_NAME": "jaxdist",
        "REPLICATED_JOB_NAME": "workers",
        "HOSTNAME": "jaxdist-workers-0-2",
    }
    assert detect(env) == ClusterSpec("jaxdist-workers-0-0.jaxdist:8476", 4, 2, None, "kubernetes")
    env.update(JAXDIST_K8S_SUBDOMAIN="net", JAXDIST_COORDINATOR_PORT="1234")
    assert detect(env).coordinator_address == "jaxdist-workers-0-0.net:1234"


def test_kubernetes_indexed_job_from_hostname():
    env = {
        "JOB_COMPLETION_INDEX": "11",
        "JAXDIST_NUM_PROCESSES": "12",
        "HOSTNAME": "train-11",
        "JAXDIST_K8S_SUBDOMAIN": "train-svc",
    }
    assert detect(env) == ClusterSpec("train-0.train-svc:8476", 12, 11, None, "kubernetes")
    env["JAXDIST_COORDINATOR"] = "train-0.train-svc.ml.svc.cluster.local:8476"
    assert detect(env).coordinator_address == env["JAXDIST_COORDINATOR"]


def test_kubernetes_needs_count_and_coordinator():
    with pytest.raises(ConfigError, match="num_processes|JAXDIST_NUM_PROCESSES"):
        detect({"JOB_COMPLETION_INDEX": "1", "HOSTNAME": "j-1", "JAXDIST_K8S_SUBDOMAIN": "s"})
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX=1.*JAXDIST_COORDINATOR"):
        detect({"JOB_COMPLETION_INDEX": "1", "JAXDIST_NUM_PROCESSES": "2", "HOSTNAME": "j-1"})


def test_openmpi():
    env = {
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
        "OMPI_MCA_orte_hnp_uri": "1531576320.0;tcp://10.96.0.1,10.148.0.1:34911",
    }
    assert detect(env) == ClusterSpec("10.96.0.1:8476", 4, 2, None, "openmpi")
    # Open MPI 5 (PRRTE) publishes the launcher through PMIx instead.
    del env["OMPI_MCA_orte_hnp_uri"]
    env["PMIX_SERVER_URI41"] = "prterun-head-1234@0.0;tcp4://10.1.2.3:40000"
    assert detect(env).coordinator_address == "10.1.2.3:8476"
    del env["PMIX_SERVER_URI41"]
    with pytest.raises(ConfigError, match="JAXDIST_COORDINATOR"):
        detect(env)


def test_openmpi_wins_over_the_slurm_allocation_around_it():
    env = dict(SLURM, OMPI_COMM_WORLD_SIZE="8", OMPI_COMM_WORLD_RANK="5")
    env["JAXDIST_COORDINATOR"] = "node001:1"
    spec = detect(env)
    assert (spec.source, spec.num_processes, spec.process_id) == ("openmpi", 8, 5)


def test_precedence_flags_then_our_env_then_scheduler():
    env = dict(SLURM, JAXDIST_NUM_PROCESSES="6", JAXDIST_COORDINATOR="head:1")
    spec = detect(env)
    # Count and coordinator from our variables, rank from Slurm: Slurm is the least specific used.
    assert (spec.num_processes, spec.process_id, spec.coordinator_address) == (6, 3, "head:1")
    assert spec.source == "slurm"
    spec = detect(env, coordinator_address="flag:2", num_processes=5, process_id=4)
    assert spec == ClusterSpec("flag:2", 5, 4, None, "flags")
    assert detect({}, coordinator_address="h:1", num_processes=2, process_id=0).source == "flags"
    assert detect(env, num_processes=1).source == "single"


@pytest.mark.parametrize(
    "env, match",
    [
        ({"JAXDIST_NUM_PROCESSES": "two"}, "JAXDIST_NUM_PROCESSES='two' is not an integer"),
        ({"JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": "0"}, "no coordinator"),
        ({"JAXDIST_NUM_PROCESSES": "2", "JAXDIST_COORDINATOR": "h:1"}, "no process id"),
        (
            {"JAXDIST_NUM_PROCESSES": "2", "JAXDIST_PROCESS_ID": "2", "JAXDIST_COORDINATOR": "h"},
            r"process_id=2 .*0\.\.1",
        ),
        (
            {
                "JAXDIST_NUM_PROCESSES": "2",
                "JAXDIST_PROCESS_ID": "0",
                "JAXDIST_COORDINATOR": "h",
                "JAXDIST_COORDINATOR_PORT": "70000",
            },
            "JAXDIST_COORDINATOR_PORT=70000",
        ),
    ],
)
def test_detect_errors_are_one_line(env, match):
    with pytest.raises(ConfigError, match=match) as info:
        detect(env)
    assert "\n" not in str(info.value)


def test_detect_reads_the_real_environment_in_a_subprocess():
    code = "from jaxdist.distributed import detect; print(repr(detect()))"
    env = _clean_env(**SLURM, JAXDIST_COORDINATOR_PORT="6000")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    expected = ClusterSpec("node007:6000", 4, 3, None, "slurm")
    assert out.stdout.strip() == repr(expected)


# ---------------------------------------------------------------------------------------------
# initialize() in this (single) process, and the helpers.


def test_initialize_single_process_is_a_noop_and_idempotent():
    distributed._reset_for_tests()
    try:
        spec = distributed.initialize(distributed.SINGLE)
        assert spec.source == "single"
        assert distributed.initialize() is spec
        with pytest.raises(ConfigError, match="already initialized"):
            distributed.initialize(ClusterSpec("h:1", 2, 0, None, "flags"))
        assert distributed.is_main_process() and distributed.log_prefix() == ""
    finally:
        distributed._reset_for_tests()


def test_log_prefix_names_non_main_processes():
    distributed._reset_for_tests(ClusterSpec("h:1", 4, 2, None, "env"))
    try:
        assert distributed.log_prefix() == "[p2/4] "
        assert not distributed.is_main_process()
    finally:
        distributed._reset_for_tests()


def test_cpu_devices_from_env():
    assert distributed.cpu_devices_from_env({}) == 0
    assert distributed.cpu_devices_from_env({"JAXDIST_CPU_DEVICES": "4"}) == 4


def _load_launch():
    spec = importlib.util.spec_from_file_location("jaxdist_launch", LAUNCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_launcher_splits_gpus_between_processes(monkeypatch):
    launch = _load_launch()
    monkeypatch.setattr(launch, "_visible_gpus", lambda: ["0", "1", "2", "3", "4", "5"])
    args, command = launch._parse(["--num_processes=2", "--devices_per_process=3", "--", "python"])
    assert command == [sys.executable]
    envs, what = launch._child_envs(args, 1234)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1,2", "3,4,5"]
    assert "JAXDIST_CPU_DEVICES" not in envs[0] and what == "3 GPU(s)"
    args, _ = launch._parse(["--num_processes=2", "--devices_per_process=4", "--", "x"])
    envs, _ = launch._child_envs(args, 1234)  # 8 > 6 GPUs: auto falls back to CPU
    assert envs[1]["JAX_PLATFORMS"] == "cpu" and envs[1]["JAXDIST_CPU_DEVICES"] == "4"
    assert envs[1]["JAXDIST_PROCESS_ID"] == "1" and envs[1]["JAXDIST_NUM_PROCESSES"] == "2"
    args, _ = launch._parse(
        ["--num_processes=2", "--platform=gpu", "--devices_per_process=4", "--", "x"]
    )
    with pytest.raises(SystemExit, match="needs 2 x 4 = 8 GPUs but 6"):
        launch._child_envs(args, 1234)


# ---------------------------------------------------------------------------------------------
# scripts/launch.py with real 2-process JAX jobs.

WORKER = textwrap.dedent(
    """
    import logging, os, sys, time
    from jaxdist import distributed

    mode = sys.argv[1]
    rank = distributed.detect().process_id
    if mode == "nojoin" and rank == 1:
        print("rank 1 skips initialize")
        sys.exit(0)
    spec = distributed.initialize()
    import jax
    jax.config.update("jax_num_cpu_devices", distributed.cpu_devices_from_env())
    import numpy as np
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    if mode == "sum":
        mesh = Mesh(np.array(jax.devices()), ("d",))
        k = jax.local_device_count()
        local = np.arange(k, dtype=np.float32) + k * jax.process_index()  # [K] rows of [N*K]
        x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("d")), local)
        total = jax.jit(jnp.sum, out_shardings=NamedSharding(mesh, P()))(x)
        ranks = multihost_utils.process_allgather(jnp.array([jax.process_index()]))
        distributed.setup_logging()
        logging.getLogger().addHandler(logging.StreamHandler(sys.stdout))
        distributed.setup_logging()
        logging.warning("logged by %d", rank)
        print(f"RESULT rank={rank} devices={jax.device_count()} total={float(total)} "
              f"ranks={ranks.ravel().tolist()} source={spec.source}")
        sys.exit(0)
    print(f"joined {rank}", flush=True)
    if rank == 1 and mode == "exit3":
        time.sleep(0.5)
        print("rank 1 giving up", file=sys.stderr)
        sys.exit(3)
    if rank == 1 and mode == "kill":
        time.sleep(0.5)
        os.kill(os.getpid(), 9)
    time.sleep(300)
    """
)


@pytest.fixture
def worker(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return str(path)


def _launch(worker, mode, *flags, timeout=60):
    cmd = [sys.executable, str(LAUNCH), "--num_processes=2", *flags, "--", "python", worker, mode]
    start = time.monotonic()
    out = subprocess.run(cmd, env=_clean_env(), capture_output=True, text=True, timeout=timeout)
    return out, time.monotonic() - start


def test_launch_two_processes_compute_one_global_sum(worker):
    out, _ = _launch(worker, "sum", "--devices_per_process=2")
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        # 2 processes x 2 devices hold arange(4) between them: the jitted sum crosses processes.
        # This bare worker does not filter Gloo's banner (scripts/train.py does), which its C++
        # threads write to the same stdout in pieces: the line printed (one write) may follow a
        # piece that has no newline yet, whose newline then comes as an empty line of its own.
        result = f"RESULT rank={rank} devices=4 total=6.0 ranks=[0, 1] source=env"
        assert re.search(rf"^\[{rank}\] .*{re.escape(result)}$", out.stdout, re.M), out.stdout
    assert "[1] [p1/2] logged by 1" in out.stdout  # non-main processes label their log lines
    # Process 0 does not label its own. Gloo's threads print their connection banner in pieces on
    # the same descriptor (scripts/train.py filters them; this bare worker does not), so a piece
    # can share the line: the line is looked for, not its exact text.
    logged = [line for line in out.stdout.splitlines() if "logged by 0" in line]
    assert logged and all(line.startswith("[0] ") and "[p0/2]" not in line for line in logged)
    assert all(line.startswith(("[0] ", "[1] ")) for line in out.stdout.splitlines())


def test_launch_stops_everyone_when_one_exits_non_zero(worker):
    out, elapsed = _launch(worker, "exit3", "--grace_s=2")
    assert out.returncode == 3, out.stderr
    assert elapsed < 60
    assert "process 1 exited with code 3; last line: 'rank 1 giving up'" in out.stderr


def test_launch_reports_a_process_killed_by_a_signal(worker):
    out, elapsed = _launch(worker, "kill", "--grace_s=2")
    assert out.returncode == 128 + signal.SIGKILL, out.stderr
    assert elapsed < 60
    assert "process 1 was killed by SIGKILL" in out.stderr


def test_launch_reports_a_process_that_never_joins(worker):
    out, elapsed = _launch(worker, "nojoin", "--timeout_s=5", "--grace_s=2")
    assert out.returncode == 1, out.stderr
    assert elapsed < 30
    assert "process 0 of 2 did not join within 5 s: check coordinator address 127.0.0.1:" in (
        out.stderr
    )
    summary = [ln for ln in out.stderr.splitlines() if ln.startswith("launch.py: process 0")]
    assert summary and "ConfigError: process 0 of 2 did not join" in summary[0]


def test_launch_forwards_sigterm_and_exits(worker, tmp_path):
    log = tmp_path / "out.txt"
    cmd = [sys.executable, str(LAUNCH), "--num_processes=2", "--grace_s=2", "--", "python"]
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [*cmd, worker, "sleep"], env=_clean_env(), stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            deadline = time.monotonic() + 45
            while not all(f"[{r}] joined {r}" in log.read_text() for r in (0, 1)):
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
            start = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 128 + signal.SIGTERM, log.read_text()
    assert time.monotonic() - start < 15
    assert "got SIGTERM, stopped all processes" in log.read_text()


def test_a_launcher_killed_outright_leaves_its_progress_folder_to_the_next(tmp_path):
    """SIGKILL gives the launcher no time to remove its progress folder; the next launcher on the
    machine removes it, and keeps a live launcher's."""
    env = _clean_env(TMPDIR=str(tmp_path))
    cmd = [sys.executable, str(LAUNCH), "--num_processes=2", "--", "sleep", "60"]
    first = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    live = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while len(list(tmp_path.glob("jaxdist-progress-*"))) < 2:
            assert time.monotonic() < deadline and first.poll() is None and live.poll() is None
            time.sleep(0.05)
        first.kill()
        first.wait(timeout=10)
        (left,) = tmp_path.glob(f"jaxdist-progress-{first.pid}-*")
        cmd = [sys.executable, str(LAUNCH), "--num_processes=1", "--", "true"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert not left.exists()
        assert [p.name.split("-")[2] for p in tmp_path.glob("jaxdist-progress-*")] == [
            str(live.pid)
        ]
    finally:
        for proc in (first, live):
            proc.kill()
            proc.wait(timeout=10)


def test_launch_needs_a_command():
    out = subprocess.run(
        [sys.executable, str(LAUNCH), "--num_processes=2"], capture_output=True, text=True
    )
    assert out.returncode == 2 and "no command" in out.stderr


# ---------------------------------------------------------------------------------------------
# scripts/slurm/train.sbatch, run by bash with stand-ins for scontrol and srun on this machine.

FAKE_SRUN = """
import os, subprocess, sys
args = sys.argv[1:]
while args and args[0].startswith("--"):
    args.pop(0)
n = int(os.environ["SLURM_NTASKS"])
procs = [
    subprocess.Popen(args, env=dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID="0",
                                    SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"]))
    for i in range(n)
]
sys.exit(max(abs(p.wait(timeout=120)) for p in procs))
"""


def test_sbatch_script_forms_one_job(tmp_path):
    bin_dir, repo = tmp_path / "bin", tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    bin_dir.mkdir()
    (repo / "scripts" / "train.py").write_text(WORKER)
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho localhost\necho node2\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    launch = _load_launch()
    env = _clean_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        PYTHON=sys.executable,
        SLURM_SUBMIT_DIR=str(repo),
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="localhost,node2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS="2",
        JAXDIST_COORDINATOR_PORT=str(launch._free_port()),
        JAXDIST_CPU_DEVICES="2",
        JAX_PLATFORMS="cpu",
    )
    sbatch = ROOT / "scripts" / "slurm" / "train.sbatch"
    out = subprocess.run(
        ["bash", str(sbatch), "sum"], env=env, capture_output=True, text=True, timeout=90
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for rank in (0, 1):
        assert f"RESULT rank={rank} devices=4 total=6.0 ranks=[0, 1] source=slurm" in out.stdout


def test_gc_after_imports_freezes_the_heap_and_collects_the_young_less_often():
    # In a fresh process (the test process's own collector is set by conftest): what exists when
    # it is called is frozen out of the collector; what comes after is still tracked and cyclic
    # garbage made after it is still collected.
    code = textwrap.dedent(
        """
        import gc, weakref
        from jaxdist import distributed
        before = [object()]
        assert gc.get_freeze_count() == 0 and gc.get_threshold()[0] == 700
        distributed.gc_after_imports()
        frozen = gc.get_freeze_count()
        assert frozen > 1000, frozen
        assert gc.get_threshold() == (20000, 10, 10), gc.get_threshold()
        class Node: pass
        a, b = Node(), Node()
        a.other, b.other = b, a
        gone = weakref.ref(a)
        del a, b
        assert gone() is not None  # a cycle waits for a collection
        gc.collect()
        assert gone() is None
        print("ok", frozen)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stdout + proc.stderr
