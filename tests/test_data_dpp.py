"""The DPP service. Projection, exactly-once delivery (2 workers x 2 clients, and with a worker SIGKILLed
mid-epoch), resume from a checkpointed position, bad files, and nothing hanging when a worker or the master dies."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from neocfg.config.model import TableConfig
from neocfg.data.dataset import FeatureColumns, Manifest, dataset_splits
from neocfg.data.dpp.client import EndOfData
from neocfg.data.dpp.progress import Position
from neocfg.data.dpp.service import DppService
from neocfg.data.dpp.worker import SplitReader, WorkerSpec
from neocfg.data.source import make_source
from neocfg.data.transforms import bind
from neocfg.errors import DataError
from neocfg.types import DppBackendKind, OnBadSplit
from data_helpers import busy_worker, drain, labeled_ids, make_dataset, setup_for, small_cfg

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("dpp") / "ds"
    return make_dataset(path)


def test_projection_reads_only_the_model_columns(dataset):
    directory = Path(dataset.dsi.path)
    cols = FeatureColumns.for_model(dataset.model)
    split = dataset_splits(directory, Manifest.load(directory), eval=False)[0]
    spec = WorkerSpec(columns=cols, transforms=tuple(bind(dataset.dsi.transforms, cols)), batch_size=128)
    projected = SplitReader(spec)
    table, proj_bytes = projected.read(split)
    assert sorted(table.column_names) == sorted(cols.projected)
    assert not [c for c in table.column_names if c.startswith("extra_")]
    full = SplitReader(WorkerSpec(columns=cols, transforms=spec.transforms, batch_size=128, project=False))
    table_all, all_bytes = full.read(split)
    assert len(table_all.column_names) == len(cols.projected) + 8
    # The extra columns are most of the bytes: projection reads well under half of them.
    assert proj_bytes < 0.5 * all_bytes
    # And what was read matches the projected column chunks in the file's metadata (plus nothing else big).
    import pyarrow.parquet as pq

    meta = pq.ParquetFile(split.path).metadata.row_group(split.row_group)
    chunks = sum(meta.column(i).total_compressed_size for i in range(meta.num_columns)
                 if meta.column(i).path_in_schema.split(".")[0] in cols.projected)
    assert chunks <= proj_bytes < chunks + 64 * 1024


def test_exactly_once_two_workers_two_clients(dataset):
    with DppService(setup_for(dataset, workers=2, num_clients=2)) as svc:
        batches = drain(svc.clients)
        stats = svc.stats()
    ids = np.concatenate(batches)
    assert len(ids) == len(set(ids.tolist()))
    assert set(ids.tolist()) == labeled_ids(Path(dataset.dsi.path))
    sizes = [len(b) for b in batches]
    assert sizes.count(128) == len(sizes) - sum(s != 128 for s in sizes) and sum(s != 128 for s in sizes) <= 2
    assert stats.workers == 2 and stats.worker_restarts == 0 and stats.splits_done == 12
    assert all(c.tracker.duplicates == 0 for c in svc.clients)
    assert svc.clients[0].delivered > 0 and svc.clients[1].delivered > 0  # both trainers were fed


def test_sigkill_worker_mid_epoch_still_exactly_once_and_noticed_fast(dataset):
    setup = setup_for(dataset, workers=2, num_clients=2, extra_split_s=0.25, limits={"prefetch_splits": 1})
    with DppService(setup) as svc:
        first = [c.next_arrays().sample_ids for c in svc.clients]
        backend = svc.backend
        wid = busy_worker(backend)
        victim = backend.pool.pid(wid)
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        rest = drain(svc.clients)
        stats = svc.stats()
        deaths = list(backend.deaths)
    ids = np.concatenate(first + rest)
    assert len(ids) == len(set(ids.tolist())), "a sample was delivered twice"
    assert set(ids.tolist()) == labeled_ids(Path(dataset.dsi.path)), "a sample was lost"
    assert stats.worker_restarts == 1 and stats.workers == 2
    assert len(deaths) == 1 and deaths[0].wid == wid and "exit code -9" in deaths[0].reason
    assert deaths[0].noticed_at - killed_at < 1.0  # noticed within a second


def test_resume_from_checkpointed_position(dataset, tmp_path):
    expected = labeled_ids(Path(dataset.dsi.path))
    with DppService(setup_for(dataset, workers=2)) as svc:
        before = [svc.clients[0].next_arrays().sample_ids for _ in range(13)]
        svc.checkpoint(tmp_path / "dpp.json")
    pos = Position.load(tmp_path / "dpp.json")
    assert pos.pending and pos.done[0]  # mid-epoch: some splits delivered, some in part
    with DppService(setup_for(dataset, workers=2, start=pos)) as svc:
        after = drain(svc.clients)
    ids = np.concatenate(before + after)
    assert len(ids) == len(set(ids.tolist()))
    assert set(ids.tolist()) == expected


def test_resume_across_epochs_with_inline_backend(dataset):
    """Two epochs, interrupted twice: each epoch's samples exactly once."""
    expected = labeled_ids(Path(dataset.dsi.path))
    got: list[np.ndarray] = []
    pos = Position()
    for take in (30, 21, None):
        with DppService(setup_for(dataset, max_epochs=2, start=pos), DppBackendKind.inline) as svc:
            c = svc.clients[0]
            if take is None:
                got += drain([c])
            else:
                got += [c.next_arrays().sample_ids for _ in range(take)]
            pos = Position.from_state(svc.position().to_state())
    ids = np.concatenate(got)
    values, counts = np.unique(ids, return_counts=True)
    assert set(values.tolist()) == expected and (counts == 2).all()


