"""Joining N processes into one JAX job: who am I, who is the coordinator, and how many are we.

`detect()` reads the cluster from the environment (a pure function of a mapping, so it is testable);
`initialize()` calls `jax.distributed.initialize` with it, before anything touches a device, and
turns "the others never showed up" into a one-line `ConfigError` instead of an XLA abort.

Where the three numbers come from, first match per field wins:

1. explicit arguments to `detect()` (`source="flags"`);
2. jaxdist's own variables, set by `scripts/launch.py` or by hand (`source="env"`):
   `JAXDIST_COORDINATOR` (`host:port`, or `host` plus `JAXDIST_COORDINATOR_PORT`),
   `JAXDIST_NUM_PROCESSES`, `JAXDIST_PROCESS_ID`, and optionally `JAXDIST_LOCAL_DEVICE_IDS` (`0,1`);
3. the scheduler, checked in this order (the first whose variables are present is used):
   - Open MPI (`OMPI_COMM_WORLD_SIZE`, `OMPI_COMM_WORLD_RANK`; coordinator = the `mpirun` host,
     read from `OMPI_MCA_orte_hnp_uri` or `PMIX_SERVER_URI*`). Checked before Slurm because
     `mpirun` inside an allocation also leaves `SLURM_*` variables that describe the allocation,
     not the ranks.
   - Slurm (`SLURM_PROCID`; count from `SLURM_STEP_NUM_TASKS`, `SLURM_NTASKS`, `SLURM_NPROCS` or
     `SLURM_JOB_NUM_NODES`; coordinator = first host of `SLURM_STEP_NODELIST` / `SLURM_JOB_NODELIST`
     / `SLURM_NODELIST`, port `JAXDIST_COORDINATOR_PORT` or `61440 + SLURM_JOB_ID % 4096`, the same
     per-job port JAX's own Slurm detection picks).
   - Kubernetes indexed Job / JobSet (`JOB_COMPLETION_INDEX` is the process id; the count must
     come from `JAXDIST_NUM_PROCESSES`; the coordinator is the DNS name of index 0, see
     `_k8s_coordinator`).

A field nobody sets means one process: `initialize()` is then a no-op.

The `source` of a `ClusterSpec` is the least specific layer that contributed a field, so a Slurm job
whose coordinator was overridden by `JAXDIST_COORDINATOR` still reports `"slurm"`.

Why not JAX's own detection (`jax._src.clusters`, jax 0.10.2)? Where it works it gives the same
answer (Slurm under `srun`: first host of `SLURM_STEP_NODELIST`, port 61440 + job id % 4096), but:
- Slurm: it needs the step variables, so an `sbatch` script outside `srun` is not detected (jaxdist
  falls back to `SLURM_JOB_NODELIST`); it reads only the first bracket group of a hostlist
  (`rack[1-2]-n[01-02]` gives `rack1`, `expand_nodelist` gives `rack1-n01`); and it pins every task
  to the GPU of its `SLURM_LOCALID`, also when one task per node should drive all of its GPUs.
- Open MPI: it reads Open MPI 4's `OMPI_MCA_orte_hnp_uri` only; Open MPI 5 (PRRTE) publishes the
  launcher through `PMIX_SERVER_URI*`.
- Kubernetes: `K8sCluster` asks the Kubernetes API (the `kubernetes` package and a service account
  with pod read access); an indexed Job or JobSet pod can find index 0 by DNS from its environment.
- A join timeout: JAX's `initialization_timeout` ends the process with `LOG(FATAL)`; `initialize`
  waits in a thread and raises a catchable one-line `ConfigError` instead.
Once `detect` has answered, JAX's detection is switched off (`cluster_detection_method=
"deactivate"`) so it cannot override the answer (e.g. pin one GPU per process from `SLURM_LOCALID`).
"""

from __future__ import annotations

import atexit
import dataclasses
import errno
import gc
import inspect
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable, Mapping

