"""Many trainer clients on one job-wide DPP service (dsi.backend=ray), no training.

    flock /work/cpu.lock .venv/bin/python bench/bench_dpp_clients.py [--record]

The bench starts a Ray of its own (token authentication, as a run does) and --procs client processes, each a Ray
driver that joins it once. Per round it creates one master actor (the same RayMaster a training job's rank 0 makes)
over the first --splits row groups of a generated dataset, with --workers worker actors; `clients` of the processes
(indices 0..clients-1) build a DppService on it, wait for a common start time, and pull batches until the epoch ends
(max_epochs=1), as trainers' clients do minus the training. Measured per round:

  splits/s      the service's rate: splits over the wall time from the start to the last client's end
  per client    samples/s of each client over its own time (min / median / max), and its splits
  master        the master actor process's CPU time per split (its whole process: the policy, Ray's threads, the
                idle ticks), and its resident memory at the end (VmHWM, the peak) against just after it started
  exactly once  the clients' sample ids together are the split range's ids, each once

Round k's results go to outputs/bench/bench_dpp_clients.json; --record writes RESULTS.md's "DPP with many clients".
On a 2-core machine the workers, the master and the clients share 2 cores: splits/s is a floor for the transport,
not the master's ceiling (bench_dpp_scale.py measures the policy alone).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from neocfg.data.dpp.ray_backend import (RayDppService, RayMaster, RayOptions, WorkerResources,  # noqa: E402
                                         join_ray, leave_ray, master_concurrency, start_local_ray)
from neocfg.data.dpp.service import DppService  # noqa: E402
from neocfg.data.dpp.client import EndOfData  # noqa: E402

NAMESPACE = "neocfg-bench-clients"
# Rows per split (a row group) and the dataset: 64 files of as many row groups as the largest round needs (64 each
# for 4,096 splits); small splits so that thousands of them are read on 2 cores in seconds, and the per-split costs
# (pull, fetch, master) dominate.
ROWS_PER_GROUP, FILES = 64, 64
BATCH = 32
# Each client process starts within this many seconds of the others; the round starts after every one is ready.
START_SLACK_S = 2.0
TRAINERS = 128


# ------------------------------------------------------------------------------------------------ client process
def client_process(address: str, token: str, inbox: Path, proc: int) -> None:
    """Join the bench's Ray once; then serve each round whose clients include this process, until `stop`."""
    join_ray(address, NAMESPACE, token)
    (inbox / f"joined-{proc}").write_text("")
    k = 0
    while not (inbox / "stop").exists():
        spec = inbox / f"round-{k}.pkl"
        if not spec.exists():
            time.sleep(0.05)
            continue
        r = pickle.loads(spec.read_bytes())
        if proc < r["clients"]:
            try:
                _serve(r, proc, inbox / f"result-{k}-{proc}")
            except Exception as exc:  # noqa: BLE001 - the bench stops with this client's error
                (inbox / f"failed-{k}-{proc}").write_text(f"client {proc}: {type(exc).__name__}: {exc}")
                raise
        k += 1
    leave_ray()


def _serve(r: dict, client: int, out: Path) -> None:
    setup = r["setup"]
    opts = RayOptions(namespace=NAMESPACE, master_name=r["master"], owner=False,
                      resources=WorkerResources(cpus=1.0, memory_bytes=2**28), client=client, joined=False)
    backend = RayDppService(setup, opts)
    service = DppService(setup, clients=[client], backend=backend).start()
    c = service.clients[0]
    ids, rows = [], 0
    time.sleep(max(r["go"] - time.time(), 0.0))
    t0 = time.time()
    try:
        while True:
            a = c.next_arrays()
            ids.append(a.sample_ids)
            rows += a.rows
    except EndOfData:
        pass
    t1 = time.time()
    splits = backend.pulled
    service.close()
    np.save(out.with_suffix(".npy"), np.concatenate(ids) if ids else np.zeros(0, np.int64))
    out.with_suffix(".json").write_text(json.dumps({"start": t0, "end": t1, "rows": rows, "splits": splits,
                                                    "wait_s": c.wait_s}))


