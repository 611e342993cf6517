"""A worker keeps its heartbeat while one engine step outlasts the gateway's worker timeout.

The long step is real: a ~3,500-token prompt prefilled in one step (`--max-num-batched-tokens
4096`) on one thread, with the gateway's SPECULANT_WORKER_TIMEOUT at 2 s. The worker's own log
says how long its steps took, so the test checks that the premise held (a step longer than the
timeout) before it checks that the gateway kept the worker and the request completed.
"""

from __future__ import annotations

import re

import pytest
from servers import Cluster, http

TIMEOUT = 2.0
PROMPT_WORDS = 3500


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_path):
    c = Cluster(tmp_path_factory.mktemp("heartbeat"), model_path, env={"SPECULANT_WORKER_TIMEOUT": str(TIMEOUT)})
    c.start("gateway", "gateway")
    c.start_worker("w1", "--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--kv-cache-memory", "0.3")
    try:
        c.wait_workers(1)
        yield c
    finally:
        c.stop_all()


def test_a_step_longer_than_the_worker_timeout_keeps_the_worker(cluster):
    prompt = " ".join(["apple"] * PROMPT_WORDS)
    status, body, _ = http(f"{cluster.url}/v1/completions",
                           {"prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True})
    steps = [float(s) for s in re.findall(r"one engine step took ([0-9.]+) s", cluster.log("w1"))]
    assert steps and max(steps) > TIMEOUT, f"no step outlasted {TIMEOUT} s: {steps}\n{cluster.logs()}"
    assert status == 200, body
    assert body["usage"]["prompt_tokens"] >= PROMPT_WORDS and body["usage"]["completion_tokens"] == 2
    assert "silent for more than" not in cluster.log("gateway")
    assert http(f"{cluster.url}/health")[1]["workers"] == 1
