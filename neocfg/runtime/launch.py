"""Starting ranks. On cpu_local, neocfg spawns hardware.devices_per_node local processes joined by a gloo group
through a rendezvous store that the launching process holds on a localhost port; under torchrun (RANK and
WORLD_SIZE in the environment) it joins the launcher's group (NCCL on CUDA; gloo where the machine has no CUDA, e.g.
a GPU preset's ranks on CPUs), so the same command scales out with torch.distributed's own launcher. A GPU rank
makes its device current before it creates its process group, and binds the group to it (device_id).

A rank that raises a NeocfgError reports its one-line message (any other exception: its type and message); a rank
that dies makes the launcher stop the others and fail (exit non-zero) instead of leaving them blocked in a
collective; collectives time out after train.collective_timeout_s in any case.

Supervision: the ranks die with their launcher (PR_SET_PDEATHSIG: even a SIGKILLed `neocfg` leaves no rank
training and writing checkpoints); they ignore Ctrl-C (the terminal sends SIGINT to the whole process group) and
leave quietly on SIGTERM, so that Ctrl-C or SIGTERM to `neocfg` stops every rank and ends in one line.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from neocfg.errors import ConfigError, Interrupted, NeocfgError
from neocfg.logs import quiet_library_logs
from neocfg.types import Backend

if TYPE_CHECKING:
    from neocfg.config.hardware import HardwareConfig


class RankFailedError(NeocfgError):
    exit_code = 6


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    device: torch.device


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check_single_host(hw: "HardwareConfig") -> None:
    """Without torchrun, neocfg starts every rank on this host: refuse a preset that spans several nodes (its ranks
    would all land here and fail in set_device) and say how to start it."""
    if hw.nodes > 1 and not under_torchrun():
        raise ConfigError("hardware", hw.name,
                          f"spans {hw.nodes} nodes x {hw.devices_per_node} devices, and without torchrun neocfg "
                          f"starts ranks on this host only; on every node run `torchrun --nnodes {hw.nodes} "
                          f"--nproc-per-node {hw.devices_per_node} --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                          f"-m neocfg mode=train hardware={hw.name} ...`")


LOCALHOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOCALHOST, 0))
        return s.getsockname()[1]


def _device(backend: Backend, local_rank: int) -> torch.device:
    """This rank's device, made current (before its process group exists: NCCL binds the group to it)."""
    if backend is Backend.nccl:
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def effective_backend(backend: Backend) -> Backend:
    """The hardware's backend, or gloo on a machine without CUDA (a GPU preset's ranks under torchrun on CPUs)."""
    return Backend.gloo if backend is Backend.nccl and not torch.cuda.is_available() else backend


def init_group(backend: Backend, device: torch.device, timeout_s: float, **kwargs: Any) -> None:
    """The default process group, bound to this rank's device where it is a GPU (device_id: NCCL connects
    eagerly to it instead of guessing the device at the first collective)."""
    dist.init_process_group(backend.value, timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None, **kwargs)


# How many runs of a sweep train at once on this host (set by launch() for its ranks, from the Hydra launcher).
PARALLEL_RUNS_ENV = "NEOCFG_PARALLEL_RUNS"


def _threads_per_rank(local_world: int) -> int:
    runs = max(1, int(os.environ.get(PARALLEL_RUNS_ENV, "1")))
    return max(1, (os.cpu_count() or 1) // (local_world * runs))


def parallel_runs() -> int:
    """Runs of this sweep that a parallel Hydra launcher on this host runs at once (hydra/launcher=joblib:
    hydra.launcher.n_jobs, -1 meaning one per core); 1 outside a sweep or under a sequential launcher."""
    try:
        from hydra.core.hydra_config import HydraConfig

        n_jobs = HydraConfig.get().launcher.get("n_jobs")
    except Exception:  # not under Hydra, or a launcher without n_jobs
        return 1
    if not isinstance(n_jobs, int) or n_jobs == 0:
        return 1
    cores = os.cpu_count() or 1
    return n_jobs if n_jobs > 0 else max(1, cores + 1 + n_jobs)   # joblib: -1 all cores, -2 all but one, ...


def _size_for_parallel_runs(local_world: int) -> None:
    """Under a parallel launcher, the runs share the host's cores: each rank gets its share of threads, and a line
    says how to size the sweep when the runs' ranks outnumber the cores."""
    runs = parallel_runs()
    os.environ[PARALLEL_RUNS_ENV] = str(runs)
    cores = os.cpu_count() or 1
    if runs > 1 and runs * local_world > cores:
        print(f"neocfg: note: {runs} runs in parallel (hydra.launcher.n_jobs) x {local_world} ranks > {cores} cores:"
              f" the ranks share them (1 thread each) and each run's step times are slower; for runs of their own"
              f" speed use hydra.launcher.n_jobs={max(1, cores // local_world)}", file=sys.stderr)


# prctl(2) option: deliver a signal to this process when its parent exits (Linux).
_PR_SET_PDEATHSIG = 1


# glibc mallopt(3) parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks below this come from the heap and are reused once freed. It must exceed a step's largest block: the
# row-wise pooled output and its gradient on bench/bench_856.py's model ([512, 2 x 13,696] float32, 56 MB) are above
# glibc's dynamic threshold's ceiling (32 MB on 64-bit), and were faulted in again every step (13,700 minor faults;
# one-thread TBE forward of that model's 856 pieces 75 -> 59 ms with this threshold, measured on the 2-core VM).
_MMAP_THRESHOLD = 1 << 30
# What a glibc that refuses a threshold above its ceiling gets instead: the ceiling itself.
_MMAP_THRESHOLD_CEILING = 32 << 20
_INT_MAX = 2**31 - 1


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for the next allocation instead of handing it back to the kernel.

    A step allocates and frees the same large tensors every time (the routed ids, the pooled outputs and their
    gradients: tens of MB per step on the prod_856-shaped model); by default glibc serves blocks above its (dynamic)
    mmap threshold by mmap and trims the heap top, so each step faults every page in again. Measured on the 2-core
    development VM, IdRouter.route of one rank of bench/bench_856.py's model on 2 ranks, every table row-wise:
    29,000 minor page faults per call and a median of 118 ms before, 1,300 faults and 36 ms after. Blocks below
    _MMAP_THRESHOLD (or the ceiling a glibc allows) come from the heap, which is never trimmed; the process keeps its
    peak heap. Returns False where glibc's mallopt is missing (not Linux/glibc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = ((libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
               or libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_CEILING))
              and libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
    except (OSError, AttributeError):
        return False
    return bool(ok)