# --------------------------------------------------------------------------------------------------------- main
def _proc_stat(pid: int) -> tuple[float, int, int]:
    """CPU seconds (user + system), VmRSS and VmHWM bytes of a process."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    status = {ln.split(":")[0]: ln.split(":")[1] for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
              if ":" in ln}
    return cpu, int(status["VmRSS"].split()[0]) * 1024, int(status["VmHWM"].split()[0]) * 1024


def make_dataset(root: Path, splits: int):
    """A dataset of at least `splits` row groups (kept between runs, one per size)."""
    from bench.common import compose_cfg
    from neocfg.data.parquet_gen import write_dataset

    groups = -(-splits // FILES)
    path = root / f"dpp_clients_ds_{FILES * groups}"
    cfg = compose_cfg(["dsi=parquet_local", f"dsi.path={path}", f"dsi.num_samples={ROWS_PER_GROUP * FILES * groups}",
                       f"dsi.num_files={FILES}", f"dsi.row_groups_per_file={groups}", "dsi.eval_samples=256",
                       "dsi.unlabeled_fraction=0", "dsi.extra_columns=0", f"train.batch_size={BATCH}"])
    if not (path / "_manifest.json").exists():
        write_dataset(cfg)
    return cfg


def base_setup(cfg):
    from neocfg.data.dataset import FeatureColumns, Manifest, dataset_splits
    from neocfg.data.dpp.master import ServiceLimits, ServiceSetup
    from neocfg.data.dpp.worker import WorkerSpec
    from neocfg.data.transforms import bind

    directory = Path(cfg.dsi.path)
    cols = FeatureColumns.for_model(cfg.model)
    spec = WorkerSpec(columns=cols, transforms=tuple(bind(cfg.dsi.transforms, cols)), batch_size=BATCH)
    splits = tuple(dataset_splits(directory, Manifest.load(directory), eval=False))
    return ServiceSetup(splits=splits, spec=spec, workers=1, seed=3, max_epochs=1,
                        limits=ServiceLimits(prefetch_splits=8, stall_timeout_s=300.0))


def run_round(k: int, inbox: Path, setup, clients: int, splits: int, workers: int,
              procs: list[subprocess.Popen]) -> dict:
    import ray

    setup = replace(setup, splits=setup.splits[:splits], workers=workers, num_clients=clients)
    name = f"bench-{uuid.uuid4().hex[:8]}"
    master = RayMaster.options(name=name, namespace=NAMESPACE, max_concurrency=master_concurrency(clients)).remote(
        setup, WorkerResources(cpus=1.0, memory_bytes=2**28))
    pid = ray.get(master.pid.remote())
    while ray.get(master.workers_ready.remote()) < workers:
        time.sleep(0.1)
    _, rss0, _ = _proc_stat(pid)
    cpu0 = _proc_stat(pid)[0]
    go = time.time() + START_SLACK_S + 0.05 * clients
    part = inbox / f"round-{k}.part"  # renamed when whole: the clients poll for the file
    part.write_bytes(pickle.dumps({"setup": setup, "master": name, "clients": clients, "go": go}))
    part.rename(inbox / f"round-{k}.pkl")
    results = [inbox / f"result-{k}-{c}.json" for c in range(clients)]
    trace = []  # (splits done, master RSS) twice a second: retention shows as RSS growing with splits
    while not all(p.exists() for p in results):
        failed = sorted(inbox.glob(f"failed-{k}-*"))
        if failed:
            raise SystemExit(failed[0].read_text())
        dead = [i for i, p in enumerate(procs[:clients]) if p.poll() is not None]
        if dead:
            raise SystemExit(f"client process {dead[0]} exited ({procs[dead[0]].returncode}); its stderr: "
                             f"{(inbox / f'client-{dead[0]}.err').read_text()[-2000:]}")
        trace.append((ray.get(master.stats.remote()).splits_done, _proc_stat(pid)[1]))
        time.sleep(0.5)
    cpu1, _, hwm = _proc_stat(pid)
    ray.get(master.stop.remote(clients, 30.0))
    ray.kill(master, no_restart=True)
    got = [json.loads(p.read_text()) for p in results]
    ids = np.concatenate([np.load(p.with_suffix(".npy")) for p in results])
    want = np.arange(splits * ROWS_PER_GROUP)  # the first `splits` row groups hold sample ids 0.. in order
    values, counts = np.unique(ids, return_counts=True)
    once = bool(len(values) == len(want) and (values == want).all() and counts.max() == 1)
    wall = max(g["end"] for g in got) - go
    rates = [g["rows"] / max(g["end"] - go, 1e-9) for g in got]
    row = {"clients": clients, "splits": splits, "workers": workers, "wall_s": wall, "splits_per_s": splits / wall,
           "samples_per_s": len(ids) / wall, "client_samples_per_s": [min(rates), statistics.median(rates),
                                                                      max(rates)],
           "client_splits": [min(g["splits"] for g in got), max(g["splits"] for g in got)],
           "master_cpu_us_per_split": 1e6 * (cpu1 - cpu0) / splits, "master_rss_start": rss0,
           "master_hwm": hwm, "exactly_once": once,
           "master_rss_growth_per_split": _growth(trace, splits), "rss_trace": trace}
    print(f"{clients:3d} clients, {splits:5d} splits, {workers} workers: {row['splits_per_s']:7,.0f} splits/s, "
          f"{row['samples_per_s']:9,.0f} samples/s; per client {min(rates):,.0f} / {statistics.median(rates):,.0f} "
          f"/ {max(rates):,.0f} samples/s; master {row['master_cpu_us_per_split']:,.0f} us CPU/split, "
          f"{rss0 / 2**20:.0f} -> {hwm / 2**20:.0f} MiB (+{row['master_rss_growth_per_split']:,.0f} B/split from a "
          f"quarter of the splits on); exactly once: {once}", flush=True)
    return row


def _growth(trace: list[tuple[int, int]], splits: int) -> float:
    """Master RSS bytes gained per split done, from the first sample past a quarter of the splits to the last."""
    later = [t for t in trace if t[0] >= splits // 4]
    if len(later) < 2 or later[-1][0] == later[0][0]:
        return 0.0
    return (later[-1][1] - later[0][1]) / (later[-1][0] - later[0][0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", nargs="+", default=["16:4096:2", "32:4096:2", "64:4096:2", "64:1024:2",
                                                      "64:4096:4"],
                    help="clients:splits:workers per round")
    ap.add_argument("--record", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "outputs" / "bench" / "bench_dpp_clients.json")
    ap.add_argument("--record-from", type=Path, nargs="+",
                    help="only write the section from earlier runs' JSON (their rounds in the order given)")
    ap.add_argument("--note", default="", help="a line said under the table (with --record-from)")
    ap.add_argument("--client-proc", nargs=4, metavar=("ADDRESS", "TOKEN", "INBOX", "INDEX"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client_proc:
        address, token, inbox, index = args.client_proc
        client_process(address, token, Path(inbox), int(index))
        return
    if args.record_from:
        record([r for p in args.record_from for r in json.loads(p.read_text())["rows"]], args.note)
        return
    rounds = [tuple(int(x) for x in r.split(":")) for r in args.rounds]
    procs_n = max(c for c, _, _ in rounds)
    cfg = make_dataset(REPO / "outputs" / "bench", max(n for _, n, _ in rounds))
    setup = base_setup(cfg)
    inbox = REPO / "outputs" / "bench" / f"dpp_clients_{uuid.uuid4().hex[:8]}"
    inbox.mkdir(parents=True)
    address, token = start_local_ray(object_store_mb=512, num_cpus=max(w for _, _, w in rounds), namespace=NAMESPACE)
    procs = []
    rows = []
    try:
        t0 = time.time()
        for i in range(procs_n):
            procs.append(subprocess.Popen([sys.executable, __file__, "--client-proc", address, token, str(inbox),
                                           str(i)], stdout=subprocess.DEVNULL,
                                          stderr=(inbox / f"client-{i}.err").open("w")))
        while sum((inbox / f"joined-{i}").exists() for i in range(procs_n)) < procs_n:
            dead = [p for p in procs if p.poll() is not None]
            if dead:
                raise SystemExit(f"a client process failed: {dead[0].args[-1]} (its stderr is in {inbox})")
            time.sleep(0.2)
        print(f"{procs_n} client processes joined in {time.time() - t0:.0f} s", flush=True)
        for k, (clients, splits, workers) in enumerate(rounds):
            rows.append(run_round(k, inbox, setup, clients, splits, workers, procs))
    finally:
        (inbox / "stop").write_text("")
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        leave_ray()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    if not all(r["exactly_once"] for r in rows):
        raise SystemExit("a round did not deliver every sample exactly once")
    if args.record:
        record(rows)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def _slopes(rows: list[dict]) -> list[tuple[str, tuple, dict, dict, float]]:
    """The master's peak memory against clients (same splits and workers) and against splits (same clients and
    workers): (what varies, the fixed values, the smallest and the largest round, bytes per added client or split)."""
    out = []
    for vary, fixed in (("clients", ("splits", "workers")), ("splits", ("clients", "workers"))):
        groups: dict[tuple, list[dict]] = {}
        for r in rows:
            groups.setdefault(tuple(r[k] for k in fixed), []).append(r)
        for key, g in groups.items():
            lo, hi = min(g, key=lambda r: r[vary]), max(g, key=lambda r: r[vary])
            if lo[vary] != hi[vary]:
                out.append((vary, key, lo, hi, (hi["master_hwm"] - lo["master_hwm"]) / (hi[vary] - lo[vary])))
    return out


def _flatness(rows: list[dict]) -> list[str]:
    out = []
    for vary, key, lo, hi, per in _slopes(rows):
        fixed = ("splits", "workers") if vary == "clients" else ("clients", "workers")
        at = ", ".join(f"{k} {v:,}" for k, v in zip(fixed, key))
        out.append(f"- master peak from {lo[vary]:,} to {hi[vary]:,} {vary} ({at}): {lo['master_hwm'] / 2**20:.0f} "
                   f"-> {hi['master_hwm'] / 2**20:.0f} MiB, {per:+,.0f} B per {vary[:-1]}; CPU per split "
                   f"{lo['master_cpu_us_per_split']:,.0f} -> {hi['master_cpu_us_per_split']:,.0f} us")
    return ["", "Master memory and work as the job grows:", "", *out] if out else []


def _summary(rows: list[dict]) -> str:
    """The README's sentence (bench/common.py SUMMARY_LEAD): the rounds' range, the master's cost and its ceiling."""
    def span(key: str) -> str:
        lo, hi = min(r[key] for r in rows), max(r[key] for r in rows)
        return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"

    cpu = [r["master_cpu_us_per_split"] / 1e3 for r in rows]
    worst = max(r["master_cpu_us_per_split"] for r in rows)
    per = {vary: max(p for v, _, _, _, p in _slopes(rows) if v == vary) for vary in ("clients", "splits")
           if any(v == vary for v, *_ in _slopes(rows))}
    memory = " and +".join(f"{per[v] / 2**10:,.1f} KiB per {v[:-1]}" for v in ("splits", "clients") if v in per)
    return (f"In short: {span('clients')} trainer clients pulling {span('splits')} splits cost the master "
            f"{min(cpu):.1f}-{max(cpu):.1f} ms of CPU per split, memory +{memory or 'nothing'}; its ceiling, "
            f"{1e6 / worst:,.0f} splits/s, is {1e6 / worst * 65536 / TRAINERS / 1e3:,.0f} k samples/s per trainer at "
            f"{TRAINERS} trainers (65,536-row splits).")


