"""Results of `speculant bench spec`: derived rows, the printed table, spec.json, spec.md, plots.

Every metric is derived from raw sums of a block (tokens, seconds, engine counters), so the
"all" rows are the same formulas over summed raws, not averages of ratios.
- AL (vLLM's mean acceptance length) = 1 + accepted / drafts, over verify steps that had drafts;
- tok/step = output tokens / (request, step) pairs, over every step, drafts or not;
- per-position acceptance[i] = steps whose draft i was accepted / steps with drafts;
- speedup = tok/s / the baseline's tok/s on the same prompts in the same mode (fastest blocks of each);
- paired = the median over repeats of a block's tok/s over the two baseline blocks run beside it
  (benchmarks/spec_pairs.py); the targets use it where a run has it, as the machine drifts less within a pair;
- from grammar = output tokens that were grammar-forced drafts (prompts with a response_format; the
  baseline decodes those under the same grammar with no drafts at all).
"""

from __future__ import annotations

import json
import pathlib

COPY_HEAVY = ("code_edit",)
REPEATED = ("agent_json",)
_SUMMED = ("num_prompts", "output_tokens", "wall_s", "engine_steps", "request_steps", "num_drafts",
           "num_draft_tokens", "num_accepted_tokens", "num_grammar_tokens", "num_asks", "num_allowed_tokens", "propose_s", "forward_s",
           "tpot_s_sum", "tpot_count")
_LISTS = ("accepted_per_pos", "drafted_per_pos", "reached_per_pos")


def _ratio(a, b):
    return a / b if b else None


def _sum_raw(raws: list[dict]) -> dict:
    out = {k: sum(r[k] for r in raws) for k in _SUMMED}
    for key in _LISTS:
        width = max((len(r[key]) for r in raws), default=0)
        out[key] = [sum(r[key][i] for r in raws if i < len(r[key])) for i in range(width)]
    out["token_ids"] = {k: v for r in raws for k, v in r["token_ids"].items()}
    return out


def derive(raw: dict, base: dict) -> dict:
    """One row's metrics from its raw sums and the baseline's raw sums for the same prompts (greedy or seeded:
    `identical` says whether every output equals the baseline's)."""
    steps = raw["engine_steps"]
    tok_s = _ratio(raw["output_tokens"], raw["wall_s"])
    base_tok_s = _ratio(base["output_tokens"], base["wall_s"])
    mismatches = [{"prompt_id": pid, "first_diff": _first_diff(ids, base["token_ids"].get(pid, []))}
                  for pid, ids in raw["token_ids"].items() if ids != base["token_ids"].get(pid)]
    num_drafts = raw["num_drafts"]
    return {
        "al": 1 + raw["num_accepted_tokens"] / num_drafts if num_drafts else None,
        "tokens_per_step": _ratio(raw["output_tokens"], raw["request_steps"]),
        "draft_acceptance_rate": _ratio(raw["num_accepted_tokens"], raw["num_draft_tokens"]),
        "acceptance_per_pos": [x / num_drafts for x in raw["accepted_per_pos"]] if num_drafts else [],
        # P(token i accepted | the draft has a token i and tokens 0..i-1 were accepted): draft length factored out
        "conditional_acceptance_per_pos": [
            a / d if d else None for a, d in zip(raw["accepted_per_pos"], raw["reached_per_pos"])],
        "mean_draft_len": _ratio(raw["num_draft_tokens"], num_drafts),
        "mean_allowed_k": _ratio(raw["num_allowed_tokens"], raw["num_asks"]),
        "draft_step_share": _ratio(num_drafts, raw["request_steps"]),
        "grammar_token_share": _ratio(raw["num_grammar_tokens"], raw["output_tokens"]),  # free drafts of a grammar
        "tok_s": tok_s,
        "speedup": _ratio(tok_s, base_tok_s) if tok_s is not None else None,
        "tpot_ms": 1000 * raw["tpot_s_sum"] / raw["tpot_count"] if raw["tpot_count"] else None,
        "identical": len(mismatches) == 0,
        "num_identical": raw["num_prompts"] - len(mismatches),
        "mismatches": mismatches,
        "forward_ms_per_step": _ms(raw["forward_s"], steps),
        "propose_ms_per_step": _ms(raw["propose_s"], steps),
        "other_ms_per_step": _ms(raw["wall_s"] - raw["forward_s"] - raw["propose_s"], steps),
        "proposer_share": _ratio(raw["propose_s"], raw["wall_s"]),
        **{k: raw[k] for k in _SUMMED if k not in ("tpot_s_sum", "tpot_count")},
        **{k: raw[k] for k in _LISTS},
    }


def _ms(seconds: float, steps: int):
    return 1000 * seconds / steps if steps else None


