"""`speculant bench all`'s report: report.json, report.md (every table) and the PNG plots.

The spec section reuses `benchmarks.report` (its Markdown tables and its two plots); the model
and serve sections get their tables and plots here: the verify curve against the memory floor,
and tokens/s and TTFT against the number of concurrent clients.
"""

from __future__ import annotations

import json
import pathlib

from benchmarks import report as spec_report
from benchmarks import serve as serve_bench

NO_MATPLOTLIB = "Plots skipped: matplotlib is not installed (`pip install 'speculant[bench]'`)."


def _pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(result: dict, out_dir) -> list[pathlib.Path]:
    """Plots first (so the Markdown links exactly the files that exist), then report.md and report.json."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = write_plots(result, out)
    result["plots"] = [p.name for p in plots]
    (out / "report.md").write_text(format_markdown(result, {p.name for p in plots}))
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    return [out / "report.json", out / "report.md", *plots]


def write_plots(result: dict, out: pathlib.Path) -> list[pathlib.Path]:
    plt = _pyplot()
    if plt is None:
        return []
    paths = []
    if _ok(result, "model"):
        paths.append(_save(plt, _plot_verify, result["model"], out / "model_verify_curve.png"))
    if _ok(result, "spec"):
        paths += spec_report.write_plots(result["spec"], out)
    if _ok(result, "serve"):
        paths.append(_save(plt, _plot_serve, result["serve"]["levels"], out / "serve_concurrency.png"))
    return paths


def _ok(result: dict, section: str) -> bool:
    return section in result and "error" not in result[section]


def _save(plt, draw, data, path: pathlib.Path) -> pathlib.Path:
    fig = draw(plt, data)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_verify(plt, res: dict):
    """ms per forward against T, beside the floor (weights streamed once) and T separate steps."""
    ts = sorted(int(t) for t in res["verify_ms"])
    ms = [res["verify_ms"][t] for t in ts]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ts, ms, marker="o", label="verify forward (measured)")
    ax.plot(ts, [t * ms[0] for t in ts], ls=":", color="grey", label="T separate decode steps")
    ax.axhline(res["floor_ms"], color="k", ls="--", label=f"memory floor {res['floor_ms']:.2f} ms")
    ax.set_xlabel("T: tokens appended in one forward")
    ax.set_ylabel("ms per forward")
    ax.set_ylim(bottom=0)
    ax.set_title(f"verify curve at a {res.get('context', '?')}-token context")
    ax.legend(fontsize=8)
    return fig


def _plot_serve(plt, rows: list[dict]):
    levels = [r["concurrency"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.plot(levels, [r["output_tokens_per_s"] for r in rows], marker="o", label="HTTP")
    if all(r.get("direct_output_tokens_per_s") is not None for r in rows):
        left.plot(levels, [r["direct_output_tokens_per_s"] for r in rows], marker="s", label="engine in-process")
    left.set_title("output tokens/s")
    for q in ("p50", "p99"):
        right.plot(levels, [r["ttft_ms"][q] for r in rows], marker="o", label=f"TTFT {q}")
    right.set_title("time to first token (ms)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(x) for x in levels])
        ax.set_xlabel("concurrent clients")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- Markdown


def _table(head: list[str], body: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in body]


def _images(names: list[str], present: set[str]) -> list[str]:
    shown = [f"![{n.removesuffix('.png')}]({n})" for n in names if n in present]
    return ["", *shown] if shown else []


def model_markdown(res: dict, present: set[str]) -> list[str]:
    lines = _table(["measure", "value"], [
        ["compute threads", str(res["machine_threads"])],
        ["weights streamed per step", f"{res['weight_bytes'] / 1e6:.1f} MB"],
        ["read bandwidth", f"{res['read_bandwidth_gbs']:.1f} GB/s"],
        ["memory floor (T=1)", f"{res['floor_ms']:.2f} ms"],
        ["prefill", f"{res['prefill_tok_s']:.0f} tok/s"],
        ["decode, batch 1", f"{res['decode_tok_s_b1']:.1f} tok/s"],
        ["decode, batch 8", f"{res['decode_tok_s_b8']:.1f} tok/s"],
        ["peak RSS", f"{res['peak_rss_mb']:.0f} MB"],
        *_compute_rows(res.get("compute_rate")),
    ])
    lines += ["", f"Verify curve: one forward appending T tokens at a {res['context']}-token context.", ""]
    lines += _table(["T", "ms", "x T=1", "x floor"], [
        [str(t), f"{ms:.2f}", f"{res['verify_ratio'][t]:.2f}", f"{ms / res['floor_ms']:.2f}"]
        for t, ms in res["verify_ms"].items()])
    return lines + _images(["model_verify_curve.png"], present)


def _compute_rows(rate: dict | None) -> list[list[str]]:
    if not rate:
        return []
    peak, combined = rate["peak_gmacs"], rate.get("combined_gmacs")
    rows = [[f"integer 4-dot peak ({rate['path']})", f"{peak:.1f} GMAC/s"]]
    if combined:  # (runs before the forty-second session did not measure it)
        rows.append(["the same with Q4_1's float combine", f"{combined:.1f} GMAC/s"])
    return rows + [[f"weight products at T={t}", f"{g:.1f} GMAC/s ({g / peak:.0%} of the peak"
                    + (f", {g / combined:.0%} with the combine)" if combined else ")")]
                   for t, g in rate["products_gmacs"].items()]


def spec_markdown(result: dict, present: set[str]) -> list[str]:
    """`benchmarks.report`'s spec.md, one heading level down, with its plots."""
    body = spec_report.format_markdown(result).splitlines()[2:]  # drop "# speculant bench spec" and a blank
    lines = ["#" + line if line.startswith("## ") else line for line in body]
    skipped = result["config"].get("skipped_methods") or {}
    lines += [f"- skipped `{label}`: {why}" for label, why in skipped.items()]
    return lines + _images(["spec_speedup.png", "spec_acceptance_per_pos.png"], present)