@pytest.mark.parametrize("kind", [DppBackendKind.inline, DppBackendKind.local])
def test_resume_with_one_worker_repeats_the_uninterrupted_batches(dataset, kind):
    """With one worker the service is deterministic, and a resumed client hands out exactly the same batches."""
    with DppService(setup_for(dataset, workers=1, max_epochs=2), kind) as svc:
        reference = drain(svc.clients)
    got, pos = [], Position()
    for take in (17, 45, None):  # stops mid-epoch (tails pooled) and in the second epoch
        with DppService(setup_for(dataset, workers=1, max_epochs=2, start=pos), kind) as svc:
            c = svc.clients[0]
            got += drain([c]) if take is None else [c.next_arrays().sample_ids for _ in range(take - len(got))]
            pos = Position.from_state(json.loads(json.dumps(svc.position().to_state())))
    assert len(got) == len(reference)
    for a, b in zip(got, reference):
        np.testing.assert_array_equal(a, b)


def test_source_state_dict_round_trip(dataset):
    cfg = small_cfg(Path(dataset.dsi.path), "dsi.workers=1")
    src = make_source(cfg, 0, 2)
    try:
        b = src.next_batch()
        assert b.dense.shape == (128, 13) and b.lengths.shape == (8, 128) and b.values.numel() == b.lengths.sum()
        assert b.dense.dtype.is_floating_point and str(b.values.dtype) == "torch.int64"
        seen = [src.next_batch().sample_ids.numpy() for _ in range(5)] + [b.sample_ids.numpy()]
        state = src.state_dict()
    finally:
        src.close()
    resumed = make_source(cfg, 0, 2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    try:
        more = [resumed.next_batch().sample_ids.numpy() for _ in range(5)]
        stats = resumed.stats()
    finally:
        resumed.close()
    ids = np.concatenate(seen + more)
    assert len(ids) == len(set(ids.tolist()))
    assert stats["samples_delivered"] == 5 * 128 and stats["duplicate_samples"] == 0
    assert {"data_stall_fraction", "data_wait_seconds", "dpp.workers", "dpp.worker_restarts",
            "dpp.bytes_read"} <= set(stats)
    assert stats["dpp.workers"] == 1 and stats["dpp.bytes_read"] > 0


def test_ranks_and_eval_are_disjoint(dataset):
    cfg = small_cfg(Path(dataset.dsi.path), "dsi.backend=inline")
    sources = [make_source(cfg, r, 2) for r in range(2)] + [make_source(cfg, 0, 2, eval=True)]
    try:
        ids = [set(np.concatenate([s.next_batch().sample_ids.numpy() for _ in range(10)]).tolist()) for s in sources]
    finally:
        for s in sources:
            s.close()
    assert not ids[0] & ids[1] and not ids[2] & (ids[0] | ids[1])
    assert min(ids[2]) >= 1 << 40


@pytest.fixture
def broken(tmp_path):
    cfg = make_dataset(tmp_path / "ds", "dsi.num_samples=3000")
    return cfg, tmp_path / "ds"


def test_corrupt_file_is_one_line_error_naming_file_and_split(broken):
    cfg, directory = broken
    bad = directory / "part-00001.parquet"
    bad.write_bytes(b"this is not parquet" * 100)
    with DppService(setup_for(cfg, workers=2)) as svc:
        with pytest.raises(DataError) as err:
            drain(svc.clients)
    msg = str(err.value)
    assert str(bad) in msg and " split " in msg and "\n" not in msg and "Parquet" in msg


def test_missing_file_fails_or_is_skipped_and_counted(broken):
    cfg, directory = broken
    (directory / "part-00002.parquet").unlink()
    with DppService(setup_for(cfg, workers=1)) as svc:
        with pytest.raises(DataError, match=r"part-00002\.parquet split \d+ \(row group \d\): file not found"):
            drain(svc.clients)
    with DppService(setup_for(cfg, workers=2, on_bad_split=OnBadSplit.skip)) as svc:
        ids = np.concatenate(drain(svc.clients))
        stats = svc.stats()
    assert stats.splits_skipped == 4 and svc.clients[0].skipped == 4
    assert set(ids.tolist()) == labeled_ids(directory, skip_files=("part-00002.parquet",))


def test_schema_not_matching_the_model(broken):
    cfg, directory = broken
    other = small_cfg(directory)
    other.model.tables.append(TableConfig(name="t8", num_embeddings=10, embedding_dim=16))
    with DppService(setup_for(other, workers=1), DppBackendKind.inline) as svc:
        with pytest.raises(DataError, match=r"part-0000\d.parquet split \d+ \(row group \d\): "
                                            r"column 'sparse_t8' is missing.*does not match"):
            drain(svc.clients)


def test_source_reports_missing_dataset(tmp_path):
    with pytest.raises(DataError, match=r"no dataset here.*mode=gen_data"):
        make_source(small_cfg(tmp_path / "nothing"), 0, 1)


def test_stalled_service_raises_instead_of_hanging(broken):
    cfg, _ = broken
    setup = setup_for(cfg, workers=1, extra_split_s=30.0, limits={"stall_timeout_s": 1.0})
    t0 = time.monotonic()
    with DppService(setup) as svc:
        with pytest.raises(DataError, match=r"no batch for 1 s"):
            svc.clients[0].next_arrays()
    assert time.monotonic() - t0 < 10


def test_workers_exit_when_the_master_process_dies(broken, tmp_path):
    cfg, directory = broken
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from data_helpers import small_cfg, setup_for
        from neocfg.data.dpp.service import DppService
        if __name__ == "__main__":
            svc = DppService(setup_for(small_cfg({str(directory)!r}), workers=2, max_epochs=None)).start()
            svc.clients[0].next_arrays()
            print(*svc.backend.worker_pids(), flush=True)
            time.sleep(600)
    """))
    owner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        owner.kill()  # SIGKILL: the master thread dies with its process, no cleanup runs
        owner.wait()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), "orphaned DPP workers"
    finally:
        owner.kill()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by init) is gone for our purpose
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_split_that_kills_its_workers_is_a_bad_split(broken):
    cfg, _ = broken
    setup = setup_for(cfg, workers=1, extra_split_s=30.0, limits={"split_timeout_s": 0.3})
    with DppService(setup) as svc:
        with pytest.raises(DataError, match=r"split \d+ \(row group \d\): killed 3 workers"):
            svc.clients[0].next_arrays()
        assert svc.stats().worker_restarts == 3


def test_online_scaling_adds_workers_while_clients_stall_and_retires_idle_ones(dataset):
    limits = {"autoscale": True, "max_workers": 3, "prefetch_splits": 2}
    setup = setup_for(dataset, workers=1, max_epochs=None, extra_split_s=0.2, limits=limits)
    with DppService(setup) as svc:
        c = svc.clients[0]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3.5:  # a trainer that wants more than one worker gives
            c.next_arrays()
        grown = svc.stats()
        deadline = time.monotonic() + 10  # the trainer pauses: buffers fill, nobody waits
        while svc.stats().workers_retired == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        shrunk = svc.stats()
    assert grown.workers_added >= 1 and grown.workers >= 2
    # It shrank from its peak (1 + every worker added) by the workers it retired.
    assert shrunk.workers_retired >= 1 and shrunk.workers == 1 + shrunk.workers_added - shrunk.workers_retired


def test_a_failed_master_is_reported_to_clients_at_once(dataset):
    with DppService(setup_for(dataset, workers=1, max_epochs=None)) as svc:
        c = svc.clients[0]
        c.next_arrays()

        def broken() -> None:
            raise RuntimeError("lost its state")

        svc.backend.loop._assign = broken
        t0 = time.monotonic()
        with pytest.raises(DataError, match="DPP master failed: RuntimeError: lost its state"):
            for _ in range(10_000):
                c.next_arrays()
        assert time.monotonic() - t0 < 2.0


def test_position_taken_before_the_first_batch_after_a_resume_keeps_what_is_owed(dataset):
    with DppService(setup_for(dataset, workers=1)) as svc:
        first = [svc.clients[0].next_arrays().sample_ids for _ in range(9)]
        pos = svc.position()
    with DppService(setup_for(dataset, workers=1, start=pos)) as svc:
        again = svc.position()  # checkpoint again before taking anything
    assert again.pending == pos.pending and again.done == pos.done
    with DppService(setup_for(dataset, workers=1, start=again)) as svc:
        rest = drain(svc.clients)
    ids = np.concatenate(first + rest)
    assert len(ids) == len(set(ids.tolist())) and set(ids.tolist()) == labeled_ids(Path(dataset.dsi.path))


def _tracking_peak(cfg) -> tuple[int, int, int]:
    """Drain one epoch (inline backend) and return the peak bytes held by the progress tracking (allocations made in
    progress.py and master.py that are still alive, sampled every few batches), the peak tracking entries, and the
    samples delivered."""
    import tracemalloc

    from neocfg.data.dpp import master as master_mod, progress as progress_mod

    files = [tracemalloc.Filter(True, master_mod.__file__), tracemalloc.Filter(True, progress_mod.__file__)]
    tracemalloc.start()
    peak_bytes = peak_entries = delivered = 0
    try:
        with DppService(setup_for(cfg, max_epochs=1), DppBackendKind.inline) as svc:
            c, n = svc.clients[0], 0
            while True:
                try:
                    delivered += c.next_arrays().rows
                except EndOfData:
                    break
                n += 1
                if n % 5 == 0:
                    snap = tracemalloc.take_snapshot().filter_traces(files)
                    peak_bytes = max(peak_bytes, sum(s.size for s in snap.statistics("filename")))
                    peak_entries = max(peak_entries, svc.backend.master.tracking_size() + c.tracker.size())
    finally:
        tracemalloc.stop()
    return peak_bytes, peak_entries, delivered


def test_exactly_once_tracking_memory_is_flat_in_the_number_of_samples(tmp_path):
    """Same 12 splits, 10x more samples per split: the per-split tracking holds the same entries and no more bytes
    (a per-sample id set, as before, grew by about 10 x 60 bytes per sample here)."""
    small = make_dataset(tmp_path / "small", "dsi.num_samples=3000")
    big = make_dataset(tmp_path / "big", "dsi.num_samples=30000")
    b_small, e_small, n_small = _tracking_peak(small)
    b_big, e_big, n_big = _tracking_peak(big)
    assert n_big > 9 * n_small
    assert e_big <= e_small + 2
    assert b_big < b_small + 4096, (b_small, b_big)


def _s3_copy(local: Path, monkeypatch) -> str:
    """An S3-compatible server (moto, in this process) holding a copy of the dataset; its s3:// URI. Workers reach
    it through AWS_ENDPOINT_URL, which pyarrow's S3 filesystem reads (and spawned workers inherit)."""
    server_mod = pytest.importorskip("moto.server")
    import pyarrow.fs as pafs

    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    for k, v in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
                 "AWS_ENDPOINT_URL": f"http://{host}:{port}"}.items():
        monkeypatch.setenv(k, v)
    s3, _ = pafs.FileSystem.from_uri("s3://neocfg-test?allow_bucket_creation=true")
    s3.create_dir("neocfg-test")
    pafs.copy_files(str(local), "neocfg-test/ds", source_filesystem=pafs.LocalFileSystem(), destination_filesystem=s3)
    return "s3://neocfg-test/ds"


