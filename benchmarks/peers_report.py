"""Results of `speculant bench peers`: the rows, the printed table and peers.md.

Ratios divide decode tokens/s (1 / mean time per output token after the first) by Speculant's:
by its best speculative mode of this run and by its plain decoding.
"""

from __future__ import annotations

HEAD = ["system", "mode", "tok/s", "decode tok/s", "vs Speculant best", "vs Speculant plain", "output = own plain"]
NOTES = [
    ("Shared machine: other processes compete for the CPUs, so the speeds are indicative; the systems ran one "
     "after another, each peer in its own process, on the same prompts."),
    ("tok/s = output tokens / wall time, prompt processing included; decode tok/s = 1 / mean time per output token "
     "after the first. The ratios use decode tok/s, because the systems treat a repeated prompt differently "
     "(Speculant's prefix cache holds every prompt after the warm-up, llama.cpp reuses the previous prompt's common "
     "prefix, transformers recomputes it)."),
    ("output = own plain: prompts whose speculative output equals the same system's plain output (token ids; "
     "text for llama.cpp, whose completion API returns no ids). Greedy speculation is lossless only where verifying "
     "several tokens in one forward computes each row exactly as a one-token step does; otherwise float rounding "
     "can flip a near-tie."),
]


def _ratio(a, b):
    return a / b if a is not None and b else None


def make_rows(systems: list[dict]) -> list[dict]:
    """One row per (system, mode); a system that did not run gets one row carrying its status."""
    (ours,) = [s for s in systems if s["system"] == "speculant"]
    best = next(m for m in ours["modes"] if m.get("best"))["decode_tok_s"]
    plain = next(m for m in ours["modes"] if not m["speculative"])["decode_tok_s"]
    rows = []
    for system in systems:
        if system["status"] != "ok":
            rows.append({"system": system["system"], "mode": None, "status": system["status"]})
            continue
        for mode in system["modes"]:
            rows.append({
                "system": system["system"], "mode": mode["mode"], "status": "ok", "best": bool(mode.get("best")),
                "tok_s": mode["tok_s"], "decode_tok_s": mode["decode_tok_s"],
                "vs_speculant_best": _ratio(mode["decode_tok_s"], best),
                "vs_speculant_plain": _ratio(mode["decode_tok_s"], plain),
                "same_as_plain": mode.get("same_as_plain"), "num_prompts": mode["num_prompts"],
                "compared_by": system["compared_by"],
            })
    return rows


def _f(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _cells(row: dict) -> list[str]:
    if row["status"] != "ok":
        return [row["system"], row["status"], "-", "-", "-", "-", "-"]
    same = "-" if row["same_as_plain"] is None else f"{row['same_as_plain']}/{row['num_prompts']}"
    return [row["system"], row["mode"] + (" (best)" if row["best"] else ""), _f(row["tok_s"]),
            _f(row["decode_tok_s"]), _f(row["vs_speculant_best"], "{:.2f}x"),
            _f(row["vs_speculant_plain"], "{:.2f}x"), same]


def format_table(result: dict) -> str:
    """Fixed-width table for the terminal, then the notes that the numbers need."""
    body = [_cells(r) for r in result["rows"]]
    widths = [max(len(x) for x in col) for col in zip(HEAD, *body)]
    lines = ["", _setup(result), "  ".join(h.ljust(w) for h, w in zip(HEAD, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(cells, widths)) for cells in body]
    lines += ["", *_prompt_id_notes(result), *(f"note: {n}" for n in NOTES[:1])]
    return "\n".join(lines)


def _setup(result: dict) -> str:
    cfg = result["config"]
    threads = cfg["threads"] or f"all ({cfg['machine']['cpu_count']})"
    m = cfg["machine"]
    cpu = (f"CPU {m.get('cpu_model', '?')} ({m.get('llvm_cpu', '?')}; {' '.join(m.get('cpu_flags', []))}), "
           f"Speculant kernel path {m.get('kernel_path', '?')}")
    return (f"model {cfg['model']}, {cfg['num_prompts']} prompts, greedy, max_tokens {cfg['max_tokens']}, "
            f"threads {threads}, 1-min load before {cfg['load_avg_1m_before']}\n{cpu}")


def _prompt_id_notes(result: dict) -> list[str]:
    """Where a peer's own tokenizer turned the shared text into different prompt ids than ours."""
    n = result["config"]["num_prompts"]
    return [f"note: {s['system']} tokenized {n - s['same_prompt_ids']} of {n} prompt texts differently from "
            "Speculant, so its outputs may differ from ours there"
            for s in result["systems"] if s["status"] == "ok" and s["same_prompt_ids"] != n]


def _versions(result: dict) -> str:
    return ", ".join(f"{s['system']} {s['version']}" for s in result["systems"] if s["status"] == "ok")


def format_markdown(result: dict) -> str:
    lines = ["# speculant bench peers", "", _setup(result) + ".", "", f"Versions: {_versions(result)}.", ""]
    lines += ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in result["rows"]]
    lines += [""] + [f"- {n}" for n in [*NOTES, *(x.removeprefix("note: ") for x in _prompt_id_notes(result))]]
    return "\n".join(lines) + "\n"