def _first_diff(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def make_rows(raw: dict, baseline: str, modes: list[str], categories: list[str], labels: list[str],
              paired: dict | None = None) -> list[dict]:
    """raw[(mode, category, label)] -> rows for every (mode, category or "all", method); paired[(mode, category
    or "all", label)]: the method's paired speedup (spec_pairs), 1.0 for the baseline."""
    paired = paired or {}
    rows = []
    for mode in modes:
        for cat in [*categories, "all"]:
            cats = categories if cat == "all" else [cat]
            base = _sum_raw([raw[(mode, c, baseline)] for c in cats])
            for label in labels:
                row = derive(_sum_raw([raw[(mode, c, label)] for c in cats]), base)
                pair = 1.0 if label == baseline else paired.get((mode, cat, label))
                rows.append({"mode": mode, "category": cat, "method": label, **row, "paired_speedup": pair})
    return rows


# ---------------------------------------------------------------- targets


def _speedup(row: dict) -> float:
    """The speedup a target judges: the paired one where the run has it (spec_pairs), else fastest over fastest."""
    value = row.get("paired_speedup")
    return (row["speedup"] if value is None else value) or 0.0


def targets(result: dict) -> list[dict]:
    """The project's goals, checked (reported, never asserted); speedups as `_speedup` gives them."""
    rows, out = [{**r, "speedup": _speedup(r)} for r in result["rows"]], []
    spec_rows = [r for r in rows if r["method"] != result["baseline"] and result["methods"][r["method"]]
                 and result["methods"][r["method"]]["method"] != "naive"]
    for cat in COPY_HEAVY:
        cands = [r for r in spec_rows if r["category"] == cat and r["mode"] == "batch1"]
        if cands:
            best = max(cands, key=lambda r: r["speedup"] or 0)
            out.append(_target(f">= 2x on {cat} at batch 1", (best["speedup"] or 0) >= 2.0,
                               f"best: {best['method']} {_f(best['speedup'])}x"))
    chat = [r for r in spec_rows if r["category"] == "open_chat"]
    if chat:
        worst = min(chat, key=lambda r: r["speedup"] or 0)
        out.append(_target("never below 0.95x on open_chat", (worst["speedup"] or 0) >= 0.95,
                           f"worst: {worst['method']} ({worst['mode']}) {_f(worst['speedup'])}x"))
    by_key = {(r["mode"], r["category"], r["method"]): r for r in rows}
    for cat in REPEATED:
        for mode in result["config"]["modes"]:
            s, n = by_key.get((mode, cat, "suffix")), by_key.get((mode, cat, "ngram"))
            if s and n:
                out.append(_target(f"suffix >= ngram on {cat} ({mode})", (s["tok_s"] or 0) >= (n["tok_s"] or 0),
                                   f"suffix {_f(s['tok_s'], '{:.1f}')} vs ngram {_f(n['tok_s'], '{:.1f}')} tok/s "
                                   f"(AL {_f(s['al'])} vs {_f(n['al'])})"))
    constrained = [r for r in spec_rows if r["category"] == "agent_json" and r["mode"] == "batch1"]
    if constrained:  # the built-in agent_json prompts carry a json_schema response_format
        best = max(constrained, key=lambda r: r["speedup"] or 0)
        out.append(_target(">= 1.5x constrained decoding on agent_json (batch1)", (best["speedup"] or 0) >= 1.5,
                           f"best: {best['method']} {_f(best['speedup'])}x, "
                           f"{_f(best['grammar_token_share'], '{:.0%}')} of tokens from the grammar"))
    out += _learned_targets(result, [r for r in spec_rows if r["mode"] == "batch1"])
    out.append(_identical_target(result))
    return out


MODEL_FREE = ("ngram", "suffix", "naive")  # built-in proposers whose drafts are one token, no q


def _identical_target(result: dict) -> dict:
    """Greedy: every output equals the baseline's. Sampled (every request seeded): the model-free methods' do
    (target_match); drafts sampled from a model's q keep the target distribution, not plain decoding's tokens."""
    if result["config"].get("temperature", 0.0) == 0:
        rows, name = result["rows"], "greedy outputs identical to the baseline"
    else:
        def plain_equal(cfg: dict | None) -> bool:  # verified by target_match, as the default is
            return cfg is None or (cfg["method"] in MODEL_FREE and cfg.get("verify_strategy") in (None, "target_match"))

        rows = [r for r in result["rows"] if plain_equal(result["methods"][r["method"]])]
        name = f"seeded sampled outputs of {', '.join(MODEL_FREE)} (target_match) identical to the baseline"
    lossless = all(r["identical"] for r in rows)
    return _target(name, lossless, "all their rows" if lossless else "see the identical column")


def _learned_targets(result: dict, rows: list[dict]) -> list[dict]:
    """Issue targets for learned heads at batch 1: eagle/mtp on open chat, and the MTP + lookup hybrid."""
    cfg = result["methods"]

    def strategy(label):
        return cfg[label].get("options", {}).get("mtp_strategy", "default")

    heads = [r for r in rows if cfg[r["method"]]["method"] in ("eagle", "mtp") and strategy(r["method"]) == "default"]
    out = []
    chat = [r for r in heads if r["category"] == "open_chat"]
    if chat:
        by_al, by_speed = max(chat, key=lambda r: r["al"] or 0), max(chat, key=lambda r: r["speedup"] or 0)
        out.append(_target("eagle or mtp: acceptance length >= 2.0 on open_chat", (by_al["al"] or 0) >= 2.0,
                           f"best: {by_al['method']} AL {_f(by_al['al'])}"))
        out.append(_target("eagle or mtp: >= 1.5x on open_chat", (by_speed["speedup"] or 0) >= 1.5,
                           f"best: {by_speed['method']} {_f(by_speed['speedup'])}x"))
    parts = heads + [r for r in rows if cfg[r["method"]]["method"] == "ngram"]
    for hybrid in (r for r in rows if cfg[r["method"]]["method"] == "mtp" and strategy(r["method"]) != "default"):
        rivals = [r for r in parts if r["category"] == hybrid["category"]]
        kinds = {cfg[r["method"]]["method"] for r in rivals}
        if {"mtp", "ngram"} <= kinds:
            best = max(rivals, key=lambda r: r["tok_s"] or 0)
            out.append(_target(f"{hybrid['method']} >= its parts on {hybrid['category']} (3% noise allowed)",
                               (hybrid["tok_s"] or 0) >= 0.97 * (best["tok_s"] or 0),  # 3%: timing noise
                               f"{_f(hybrid['tok_s'], '{:.1f}')} vs {best['method']} {_f(best['tok_s'], '{:.1f}')} tok/s"))
    return out


def _target(name: str, met: bool, detail: str) -> dict:
    return {"target": name, "met": bool(met), "detail": detail}


# ---------------------------------------------------------------- text


def _f(x, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


COLUMNS = [("category", "{}"), ("method", "{}"), ("AL", "al"), ("tok/step", "tokens_per_step"),
           ("accept", "draft_acceptance_rate"), ("tok/s", "tok_s"), ("speedup", "speedup"),
           ("paired", "paired_speedup"), ("from grammar", "grammar_token_share"), ("identical", "identical"),
           ("propose ms/step", "propose_ms_per_step")]


def _cells(row: dict) -> list[str]:
    ident = "yes" if row["identical"] else f"NO {row['num_identical']}/{row['num_prompts']}"
    return [row["category"], row["method"], _f(row["al"]), _f(row["tokens_per_step"]),
            _f(row["draft_acceptance_rate"], "{:.0%}"), _f(row["tok_s"], "{:.1f}"),
            _f(row["speedup"], "{:.2f}x"), _f(row.get("paired_speedup"), "{:.2f}x"),
            _f(row["grammar_token_share"], "{:.0%}"), ident,
            _f(row["propose_ms_per_step"], "{:.3f}")]


def _mode_title(result: dict, mode: str) -> str:
    n = result["config"]["modes"][mode]
    return f"{mode}: " + ("one request at a time" if n == 1 else f"up to {n} requests of a category at once")


def format_table(result: dict) -> str:
    """The method x category table per mode, fixed width, for the terminal."""
    head = [c for c, _ in COLUMNS]
    lines = []
    for mode in result["config"]["modes"]:
        body = [_cells(r) for r in result["rows"] if r["mode"] == mode]
        widths = [max(len(x) for x in col) for col in zip(head, *body)]
        lines += ["", _mode_title(result, mode), "  ".join(h.ljust(w) for h, w in zip(head, widths))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in body]
    lines += [_load_note(result["config"])] if _load_note(result["config"]) else []
    lines += ["", "targets:"] + [f"  [{'met' if t['met'] else 'NOT met'}] {t['target']}: {t['detail']}"
                                 for t in targets(result)]
    return "\n".join(lines)


OTHER_CORES_LIMIT = 0.25  # CPU other processes may take during the timed blocks, in cores, before the run is flagged


def _load_note(cfg: dict) -> str | None:
    """A warning when other processes competed for the CPUs: the CPU time they took during the timed blocks
    (benchmarks/cpu_share.py), or where that was not measured the load averages (our own run adds about 1-2)."""
    machine = cfg.get("machine", {})
    others = cfg.get("other_cpu_cores")
    if others is not None:
        if others <= OTHER_CORES_LIMIT:
            return None
        return (f"note: other processes took {others} cores' worth of CPU during the timed blocks: tok/s and "
                "speedups are unreliable (AL, acceptance, identical are not)")
    before, after, cpus = cfg.get("load_avg_1m_before"), machine.get("load_avg_1m"), machine.get("cpu_count") or 1
    if (before is not None and before > 0.5 * cpus) or (after is not None and after > cpus + 0.5):
        return (f"note: 1-min load average {before} before / {after} after the run on {cpus} CPUs: other processes "
                "competed for the CPUs, so tok/s and speedups are unreliable (AL, acceptance, identical are not)")
    return None


def _md_table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def format_markdown(result: dict) -> str:
    cfg = result["config"]
    decoding = (f"sampled at temperature {cfg['temperature']}, top_p {cfg.get('top_p', 1.0)}, seed {cfg.get('seed')}"
                if cfg.get("temperature", 0.0) > 0 else "greedy")
    setup = (f"model `{cfg.get('model', '?')}`, {decoding}, max_tokens {cfg['max_tokens']}, repeats {cfg['repeats']}, "
             f"machine {cfg['machine']}, load avg before {cfg.get('load_avg_1m_before', '?')}")
    lines = ["# speculant bench spec", "", setup, ""] + ([f"**{_load_note(cfg)}**", ""] if _load_note(cfg) else [])
    lines += [f"- `{label}`: {json.dumps(spec) if spec else 'no speculation (baseline)'}"
              for label, spec in result["methods"].items()]
    lines += ["", "## Targets", ""] + [f"- {'met' if t['met'] else '**NOT met**'}: {t['target']} ({t['detail']})"
                                       for t in targets(result)]
    for mode in cfg["modes"]:
        rows = [r for r in result["rows"] if r["mode"] == mode]
        lines += ["", f"## {_mode_title(result, mode)}", ""]
        lines += _md_table([c for c, _ in COLUMNS], [_cells(r) for r in rows])
        lines += ["", DETAIL_NOTE, ""]
        lines += _md_table(["category", "method", "k allowed", "draft len", "drafted steps", "acceptance per position",
                            "conditional", "forward", "propose", "other", "TPOT ms"], [_detail_cells(r) for r in rows])
    return "\n".join(lines) + "\n"


DETAIL_NOTE = ("Drafting detail: k the controller allowed per drafting step, mean draft length, share of request "
               "steps with drafts, acceptance per position (vLLM's: / drafts) and conditional on the position being "
               "reached; where an engine step's time goes (ms).")


def _detail_cells(r: dict) -> list[str]:
    def seq(xs):
        return " ".join(_f(x) for x in xs) or "-"

    return [r["category"], r["method"], _f(r["mean_allowed_k"]), _f(r["mean_draft_len"]),
            _f(r["draft_step_share"], "{:.0%}"), seq(r["acceptance_per_pos"]), seq(r["conditional_acceptance_per_pos"]),
            _f(r["forward_ms_per_step"]), _f(r["propose_ms_per_step"], "{:.3f}"), _f(r["other_ms_per_step"]),
            _f(r["tpot_ms"])]


def write_all(result: dict, out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """spec.json, spec.md, and the two plots when matplotlib is importable."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = {**result, "targets": targets(result)}
    (out / "spec.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / "spec.md").write_text(format_markdown(result))
    return [out / "spec.json", out / "spec.md", *write_plots(result, out)]


def write_plots(result: dict, out: pathlib.Path) -> list[pathlib.Path]:
    """spec_speedup.png and spec_acceptance_per_pos.png; none when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    paths = [out / "spec_speedup.png", out / "spec_acceptance_per_pos.png"]
    for draw, path in zip((_plot_speedup, _plot_acceptance), paths):
        modes = list(result["config"]["modes"])
        fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4), squeeze=False)
        for ax, mode in zip(axes[0], modes):
            draw(ax, result, mode)
            if ax.get_legend_handles_labels()[0]:  # a mode whose methods drafted nothing has no lines to name
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
    return paths


def _plot_speedup(ax, result: dict, mode: str) -> None:
    """Grouped bars: one group per category, one bar per method."""
    methods = list(result["methods"])
    cats = list(dict.fromkeys(r["category"] for r in result["rows"]))
    rows = {(r["mode"], r["category"], r["method"]): r for r in result["rows"]}
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        vals = [_speedup(rows[(mode, c, m)]) for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], vals, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], cats, rotation=20)
    ax.set_title(f"speedup over no speculation ({mode})")


def _plot_acceptance(ax, result: dict, mode: str) -> None:
    for r in result["rows"]:
        if r["mode"] == mode and r["category"] == "all" and r["acceptance_per_pos"]:
            per_pos = r["acceptance_per_pos"]
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=r["method"])
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1)
    ax.set_title(f"acceptance per position, all categories ({mode})")