@pytest.mark.parametrize("scheme", ["path", "file", "s3"])
def test_dataset_by_uri(dataset, scheme, monkeypatch):
    """dsi.path as a local path, a file:// URI or an s3:// URI: the workers open the files through pyarrow.fs and
    deliver every labeled sample exactly once."""
    local = Path(dataset.dsi.path)
    uri = {"path": str(local), "file": local.as_uri()}.get(scheme) or _s3_copy(local, monkeypatch)
    cfg = small_cfg(uri)
    with DppService(setup_for(cfg, workers=2)) as svc:
        assert svc.setup.splits[0].path.startswith(uri)
        ids = np.concatenate(drain(svc.clients))
        stats = svc.stats()
    assert len(ids) == len(set(ids.tolist())) and set(ids.tolist()) == labeled_ids(local)
    assert stats.bytes_read > 0 and stats.splits_done == len(svc.setup.splits)


def test_a_bad_uri_is_one_line(tmp_path):
    with pytest.raises(DataError, match=r"^nosuch://x/ds.*cannot open this location.*file://, s3://") as err:
        make_source(small_cfg("nosuch://x/ds"), 0, 1)
    assert "\n" not in str(err.value)
    with pytest.raises(DataError, match=r"no dataset here"):
        make_source(small_cfg((tmp_path / "none").as_uri()), 0, 1)


