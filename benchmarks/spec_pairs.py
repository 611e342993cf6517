"""Paired timing for `speculant bench spec`: every method's block runs between two baseline blocks.

This VM's speed moves by up to 2x within minutes, while a block takes a few seconds. With the blocks
run method after method, a method's block could sit tens of seconds from the baseline's, and its
ratio to the fastest baseline block measured the machine as much as the method. So, per mode and
category, the blocks run as

    baseline, m1, baseline, m2, ..., baseline, mN, baseline, m2, ..., baseline, m1, baseline, ...

(repeats x N pairs) and each method block's *paired speedup* is its tok/s over the tok/s of the two
baseline blocks beside it (their tokens over their seconds, summed), a few seconds from it on either
side. A row's paired speedup is the median over its repeats; the "all" row pairs the summed tokens and
seconds over the categories, repeat by repeat, the same way the other rows' metrics sum their raws.

Each repeat starts one method further on, so over N repeats every method takes every place in the
sequence once. With the order fixed, the ranking of eagle with q8_0 and with q4_0 head weights turned
when the two swapped places (Zen 4, fortieth session: see the journal).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def block_order(modes: Sequence[tuple[str, int]], categories: Sequence[str], repeats: int, labels: Sequence[str],
                baseline: str) -> list[tuple[str, int, str, str, int]]:
    """(mode, concurrency, category, label, repeat) for every block, in run order (see the module doc)."""
    methods = [label for label in labels if label != baseline]
    order = []
    for mode, n in modes:
        for cat in categories:
            if not methods:
                order += [(mode, n, cat, baseline, r) for r in range(repeats)]
                continue
            order.append((mode, n, cat, baseline, 0))
            for r in range(repeats):
                turn = r % len(methods)
                for label in methods[turn:] + methods[:turn]:
                    order += [(mode, n, cat, label, r), (mode, n, cat, baseline, r)]
    return order


def _speed(runs: list[dict]) -> float | None:
    seconds = sum(run["wall_s"] for run in runs)
    return sum(run["output_tokens"] for run in runs) / seconds if seconds else None


def paired_ratios(runs: list[tuple[tuple[str, str, str, int], dict]], baseline: str,
                  categories: Sequence[str]) -> dict[tuple[str, str, str], list[float]]:
    """runs: ((mode, category, label, repeat), block raw) in run order -> {(mode, category or "all", label):
    per repeat, the method's tok/s over the tok/s of the baseline blocks beside it}."""
    pairs: dict[tuple[str, str, str, int], tuple[dict, list[dict]]] = {}
    for i, ((mode, cat, label, r), run) in enumerate(runs):
        if label == baseline:
            continue
        beside = [runs[j] for j in (i - 1, i + 1) if 0 <= j < len(runs)]
        bases = [b for (m, c, lab, _), b in beside if (m, c, lab) == (mode, cat, baseline)]
        if bases:
            pairs[(mode, cat, label, r)] = (run, bases)
    ratios: dict[tuple[str, str, str], list[float]] = {}
    for (mode, cat, label, r), (run, bases) in pairs.items():
        ratios.setdefault((mode, cat, label), []).append(_ratio([run], bases))
    for mode, label, r in sorted({(m, lab, r) for m, _, lab, r in pairs}, key=lambda key: key[2]):  # repeat order
        members = [pairs.get((mode, cat, label, r)) for cat in categories]
        if all(members):
            ratios.setdefault((mode, "all", label), []).append(
                _ratio([run for run, _ in members], [b for _, bases in members for b in bases]))
    return {key: vals for key, vals in ratios.items() if None not in vals}


def paired_speedups(ratios: dict[tuple[str, str, str], list[float]]) -> dict[tuple[str, str, str], float]:
    """The median of each row's paired ratios."""
    return {key: statistics.median(vals) for key, vals in ratios.items()}


def _ratio(method_runs: list[dict], base_runs: list[dict]) -> float | None:
    method, base = _speed(method_runs), _speed(base_runs)
    return method / base if method is not None and base else None
