"""The Ray DPP backend (`dsi.backend=ray`): one master per job, workers on any host of a Ray cluster.

  master   a named Ray actor (RayMaster, in namespace dsi.ray.namespace) created by rank 0 on its own node (so that it
           lives as long as the job does) and found by name by every rank's client; it runs the same policy as the
           local backend (neocfg/data/dpp/master.py) in a thread that hands tasks to worker actors and waits on their
           results
  workers  Ray actors (DppWorkerActor) with the CPUs and memory of the planned worker shape, scaled down with a
           warning where the cluster has less; a worker that dies (ray.kill, a lost node) fails its task's result,
           and the master requeues the task and starts a replacement, as the local backend does for processes
  batches  the master never holds rows: a worker puts a split's rows in Ray's object store itself (it owns them)
           and returns their metadata with a reference to them; the master reads the metadata and hands the
           reference on to the client that pulls the split, which fetches the rows from the worker's node; once
           the client dropped its reference, Ray frees them. Rows that cannot be fetched (their node, object
           store or worker was lost: ObjectLostError, ObjectReconstructionFailedError, OwnerDiedError,
           ActorDiedError; or not within fetch_timeout_s) were never delivered: the client hands the split back and
           the master queues it again, to be re-read from storage by a live worker
  cluster  dsi.ray.address=null: rank 0 starts a Ray of its own for the run (address="local", whatever else runs on
           the machine; token authentication with a token made for the run, shared with the other ranks), shut down
           at the end; "auto" or "host:port" joins a running cluster (`ray start --head`); rank 0 says which

Every split goes to exactly one client (rank) per epoch. Per batch nothing crosses to the master: a client pulls a
split when it has no rows left, reporting the splits it delivered whole and the time it waited (and, as it gets
one, asks for the next one and fetches its rows in a background thread: RayDppService.pull). A checkpoint is the
one barrier: every rank sends its record of what it consumed (progress.Consumed) after the same step, and each gets
the job's Position back (stored in every rank's checkpoint; a resumed job's master starts from it).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from neocfg.config.dsi import DsiConfig
from neocfg.data.arrays import BatchArrays
from neocfg.data.dpp.loop import EventKind, PoolEvent, ServiceLoop
from neocfg.data.dpp.master import DataStall, DppStats, ServiceSetup
from neocfg.data.dpp.progress import Consumed, Finished, Position, Task
from neocfg.data.dpp.sizing import PlannedDpp
from neocfg.data.dpp.worker import Piece, SplitReader, SplitResult, WorkerSpec
from neocfg.errors import DataError

# A Ray started for the run: no usage-stats prompt (and no dashboard: ray.init below); its GCS, raylet and workers
# listen on every interface (Ray binds its gRPC servers there), so they require a token made for the run
# (Ray's token authentication, https://docs.ray.io/en/latest/ray-security/token-auth.html).
LOCAL_RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}
AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV = "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"
# Bytes of randomness in the run's token (hex: twice as many characters).
AUTH_TOKEN_BYTES = 32
# A client that cannot fetch a pulled split's rows within FETCH_MIN_S plus their stored bytes at FETCH_MIN_BYTES_PER_S
# hands the split back, to be read again by a live worker, instead of waiting for Ray to declare the rows' node dead
# (its health checks: 5 missed checks 3 s apart by default, about 15 s, and longer for a host that hangs). A split's
# rows arrive in milliseconds from a live node (a few MB); the floor leaves room for a busy host, and a false
# timeout costs one split read again.
FETCH_MIN_S = 5.0
FETCH_MIN_BYTES_PER_S = 10e6


def fetch_timeout_s(bytes_read: int) -> float:
    return FETCH_MIN_S + bytes_read / FETCH_MIN_BYTES_PER_S


# The master's loop wakes at least this often (seconds) to check timeouts, scaling and shutdown.
TICK_S = 0.05
# A client blocked in pull is woken by every change it waits for (a finished split, the end, an error); it also
# wakes this often (seconds) as a safety net. Shorter costs the master CPU per waiting client (with a 0.05 s wake-up
# its CPU per split grew from 3.0 ms with 16 clients to 5.7 ms with 64: bench_dpp_clients.py).
PULL_WAKE_S = 1.0
# An idle worker actor is asked for its pid this often (seconds), so that one whose process or node died while it had
# no split is noticed and replaced then, not when a split is next sent to it (with the buffer full, the first idle
# workers get every split and a dead one further down could go unnoticed to the end of the run).
IDLE_PING_S = 1.0
# A client's background ask for its next split waits at most this long per call before asking again (so that it
# notices close; a split is handed to it the moment one is ready, whatever this is).
AHEAD_WAIT_S = 1.0
# Concurrent calls into the master actor: per client a pull that may wait and one short call (the pull asked
# ahead, a checkpoint, leave), and a few more (stats, rank 0's stop). Fewer threads than waiting pulls would hold
# back the pull that reports the last split of a finite run until the others time out. Each thread that ran a call
# keeps about 88 KiB of the master's memory (docs/dpp.md, many trainer clients).
MASTER_CALLS_PER_CLIENT, MASTER_SPARE_CALLS = 2, 8


def master_concurrency(num_clients: int) -> int:
    return MASTER_CALLS_PER_CLIENT * num_clients + MASTER_SPARE_CALLS
# How long a rank's client looks for the master actor that rank 0 creates (seconds).
FIND_MASTER_S = 120.0
# How long rank 0 waits at close for the other ranks' clients to leave before it stops the service (seconds).
LEAVE_WAIT_S = 30.0


@dataclass(frozen=True)
class WorkerResources:
    """What one worker actor asks of the cluster."""

    cpus: float
    memory_bytes: int


@dataclass(frozen=True)
class RayOptions:
    namespace: str
    master_name: str
    owner: bool                  # this rank creates (and at the end removes) the master
    resources: WorkerResources
    client: int = 0              # this rank's client index
    joined: bool = False         # connect() started or joined Ray in this process: shut it down (or leave) at close


_saved_auth: Optional[dict[str, Optional[str]]] = None


def set_ray_auth(env: dict[str, Optional[str]]) -> None:
    """Set (value) or unset (None) Ray's auth variables in this process and make Ray re-read them (it reads them
    once at import otherwise): what Ray's own tests do to switch authentication modes in one process."""
    from ray._raylet import AuthenticationTokenLoader, Config

    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _run_auth(token: str) -> None:
    """This process uses the run's token (saving what the auth variables were, restored by leave_ray)."""
    global _saved_auth
    keys = (AUTH_MODE_ENV, AUTH_TOKEN_ENV, AUTH_TOKEN_PATH_ENV)
    if _saved_auth is None:
        _saved_auth = {k: os.environ.get(k) for k in keys}
    set_ray_auth({AUTH_MODE_ENV: "token", AUTH_TOKEN_ENV: token, AUTH_TOKEN_PATH_ENV: None})


