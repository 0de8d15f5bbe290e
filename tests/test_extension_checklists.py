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