def serve_markdown(result: dict, present: set[str]) -> list[str]:
    s, m = result["settings"], result["machine"]
    setup = (f"{s['requests']} streamed chat completions per level, {s['max_tokens']} tokens each (ignore_eos), "
             f"greedy, speculative config {s['speculative_config'] or 'off'}; load average before "
             f"{m['load_avg_before'][0]}, after {m['load_avg_after'][0]} on {m['cpus']} CPUs.")
    lines = [setup, ""]
    lines += ["| " + line + " |" for line in serve_bench.format_table(result["levels"]).splitlines()]
    return lines + _images(["serve_concurrency.png"], present)


SECTION_TITLES = {"model": "Model runtime", "spec": "Speculative decoding", "serve": "Serving"}
SECTION_WRITERS = {"model": model_markdown, "spec": spec_markdown, "serve": serve_markdown}


def format_markdown(result: dict, present: set[str]) -> str:
    cfg = result["config"]
    quick = " (--quick: tiny sizes, the numbers are noise)" if cfg["quick"] else ""
    setup = (f"model `{cfg['model']}`{quick}, {cfg['cpu_count']} CPUs, threads {cfg['threads'] or 'all'}, "
             f"started {cfg['started']}, 1-min load average {cfg['load_avg_1m_before']} before / "
             f"{cfg.get('load_avg_1m_after', '?')} after. On a shared machine the speeds are indicative.")
    lines = ["# speculant bench all", "", setup]
    if not present:
        lines += ["", NO_MATPLOTLIB if _pyplot() is None else "No plots: no section finished."]
    for section in cfg["sections"]:
        data = result[section]
        lines += ["", f"## {SECTION_TITLES[section]}", "", f"({data['elapsed_s']} s)", ""]
        if "error" in data:
            lines.append(f"**Failed:** {data['error']}")
        else:
            lines += SECTION_WRITERS[section](data, present)
    return "\n".join(lines) + "\n"