def start_local_ray(object_store_mb: int, num_cpus: Optional[int] = None, namespace: Optional[str] = None
                    ) -> tuple[str, str]:
    """Start a Ray of this run's own (address="local": never a cluster already running here; no prompts, no
    dashboard), whose servers require a token made for the run. Returns its address and that token, for the other
    ranks to join with."""
    for k, v in LOCAL_RAY_ENV.items():
        os.environ.setdefault(k, v)
    token = secrets.token_hex(AUTH_TOKEN_BYTES)
    _run_auth(token)
    ctx = ray.init(address="local", num_cpus=num_cpus or os.cpu_count() or 1,
                   object_store_memory=object_store_mb * 2**20, include_dashboard=False, namespace=namespace,
                   logging_level=logging.WARNING, log_to_driver=False, configure_logging=True)
    return ctx.address_info["gcs_address"], token


def join_ray(address: str, namespace: str, token: Optional[str] = None) -> None:
    """Join a cluster: the run's own (with its token) or one the user runs (with the user's Ray auth settings)."""
    if token is not None:
        _run_auth(token)
    if not ray.is_initialized():
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)


def leave_ray() -> None:
    """Disconnect (a run's own Ray stops with its last driver) and restore the auth variables _run_auth changed."""
    global _saved_auth
    ray.shutdown()
    if _saved_auth is not None:
        set_ray_auth(_saved_auth)
        _saved_auth = None