from jaxdist.errors import ConfigError

DEFAULT_PORT = 8476
DEFAULT_TIMEOUT_S = 60.0

ENV_COORDINATOR = "JAXDIST_COORDINATOR"
ENV_COORDINATOR_PORT = "JAXDIST_COORDINATOR_PORT"
ENV_NUM_PROCESSES = "JAXDIST_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXDIST_PROCESS_ID"
ENV_LOCAL_DEVICE_IDS = "JAXDIST_LOCAL_DEVICE_IDS"
ENV_CPU_DEVICES = "JAXDIST_CPU_DEVICES"
ENV_INIT_TIMEOUT = "JAXDIST_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT = "JAXDIST_HEARTBEAT_TIMEOUT_S"
ENV_K8S_SUBDOMAIN = "JAXDIST_K8S_SUBDOMAIN"

SOURCES = ("flags", "env", "slurm", "kubernetes", "openmpi", "single")


@dataclasses.dataclass(frozen=True)
class ClusterSpec:
    """Where this process sits in the job.

    Attributes:
      coordinator_address: `host:port` of process 0's coordination service; None for one process.
      num_processes: processes in the job (hosts, or one per GPU).
      process_id: this process's rank, `0 <= process_id < num_processes`.
      local_device_ids: accelerator ids this process may use, or None for all it can see.
      source: which layer decided: "flags", "env", "slurm", "kubernetes", "openmpi" or "single".
    """

    coordinator_address: str | None
    num_processes: int
    process_id: int
    local_device_ids: tuple[int, ...] | None = None
    source: str = "single"

    @property
    def is_multiprocess(self) -> bool:
        return self.num_processes > 1


SINGLE = ClusterSpec(coordinator_address=None, num_processes=1, process_id=0, source="single")


# ---------------------------------------------------------------------------------------------
# Slurm hostlists: "node[001-003,007],gpu-a1" -> node001 node002 node003 node007 gpu-a1.


def _split_top_level(text: str) -> list[str]:
    """Splits on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError("unbalanced '['")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str) -> list[str]:
    """Expands "001-003,7" to ["001", "002", "003", "7"]; zero padding follows the start."""
    out = []
    for item in body.split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad range {item!r}")
        if not sep:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r}")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str) -> list[str]:
    """One hostlist item, possibly with several bracket groups ("r[1-2]n[01-02]")."""
    open_at = pattern.find("[")
    if open_at < 0:
        if "]" in pattern:
            raise ValueError("unbalanced ']'")
        return [pattern]
    close_at = pattern.find("]", open_at)
    if close_at < 0:
        raise ValueError("unbalanced '['")
    prefix, body, rest = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    tails = _expand_host(rest)
    return [prefix + mid + tail for mid in _expand_range(body) for tail in tails]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expands Slurm's compressed hostlist syntax, in order.

    Args:
      nodelist: e.g. "node[001-004,007]", "a1,b[2-3]", "rack[1-2]-n[01-02]".

    Returns:
      Host names, e.g. ["node001", "node002", "node003", "node004", "node007"].

    Raises:
      ConfigError: the text is not a hostlist.
    """
    try:
        hosts = [h for item in _split_top_level(nodelist) for h in _expand_host(item)]
    except ValueError as e:
        raise ConfigError(f"Slurm nodelist {nodelist!r} is not a valid hostlist: {e}") from None
    if not hosts:
        raise ConfigError(f"Slurm nodelist {nodelist!r} is empty")
    return hosts


