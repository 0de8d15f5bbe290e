"""The docs describe the project as it is: docs/configuration.md documents every schema key (and no other) with the
default a user gets, the README stays short and its links resolve, and nothing in the tree narrates history."""

from __future__ import annotations

import re
import subprocess

import pytest

from conftest import REPO, compose_cfg
from schema_keys import REQUIRED, render, schema_keys

CONFIG_DOC = REPO / "docs" / "configuration.md"
README = REPO / "README.md"
README_MAX_LINES = 250
# Sections set by conf/config.yaml itself (not by a preset group): their documented default is the composed value.
TOP_LEVEL = ("planner.", "train.", "sweep.")
TOP_LEVEL_KEYS = ("mode", "debug")
ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|\s*([^|]*?)\s*\|\s*([^|]*?)\s*\|")


def documented_rows() -> dict[str, tuple[str, str]]:
    """key -> (type, default) from the doc's key tables: rows `| `key` | type | default | meaning |`."""
    rows: dict[str, tuple[str, str]] = {}
    for line in CONFIG_DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            key, typ, default = m.group(1), m.group(2), m.group(3).strip("`")
            assert key not in rows, f"docs/configuration.md documents {key} twice"
            rows[key] = (typ.strip("`"), default)
    return rows


def composed_default(path: str, cfg) -> str:
    node = cfg
    for part in path.split("."):
        node = getattr(node, part)
    return render(node)


def test_configuration_doc_lists_every_schema_key_and_no_other():
    rows = documented_rows()
    keys = {k.path for k in schema_keys()}
    missing = sorted(keys - set(rows))
    extra = sorted(set(rows) - keys)
    assert not missing, f"schema keys without a row in docs/configuration.md: {missing}"
    assert not extra, f"docs/configuration.md rows for keys the schema does not have: {extra}"


def test_configuration_doc_defaults_and_types_match_the_schema():
    rows = documented_rows()
    cfg = compose_cfg([])
    wrong = []
    for key in schema_keys():
        if key.path not in rows:
            continue  # test_configuration_doc_lists_every_schema_key_and_no_other names it
        typ, default = rows[key.path]
        top = key.path in TOP_LEVEL_KEYS or key.path.startswith(TOP_LEVEL)
        want = composed_default(key.path, cfg) if top else key.default
        if default != want:
            wrong.append(f"{key.path}: documented default {default!r}, schema {want!r}")
        if typ != key.type_name:
            wrong.append(f"{key.path}: documented type {typ!r}, schema {key.type_name!r}")
    assert not wrong, "\n".join(wrong)


def test_required_keys_are_marked_required():
    rows = documented_rows()
    required = [k.path for k in schema_keys() if k.default == REQUIRED]
    assert required, "the schema has required keys (model.name, hardware.device.hbm_gib, ...)"
    assert all(rows[k][1] == REQUIRED for k in required)


def test_readme_is_short_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    assert any(link.startswith("docs/") for link in local), "the README links into docs/"
    broken = [link for link in local if not (REPO / link).exists()]
    assert not broken, f"README links to missing files: {broken}"


def test_docs_links_resolve():
    broken = []
    for doc in sorted((REPO / "docs").glob("*.md")):
        for link in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if not re.match(r"[a-z]+://", link) and not (doc.parent / link).exists():
                broken.append(f"{doc.name}: {link}")
    assert not broken, broken


HISTORY = re.compile(r"(?i:issue [0-9]+)|[0-9a-f]{7,40}\b.*commit|UTC")


@pytest.mark.parametrize("where", ["neocfg", "tests", "docs", "README.md"])
def test_nothing_narrates_the_projects_history(where):
    files = subprocess.run(["git", "ls-files", where], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    hits = []
    for name in files:
        path = REPO / name
        if path.suffix not in (".py", ".md", ".yaml") or path.name == "test_docs.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{name}:{i}: {line.strip()[:100]}")
    assert not hits, "\n".join(hits)


def _bench_common():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_common", REPO / "bench" / "common.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_quotes_the_recorded_results_as_they_are():
    """The README's result tables are bench/RESULTS.md's, re-quoted by the benches (`python bench/common.py --readme`)."""
    common = _bench_common()
    readme, results = README.read_text(), (REPO / "bench" / "RESULTS.md").read_text()
    blocks = common.README_BLOCK.findall(readme)
    assert len(blocks) >= 2, "the README quotes the speed and TorchRec-planner tables"
    assert common.refresh_readme(readme, results) == readme, (
        "a README results table differs from bench/RESULTS.md: run `python bench/common.py --readme`")
    for block in common.README_BLOCK.finditer(readme):
        assert "Command: `python bench/" in block["body"] and "| ---" not in block["body"].split("|", 1)[0]
        assert re.search(r"^\|.*\|$", block["body"], re.M), f"the '{block['section']}' quote holds a table"


def test_readme_summaries_are_the_recorded_sections_sentences():
    """A summary quote inside a README paragraph is its RESULTS section's 'In short:' paragraph, wrapped to the
    README's width where it stands, and refreshed when the section changes."""
    common = _bench_common()
    readme, results = README.read_text(), (REPO / "bench" / "RESULTS.md").read_text()
    quotes = list(common.README_SUMMARY.finditer(readme))
    assert quotes, "the README quotes the DPP benches' summaries"
    for m in quotes:
        section = common.results_section(m["section"].strip(), results)
        said = next(p for p in section.split("\n\n") if p.startswith(common.SUMMARY_LEAD))
        assert " ".join(m["body"].split()) == " ".join(said[len(common.SUMMARY_LEAD):].split())
    results_doc = ("## A\n\nCommand: `python bench/x.py`\n\n| a |\n|---|\n| 1 |\n\n"
                   f"{common.SUMMARY_LEAD}{'word ' * 60}end.\n")
    text = "Some prose and then <!-- results: A; summary -->old words<!-- /results --> after.\n"
    refreshed = common.refresh_readme(text, results_doc)
    assert "old words" not in refreshed and "end.<!-- /results --> after." in refreshed
    body = common.README_SUMMARY.search(refreshed)["body"]
    assert body.split() == ["word"] * 60 + ["end."]
    lines = refreshed.splitlines()
    assert len(lines) > 2 and all(len(line) <= common.README_WIDTH for line in lines[1:-1])