def record(rows: list[dict], note: str = "") -> None:
    from bench.common import record_results

    lines = ["One job-wide master actor (dsi.backend=ray, the run's own Ray with token authentication) and separate "
             "client processes (Ray drivers, as trainer ranks are), pulling one epoch of small splits "
             f"({ROWS_PER_GROUP} rows, {BATCH}-sample batches) with no training; every process on the same 2 cores. "
             "Master CPU is its whole process's CPU time per split (policy, Ray's threads, idle ticks); memory is its "
             "resident set just after start and its peak during the round.", "",
             "| clients | splits | workers | splits/s | samples/s | per-client samples/s (min / median / max) | "
             "splits per client (min-max) | master CPU us/split | master MiB start -> peak | master RSS B/split "
             "(after a quarter) | exactly once |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, med, hi = r["client_samples_per_s"]
        lines.append(f"| {r['clients']} | {r['splits']:,} | {r['workers']} | {r['splits_per_s']:,.0f} | "
                     f"{r['samples_per_s']:,.0f} | {lo:,.0f} / {med:,.0f} / {hi:,.0f} | "
                     f"{r['client_splits'][0]}-{r['client_splits'][1]} | {r['master_cpu_us_per_split']:,.0f} | "
                     f"{r['master_rss_start'] / 2**20:.0f} -> {r['master_hwm'] / 2**20:.0f} | "
                     f"{_fmt(r.get('master_rss_growth_per_split'))} | {'yes' if r['exactly_once'] else 'NO'} |")
    worst = max(r["master_cpu_us_per_split"] for r in rows)
    lines += ["", f"The master's ceiling from its CPU per split (the highest row, {worst:,.0f} us): "
                  f"{1e6 / worst:,.0f} splits/s on one core; at 65,536 rows per split (a typical row group) that is "
                  f"{1e6 / worst * 65536 / 1e6:,.0f} M samples/s for the job, "
                  f"{1e6 / worst * 65536 / TRAINERS / 1e3:,.0f} k samples/s per trainer over {TRAINERS} trainers."]
    lines += _flatness(rows)
    lines += ["", _summary(rows)]
    if note:
        lines += ["", note]
    record_results("DPP with many clients", "\n".join(lines))


if __name__ == "__main__":
    main()
