"""`speculant bench spec` on the real model: one short prompt per category, result structure and counters."""

from __future__ import annotations

import copy
import json
import pathlib
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from benchmarks import report
from benchmarks.prompts import BUILTIN_CATEGORIES, LONG_CATEGORIES, builtin_prompts, load_prompts, parse_record, select
from benchmarks.spec import main, method_configs, run_spec_bench, share_verify_curve
from benchmarks.spec_timing import reset_proposer
from engine.generate import generate
from engine.serving.protocol import SamplingParams

MAX_TOKENS = 6
METHODS = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
           "suffix": {"method": "suffix", "num_speculative_tokens": 4}}


TINY = [  # one tiny prompt per built-in category: prefill stays cheap
    {"category": "code_edit", "prompt": "Rename f to g:\n```python\ndef f(x):\n    return x + 1\n\nprint(f(2))\n```"},
    {"category": "extraction", "prompt": "Extract the city as JSON: Ana moved from Porto to Lyon in May."},
    {"category": "open_chat", "prompt": "Why do cats purr?"},
    {"category": "agent_json", "messages": [
        {"role": "system", "content": 'Reply only with {"tool": "get_weather", "arguments": {"city": CITY}}.'},
        {"role": "user", "content": "Weather in Oslo?"}]},
]


@pytest.fixture(scope="module")
def prompts():
    return [parse_record(r, "tiny", f"tiny-{i}") for i, r in enumerate(TINY)]


@pytest.fixture(scope="module")
def engines(engine, make_engine):
    built = {label: make_engine(speculative_config=json.dumps(cfg)) for label, cfg in METHODS.items()}
    return {"none": engine, **built}


@pytest.fixture(scope="module")
def result(engines, prompts):
    return run_spec_bench(engines, prompts, max_tokens=MAX_TOKENS, concurrency=2, progress=False)


def _row(result, mode, category, method):
    (row,) = [r for r in result["rows"] if (r["mode"], r["category"], r["method"]) == (mode, category, method)]
    return row


def test_builtin_suite_has_every_category_with_3_to_6_prompts():
    counts = {c: sum(p.category == c for p in builtin_prompts()) for c in BUILTIN_CATEGORIES}
    assert all(3 <= n <= 6 for n in counts.values()), counts


def test_long_prompt_categories_run_only_when_named(tokenizer):
    """long_code / long_chat: built in, left out of the default suite, ~1,400 tokens a prompt (chat template
    included), which the bench's default --max-model-len of 2,048 holds with 128 tokens of answer."""
    from benchmarks.spec import load_suite, parse

    assert not {p.category for p in builtin_prompts()} & set(LONG_CATEGORIES)
    prompts = load_suite(parse(["--categories", "long_chat,long_code"]))
    assert [p.category for p in prompts] == ["long_chat"] * 2 + ["long_code"] * 2
    lengths = [len(tokenizer.encode(tokenizer.apply_chat_template(p.messages), add_special_tokens=False))
               for p in prompts]
    assert all(1000 <= n <= 2048 - 128 for n in lengths), lengths


def test_one_row_per_mode_category_and_method(result, prompts):
    cats = [p.category for p in prompts] + ["all"]
    keys = {(r["mode"], r["category"], r["method"]) for r in result["rows"]}
    assert keys == {(m, c, x) for m in ("batch1", "concurrent") for c in cats for x in ("none", "ngram", "suffix")}
    assert len(result["rows"]) == len(keys)
    assert result["baseline"] == "none" and result["methods"]["none"] is None
    assert result["methods"]["ngram"]["num_speculative_tokens"] == 4


def test_baseline_matches_generate_and_speculation_is_lossless(result, engines, prompts):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    for p in prompts:
        (ref,) = generate(engines["none"], [list(p.messages)], params)
        for mode in ("batch1", "concurrent"):
            assert _row(result, mode, p.category, "none")["output_tokens"] == len(ref.token_ids)
    for row in result["rows"]:
        assert row["identical"] and row["mismatches"] == [], row
        if row["method"] == "none":
            assert row["speedup"] == pytest.approx(1.0) and row["al"] is None