def fit_workers(sizing: Optional[PlannedDpp], workers: int, nodes: list[dict[str, float]]
                ) -> tuple[WorkerResources, str]:
    """The planned shape's CPUs and memory per worker, scaled down (with a warning) so that every worker can be
    placed on the cluster's nodes (`nodes`: each alive node's resources), not only within its totals: the workers
    are spread over the nodes with CPUs in proportion to them, and each gets what its node has per worker there."""
    want_cpus = sizing.cores_per_host if sizing else 1.0
    want_mem = (sizing.memory_gib_per_host if sizing else 1.0) * 2**30
    hosts = [n for n in nodes if n.get("CPU", 0.0) > 0] or [{"CPU": 1.0}]
    cpu = [n["CPU"] for n in hosts]
    mem = [n.get("memory", want_mem * workers) for n in hosts]
    if sum(min(math.floor(c / want_cpus), math.floor(m / want_mem)) for c, m in zip(cpu, mem)) >= workers:
        return WorkerResources(cpus=want_cpus, memory_bytes=int(want_mem)), ""
    per_node = [0] * len(hosts)
    for _ in range(workers):  # the next worker goes where the most CPU per worker would be left
        i = max(range(len(hosts)), key=lambda j: cpu[j] / (per_node[j] + 1))
        per_node[i] += 1
    used = [i for i, k in enumerate(per_node) if k]
    cpus = max(math.floor(min(want_cpus, *(cpu[i] / per_node[i] for i in used)) * 100) / 100, 0.01)
    memory = min(want_mem, *(mem[i] / per_node[i] for i in used)) // 2**20 * 2**20
    what = sizing.shape.split(" x ")[-1] if sizing else "the default worker"
    return WorkerResources(cpus=cpus, memory_bytes=int(memory)), (
        f"warning: DPP worker shape {what} asks {want_cpus:g} CPUs and {want_mem / 2**30:g} GiB per worker; the Ray "
        f"cluster has {sum(cpu):g} CPUs and {sum(mem) / 2**30:.1f} GiB on {len(hosts)} node(s) with CPUs for "
        f"{workers} workers: each gets {cpus:g} CPUs and {memory / 2**30:.1f} GiB")


