"""docs/architecture.md's checklists, followed the way a user would: a hardware preset of one's own from the
template in docs/hardware.md plans through --config-dir; a toy memory tier added as the checklist says is planned,
priced, exported and mapped to fbgemm. (The toy sharding type is in test_contract.py.)"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from conftest import REPO

HARDWARE_DOC = REPO / "docs" / "hardware.md"


def template() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", HARDWARE_DOC.read_text(), re.S)
    assert blocks, "docs/hardware.md holds a yaml template of a hardware preset"
    return blocks[0]


def test_the_hardware_template_plans_as_a_preset_of_ones_own(cli, tmp_path):
    text = template()
    preset = yaml.safe_load(text)
    (tmp_path / "myconf" / "hardware").mkdir(parents=True)
    (tmp_path / "myconf" / "hardware" / "mine.yaml").write_text(text)
    res = cli("--config-dir", str(tmp_path / "myconf"), "mode=plan", "hardware=mine", "hydra.run.dir=run")
    assert res.returncode == 0, res.stderr
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["world_size"] == preset["nodes"] * preset["devices_per_node"]


def test_a_template_missing_a_required_field_is_one_line_naming_it(cli, tmp_path):
    preset = yaml.safe_load(template())
    del preset["device"]["hbm_gib"]
    (tmp_path / "myconf" / "hardware").mkdir(parents=True)
    (tmp_path / "myconf" / "hardware" / "mine.yaml").write_text(yaml.safe_dump(preset))
    res = cli("--config-dir", str(tmp_path / "myconf"), "mode=plan", "hardware=mine")
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.startswith("neocfg: error")]
    assert len(lines) == 1 and "hardware.device.hbm_gib" in lines[0], res.stderr


# ---- a memory tier: one MemoryTier member and its Tier in neocfg.tiers.TIERS ---------------------------------------
TOY_TIER = ('    Tier(MemoryTier.far_host, on_device=False, hbm_cache=False, fbgemm_location="HOST",\n'
            '         torchrec_kernel="key_value"),\n')


def _package_with_toy_tier(root: Path) -> Path:
    """A copy of the package and conf/ with a toy tier added as docs/architecture.md says: the enum member, its Tier."""
    shutil.copytree(REPO / "neocfg", root / "neocfg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", root / "conf")
    for path, anchor, added in (
            (root / "neocfg" / "types.py", '    host = "host"\n', '    far_host = "far_host"\n'),
            (root / "neocfg" / "tiers.py", '    Tier(MemoryTier.host, ', TOY_TIER)):
        text = path.read_text()
        assert text.count(anchor) == 1, (path, anchor)
        at = text.index(anchor) + (len(anchor) if anchor.endswith("\n") else 0)
        path.write_text(text[:at] + added + text[at:])
    return root


def test_a_toy_memory_tier_is_planned_priced_and_mapped(tmp_path):
    root = _package_with_toy_tier(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "NEOCFG_DEBUG"}
    env["PYTHONPATH"] = str(root)
    out = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "neocfg", "mode=plan", "model=dlrm_tiny", "hardware=zionex_1node",
                          "planner.memory_tiers=[far_host]", "planner.export=torchrec", f"hydra.run.dir={out}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    plan = json.loads((out / "plan.json").read_text())
    sharded = [t for t in plan["tables"] if t["sharding"] != "data_parallel"]
    assert sharded and {t["memory"] for t in sharded} == {"far_host"}
    # priced as host-resident: no weights on the device, all of them in host memory
    assert sum(d["host_bytes"] for d in plan["devices"]) > 0
    exported = json.loads((out / "torchrec_plan.json").read_text())
    assert "key_value" in json.dumps(exported)
    # and the runtime maps it to its fbgemm location
    probe = subprocess.run([sys.executable, "-c", "from neocfg.runtime.embedding import GPU_LOCATION; "
                            "from neocfg.types import MemoryTier; print(GPU_LOCATION[MemoryTier.far_host].name)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "HOST", probe.stderr


def test_a_tier_without_its_tier_entry_is_refused_at_import(tmp_path):
    root = tmp_path / "src"
    shutil.copytree(REPO / "neocfg", root / "neocfg", ignore=shutil.ignore_patterns("__pycache__"))
    types_py = root / "neocfg" / "types.py"
    types_py.write_text(types_py.read_text().replace('    host = "host"\n', '    host = "host"\n    far_host = "far_host"\n'))
    env = dict(os.environ, PYTHONPATH=str(root))
    res = subprocess.run([sys.executable, "-c", "import neocfg.tiers"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and "every MemoryTier needs a Tier" in res.stderr


# ---- a DPP backend: one module in neocfg/data/dpp/backends/ and one preset in conf/dsi/ ----------------------------
TOY_BACKEND = '''"""`dsi.backend=threads`: DPP workers as threads of each trainer's process, one service per rank."""

