"""Every preset composes and validates; overrides; schema defaults; cross-field checks."""

from __future__ import annotations

import pytest

from neocfg.errors import ConfigError
from neocfg.types import Interaction, Mode

from conftest import CONF, compose_cfg


def _presets(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize("model", _presets("model"))
def test_every_model_preset_validates(model):
    cfg = compose_cfg([f"model={model}"])
    assert cfg.model.name == model
    assert len(cfg.model.tables) > 0
    assert all(t.num_embeddings > 0 and t.embedding_dim > 0 for t in cfg.model.tables)


@pytest.mark.parametrize("hardware", _presets("hardware"))
def test_every_hardware_preset_validates(hardware):
    cfg = compose_cfg([f"hardware={hardware}"])
    assert cfg.hardware.name == hardware
    assert cfg.hardware.num_devices == cfg.hardware.nodes * cfg.hardware.devices_per_node


@pytest.mark.parametrize("dsi", _presets("dsi"))
def test_every_dsi_preset_validates(dsi):
    cfg = compose_cfg([f"dsi={dsi}"])
    assert cfg.dsi.name == dsi


def test_published_numbers():
    kaggle = compose_cfg(["model=criteo_kaggle"]).model
    assert len(kaggle.tables) == 26 and kaggle.tables[2].num_embeddings == 10131227
    assert kaggle.bottom_layers == [512, 256, 64, 16] and kaggle.top_mlp == [512, 256, 1]
    dcn = compose_cfg(["model=dcnv2_mlperf"]).model
    assert dcn.interaction is Interaction.dcn and dcn.dcn_low_rank_dim == 512
    assert [t.pooling_factor for t in dcn.tables][20] == 100
    assert sum(t.num_embeddings for t in dcn.tables) == 204_184_588
    neo = compose_cfg(["model=neo_model_f_12t"]).model
    assert 11e12 < neo.num_parameters < 13e12 and {t.embedding_dim for t in neo.tables} == {256}
    z16 = compose_cfg(["hardware=zionex_16node"]).hardware
    assert z16.num_devices == 128 and z16.device.hbm_gib == 40 and z16.inter_node_bandwidth_gbs == 25


def test_overrides_apply():
    cfg = compose_cfg(["model=criteo_kaggle", "model.tables.3.num_embeddings=77", "hardware.devices_per_node=4",
                       "train.batch_size=64", "planner.algorithm=greedy"])
    assert cfg.model.tables[3].num_embeddings == 77
    assert cfg.hardware.num_devices == 4
    assert cfg.train.batch_size == 64
    assert cfg.planner.algorithm.value == "greedy"
    assert cfg.mode is Mode.train  # the default job


def test_integer_keys_take_integral_floats(tmp_path):
    """1e7 and 2.0, as people write them, on the command line and in a preset of one's own."""
    cfg = compose_cfg(["model.tables.0.num_embeddings=1e7", "train.steps=2.0", "model.bottom_mlp=[64,32.0,16]"])
    assert cfg.model.tables[0].num_embeddings == 10_000_000 and type(cfg.model.tables[0].num_embeddings) is int
    assert cfg.train.steps == 2 and cfg.model.bottom_layers == [64, 32, 16]
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text(
        "name: mine\ntables:\n  - {name: a, num_embeddings: 1e7, embedding_dim: 16.0}\n")
    cfg = compose_cfg(["model=mine", f"hydra.searchpath=[file://{tmp_path}]"])
    assert cfg.model.tables[0].num_embeddings == 10_000_000 and cfg.model.tables[0].embedding_dim == 16


def test_node_count_override_works_on_presets():
    cfg = compose_cfg(["hardware=zionex_1node", "hardware.nodes=4"])
    assert cfg.hardware.num_devices == 32


def test_model_with_only_name_and_tables_is_valid(tmp_path):
    from hydra import compose, initialize_config_dir
    from neocfg.config.schema import load, register

    (tmp_path / "model").mkdir()
    rows = "\n".join(f"  - {{name: t{i}, num_embeddings: {1000 + i}, embedding_dim: 64, pooling_factor: 3.5}}"
                     for i in range(300))
    (tmp_path / "model" / "mine.yaml").write_text(f"name: mine\ntables:\n{rows}\n")
    register()
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        raw = compose("config", overrides=["model=mine", f"hydra.searchpath=[file://{tmp_path}]"])
    cfg = load(raw)
    assert len(cfg.model.tables) == 300
    assert cfg.model.bottom_layers[-1] == 64  # default bottom MLP ends at the embedding dim
    assert cfg.model.tables[0].pooling_factor == 3.5


@pytest.mark.parametrize("override,key", [
    ("model.tables.0.num_embeddings=-5", "model.tables.0.num_embeddings"),
    ("model.tables.2.embedding_dim=0", "model.tables.2.embedding_dim"),
    ("model.tables.1.pooling_factor=-1", "model.tables.1.pooling_factor"),
    ("model.tables.1.name=t0", "model.tables.1.name"),
    ("hardware.world_size=3", "hardware.world_size"),
    ("model.bottom_mlp=[64,32,8]", "model.bottom_mlp"),
    ("planner.cache_ratio=0", "planner.cache_ratio"),
    ("model.tables.0.ranks=[9]", "model.tables.0.ranks.0"),
    ("hardware.output_overlap_efficiency=1.5", "hardware.output_overlap_efficiency"),
    ("hardware.output_overlap_efficiency=-0.1", "hardware.output_overlap_efficiency"),
])
def test_cross_field_checks_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        compose_cfg([override])
    assert err.value.key == key


def test_a_preset_missing_required_keys_hears_all_of_them_with_typical_values(cli, tmp_path):
    (tmp_path / "hardware").mkdir()
    lines = [line for line in (CONF / "hardware" / "zionex_1node.yaml").read_text().splitlines()
             if not line.lstrip().startswith(("intra_node_bandwidth_gbs", "hbm_bandwidth_gbs", "name"))]
    (tmp_path / "hardware" / "mine.yaml").write_text("name: mine\n" + "\n".join(lines) + "\n")
    r = cli("--config-dir", str(tmp_path), "mode=describe", "hardware=mine")
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(err) == 1, r.stderr
    assert "2 required keys missing" in err[0] and "docs/hardware.md" in err[0]
    assert "hardware.device.hbm_bandwidth_gbs (one device's memory bandwidth in GB/s, e.g. 3350" in err[0]
    assert "hardware.intra_node_bandwidth_gbs (all-to-all bandwidth per device within a node" in err[0]


def test_a_missing_precision_peak_is_a_warning(capsys):
    compose_cfg(["mode=plan", "hardware=h100_8node", "train.dense_precision=tf32"])
    assert "warning" not in capsys.readouterr().err
    compose_cfg(["mode=plan", "hardware=h100_8node", "train.dense_precision=bf16", "hardware.device.peak_tflops_bf16=null"])
    err = capsys.readouterr().err
    assert "warning: hardware.device.peak_tflops_bf16 is not set" in err and "fp32 peak (67 TFLOP/s)" in err
    compose_cfg(["mode=plan", "hardware=cpu_local", "train.dense_precision=bf16"])   # a CPU has no tensor cores
    assert "warning" not in capsys.readouterr().err


def test_the_template_hardware_preset_in_the_docs_validates(tmp_path):
    import re

    from conftest import REPO

    text = (REPO / "docs" / "hardware.md").read_text()
    template = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "my_cluster.yaml").write_text(template)
    hw = compose_cfg(["hardware=my_cluster", f"hydra.searchpath=[file://{tmp_path}]"]).hardware
    assert hw.num_devices == 32 and hw.device.peak_tflops_tf32 == 495


def test_output_overlap_efficiency_out_of_range_is_one_line():
    with pytest.raises(ConfigError) as err:
        compose_cfg(["hardware.output_overlap_efficiency=2"])
    assert str(err.value).count("\n") == 0
    assert "hardware.output_overlap_efficiency" in str(err.value) and "2" in str(err.value)
    assert "[0.0, 1.0]" in str(err.value)
