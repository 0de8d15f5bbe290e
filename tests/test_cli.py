"""Through the real CLI: describe, Hydra flags, user presets, and bad input as one clear line."""

from __future__ import annotations

import pytest


def test_describe_default(cli, tmp_path):
    r = cli("mode=describe")
    assert r.returncode == 0, r.stderr
    assert "model dlrm_tiny: 8 tables" in r.stdout
    assert "world size 2" in r.stdout
    assert list((tmp_path / "outputs").rglob("describe.json"))


def test_describe_dcnv2_on_zionex_16node(cli):
    r = cli("mode=describe", "model=dcnv2_mlperf", "hardware=zionex_16node")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "26 tables" in out and "204,184,588 rows" in out
    assert "world size 128" in out
    assert "5.00 TiB HBM" in out  # 128 x 40 GiB
    assert "all in HBM at fp32 yes" in out


def test_describe_says_when_it_cannot_fit(cli):
    r = cli("mode=describe", "model=neo_model_f_12t", "hardware=zionex_1node")
    assert r.returncode == 0, r.stderr
    assert "all in HBM at fp32 no" in r.stdout and "HBM + host DDR at fp16 no" in r.stdout


def test_cfg_job_and_help(cli):
    r = cli("--cfg", "job", "model=criteo_kaggle")
    assert r.returncode == 0 and "name: criteo_kaggle" in r.stdout
    r = cli("--help")
    assert r.returncode == 0 and "hardware: " in r.stdout and "zionex_16node" in r.stdout


def test_user_preset_via_config_dir(cli, tmp_path):
    user = tmp_path / "myconf"
    (user / "model").mkdir(parents=True)
    (user / "model" / "mymodel.yaml").write_text(
        "name: mymodel\ntables:\n  - {name: a, num_embeddings: 1000, embedding_dim: 32, pooling_factor: 2}\n")
    (user / "hardware").mkdir()
    (user / "hardware" / "mybox.yaml").write_text(
        "name: mybox\nnodes: 2\ndevices_per_node: 4\ndevice: {hbm_gib: 16, hbm_bandwidth_gbs: 900}\n"
        "host: {ddr_gib: 256, ddr_bandwidth_gbs: 100}\nintra_node_bandwidth_gbs: 300\ninter_node_bandwidth_gbs: 12.5\n")
    r = cli("--config-dir", str(user), "mode=describe", "model=mymodel", "hardware=mybox")
    assert r.returncode == 0, r.stderr
    assert "model mymodel: 1 tables" in r.stdout and "world size 8" in r.stdout


BAD_INPUTS = [
    # (overrides, text that must appear in the one-line message)
    (["model.tables.0.num_embeddings=-5"], ["model.tables.0.num_embeddings", "-5", "> 0"]),
    (["model.tables.0.num_embeddings=abc"], ["model.tables.0.num_embeddings", "abc", "Integer"]),
    (["model=nope"], ["model=nope", "available", "dlrm_tiny"]),
    (["hardware=nope"], ["hardware=nope", "zionex_1node"]),
    (["mode=foo"], ["mode", "foo", "describe"]),
    (["hardware.world_size=5"], ["hardware.world_size", "5", "nodes x"]),
    (["model.foo=1"], ["model.foo", "unknown key", "ModelConfig"]),
    (["+model.tables.0.extra=3"], ["model.tables.0.extra", "unknown key"]),
    (["model.interaction=xyz"], ["model.interaction", "xyz", "dot, dcn"]),
    (["hardware.nodes=0"], ["hardware.nodes", "0", "> 0"]),
    (["planner.mip_gap=2"], ["planner.mip_gap", "2", "[0.0, 1.0]"]),
    (["dsi.workers=zero"], ["dsi.workers", "zero", "auto"]),
    (["model.tables.1.name=t0"], ["model.tables.1.name", "t0", "unique"]),
    (["train.batch_size=1.5"], ["train.batch_size", "1.5", "not a whole number"]),
    (["model.bottom_mlp=[64,32.5,16]"], ["model.bottom_mlp.1", "32.5", "not a whole number"]),
    (["model.tables.0.num_embeddings=1e23"], ["model.tables.0.num_embeddings", "no cluster could hold it"]),
    (["model.tables.0.sharding_types=[bogus]"], ["model.tables.0.sharding_types.0", "bogus", "row_wise"]),
    (["model.top_mlp=[4,2]"], ["model.top_mlp", "width 1"]),
    (["hardware.device.hbm_gib=???"], ["hardware.device.hbm_gib", "required"]),
    (["hardware.device.hbm_gib=null"], ["hardware.device.hbm_gib", "Optional"]),
    (["model.tables.0.ranks=[7]"], ["model.tables.0.ranks.0", "7", "world size 2"]),
    (["model.tables.0.zipf_alpha=9"], ["model.tables.0.zipf_alpha", "9", "[0.0, 5.0]"]),
    (["model=dlrm_tiny", "model.bottom_mlp=[64,8]"], ["model.bottom_mlp", "embedding_dim=16"]),
    (["hardware=cpu_local", "hardware.backend=nccl"], ["hardware.backend", "nccl", "gloo"]),
]


@pytest.mark.parametrize("overrides,expected", BAD_INPUTS, ids=[" ".join(o) for o, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line(cli, tmp_path, overrides, expected):
    r = cli("mode=describe", *overrides)
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("neocfg: error: ")
    for text in expected:
        assert text in lines[0], (text, lines[0])
    assert "Traceback" not in r.stderr
    # Nothing written half-way: a run that failed validation leaves no output directory.
    assert not (tmp_path / "outputs").exists()


def test_failed_validation_leaves_no_run_directory(cli, tmp_path):
    r = cli("hardware.nodes=0")
    assert r.returncode != 0
    assert not (tmp_path / "outputs").exists()


def test_debug_shows_traceback(cli):
    r = cli("hardware.nodes=0", env={"NEOCFG_DEBUG": "1"})
    assert r.returncode != 0 and "Traceback" in r.stderr


def test_debug_set_in_a_config_file_shows_traceback(cli, tmp_path):
    user = tmp_path / "myconf"
    user.mkdir()
    (user / "myjob.yaml").write_text("defaults:\n  - config\n  - _self_\n\ndebug: true\n")
    r = cli("--config-dir", str(user), "--config-name", "myjob", "hardware.nodes=0")
    assert r.returncode != 0 and "Traceback" in r.stderr and "hardware.nodes" in r.stderr


def test_an_interrupt_hidden_behind_a_library_error_is_still_an_interrupt():
    """Ctrl-C landing in OmegaConf's flag clean-up made it raise ConfigKeyError('NoneType' ...) during composition,
    which the CLI reported as `tables: unknown key`; the interrupt is in the chain and wins."""
    from neocfg.cli import interrupt_behind
    from neocfg.errors import Interrupted

    def compose() -> None:
        try:
            raise Interrupted(2)
        finally:
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'")

    try:
        try:
            compose()
        except AttributeError as exc:
            raise KeyError("tables") from exc
    except KeyError as exc:
        found = interrupt_behind(exc)
    assert isinstance(found, Interrupted) and found.exit_code == 130
    assert interrupt_behind(ValueError("plain")) is None