# ---------------------------------------------------------------------------------------------
# Environment parsing.


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _int_list(env: Mapping[str, str], name: str) -> tuple[int, ...] | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return tuple(int(x) for x in raw.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a comma-separated list of integers") from None


def _port(env: Mapping[str, str], default: int = DEFAULT_PORT) -> int:
    port = _int(env, ENV_COORDINATOR_PORT)
    port = default if port is None else port
    if not 0 < port < 65536:
        raise ConfigError(f"{ENV_COORDINATOR_PORT}={port} is not a TCP port (1..65535)")
    return port


def _with_port(address: str, env: Mapping[str, str], default_port: int = DEFAULT_PORT) -> str:
    """Adds `:port` to a bare host ("node1", "10.0.0.1", "[fe80::1]", "fe80::1")."""
    address = address.strip()
    if address.startswith("["):
        return address if "]:" in address else f"{address}:{_port(env, default_port)}"
    if address.count(":") == 1:
        return address
    if address.count(":") > 1:  # a bare IPv6 literal
        return f"[{address}]:{_port(env, default_port)}"
    return f"{address}:{_port(env, default_port)}"


@dataclasses.dataclass(frozen=True)
class _Scheduler:
    name: str
    num_processes: int | None
    process_id: int | None
    local_device_ids: tuple[int, ...] | None
    coordinator: Callable[[], str]  # lazy: only evaluated when no higher layer names one


def _per_gpu_device(env: Mapping[str, str], tasks: int | None, nodes: int | None, local: str):
    """Several processes per host: each takes the visible GPU at its local rank, as JAX does.

    Left to the scheduler (None) when it already bound GPUs to the task: `SLURM_GPUS_PER_TASK` is
    set, or `CUDA_VISIBLE_DEVICES` names a single GPU. Several GPUs per process on a shared host
    need `JAXDIST_LOCAL_DEVICE_IDS` or `--gpus-per-task`. On CPU the ids are harmless: JAX only
    uses them for `jax_cuda_visible_devices`.
    """
    local_rank = _int(env, local)
    if local_rank is None or tasks is None or nodes is None or tasks <= nodes:
        return None
    if env.get("SLURM_GPUS_PER_TASK"):
        return None
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if len(visible) == 1:
        return None
    return (local_rank,)


def _openmpi(env: Mapping[str, str]) -> _Scheduler | None:
    if "OMPI_COMM_WORLD_SIZE" not in env or "OMPI_COMM_WORLD_RANK" not in env:
        return None
    size = _int(env, "OMPI_COMM_WORLD_SIZE")

    def coordinator() -> str:
        uris = [env.get("OMPI_MCA_orte_hnp_uri", "")]
        uris += [v for k, v in sorted(env.items()) if k.startswith("PMIX_SERVER_URI")]
        for uri in uris:
            m = re.search(r"tcp4?://\[?([^,:\]/]+)|tcp6://\[([^,\]]+)", uri)
            if m:
                host = m.group(1) or f"[{m.group(2)}]"
                return f"{host}:{_port(env)}"
        raise ConfigError(
            "Open MPI job but the mpirun host is not in OMPI_MCA_orte_hnp_uri or PMIX_SERVER_URI*: "
            f"set {ENV_COORDINATOR}=host:port to the host of rank 0"
        )

    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    return _Scheduler(
        name="openmpi",
        num_processes=size,
        process_id=_int(env, "OMPI_COMM_WORLD_RANK"),
        local_device_ids=_per_gpu_device(env, local_size, 1, "OMPI_COMM_WORLD_LOCAL_RANK"),
        coordinator=coordinator,
    )


def _slurm(env: Mapping[str, str]) -> _Scheduler | None:
    if "SLURM_PROCID" not in env:
        return None
    tasks = None
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_NUM_NODES"):
        tasks = _int(env, name)
        if tasks is not None:
            break
    nodes = None
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        nodes = _int(env, name)
        if nodes is not None:
            break

    def coordinator() -> str:
        for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
            if env.get(name):
                host = expand_nodelist(env[name])[0]
                break
        else:
            raise ConfigError(
                f"Slurm job without SLURM_STEP_NODELIST or SLURM_JOB_NODELIST: "
                f"set {ENV_COORDINATOR}=host:port"
            )
        job_id = _int(env, "SLURM_JOB_ID")
        # Same port JAX's own Slurm detection derives, so two jobs sharing a node rarely collide.
        default = DEFAULT_PORT if job_id is None else 61440 + job_id % 4096
        return f"{host}:{_port(env, default)}"

    return _Scheduler(
        name="slurm",
        num_processes=tasks,
        process_id=_int(env, "SLURM_PROCID"),
        local_device_ids=_per_gpu_device(env, tasks, nodes, "SLURM_LOCALID"),
        coordinator=coordinator,
    )


def _k8s_coordinator(env: Mapping[str, str], index: int) -> str:
    """DNS name of the pod with completion index 0, reachable through the headless service.

    In order: `JAXDIST_COORDINATOR` (handled by the caller); a JobSet, from `JOBSET_NAME` and
    `REPLICATED_JOB_NAME` (exposed from the pod labels `jobset.sigs.k8s.io/jobset-name` and
    `jobset.sigs.k8s.io/replicatedjob-name` by the downward API): JobSet names pods
    `<jobset>-<replicated job>-<job index>-<pod index>` under the subdomain `<jobset>` (or
    `JAXDIST_K8S_SUBDOMAIN` when `spec.network.subdomain` is set); a plain indexed Job, from
    `HOSTNAME` (`<job>-<index>`) and `JAXDIST_K8S_SUBDOMAIN` (the headless service's name).
    """
    subdomain = env.get(ENV_K8S_SUBDOMAIN, "").strip()
    jobset, rjob = env.get("JOBSET_NAME", "").strip(), env.get("REPLICATED_JOB_NAME", "").strip()
    if jobset and rjob:
        return f"{jobset}-{rjob}-0-0.{subdomain or jobset}:{_port(env)}"
    hostname = env.get("HOSTNAME", "").strip()
    suffix = f"-{index}"
    if subdomain and hostname.endswith(suffix):
        return f"{hostname[: -len(suffix)]}-0.{subdomain}:{_port(env)}"
    raise ConfigError(
        f"Kubernetes indexed Job (JOB_COMPLETION_INDEX={index}) without a coordinator: set "
        f"{ENV_COORDINATOR}=host:port, or JOBSET_NAME and REPLICATED_JOB_NAME (JobSet), or "
        f"{ENV_K8S_SUBDOMAIN}=<headless service name> (indexed Job, pod HOSTNAME <job>-<index>)"
    )


def _kubernetes(env: Mapping[str, str]) -> _Scheduler | None:
    if "JOB_COMPLETION_INDEX" not in env:
        return None
    index = _int(env, "JOB_COMPLETION_INDEX")
    return _Scheduler(
        name="kubernetes",
        num_processes=None,  # Kubernetes does not export completions: JAXDIST_NUM_PROCESSES
        process_id=index,
        local_device_ids=None,
        coordinator=lambda: _k8s_coordinator(env, index if index is not None else 0),
    )


_SCHEDULERS = (_openmpi, _slurm, _kubernetes)


def detect(
    env: Mapping[str, str] = os.environ,
    *,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> ClusterSpec:
    """Works out this process's place in the job from arguments and environment variables.

    Args:
      env: the environment to read (default `os.environ`); nothing else is consulted.
      coordinator_address: `host:port` (or `host`, port from `JAXDIST_COORDINATOR_PORT` or
        `DEFAULT_PORT`); wins over every variable.
      num_processes: wins over every variable.
      process_id: wins over every variable.

    Returns:
      The spec; `source="single"` (and `num_processes=1`) when nothing asks for more than one
      process.

    Raises:
      ConfigError: a variable is malformed, or the job has more than one process but the
        coordinator or this process's id cannot be found.
    """
    flags = {
        "coordinator_address": coordinator_address,
        "num_processes": num_processes,
        "process_id": process_id,
    }
    scheduler = next((s for s in (f(env) for f in _SCHEDULERS) if s is not None), None)
    layers = _layers(env, flags, scheduler)

    # Count and rank first: a one-process job needs no coordinator, so it must not fail on one.
    used: list[int] = []
    resolved: dict[str, object] = {}
    for field in ("num_processes", "process_id", "coordinator_address"):
        for i, (_, values) in enumerate(layers):
            if values.get(field) is not None:
                resolved[field] = values[field]
                used.append(i)
                break
        if field == "process_id" and _one_process(resolved, scheduler):
            return SINGLE
    source = layers[max(used)][0]
    n, pid = _checked_rank(resolved, f"(cluster source {source})")
    local_ids = _int_list(env, ENV_LOCAL_DEVICE_IDS)
    if local_ids is None and scheduler is not None and source == scheduler.name:
        local_ids = scheduler.local_device_ids
    return ClusterSpec(
        coordinator_address=_coordinator(resolved.get("coordinator_address"), env, n, source),
        num_processes=n,
        process_id=pid,
        local_device_ids=local_ids,
        source=source,
    )


def _layers(
    env: Mapping[str, str], flags: dict, scheduler: _Scheduler | None
) -> list[tuple[str, dict]]:
    """(source, fields) from the most specific to the least: flags, our variables, the scheduler."""
    ours = {
        "coordinator_address": env.get(ENV_COORDINATOR, "").strip() or None,
        "num_processes": _int(env, ENV_NUM_PROCESSES),
        "process_id": _int(env, ENV_PROCESS_ID),
    }
    layers: list[tuple[str, dict]] = [("flags", flags), ("env", ours)]
    if scheduler is not None:
        fields = {
            "num_processes": scheduler.num_processes,
            "process_id": scheduler.process_id,
            "coordinator_address": scheduler.coordinator,
        }
        layers.append((scheduler.name, fields))
    return layers


def _one_process(resolved: dict, scheduler: _Scheduler | None) -> bool:
    """True when no layer asks for more than one process; raises on a rank without a count."""
    n, pid = resolved.get("num_processes"), resolved.get("process_id")
    if n is None and scheduler is not None and scheduler.name == "kubernetes":
        raise ConfigError(
            f"Kubernetes indexed Job (JOB_COMPLETION_INDEX={pid}) but no process count: "
            f"set {ENV_NUM_PROCESSES} to the Job's completions"
        )
    if n is None and pid:
        raise ConfigError(f"process id {pid} but no process count: set {ENV_NUM_PROCESSES}")
    return n is None or n == 1


def _checked_rank(resolved: dict, where: str) -> tuple[int, int]:
    n, pid = resolved["num_processes"], resolved.get("process_id")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_processes={n} {where}: must be a positive integer")
    if pid is None:
        raise ConfigError(
            f"num_processes={n} {where} but no process id: set {ENV_PROCESS_ID} or pass process_id"
        )
    if not 0 <= pid < n:
        raise ConfigError(f"process_id={pid} {where}: must be in 0..{n - 1} for {n} processes")
    return n, pid


def _coordinator(address: object, env: Mapping[str, str], n: int, source: str) -> str:
    """`host:port` of process 0: a scheduler's (lazy) answer, or a given address with its port."""
    if callable(address):
        return address()
    if address is None:
        raise ConfigError(
            f"num_processes={n} (cluster source {source}) but no coordinator: set "
            f"{ENV_COORDINATOR}=host:port (the host of process 0) or pass coordinator_address"
        )
    return _with_port(address, env)


def cpu_devices_from_env(env: Mapping[str, str] = os.environ) -> int:
    """Simulated CPU devices per process that `scripts/launch.py` asked for (0 = not asked)."""
    return _int(env, ENV_CPU_DEVICES) or 0


# ---------------------------------------------------------------------------------------------
# Joining the job.

_lock = threading.Lock()
_spec: ClusterSpec | None = None  # set once initialize() has succeeded
_failure: ConfigError | None = None  # set once it has failed; JAX cannot be initialized twice


def _env_float(name: str) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number of seconds") from None


def _jax_initialize_kwargs(spec: ClusterSpec, timeout_s: float, heartbeat_s: float | None):
    import jax

    wanted = {
        "coordinator_address": spec.coordinator_address,
        "num_processes": spec.num_processes,
        "process_id": spec.process_id,
        "local_device_ids": list(spec.local_device_ids) if spec.local_device_ids else None,
        # We already did the detection; stop JAX from second-guessing it from SLURM_*/OMPI_*.
        "cluster_detection_method": "deactivate",
        # JAX's own deadline aborts the whole process (LOG(FATAL)), so it is kept well past ours:
        # by then our ConfigError has been raised and the process has normally exited.
        "initialization_timeout": int(timeout_s + max(30.0, timeout_s)),
    }
    if heartbeat_s is not None:
        wanted["heartbeat_timeout_seconds"] = int(heartbeat_s)
    # Keyword names drift between JAX releases: pass only those this one accepts.
    accepted = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in wanted.items() if k in accepted}


_exit_status: int | None = None  # non-zero once this process is known to be failing


def _note_exit_status(status: object) -> None:
    global _exit_status
    if status is None or status == 0:
        return
    _exit_status = status if isinstance(status, int) else 1


def _exit_now_if_failing() -> None:
    """At exit, before JAX's shutdown barrier: a failing process leaves at once (`os._exit`)."""
    status = _exit_status
    if status is None and getattr(sys, "last_value", None) is not None:
        # The interpreter records an uncaught exception here before running exit hooks.
        status = 130 if isinstance(sys.last_value, KeyboardInterrupt) else 1
    if status:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


def _install_fail_fast() -> None:
    """Lets a failing process exit at once instead of waiting in JAX's shutdown barrier.

    At exit JAX waits (up to 300 s) until every process reaches its shutdown barrier, so a process
    that raised, or called `sys.exit(3)`, would look alive to its launcher or scheduler while its
    peers block in their next collective. An exit hook that runs before JAX's (atexit is last-in
    first-out) skips the barrier with `os._exit(code)` when the process is failing; a clean exit
    keeps it. An uncaught exception is seen without any hook (`sys.last_value`). `sys.exit(n)` is
    not: Python gives exit hooks no exit status, so `sys.exit` gets a thin wrapper that records a
    non-zero status. That wrapper is the one process-wide patch, installed only once this process
    has joined a multi-process job. (A `sys.exit(n)` whose SystemExit the program catches and
    survives still counts as failing; `raise SystemExit(n)` is not seen.)
    """
    real_exit = sys.exit
    if getattr(real_exit, "_jaxdist_exit", False):
        return

    def exit_(status: object = None):
        _note_exit_status(status)
        real_exit(status)

    exit_._jaxdist_exit = True
    sys.exit = exit_
    atexit.register(_exit_now_if_failing)


def initialize(
    spec: ClusterSpec | None = None,
    *,
    timeout_s: float | None = None,
    heartbeat_timeout_s: float | None = None,
) -> ClusterSpec:
    """Joins this process to the job; call it first, before anything touches a device.

    One process: does nothing. Several: uses gloo for CPU collectives (unless
    `JAX_CPU_COLLECTIVES_IMPLEMENTATION` says otherwise) and calls `jax.distributed.initialize`.
    Calling it again returns the same spec. Once joined, a process that fails (uncaught exception,
    `sys.exit(n)` with n != 0) exits at once rather than in JAX's shutdown barrier.

    Args:
      spec: where this process sits; default `detect()`.
      timeout_s: seconds to wait for every process to join; default `JAXDIST_INIT_TIMEOUT_S` or 60.
      heartbeat_timeout_s: seconds without a heartbeat before JAX declares a peer dead; default
        `JAXDIST_HEARTBEAT_TIMEOUT_S` or JAX's own (100 s).

    Returns:
      The spec in force.

    Raises:
      ConfigError: the processes did not all join within `timeout_s` (one line naming this
        process and the coordinator address), or JAX refused (e.g. a device was already used).
        After a join timeout, JAX's own connect attempt is still running in the background and
        aborts the process `max(30, timeout_s)` seconds later: let the error end the program.
    """
    global _spec, _failure
    with _lock:
        if _failure is not None:
            raise _failure
        if _spec is not None:
            if spec is not None and spec != _spec:
                raise ConfigError(f"already initialized as {_spec}; cannot re-initialize as {spec}")
            return _spec
        spec = detect() if spec is None else spec
        if not spec.is_multiprocess:
            _spec = spec
            return spec

        if timeout_s is None:
            timeout_s = _env_float(ENV_INIT_TIMEOUT) or DEFAULT_TIMEOUT_S
        if heartbeat_timeout_s is None:
            heartbeat_timeout_s = _env_float(ENV_HEARTBEAT_TIMEOUT)

        _failure = _join(spec, timeout_s, heartbeat_timeout_s)
        if _failure is not None:
            raise _failure from _failure.__cause__
        _spec = spec
        logging.getLogger(__name__).info(
            "joined as process %d of %d via %s (coordinator %s)",
            spec.process_id,
            spec.num_processes,
            spec.source,
            spec.coordinator_address,
        )
        return spec


def port_in_use(port: int) -> bool:
    """True when a TCP listener on this host holds `port` on some address.

    JAX's coordination service binds `[::]:port` (every address, IPv4 included) on process 0, and
    a port already held there ends the process with a segfault instead of an exception; a test
    bind of the same address first turns that into a one-line error. SO_REUSEADDR keeps a port
    whose last connection lingers in TIME_WAIT usable, as it is for the service itself.
    """
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 on this host: the IPv4 probe decides
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                probe.bind((address, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
                continue
            return False
    return False


def _coordinator_port(address: str) -> int | None:
    """The port of a `host:port` or `[v6]:port` address; None when it has none."""
    tail = address.rsplit("]", 1)[-1] if address.startswith("[") else address
    _, sep, port = tail.rpartition(":")
    return int(port) if sep and port.isdigit() else None


def _join(spec: ClusterSpec, timeout_s: float, heartbeat_s: float | None) -> ConfigError | None:
    """Calls `jax.distributed.initialize` with a catchable deadline; the error, or None if joined."""
    import jax

    port = _coordinator_port(spec.coordinator_address or "")
    if spec.process_id == 0 and port is not None and port_in_use(port):
        return ConfigError(
            f"coordinator port {port} ({spec.coordinator_address}, from {spec.source}) is already "
            f"in use on this host, where process 0 serves the job's coordinator: stop what holds "
            f"it, or pick another port ({ENV_COORDINATOR_PORT}=N, {ENV_COORDINATOR}=host:N, or "
            "scripts/launch.py --coordinator_port=0 for a free one)"
        )

    if "JAX_CPU_COLLECTIVES_IMPLEMENTATION" not in os.environ:
        try:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except (AttributeError, KeyError, ValueError):
            pass  # a JAX without the option picks its own CPU collectives
    kwargs = _jax_initialize_kwargs(spec, timeout_s, heartbeat_s)
    who = f"process {spec.process_id} of {spec.num_processes}"
    # JAX blocks in C++ until everyone registers and aborts the process on its deadline, so the
    # call runs in a daemon thread and we keep our own, catchable deadline here.
    outcome: dict[str, BaseException | None] = {}

    def join() -> None:
        try:
            jax.distributed.initialize(**kwargs)
            outcome["error"] = None
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    _install_fail_fast()  # also spares a failed join JAX's slow teardown of the half-made client
    thread = threading.Thread(target=join, name="jaxdist-join", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return ConfigError(
            f"{who} did not join within {timeout_s:g} s: check coordinator address "
            f"{spec.coordinator_address} (from {spec.source}) is reachable and that all "
            f"{spec.num_processes} processes started"
        )
    error = outcome.get("error")
    if error is None:
        return None
    first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
    failure = ConfigError(
        f"{who} could not join the job at {spec.coordinator_address}: {first_line}"
    )
    failure.__cause__ = error
    return failure


def _current() -> ClusterSpec:
    """This process's spec without touching a device: ours, JAX's, else the environment's."""
    if _spec is not None:
        return _spec
    try:
        import jax

        if jax.distributed.is_initialized():  # someone called jax.distributed directly
            return ClusterSpec(None, jax.process_count(), jax.process_index(), source="flags")
    except (ImportError, AttributeError):
        pass
    try:
        return detect()
    except ConfigError:
        return SINGLE


def is_main_process() -> bool:
    """True on process 0 (and in a one-process run): the one that writes metrics, logs, configs."""
    return _current().process_id == 0


def log_prefix() -> str:
    """Returns "" on process 0 and "[p1/2] " on process 1 of 2, for lines every process prints."""
    spec = _current()
    if spec.process_id == 0:
        return ""
    return f"[p{spec.process_id}/{spec.num_processes}] "


class _PrefixFilter(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "_jaxdist_prefixed", False):
            record.msg = f"{self.prefix}{record.msg}"
            record._jaxdist_prefixed = True
        return True


def setup_logging(*, quiet: bool = False) -> None:
    """Makes logging on processes other than 0 either quiet or labelled; a no-op on process 0.

    Args:
      quiet: True raises the threshold of Python and absl logging to WARNING; False prefixes every
        record with `log_prefix()` (on the root logger's handlers and absl's handler).
    """
    if is_main_process():
        return
    try:
        import absl.logging as absl_logging
    except ImportError:
        absl_logging = None
    if quiet:
        logging.getLogger().setLevel(logging.WARNING)
        if absl_logging is not None:
            absl_logging.set_verbosity(absl_logging.WARNING)
        return
    handlers = list(logging.getLogger().handlers)
    if absl_logging is not None:
        handlers.append(absl_logging.get_absl_handler())
    prefix_filter = _PrefixFilter(log_prefix())
    for handler in handlers:
        if not any(isinstance(f, _PrefixFilter) for f in handler.filters):
            handler.addFilter(prefix_filter)


def gc_after_imports() -> None:
    """For a script whose imports are done, before it traces anything: moves every object alive
    now (the imported modules' functions, classes and constants: about 150,000 once train.py has
    imported the loop) out of Python's cyclic collector (`gc.freeze`), and collects the youngest
    generation every 20,000 net allocations instead of 700. Tracing and lowering a train step
    allocate millions of short-lived objects; with the defaults each older-generation pass
    rescans the whole import-time heap. Cycles are still collected, later. `scripts/train.py`
    with the default config, 4 steps on a CPU: 0.944 of the CPU time (`farm-bench -n 6 --vs`,
    2026-11-28; about 0.96 from the freeze alone), peak memory 517 against 514 MiB.
    """
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)


def reached_preemption_point(step: int) -> bool:
    """True on every process at the same step once any of them got SIGTERM (checkpoint, then exit).

    With several processes JAX's preemption service catches SIGTERM instead of dying on it, so a
    loop that never asks keeps running until SIGKILL. One process: always False.
    """
    if not _current().is_multiprocess:
        return False
    from jax.experimental import multihost_utils

    return bool(multihost_utils.reached_preemption_sync_point(step))


def _reset_for_tests(spec: ClusterSpec | None = None) -> None:
    """Forgets what initialize() recorded (JAX's own state is untouched)."""
    global _spec, _failure
    _spec, _failure = spec, None


__all__ = [
    "ClusterSpec",
    "DEFAULT_PORT",
    "cpu_devices_from_env",
    "detect",
    "expand_nodelist",
    "initialize",
    "is_main_process",
    "log_prefix",
    "port_in_use",
    "reached_preemption_point",
    "setup_logging",
]
