"""Shared helpers of the benchmarks: compose conf/ like the CLI, cap table sizes, write JSON results."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir

from neocfg.config.schema import NeocfgConfig, load, register

REPO = Path(__file__).resolve().parent.parent


def compose_cfg(overrides: list[str]) -> NeocfgConfig:
    register()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base=None):
        return load(compose("config", overrides=overrides))


def cap_rows(model: str, cap: int) -> list[str]:
    """Overrides that cap every table of a model preset at `cap` rows (so a CPU box can hold it)."""
    cfg = compose_cfg([f"model={model}"])
    return [f"model.tables.{i}.num_embeddings={cap}" for i, t in enumerate(cfg.model.tables)
            if t.num_embeddings > cap]


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=1)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
        print(f"written to {out}", file=sys.stderr)


RESULTS = REPO / "bench" / "RESULTS.md"
RESULTS_HEADER = ("# Benchmark results\n\nWritten by the benchmarks themselves (`record_results` in bench/common.py): each section is"
                  " replaced by the\nbench that owns it, with the command, date and machine of the run. The docs link"
                  " here instead of copying numbers.\n")


def machine() -> str:
    """One line naming the machine a result was measured on."""
    import os
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} cores ({cpu}), {gpu}, Python {platform.python_version()}, torch {torch.__version__}"


def record_results(section: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or add) `## <section>` of bench/RESULTS.md with `body`, headed by the command, date and machine."""
    import datetime
    import shlex

    command = " ".join(shlex.quote(a) for a in ["python", *sys.argv])
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    block = (f"## {section}\n\nCommand: `{command}`; date: {date}; machine: {machine()}.\n\n{body.strip()}\n")
    text = path.read_text() if path.exists() else RESULTS_HEADER
    pattern = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    text = pattern.sub(lambda _: block + "\n", text, count=1) if pattern.search(text) else text.rstrip("\n") + "\n\n" + block
    text = text.rstrip("\n") + "\n"
    readme = refresh_readme(README.read_text(), text) if path == RESULTS and README.exists() else None
    path.write_text(text)
    print(f"results: section '{section}' of {path}", file=sys.stderr)
    if readme is not None:
        README.write_text(readme)


README = REPO / "README.md"
# A README block that quotes one table of a RESULTS section, refreshed whenever that section is recorded:
#   <!-- results: <section>; table <n> -->  ...generated...  <!-- /results -->
README_BLOCK = re.compile(r"(?P<open><!-- results: (?P<section>[^;>]+); table (?P<index>\d+) -->\n)"
                          r"(?P<body>.*?)(?P<close><!-- /results -->)", re.S)


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^a-z0-9 _-]", "", heading.lower()).replace(" ", "-")


def results_section(section: str, results_text: str) -> str:
    found = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", results_text, re.S | re.M)
    if found is None:
        raise KeyError(f"bench/RESULTS.md has no section '{section}'")
    return found.group(1)


def quoted_table(section: str, index: int, results_text: str) -> str:
    """The README's quote of table `index` (from 1) of a RESULTS section, under the run's command, date and machine."""
    body = results_section(section, results_text)
    header = next((line for line in body.splitlines() if line.startswith("Command: ")), "")
    tables = re.findall(r"(?:^\|.*\n?)+", body, re.M)
    if not 1 <= index <= len(tables):
        raise KeyError(f"bench/RESULTS.md section '{section}' has {len(tables)} tables, not a table {index}")
    source = f"From [bench/RESULTS.md](bench/RESULTS.md#{anchor(section)}). {header}".rstrip()
    return f"{source}\n\n{tables[index - 1].rstrip()}\n"


# A README sentence inside a paragraph that quotes a RESULTS section's summary (its paragraph that starts with
# SUMMARY_LEAD), re-wrapped to README_WIDTH columns where it stands:
#   ... <!-- results: <section>; summary -->...generated...<!-- /results --> ...
README_SUMMARY = re.compile(r"(?P<open><!-- results: (?P<section>[^;>]+); summary -->)(?P<body>.*?)"
                            r"(?P<close><!-- /results -->)", re.S)
SUMMARY_LEAD = "In short: "
# The README's prose is wrapped at this many columns.
README_WIDTH = 120


def quoted_summary(section: str, results_text: str, column: int, close: str) -> str:
    """A RESULTS section's summary, wrapped to README_WIDTH from `column` on (where the quote starts on its line),
    leaving room for the `close` marker after its last word."""
    import textwrap

    body = results_section(section, results_text)
    summary = next((p for p in body.split("\n\n") if p.startswith(SUMMARY_LEAD)), None)
    if summary is None:
        raise KeyError(f"bench/RESULTS.md section '{section}' has no paragraph starting {SUMMARY_LEAD!r}")
    text = " ".join(summary[len(SUMMARY_LEAD):].split())
    pad, tail = "\0" * column, "\0" * len(close)
    wrapped = textwrap.fill(text + tail, width=README_WIDTH, initial_indent=pad, break_long_words=False,
                            break_on_hyphens=False)[column:-len(close)]
    first = wrapped.split("\n", 1)[0]
    if column + len(first) > README_WIDTH:  # not even its first word fits after the marker: start on the next line
        return "\n" + quoted_summary(section, results_text, 0, close)
    return wrapped


def refresh_readme(readme_text: str, results_text: str) -> str:
    """README text with every results block re-quoted from the RESULTS text."""
    text = README_BLOCK.sub(lambda m: m["open"] + quoted_table(m["section"].strip(), int(m["index"]), results_text)
                            + m["close"], readme_text)

    at = 0
    while (m := README_SUMMARY.search(text, at)) is not None:  # one by one: a quote moves the columns after it
        column = m.end("open") - (text.rfind("\n", 0, m.end("open")) + 1)
        try:
            quote = quoted_summary(m["section"].strip(), results_text, column, m["close"])
        except KeyError as exc:  # a section recorded before it had a summary: left as quoted (test_docs names it)
            print(f"warning: {exc.args[0]}; its README quote is left as it was", file=sys.stderr)
            quote = m["body"]
        text = text[:m.end("open")] + quote + text[m.start("close"):]
        at = m.end("open") + len(quote) + len(m["close"])
    return text


if __name__ == "__main__" and sys.argv[1:] == ["--readme"]:
    README.write_text(refresh_readme(README.read_text(), RESULTS.read_text()))
    print(f"re-quoted the results blocks of {README}", file=sys.stderr)