def alive_nodes() -> list[dict[str, float]]:
    """The resources of each alive node of the cluster this process joined."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def connect(dsi: DsiConfig, rank: int, share: Callable[[Any], Any], sizing: Optional[PlannedDpp],
            workers: int) -> tuple[RayOptions, str]:
    """Collective over the ranks: rank 0 starts or joins Ray and names the job's master; every rank joins.
    Returns this rank's options and rank 0's lines to say (which Ray it uses, the resource warning; '' elsewhere)."""
    said, info = "", None
    if rank == 0:
        token: Optional[str] = None
        if dsi.ray.address is None:
            address, token = start_local_ray(dsi.ray.object_store_mb, namespace=dsi.ray.namespace)
            said = (f"DPP: started a Ray of this run's own at {address} (dsi.ray.address=null; token authentication, "
                    f"stopped at the end)")
        else:
            join_ray(dsi.ray.address, dsi.ray.namespace)
            address = dsi.ray.address
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            said = (f"DPP: joined the Ray cluster at {dsi.ray.address} (dsi.ray.address; "
                    f"{nodes} node(s), {ray.cluster_resources().get('CPU', 0):g} CPUs)")
        resources, warning = fit_workers(sizing, workers, alive_nodes())
        said = "\n".join(x for x in (said, warning) if x)
        info = (ray.get_runtime_context().gcs_address, token, f"neocfg-dpp-{uuid.uuid4().hex[:12]}", resources)
    address, token, name, resources = share(info)
    if rank != 0:
        join_ray(address, dsi.ray.namespace, token)
    return RayOptions(namespace=dsi.ray.namespace, master_name=name, owner=rank == 0, resources=resources,
                      client=rank, joined=True), said


# ---------------------------------------------------------------------------------------------------- worker actor
class DppWorker:
    """A stateless worker: process one task, return (metadata, a reference to the rows) or ("error", message).

    The rows go into the object store from here, so that this worker owns them, not the master that called it: an
    object a caller owns from a task's return stays in the caller's in-process memory store after the last
    reference to it is gone when it was small enough to be returned inline and was handed to another process (the
    master's resident memory grew by one split's rows per split served; see docs/dpp.md)."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.reader = SplitReader(spec)

    def process(self, task: Task) -> tuple[Any, Any]:
        try:
            result = self.reader.process(task)
        except DataError as exc:
            return "error", str(exc)
        except Exception as exc:  # noqa: BLE001 - any failure on a split is that split's error
            return "error", f"{task.split.where}: {type(exc).__name__}: {exc}"
        return result.meta(), ray.put(result)

    def pid(self) -> int:
        return os.getpid()

    def node(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()


DppWorkerActor = ray.remote(max_restarts=0)(DppWorker)


# ---------------------------------------------------------------------------------------------------- master actor
class RayPool:
    """Worker actors (loop.WorkerPool): a worker is ready once its first call returns; a split comes back as its
    metadata and a reference to rows the worker owns, which the pool hands on without reading them."""

    what = "Ray worker actors"

    def __init__(self, spec: WorkerSpec, resources: WorkerResources) -> None:
        self.spec, self.resources = spec, resources
        self.handles: dict[int, Any] = {}
        self._waiting: dict[int, tuple[Any, bool]] = {}  # wid -> (the ref it is waited on by, a split's result)
        self._pings: dict[int, Any] = {}  # wid -> the ref of a liveness call to an idle worker
        self._heard: dict[int, float] = {}  # wid -> when it last answered (time.monotonic())
        self._next_wid = 0

    def spawn(self) -> int:
        wid = self._next_wid
        self._next_wid += 1
        handle = DppWorkerActor.options(num_cpus=self.resources.cpus, memory=self.resources.memory_bytes,
                                        name=None).remote(self.spec)
        self.handles[wid] = handle
        self._waiting[wid] = (handle.pid.remote(), False)
        return wid

    def send(self, wid: int, task: Task) -> None:
        self._waiting[wid] = (self.handles[wid].process.remote(task), True)

    def poll(self, timeout_s: float) -> list[PoolEvent]:
        self._ping_idle(time.monotonic())
        refs = {ref: wid for wid, (ref, _) in self._waiting.items()}
        pings = {ref: wid for wid, ref in self._pings.items()}
        if not refs and not pings:
            time.sleep(timeout_s)
            return []
        # as soon as one worker is done (it gets its next split), with any others done by then
        done, rest = ray.wait([*refs, *pings], num_returns=1, timeout=timeout_s)
        if done and rest:
            done += ray.wait(rest, num_returns=len(rest), timeout=0)[0]
        events = []
        for ref in done:
            if ref in pings:
                events += self._pinged(pings[ref], ref)
                continue
            wid = refs[ref]
            if wid not in self._waiting:  # its failed ping, earlier in this batch, reported it gone already
                continue
            _, split = self._waiting.pop(wid)
            try:
                got = ray.get(ref)
            except RayError as exc:
                self._forget(wid)
                events.append(PoolEvent(EventKind.gone, wid, message=_reason(exc)))
                continue
            self._heard[wid] = time.monotonic()
            if not split:
                events.append(PoolEvent(EventKind.ready, wid))
            elif isinstance(got[0], str):  # ("error", message)
                events.append(PoolEvent(EventKind.failed, wid, message=got[1]))
            else:
                events.append(PoolEvent(EventKind.done, wid, meta=got[0], payload=got[1]))
        return events

    def _ping_idle(self, now: float) -> None:
        """Ask each worker that is ready and idle, and was last heard from IDLE_PING_S ago, whether it is alive."""
        for wid, handle in self.handles.items():
            if wid not in self._waiting and wid not in self._pings and now - self._heard.get(wid, now) >= IDLE_PING_S:
                self._pings[wid] = handle.pid.remote()
                self._heard[wid] = now

    def _pinged(self, wid: int, ref: Any) -> list[PoolEvent]:
        self._pings.pop(wid, None)
        if wid not in self.handles:  # gone or killed meanwhile
            return []
        try:
            ray.get(ref)
        except RayError as exc:  # it died with no split (a split it got since is requeued by the loop)
            self._forget(wid)
            return [PoolEvent(EventKind.gone, wid, message=f"{_reason(exc)} (found by the idle check)")]
        self._heard[wid] = time.monotonic()
        return []

    def _forget(self, wid: int) -> Any:
        """Drop everything the pool keeps of a worker; its handle (None if it had none)."""
        self._waiting.pop(wid, None)
        self._pings.pop(wid, None)
        self._heard.pop(wid, None)
        return self.handles.pop(wid, None)

    def kill(self, wid: int) -> None:
        handle = self._forget(wid)
        if handle is not None:
            ray.kill(handle, no_restart=True)

    def close(self) -> None:
        for wid in list(self.handles):
            self.kill(wid)


class RayMasterImpl:
    """The job's master: the worker loop over worker actors, and the clients' calls (threaded actor)."""

    def __init__(self, setup: ServiceSetup, resources: WorkerResources) -> None:
        self.setup = setup
        self.loop = ServiceLoop(setup, RayPool(setup.spec, resources), tick_s=TICK_S, wake_s=PULL_WAKE_S)
        self.cond = threading.Condition()  # the checkpoint barrier and leaving clients
        self._left: set[int] = set()
        self._reports: dict[int, dict[int, Consumed]] = {}
        self._positions: dict[int, dict[str, Any]] = {}
        self.loop.start()

    # ---- clients (actor threads) -------------------------------------------------------------------------------
    def pull(self, client: int, timeout_s: float, finished: list[Finished], waited: float = 0.0
             ) -> tuple[str, Any, Any, int]:
        """('split', meta, rows ref, complete_below) | ('end', ...) | ('error', message, ...) | ('timeout', ...).
        `finished`: splits the client delivered whole since its last pull; `waited`: seconds it waited meanwhile."""
        try:
            got = self.loop.pull(client, timeout_s, finished, waited)
        except DataStall as exc:
            return "timeout", str(exc), None, 0
        except DataError as exc:
            return "error", str(exc), None, 0
        if got is None:
            return "end", None, None, 0
        return "split", got.meta, got.payload, got.complete_below

    def report(self, client: int, finished: list[Finished], waited: float) -> None:
        """Splits the client delivered whole, and the seconds it waited, while its ask for the next split waits."""
        self.loop.report(client, finished, waited)

    def lost_rows(self, task: Task, reason: str) -> None:
        """A client could not fetch this split's rows (nothing of it was delivered): read it again."""
        self.loop.reread(task, reason)

    def report_wait(self, client: int, seconds: float) -> None:
        self.loop.report_wait(client, seconds)

    def checkpoint(self, client: int, step: int, record: Consumed, timeout_s: float) -> Optional[dict[str, Any]]:
        """Barrier: once every client sent its record after `step` batches, the job's Position (None on timeout)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            self._reports.setdefault(step, {})[client] = record
            self.cond.notify_all()
            while step not in self._positions:
                if len(self._reports[step]) == self.setup.num_clients:
                    records = self._reports[step]
                    pos = Position.merge([records[c] for c in sorted(records)], len(self.setup.splits))
                    self._positions = {step: pos.to_state()}
                    self._reports = {s: r for s, r in self._reports.items() if s > step}
                    self.cond.notify_all()
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cond.wait(min(left, TICK_S))
            return self._positions[step]

    def stats(self) -> DppStats:
        return self.loop.stats()

    def pid(self) -> int:
        """The master actor's process (benchmarks read its CPU time and memory)."""
        return os.getpid()

    def workers_ready(self) -> int:
        return self.loop.workers_ready()

    def held_objects(self) -> tuple[int, int]:
        """Objects in this actor's in-process memory store and their bytes: what the master keeps of the splits it
        served. A few, whatever the number of splits, as the rows belong to their workers (had the master owned
        them, one split's rows per split served would stay here: DppWorker)."""
        core = ray._private.worker.global_worker.core_worker
        return core.get_memory_store_size(), core.get_local_memory_store_bytes_used()

    def worker_handles(self, busy_only: bool = False) -> list[Any]:
        pool: RayPool = self.loop.pool  # type: ignore[assignment]
        with self.loop.cond:
            return [pool.handles[w] for w, slot in self.loop.slots.items()
                    if w in pool.handles and (slot.task is not None or not busy_only)]

    def leave(self, client: int) -> None:
        with self.cond:
            self._left.add(client)
            self.cond.notify_all()

    def stop(self, wait_for: int, timeout_s: float) -> None:
        """Wait (bounded) until `wait_for` other clients left, then stop every worker."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while len(self._left) < wait_for and time.monotonic() < deadline:
                self.cond.wait(TICK_S)
        self.loop.stop()


# Created with .options(max_concurrency=master_concurrency(num_clients)).
RayMaster = ray.remote(num_cpus=0, max_restarts=0)(RayMasterImpl)


def _reason(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


# ---------------------------------------------------------------------------------------------------- client side
class Answer(Enum):
    """What one ask of the master came to, rows fetched."""

    split = "split"      # a split, its rows fetched into this process
    end = "end"          # a finite service delivered everything
    timeout = "timeout"  # nothing was ready within the ask's wait
    lost = "lost"        # its rows could not be fetched: handed back, to be read again
    error = "error"      # a bad split, a failed loop, the master gone: the message


class RayDppService:
    """A rank's view of the job-wide service (the DppBackend its client calls)."""

    def __init__(self, setup: ServiceSetup, options: RayOptions) -> None:
        self.setup, self.options = setup, options
        self.master: Any = None
        self._closed = False
        self._lock = threading.Lock()
        self._waited = 0.0  # seconds waited since the last pull, sent with the next one (guarded by _lock)
        self.rereads = 0    # splits this client handed back because their rows could not be fetched
        self.pulled = 0     # splits this client received (skipped ones included)
        self._ahead: Optional[Future] = None  # the next split, being asked for and fetched in the background
        self._fetcher: Optional[ThreadPoolExecutor] = None

    def start(self) -> None:
        o = self.options
        if o.owner:  # on this node: the master lives as long as rank 0 does, whichever other node is lost
            here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
            self.master = RayMaster.options(name=o.master_name, namespace=o.namespace, scheduling_strategy=here,
                                            max_concurrency=master_concurrency(self.setup.num_clients)
                                            ).remote(self.setup, o.resources)
            return
        deadline = time.monotonic() + FIND_MASTER_S
        while True:
            try:
                self.master = ray.get_actor(o.master_name, namespace=o.namespace)
                return
            except ValueError:
                if time.monotonic() > deadline:
                    raise DataError(f"DPP: no master actor {o.master_name!r} in Ray namespace {o.namespace!r} after "
                                    f"{FIND_MASTER_S:.0f} s (rank 0 creates it)") from None
                time.sleep(0.2)

    def _ask(self, client: int, timeout_s: float, finished: list[Finished]) -> Any:
        with self._lock:
            waited, self._waited = self._waited, 0.0
        return self.master.pull.remote(client, timeout_s, finished, waited)

    def _fetch(self, call: Any, timeout_s: float) -> tuple[Answer, Any]:
        """The master's answer to one pull, with the split's rows fetched and copied (a SplitResult)."""
        try:
            kind, meta, ref, below = ray.get(call, timeout=timeout_s + 60)
        except (RayActorError, GetTimeoutError) as exc:
            return Answer.error, f"DPP: the job's master actor is gone ({_reason(exc)})"
        if kind != "split":
            return Answer(kind), meta
        if ref is None:
            result = SplitResult.skipped_split(meta)
        else:
            try:
                result = ray.get(ref, timeout=fetch_timeout_s(meta.bytes_read))
            except (RayError, GetTimeoutError) as exc:  # the rows' node or object store is gone: read it again
                self.rereads += 1
                self.master.lost_rows.remote(meta.task, f"{meta.task.split.where}: {_reason(exc)}")
                return Answer.lost, None
            # Object-store arrays are read-only views; the trainer gets its own, writable copies.
            result.pieces = [Piece(p.start, _copy(p.arrays)) for p in result.pieces]
        result.complete_below = below
        return Answer.split, result

    def _take(self, client: int, finished: list[Finished], wait_s: float, deadline: float) -> tuple[Answer, Any]:
        """Ask for a split (reporting `finished`), each ask waiting up to wait_s, again while none was ready or its
        rows were lost, until one comes, the end, an error, the deadline or close."""
        while True:
            answer, got = self._fetch(self._ask(client, wait_s, finished), wait_s)
            finished = []
            left = deadline - time.monotonic()
            if answer not in (Answer.timeout, Answer.lost) or left <= 0 or self._closed:
                return answer, got
            wait_s = min(wait_s, left)

    def _take_ahead(self, client: int, finished: list[Finished]) -> tuple[Answer, Any]:
        """The next split, in the background: asked for and its rows fetched and copied while the trainer uses
        this one, so that neither the master's round trip nor the fetch is on the trainer's wait."""
        try:
            return self._take(client, finished, AHEAD_WAIT_S, math.inf)
        except Exception as exc:  # noqa: BLE001 - said by the pull that collects it (e.g. Ray shut down at close)
            return Answer.error, f"DPP: fetching the next split failed: {type(exc).__name__}: {exc}"

    def pull(self, client: int, timeout_s: float, finished: list[Finished]) -> Optional[SplitResult]:
        """The split asked for ahead (with the previous one) when it came, else a pull that waits up to timeout_s;
        then the next split is asked for and fetched in the background (_take_ahead). While the background ask
        still waits, `finished` is reported at once (a finite run ends on that report). A split taken ahead and
        never used (the run stops) was not delivered: a checkpoint's position does not hold it, and a resumed job
        reads it again."""
        deadline = time.monotonic() + timeout_s
        ahead, self._ahead = self._ahead, None
        answer, got = Answer.timeout, None
        if ahead is not None:
            if finished and not ahead.done():
                with self._lock:
                    waited, self._waited = self._waited, 0.0
                self.master.report.remote(client, finished, waited)
                finished = []
            try:
                answer, got = ahead.result(timeout=timeout_s)
            except FutureTimeout:
                self._ahead = ahead  # still asking: the next pull takes it
                raise DataStall(f"DPP: no batch for {timeout_s:.0f} s (dsi.stall_timeout_s)") from None
        if answer in (Answer.timeout, Answer.lost):
            answer, got = self._take(client, finished, max(deadline - time.monotonic(), 0.0), deadline)
            finished = []
        if answer is Answer.end:
            return None
        if answer is Answer.timeout:
            raise DataStall(got or f"DPP: no batch for {timeout_s:.0f} s (dsi.stall_timeout_s)")
        if answer is not Answer.split:
            raise DataError(got)
        self.pulled += 1
        if not self._closed:
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpp-ahead")
            self._ahead = self._fetcher.submit(self._take_ahead, client, finished)
        return got

    def report_wait(self, client: int, seconds: float) -> None:
        with self._lock:
            self._waited += seconds

    def position(self, step: int, records: dict[int, Consumed]) -> Position:
        (client, record), = records.items()
        timeout = self.setup.limits.stall_timeout_s
        state = ray.get(self.master.checkpoint.remote(client, step, record, timeout))
        if state is None:
            raise DataError(f"DPP: not every rank reported step {step} to the master within {timeout:.0f} s "
                            f"(dsi.stall_timeout_s)")
        return Position.from_state(state)

    def stats(self) -> DppStats:
        return ray.get(self.master.stats.remote())

    def worker_handles(self, busy_only: bool = False) -> list[Any]:
        return ray.get(self.master.worker_handles.remote(busy_only))

    def workers_ready(self) -> int:
        return ray.get(self.master.workers_ready.remote())

    def close(self) -> None:
        if self._closed or self.master is None:
            return
        self._closed = True
        try:
            if self.options.owner:
                ray.get(self.master.stop.remote(self.setup.num_clients - 1, LEAVE_WAIT_S))
                ray.kill(self.master, no_restart=True)
            else:
                ray.get(self.master.leave.remote(self.options.client), timeout=10)
        except RayError:
            pass
        if self._fetcher is not None:  # its ask returns within AHEAD_WAIT_S, now that the service stops or we left
            self._fetcher.shutdown(wait=True, cancel_futures=True)
        self._ahead = None
        if self.options.joined:
            leave_ray()


def _copy(a: BatchArrays) -> BatchArrays:
    return BatchArrays(dense=np.array(a.dense), lengths=np.array(a.lengths), values=np.array(a.values),
                       labels=np.array(a.labels), sample_ids=np.array(a.sample_ids),
                       weights=None if a.weights is None else np.array(a.weights))