def die_with_parent(parent_pid: int) -> None:
    """SIGKILL this process when the process that started it dies (whatever killed it), so no rank outlives its
    launcher. No-op where prctl is missing (not Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def exit_rank(code: int) -> NoReturn:
    """Leave a rank process whose outcome is written, skipping interpreter teardown: a gloo worker thread that
    releases a finished collective (a barrier's work) after teardown began needs the GIL to drop its thread-local
    state, cannot have it, and aborts the process (std::terminate, SIGABRT) after a successful run."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_quietly(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def rank_signals() -> None:
    """Ctrl-C is the launcher's to handle; SIGTERM (the launcher stopping us) ends the rank without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _leave_quietly)


def _report(results: str, rank: int, kind: str, payload: Any) -> None:
    """A rank's outcome as a file (written whole, then renamed): no queue or lock survives a killed rank."""
    path = os.path.join(results, f"rank_{rank}.pt")
    torch.save((rank, kind, payload), path + ".tmp")
    os.replace(path + ".tmp", path)


def _worker(local_rank: int, world: int, store_port: int, backend: Backend, timeout_s: float,
            fn: Callable[..., Any], args: tuple, results: str, parent_pid: int) -> None:
    die_with_parent(parent_pid)
    rank_signals()
    quiet_library_logs()
    torch.set_num_threads(_threads_per_rank(world))
    # tqdm's default lock is a multiprocessing semaphore, which a killed rank would leak (and Python warn about).
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    try:
        device = _device(backend, local_rank)
        store = dist.TCPStore(LOCALHOST, store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        init_group(backend, device, timeout_s, store=store, rank=local_rank, world_size=world)
        env = RankEnv(local_rank, world, local_rank, device)
        out = fn(env, *args)
        _report(results, local_rank, "ok", out)
        dist.destroy_process_group()
        exit_rank(0)
    except NeocfgError as exc:
        _report(results, local_rank, "error", (type(exc).__name__, str(exc), exc.exit_code))
        os._exit(exc.exit_code)  # skip interpreter teardown: the other ranks may be blocked in a collective
    except Exception as exc:
        if not _collective_failure(exc):
            _report(results, local_rank, "crash", (_one_line(exc), traceback.format_exc()))
            os._exit(1)
        # a peer died or stopped answering (train.collective_timeout_s): a consequence, reported only when no
        # rank has a cause of its own to report
        _report(results, local_rank, "peer", ("RankFailedError", f"rank {local_rank}: a collective failed "
                                              f"({_one_line(exc, with_type=False)}); a peer rank died or stopped"
                                              f" responding", RankFailedError.exit_code))
        os._exit(RankFailedError.exit_code)
    except BaseException as exc:
        _report(results, local_rank, "crash", (_one_line(exc), traceback.format_exc()))
        os._exit(1)


def _one_line(exc: BaseException, with_type: bool = True) -> str:
    """The exception's first non-empty line (gloo's `[file:line]` prefix dropped), e.g. `KeyError: 'rows'`."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0]) if lines else ""
    if not with_type:
        return first or type(exc).__name__
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


# What a collective raises when its peer is gone: torch's DistError family, or gloo's RuntimeErrors.
_GLOO_PEER_FAILURES = ("Timed out waiting", "Connection closed by peer", "Connection reset by peer")


def _collective_failure(exc: BaseException) -> bool:
    return isinstance(exc, dist.DistError) or (
        isinstance(exc, RuntimeError) and any(m in str(exc) for m in _GLOO_PEER_FAILURES))


# Seconds the survivors of a failed rank get to exit after SIGTERM before SIGKILL.
TERMINATE_GRACE_S = 5.0


def _supervise(procs: list) -> tuple[Optional[int], set[int]]:
    """Wait for every rank; when one exits non-zero, stop the others. Returns the first failed rank (if any) and
    the ranks the launcher stopped."""
    from multiprocessing.connection import wait

    pending, stopped = list(procs), set()
    while pending:
        wait([p.sentinel for p in pending])
        for p in list(pending):
            if p.exitcode is None:
                continue
            pending.remove(p)
            if p.exitcode != 0:
                stopped |= {procs.index(q) for q in pending}
                _stop(pending)
                return procs.index(p), stopped
    return None, stopped


def _stop(procs: list) -> None:
    """SIGTERM every live rank, SIGKILL those still there after TERMINATE_GRACE_S; returns when all are gone."""
    live = [q for q in procs if q.pid is not None and q.exitcode is None]
    for q in live:
        q.terminate()
    for q in live:
        q.join(TERMINATE_GRACE_S)
        if q.exitcode is None:
            q.kill()
            q.join()


# The start methods a spawned rank can set up again (multiprocessing.spawn passes the parent's to the child).
_STANDARD_START_METHODS = ("fork", "spawn", "forkserver")


@contextlib.contextmanager
def standard_start_method() -> Iterator[None]:
    """Start processes under a start method their children know. In a worker of joblib's loky backend
    (hydra/launcher=joblib) the process-wide start method is 'loky', which a spawned rank cannot set up ("cannot find
    context for 'loky'"): 'spawn' while the ranks start, the worker's own restored after."""
    import multiprocessing

    current = multiprocessing.get_start_method(allow_none=True)
    if current is None or current in _STANDARD_START_METHODS:
        yield
        return
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(current, force=True)


def launch(fn: Callable[..., Any], args: tuple, *, world: int, backend: Backend, timeout_s: float) -> list[Any]:
    """Run fn(RankEnv, *args) on every rank; return the ranks' results in rank order (only this rank's under
    torchrun)."""
    if under_torchrun():
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        backend = effective_backend(backend)
        quiet_library_logs()
        device = _device(backend, local)
        init_group(backend, device, timeout_s)
        try:
            return [fn(RankEnv(rank, size, local, device), *args)]
        finally:
            dist.destroy_process_group()
    ctx = mp.get_context("spawn")
    _size_for_parallel_runs(world)
    with tempfile.TemporaryDirectory(prefix="neocfg-ranks-") as results:
        # The rendezvous store lives in this process, bound before any rank starts (port 0: the OS picks a free
        # one), so no other process can take its port between choosing it and binding it.
        store = dist.TCPStore(LOCALHOST, 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
        procs = [ctx.Process(target=_worker, args=(r, world, store.port, backend, timeout_s, fn, args, results,
                                                   os.getpid()), name=f"neocfg-rank-{r}") for r in range(world)]
        try:
            with standard_start_method():
                for p in procs:
                    p.start()
            failure, stopped = _supervise(procs)
        except (Interrupted, KeyboardInterrupt):  # Ctrl-C / SIGTERM: stop every rank before reporting it
            _stop(procs)
            sys.stderr.write("\n")  # end rank 0's progress bar line
            raise
        reports = [torch.load(p, weights_only=False) for p in sorted(Path(results).glob("rank_*.pt"))]
    if failure is not None or any(kind != "ok" for _, kind, _ in reports):
        sys.stderr.write("\n")  # end rank 0's progress bar line: the error gets a line of its own
    # A rank killed by a signal from outside is the root cause; the survivors' errors (a collective that lost its
    # peer) are consequences, and the ranks the launcher stopped say nothing.
    for i, p in enumerate(procs):
        code = p.exitcode
        if i not in stopped and code is not None and code < 0:
            raise RankFailedError(f"rank {i} was killed by {signal.Signals(-code).name}; the other ranks were stopped")
    for wanted in ("error", "crash", "peer"):  # causes first, then a collective that lost its peer
        for rank, kind, payload in sorted(reports, key=lambda r: r[0]):
            if kind != wanted:
                continue
            if kind == "crash":
                line, trace = payload
                if os.environ.get("NEOCFG_DEBUG", "") not in ("", "0"):
                    sys.stderr.write(trace)
                raise RankFailedError(f"rank {rank} failed: {line} (NEOCFG_DEBUG=1 shows the traceback)")
            name, message, code = payload
            err = NeocfgError(message)
            err.exit_code = code
            raise err
    if failure is not None:
        raise RankFailedError(f"rank {failure} exited with code {procs[failure].exitcode}; the other ranks were stopped")
    by_rank = {rank: payload for rank, kind, payload in reports if kind == "ok"}
    return [by_rank.get(r) for r in range(world)]