def test_counters_match_the_requests_own_totals(result, engines, prompts):
    """generate() reproduces the batch-1 block's draft/accept counts when each prompt (one per category, so one
    per block) starts, as its block did, from a fresh proposer and no acceptance history in the controller."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    done = []
    for p in prompts:
        reset_proposer(engines["ngram"])
        done.append(generate(engines["ngram"], [list(p.messages)], params)[0])
    row = _row(result, "batch1", "all", "ngram")
    assert row["num_draft_tokens"] == sum(c.num_draft_tokens for c in done)
    assert row["num_accepted_tokens"] == sum(c.num_accepted_tokens for c in done)
    assert row["request_steps"] == sum(c.num_steps for c in done)
    for r in result["rows"]:
        assert sum(r["accepted_per_pos"]) == r["num_accepted_tokens"] <= r["num_draft_tokens"]
        if r["num_drafts"]:
            assert r["al"] == pytest.approx(1 + r["num_accepted_tokens"] / r["num_drafts"])
            assert r["acceptance_per_pos"][0] == pytest.approx(r["accepted_per_pos"][0] / r["num_drafts"])
        assert r["tokens_per_step"] == pytest.approx(r["output_tokens"] / r["request_steps"])
        # per-step deltas of the requests' own Outputs agree with the engine-wide counter diffs
        assert sum(r["drafted_per_pos"]) == r["num_draft_tokens"]
        assert (r["drafted_per_pos"] or [0])[0] == r["num_drafts"]
        assert all(a <= n for a, n in zip(r["accepted_per_pos"], r["reached_per_pos"]))



def test_sampled_runs_record_their_settings_and_compare_seeded_outputs(engines, prompts):
    """--temperature > 0: the config records temperature, top_p and seed, the baseline emits what a generate()
    with the same params emits, and every ngram / suffix output equals it (seeded sampling is the same with
    speculation on or off): the identical column and the sampled target say so."""
    kw = {"max_tokens": 24, "concurrency": 1, "progress": False, "temperature": 0.8, "top_p": 0.95, "seed": 7}
    got = run_spec_bench(engines, prompts[:2], **kw)
    assert (got["config"]["temperature"], got["config"]["top_p"], got["config"]["seed"]) == (0.8, 0.95, 7)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7)
    for p in prompts[:2]:
        (ref,) = generate(engines["none"], [list(p.messages)], params)
        assert _row(got, "batch1", p.category, "none")["output_tokens"] == len(ref.token_ids)
    assert all(r["identical"] and r["mismatches"] == [] for r in got["rows"])
    assert sum(r["num_accepted_tokens"] for r in got["rows"] if r["category"] == "all") > 0
    table = report.format_table(got)
    assert "[met] seeded sampled outputs of ngram, suffix, naive (target_match) identical" in table
    assert "greedy outputs identical" not in table
    assert "sampled at temperature 0.8, top_p 0.95, seed 7" in report.format_markdown(got)
    with pytest.raises(ValueError, match="top_p"):
        run_spec_bench(engines, prompts[:1], **{**kw, "top_p": 0.0})
    assert main(["--temperature", "-1"]) == 2 and main(["--top-p", "1.5"]) == 2

def test_engines_are_left_unwrapped(result, engines):
    for e in engines.values():
        assert "forward" not in vars(e.runner)
        assert e.proposer is None or "propose" not in vars(e.proposer)
        assert not e.has_unfinished()


def test_speculative_engines_share_one_verify_curve(result, engines):
    curves = [e.controller.verify_cost for e in engines.values() if e.proposer is not None]
    assert len(curves) == 2 and np.array_equal(curves[0], curves[1])


def test_the_shared_curve_is_the_per_t_median():
    def engine(curve, t1):
        return SimpleNamespace(controller=SimpleNamespace(verify_cost=np.array(curve), t1_seconds=t1))

    engines = [engine([1, 1, 1.2, 1.9], 0.008), engine([1, 1, 1.4, 1.7], 0.010), engine([1, 1, 1.3, 2.0, 2.5], 0.009),
               engine([1.0], 0.0)]  # the last one never measured a curve (no speculation): left alone
    share_verify_curve(engines)
    assert engines[0].controller.verify_cost.tolist() == [1, 1, 1.3, 1.9]
    assert engines[2].controller.verify_cost.tolist() == [1, 1, 1.3, 1.9, 2.5]  # T = 4 only it measured
    assert [e.controller.t1_seconds for e in engines] == [0.009, 0.009, 0.009, 0.0]


def test_json_markdown_and_table(result, tmp_path):
    paths = report.write_all(result, tmp_path)
    assert {p.name for p in paths} >= {"spec.json", "spec.md"}
    data = json.loads((tmp_path / "spec.json").read_text())
    assert set(data) >= {"config", "baseline", "methods", "rows", "targets"}
    assert data["config"]["max_tokens"] == MAX_TOKENS and data["config"]["modes"] == {"batch1": 1, "concurrent": 2}
    names = {t["target"] for t in data["targets"]}
    assert "suffix >= ngram on agent_json (batch1)" in names
    md = (tmp_path / "spec.md").read_text()
    assert "## batch1" in md and "## concurrent" in md
    assert ("| category | method | AL | tok/step | accept | tok/s | speedup | paired | from grammar | identical "
            "| propose ms/step |") in md
    table = report.format_table(result)
    assert all(f" {m} " in table for m in ("none", "ngram", "suffix")) and "targets:" in table


def test_plots_of_a_run_without_accepted_drafts_draw_without_warnings(result, tmp_path):
    """A mode where no method has per-position acceptance (nothing drafted) still gets its plots, and no
    legend warning: the acceptance plot has no lines to name."""
    pytest.importorskip("matplotlib")
    quiet = copy.deepcopy(result)
    for row in quiet["rows"]:
        row["acceptance_per_pos"] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = report.write_plots(quiet, tmp_path)
    assert [p.name for p in paths] == ["spec_speedup.png", "spec_acceptance_per_pos.png"]
    assert all(p.stat().st_size > 0 for p in paths)


def test_bad_method_and_prompt_files_fail_cleanly(tmp_path):
    with pytest.raises(ValueError, match="method"):
        method_configs("none,nosuchproposer", [], None)
    with pytest.raises(ValueError, match="method: invalid JSON"):
        method_configs("none", ["{not json"], None)
    with pytest.raises(ValueError, match="max_ngram_size"):
        method_configs("none", ['{"method": "ngram", "max_ngram_size": 0}'], None)
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"category": "x", "prompt": "hi"}\n'
                   '{"category": "x", "messages": [{"role": "bot", "content": "a"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: messages\[0\].role"):
        load_prompts(bad)
    bad.write_text('{"prompt": "hi"}\n')
    with pytest.raises(ValueError, match="p.jsonl:1: category"):
        load_prompts(bad)
    assert main(["--max-tokens", "0"]) == 2
    assert main(["--categories", "nope"]) == 2


def test_user_prompt_file_round_trip(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text('{"category": "a", "prompt": "one"}\n\n{"category": "b", "id": "x", "messages": '
                 '[{"role": "system", "content": "s"}, {"role": "user", "content": "two"}]}\n')
    got = load_prompts(f)
    assert [(p.category, p.prompt_id, len(p.messages)) for p in got] == [("a", "mine-1", 1), ("b", "x", 2)]
    assert got[1].messages[1].content == "two"
    assert [p.prompt_id for p in select(got, ["b"])] == ["x"]


def test_the_cpu_other_processes_take_is_measured_apart_from_our_own():
    """A child burning one core for a second shows up as ~1 core of other load; this process burning CPU itself
    does not (the load average counts both, and lingers for minutes after a run). The suite's other worker may
    be busy meanwhile, so the second half compares with the machine's whole busy time over the same second."""
    import subprocess
    import sys
    import time

    from benchmarks.cpu_share import OtherLoad, _busy_seconds

    if not pathlib.Path("/proc/stat").exists():
        pytest.skip("no /proc/stat")
    others = OtherLoad()
    burn = "import time\nend = time.time() + 1.5\nwhile time.time() < end: pass"
    burner = subprocess.Popen([sys.executable, "-c", burn])
    burner.wait()
    assert others.cores() >= 0.5
    ours, busy0, start = OtherLoad(), _busy_seconds(), time.monotonic()
    end = start + 1.0
    while time.monotonic() < end:
        pass
    others = ours.cores()
    machine = (_busy_seconds() - busy0) / (time.monotonic() - start)
    assert machine - others >= 0.5  # our own busy second is not among the others' (we get >= half a core)


