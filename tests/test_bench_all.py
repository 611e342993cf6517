"""`speculant bench all --quick` end to end on the real default model: one report with every section.

Passes with or without matplotlib: with it, report.md must link exactly the PNGs written; without
it (also checked by hiding matplotlib), it must say that the plots were skipped.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys

import pytest

from benchmarks.all import SIZES, main, model_free_methods
from benchmarks.all_report import NO_MATPLOTLIB, write_report
from benchmarks.model import VERIFY_TS

QUICK = {name: sizes[1] for name, sizes in SIZES.items()}
PLOTS = {"model_verify_curve.png", "spec_speedup.png", "spec_acceptance_per_pos.png", "serve_concurrency.png"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_all")
    argv = ["--quick", "--threads", "1", "--methods", "ngram", "--categories", "code_edit,open_chat",
            "--out", str(out)]
    assert main(argv) == 0
    return out


def _linked_images(md: str) -> list[str]:
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)


def test_report_json_has_every_section(out):
    data = json.loads((out / "report.json").read_text())
    assert data["config"]["sections"] == ["model", "spec", "serve"] and data["config"]["quick"]
    model, spec, serve = data["model"], data["spec"], data["serve"]
    assert [int(t) for t in model["verify_ms"]] == list(VERIFY_TS) and model["floor_ms"] > 0
    assert model["decode_tok_s_b1"] > 0 and model["context"] == QUICK["context"]
    assert model["prefill_tokens"] == QUICK["prefill_tokens"] and model["long_context"] == QUICK["long_context"]
    attention = model["long_attention"]  # the long step's attention, cold, against a plain read of its K/V
    assert attention["context"] == QUICK["long_context"] and attention["kv_mb"] > 0
    assert attention["attention_ms"] > 0 and attention["read_ms"] > 0
    rate = model["compute_rate"]
    assert rate["peak_gmacs"] > 0 and all(g > 0 for g in rate["products_gmacs"].values())
    assert rate["combined_gmacs"] > 0  # the peak loop with a Q4_1 block's float multiplies beside its 4-dots
    assert list(spec["methods"]) == ["none", "ngram"] and list(spec["config"]["modes"]) == ["batch1", "concurrent"]
    assert {r["category"] for r in spec["rows"]} == {"code_edit", "open_chat", "all"}
    assert all(r["identical"] for r in spec["rows"])  # greedy speculation stays lossless
    ngram_all = [r for r in spec["rows"] if (r["method"], r["category"]) == ("ngram", "all")]
    assert len(ngram_all) == 2  # one per mode
    for r in ngram_all:  # what the plots show: speedup, mean acceptance length, per-position acceptance
        assert r["speedup"] > 0 and (r["al"] is None or r["al"] >= 1)
        assert all(0 <= a <= 1 for a in r["acceptance_per_pos"])
    assert [r["concurrency"] for r in serve["levels"]] == [int(x) for x in QUICK["levels"].split(",")]
    per_level = QUICK["requests"] * QUICK["serve_max_tokens"]  # ignore_eos: every request runs to the end
    assert all(r["num_errors"] == 0 and r["num_output_tokens"] == per_level for r in serve["levels"])
    assert all(data[s]["elapsed_s"] > 0 for s in ("model", "spec", "serve"))


def test_markdown_has_every_table_and_links_the_plots_written(out):
    md = (out / "report.md").read_text()
    for heading in ("## Model runtime", "## Speculative decoding", "## Serving"):
        assert heading in md
    for table_head in ("| T | ms | x T=1 | x floor |", "| category | method | AL | tok/step |",
                       "| clients | reqs | TTFT p50/p99 ms |"):
        assert table_head in md
    assert "| integer 4-dot peak (" in md and "| weight products at T=8 |" in md
    written = {p.name for p in out.glob("*.png")}
    assert set(_linked_images(md)) == written == set(json.loads((out / "report.json").read_text())["plots"])
    if importlib.util.find_spec("matplotlib") is not None:
        assert written == PLOTS
    else:
        assert written == set() and NO_MATPLOTLIB in md


def test_without_matplotlib_the_report_says_so(out, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    data = json.loads((out / "report.json").read_text())
    paths = write_report(data, tmp_path)
    assert {p.name for p in paths} == {"report.json", "report.md"}
    md = (tmp_path / "report.md").read_text()
    assert NO_MATPLOTLIB in md and _linked_images(md) == []
    assert "| T | ms | x T=1 | x floor |" in md  # the tables do not need matplotlib


def test_default_methods_are_the_installed_model_free_proposers():
    names = model_free_methods()
    assert {"naive", "ngram", "suffix"} <= set(names)
    assert not set(names) & {"draft_model", "eagle", "mtp", "medusa"}  # these need weights


@pytest.mark.parametrize("argv, flag", [
    (["--sections", "model,nope"], "--sections"),
    (["--methods", "nosuchproposer"], "nosuchproposer"),
    (["--levels", "0"], "--levels"),
    (["--requests", "0"], "--requests"),
])
def test_bad_flags_name_the_flag(argv, flag, capsys):
    assert main(argv) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--prefill-tokens", "0"), ("--repeats", "0"), ("--long-context", "-1")])
def test_bench_model_refuses_a_bad_count_naming_the_flag(flag, value, capsys):
    from benchmarks.model import parse

    with pytest.raises(SystemExit) as exc:
        parse([flag, value])
    assert exc.value.code == 2 and flag in capsys.readouterr().err