def test_the_stall_clock_counts_samples_not_empty_splits(dataset):
    """Splits keep arriving but every one is empty after the transforms: the client fails after stall_timeout_s
    (before, each empty split reset the clock and it spun forever). The whole-epoch check would fire later here."""
    from neocfg.config.dsi import TransformConfig
    from neocfg.types import FilterCmp, TransformOp

    cols = FeatureColumns.for_model(dataset.model)
    nothing = TransformConfig(column="label", op=TransformOp.filter, cmp=FilterCmp.gt, value=5.0)
    setup = setup_for(dataset, workers=1, max_epochs=None, extra_split_s=0.2, limits={"stall_timeout_s": 1.0})
    setup = dataclasses.replace(setup, spec=dataclasses.replace(setup.spec, transforms=tuple(bind([nothing], cols))))
    with DppService(setup) as svc:
        while svc.backend.workers_ready() < 1:  # start-up is not what this test is about
            time.sleep(0.05)
        t0 = time.monotonic()
        with pytest.raises(DataError, match=r"no sample for 1 s \(dsi.stall_timeout_s\); [1-9]\d* splits came back "
                                            r"empty after the transforms"):
            svc.clients[0].next_arrays()
        assert time.monotonic() - t0 < 10


def test_a_position_resumes_only_with_the_same_kind_of_backend(dataset):
    """A rank's position (local) and a job's position (ray) number splits differently: mixing them is refused."""
    from neocfg.data.dpp.sizing import WorkerCount, WorkerCountSource
    from neocfg.data.dpp_source import DppSource

    cfg = small_cfg(Path(dataset.dsi.path), "dsi.workers=1", "dsi.backend=inline")
    src = make_source(cfg, 0, 2)
    try:
        src.next_batch()
        state = json.loads(json.dumps(src.state_dict()))
    finally:
        src.close()
    assert state["dpp_scope"] == "rank"
    job = DppSource(setup_for(dataset), DppBackendKind.ray, WorkerCount(2, 2, WorkerCountSource.fixed))  # starts lazily
    with pytest.raises(DataError, match=r"written with dsi.backend=local \(or inline\); resume with the same "
                                        r"dsi.backend \(this run: ray\)"):
        job.load_state_dict(state)