def test_the_load_note_follows_the_measured_cpu_of_other_processes():
    lingering = {"load_avg_1m_before": 1.8, "machine": {"load_avg_1m": 1.9, "cpu_count": 2}}
    assert report._load_note({**lingering, "other_cpu_cores": 0.05}) is None
    assert "0.9 cores" in report._load_note({**lingering, "other_cpu_cores": 0.9})
    assert "load average" in report._load_note(lingering)  # not measured (no /proc/stat): the load averages decide


def test_every_method_block_runs_between_two_baseline_blocks():
    from benchmarks.spec_pairs import block_order

    order = block_order([("batch1", 1), ("concurrent", 2)], ["code_edit", "open_chat"], 2, ["none", "a", "b"], "none")
    for i, (mode, _, cat, label, _) in enumerate(order):
        if label != "none":
            assert order[i - 1][:4] == order[i + 1][:4] == (mode, order[i][1], cat, "none")
    methods = [(o[0], o[2], o[3]) for o in order if o[3] != "none"]
    assert sorted(set(methods)) == sorted({(m, c, x) for m in ("batch1", "concurrent")
                                           for c in ("code_edit", "open_chat") for x in "ab"})
    assert all(methods.count(k) == 2 for k in set(methods))  # one block a repeat
    assert len(order) == 2 * 2 * (1 + 2 * 2 * 2)
    assert block_order([("batch1", 1)], ["x"], 3, ["none"], "none") == [("batch1", 1, "x", "none", r) for r in range(3)]