import queue
import threading

from neocfg.data.dpp.backends import Backend
from neocfg.data.dpp.loop import EventKind, InProcessService, PoolEvent
from neocfg.data.dpp.worker import SplitReader
from neocfg.errors import DataError


class ThreadPool:
    what = "worker threads"

    def __init__(self, spec):
        self.spec, self.inbox, self.events, self.next_wid = spec, {}, queue.Queue(), 0

    def spawn(self):
        wid, self.next_wid = self.next_wid, self.next_wid + 1
        self.inbox[wid] = queue.Queue()
        threading.Thread(target=self._work, args=(wid, self.inbox[wid]), daemon=True).start()
        return wid

    def _work(self, wid, inbox):
        reader = SplitReader(self.spec)
        self.events.put(PoolEvent(EventKind.ready, wid))
        while (task := inbox.get()) is not None:
            try:
                result = reader.process(task)
            except DataError as exc:
                self.events.put(PoolEvent(EventKind.failed, wid, message=str(exc)))
            else:
                self.events.put(PoolEvent(EventKind.done, wid, meta=result.meta(), payload=result))
        reader.close()

    def send(self, wid, task):
        self.inbox[wid].put(task)

    def poll(self, timeout_s):
        try:
            got = [self.events.get(timeout=timeout_s)]
        except queue.Empty:
            return []
        while not self.events.empty():
            got.append(self.events.get_nowait())
        return got

    def kill(self, wid):
        self.inbox.pop(wid).put(None)

    def close(self):
        for wid in list(self.inbox):
            self.kill(wid)


BACKEND = Backend(job_wide=False,
                  make=lambda setup, options: InProcessService(setup, ThreadPool(setup.spec), tick_s=0.05, wake_s=0.05))
'''
# 64 steps x 64 samples per rank: about 4 passes over a rank's ~990 samples.
THREADS_PER_RANK, STEPS = 2, 64


def _package_with_toy_backend(root: Path) -> Path:
    """A copy of the package and conf/ with the toy backend added as docs/architecture.md says: its module, its
    preset (parquet_local's settings with dsi.backend=threads)."""
    shutil.copytree(REPO / "neocfg", root / "neocfg", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "conf", root / "conf")
    (root / "neocfg" / "data" / "dpp" / "backends" / "threads.py").write_text(TOY_BACKEND)
    preset = (REPO / "conf" / "dsi" / "parquet_local.yaml").read_text()
    assert preset.count("backend: local\n") == 1 and preset.count("name: parquet_local\n") == 1
    (root / "conf" / "dsi" / "threads.yaml").write_text(
        preset.replace("backend: local\n", "backend: threads\n").replace("name: parquet_local\n", "name: threads\n"))
    return root


def test_a_toy_dpp_backend_trains_every_sample_exactly_once_per_epoch(tmp_path):
    from data_helpers import labeled_ids
    from neocfg.data.dpp.progress import DeliveryLog
    from neocfg.data.dpp_source import AUDIT_ENV

    import numpy as np

    root = _package_with_toy_backend(tmp_path / "src")
    audit = tmp_path / "audit"
    audit.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NEOCFG_DEBUG"}
    env.update(PYTHONPATH=str(root), **{AUDIT_ENV: str(audit)})

    def neocfg(*args: str) -> subprocess.CompletedProcess:
        res = subprocess.run([sys.executable, "-m", "neocfg", *args, "dsi=threads", "dsi.path=ds"], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr
        return res

    neocfg("mode=gen_data", "dsi.num_samples=2000", "dsi.eval_samples=500")
    neocfg("mode=train", f"train.steps={STEPS}", "train.batch_size=64", "train.eval_batches=1",
           "planner.algorithm=greedy", f"dsi.workers={2 * THREADS_PER_RANK}", "hydra.run.dir=run")
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["dpp"]["backend"] == "threads"
    assert [d["dpp.workers"] for d in m["data_per_rank"]] == [THREADS_PER_RANK] * 2
    logs = [DeliveryLog.read(f) for f in sorted(audit.glob("rank*.bin"))]
    assert len(logs) == 2 and all(len(x) >= STEPS * 64 for x in logs)
    pairs = np.concatenate(logs)
    epochs = sorted(set(pairs[:, 0].tolist()))
    assert epochs == list(range(len(epochs))) and len(epochs) >= 4, epochs
    want = labeled_ids(tmp_path / "ds")
    for e in epochs[:-2]:  # each rank's service counts its own epochs: the last two may be under way in one
        ids, counts = np.unique(pairs[pairs[:, 0] == e, 1], return_counts=True)
        assert counts.max() == 1, f"epoch {e}: {int((counts > 1).sum())} samples delivered twice"
        assert set(ids.tolist()) == want, f"epoch {e}: {len(want - set(ids.tolist()))} samples lost"
