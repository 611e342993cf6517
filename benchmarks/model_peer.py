"""llama.cpp's side of `speculant bench model --peers`, in its own process (benchmarks/isolated.py).

    python -m benchmarks.model_peer JOB.json RESULT.json

The same measurements as ours, on the same GGUF with the same thread count, through
llama-cpp-python's low-level `eval` (no sampling, no detokenizing): the verify curve (ms to
append T tokens on top of `context` cached ones), a plain decode step at `context` and at
`long_context` (greedy, one token per eval) and prefill of a fresh `prefill_tokens` prompt.
Medians of `repeats`.
"""

from __future__ import annotations

import statistics
import time

from benchmarks.isolated import child_main


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times)


def _llama(job: dict):
    from llama_cpp import Llama

    n_ctx = max(job["context"], job["long_context"], job["prefill_tokens"]) + job["decode_tokens"] + 64
    return Llama(job["model_path"], n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=job["threads"],
                 n_threads_batch=job["threads"], verbose=False)


def _at(llm, ids: list[int]) -> None:
    """The KV cache holds exactly `ids` (llama-cpp-python drops positions past n_tokens on eval)."""
    llm.reset()
    llm.eval(ids)


def _append_ms(llm, ids: list[int], extra: list[int], repeats: int) -> float:
    """Median ms to append `extra` on top of the cached `ids`, rolled back after each try."""
    _at(llm, ids)

    def once():
        llm.n_tokens = len(ids)
        llm.eval(extra)

    once()  # warm
    return _median_ms(once, repeats)


def _decode_ms(llm, ids: list[int], num_tokens: int) -> float:
    """Mean ms per greedy token, one eval per token, after the prompt `ids`."""
    import numpy as np

    def last_logits():  # the last evaluated token's logits (eval keeps no copy without logits_all)
        return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))

    _at(llm, ids)
    start = time.perf_counter()
    for _ in range(num_tokens):
        llm.eval([int(np.argmax(last_logits()))])
    return 1000 * (time.perf_counter() - start) / num_tokens


def measure(job: dict) -> dict:
    import llama_cpp

    llm = _llama(job)
    ids = job["prompt_ids"]
    ctx, long_ids = ids[: job["context"]], (ids * (job["long_context"] // len(ids) + 1))[: job["long_context"]]
    verify = {t: _append_ms(llm, ctx, [7 + i for i in range(t)], job["repeats"]) for t in job["verify_ts"]}
    fresh = [100 + (i * 7919) % 30000 for i in range(job["prefill_tokens"])]
    prefill_ms = _median_ms(lambda: _at(llm, fresh), max(1, job["repeats"] // 2))
    res = {"version": llama_cpp.__version__, "verify_ms": verify, "prefill_tok_s": job["prefill_tokens"] / prefill_ms * 1000,
           "decode_tok_s_b1": 1000 / _decode_ms(llm, ctx, job["decode_tokens"])}
    if job["long_context"]:
        res["long_decode_ms"] = _decode_ms(llm, long_ids, job["decode_tokens"] // 2)
    return res


if __name__ == "__main__":
    raise SystemExit(child_main(measure))