def test_each_repeat_starts_one_method_further_on_so_every_method_takes_every_place():
    from benchmarks.spec_pairs import block_order

    order = block_order([("batch1", 1)], ["x"], 3, ["none", "a", "b", "c"], "none")
    runs = [[label for _, _, _, label, r in order if label != "none" and r == rep] for rep in range(3)]
    assert runs == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(run[place] for run in runs) == ["a", "b", "c"] for place in range(3))


def test_paired_speedup_is_the_median_over_repeats_of_a_block_over_its_neighbours():
    from benchmarks.spec_pairs import paired_ratios, paired_speedups

    def run(tokens, seconds):
        return {"output_tokens": tokens, "wall_s": seconds}

    # one category, method "a", three repeats; the machine slows down between repeats
    runs = [(("b1", "c", "none", 0), run(100, 1.0)), (("b1", "c", "a", 0), run(100, 0.5)),
            (("b1", "c", "none", 0), run(100, 3.0)),  # neighbours 1.0 s and 3.0 s: 200 tok / 4 s; a 200/50 = 4.0
            (("b1", "c", "a", 1), run(100, 1.5)), (("b1", "c", "none", 1), run(100, 3.0)),  # 66.7 over 200/6: 2.0
            (("b1", "c", "a", 2), run(90, 2.0)), (("b1", "c", "none", 2), run(100, 2.0))]  # 45 over 200/5: 1.125
    got = paired_speedups(paired_ratios(runs, "none", ["c"]))
    assert got[("b1", "c", "a")] == pytest.approx(2.0)  # the median of 4.0, 2.0, 1.125
    assert got[("b1", "all", "a")] == pytest.approx(2.0)  # one category: the same pairs
    # two categories: "all" sums each repeat's tokens and seconds over the categories before its ratio
    two = [(("b1", cat, label, 0), run(tokens, seconds))
           for cat, tokens, base_s, method_s in (("x", 10, 1.0, 0.5), ("y", 30, 2.0, 3.0))
           for label, seconds in (("none", base_s), ("a", method_s), ("none", base_s))]
    got = paired_speedups(paired_ratios(two, "none", ["x", "y"]))
    assert got[("b1", "x", "a")] == pytest.approx(2.0) and got[("b1", "y", "a")] == pytest.approx(2 / 3)
    assert got[("b1", "all", "a")] == pytest.approx((40 / 3.5) / (80 / 6.0))


def test_rows_carry_the_paired_speedup_and_the_table_shows_it(result):
    for row in result["rows"]:
        if row["method"] == "none":
            assert row["paired_speedup"] == 1.0
        else:
            assert row["paired_speedup"] is not None and row["paired_speedup"] > 0, row
    assert "paired" in report.format_table(result).splitlines()[2]
    assert len(result["paired_ratios"]["batch1/open_chat/ngram"]) == 1  # one repeat: one pair
