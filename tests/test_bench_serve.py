"""`speculant bench serve`: a tiny sweep against a real gateway + worker, and its statistics by hand."""

from __future__ import annotations

import json
import pathlib
import socket
from types import SimpleNamespace

import pytest

from benchmarks import serve_servers
from benchmarks.serve import check, main, parse
from benchmarks.serve_load import RequestRecord, summarize

MAX_TOKENS = 8
NUM_REQUESTS = 2
PROMPTS = [  # the first is copy-heavy, so n-gram drafts get accepted
    {"category": "copy", "prompt": "Fix the typo and return the whole sentence: The cat sat on the mat and looked "
                                   "out of the windoow."},
    {"category": "chat", "prompt": "Why do cats purr?"},
]


def test_summary_splits_chunk_gaps_over_their_tokens():
    a = RequestRecord(start=0.0, first_token=0.1, end=0.5, chunk_times=[0.1, 0.2, 0.5], chunk_tokens=[1, 1, 3],
                      completion_tokens=5, num_drafts=1, num_draft_tokens=3, num_accepted_tokens=2)
    b = RequestRecord(start=1.0, first_token=1.3, end=1.4, chunk_times=[1.3, 1.4], chunk_tokens=[1, 1],
                      completion_tokens=2)
    failed = RequestRecord(start=2.0, error="HTTP 503: no worker")
    s = summarize([a, b, failed], wall=2.0)
    assert (s["num_requests"], s["num_errors"], s["errors"]) == (3, 1, ["HTTP 503: no worker"])
    assert s["num_output_tokens"] == 7 and s["num_chunks"] == 5 and s["tokens_per_chunk"] == pytest.approx(1.4)
    assert s["output_tokens_per_s"] == pytest.approx(3.5)
    assert s["ttft_ms"]["p50"] == pytest.approx(200.0)  # median of 100 and 300 ms
    # chunk gaps: 100, 300 (3 tokens), 100 ms -> per token: 100, 100, 100, 100, 100 ms
    assert s["itl_chunk_ms"]["p50"] == pytest.approx(100.0)
    assert s["itl_chunk_ms"]["p99"] == pytest.approx(100 + 0.98 * 200)  # linear interpolation, 3 samples
    assert s["itl_token_ms"]["p50"] == pytest.approx(100.0) and s["itl_token_ms"]["p99"] == pytest.approx(100.0)
    assert s["mean_acceptance_length"] == pytest.approx(3.0)


@pytest.mark.parametrize("argv, flag", [
    (["--levels", "0,4"], "--levels"),
    (["--levels", "a"], "--levels"),
    (["--requests", "0"], "--requests"),
    (["--url", "http://x", "--speculative-config", '{"method": "ngram"}'], "--speculative-config"),
])
def test_bad_flags_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        check(parse(argv))
    assert main(argv) == 2


@pytest.fixture(scope="module")
def result(tmp_path_factory, model_path):
    tmp = tmp_path_factory.mktemp("bench_serve")
    prompts = tmp / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp / "serve.json"
    argv = ["--model", str(model_path), "--levels", "1,2", "--requests", str(NUM_REQUESTS),
            "--max-tokens", str(MAX_TOKENS), "--threads", "1", "--max-model-len", "256", "--kv-cache-memory", "0.05",
            "--prompts", str(prompts), "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
            "--json", str(out), "--log-dir", str(tmp / "logs")]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_sweep_reports_every_level(result):
    assert [row["concurrency"] for row in result["levels"]] == [1, 2]
    assert result["settings"]["levels"] == [1, 2] and result["machine"]["cpus"] >= 1
    for row in result["levels"]:
        assert (row["num_requests"], row["num_errors"]) == (NUM_REQUESTS, 0), row["errors"]
        assert row["num_output_tokens"] == NUM_REQUESTS * MAX_TOKENS  # ignore_eos: every request runs to the end
        assert row["num_streamed_tokens"] == row["num_output_tokens"]  # per-chunk counts add up to usage
        assert row["num_chunks"] * row["tokens_per_chunk"] == pytest.approx(row["num_output_tokens"], rel=1e-3)
        for key in ("ttft_ms", "itl_chunk_ms", "itl_token_ms"):
            assert 0 < row[key]["p50"] <= row[key]["p99"], key
        assert row["output_tokens_per_s"] > 0 and row["direct_output_tokens_per_s"] > 0
        assert isinstance(row["overhead_ms_per_token"], float)


def test_speculation_reaches_the_worker_and_outputs_match_direct(result):
    assert sum(row["num_drafts"] for row in result["levels"]) > 0  # --speculative-config got through
    # Greedy, one request at a time: HTTP and in-process must produce the same tokens.
    assert result["levels"][0]["same_output_fraction"] == 1.0


def test_free_ports_lie_outside_the_range_given_to_client_sockets():
    low, high = (int(v) for v in pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    ports = [serve_servers.free_port() for _ in range(50)]
    assert all(p < low or p > high for p in ports)


def test_servers_start_on_fresh_ports_when_their_port_is_taken(model_path, tmp_path, monkeypatch):
    """A gateway that cannot bind exits 1; LocalServers picks new ports and starts again."""
    with socket.socket() as held:
        held.bind(("127.0.0.1", serve_servers.free_port()))
        held.listen()
        taken = held.getsockname()[1]
        first, real = iter([taken]), serve_servers.free_port
        monkeypatch.setattr(serve_servers, "free_port", lambda exclude=(): next(first, None) or real(exclude))
        args = SimpleNamespace(model=model_path, max_model_len=256, kv_cache_memory=0.05, max_num_seqs=2, threads=1,
                               max_num_batched_tokens=256, speculative_config=None)
        with serve_servers.LocalServers(args, str(tmp_path)) as servers:
            assert servers.port != taken and serve_servers.num_ready_workers(servers.url) == 1
    assert "address already in use" in (tmp_path / "gateway.log").read_text().lower()  # the first try's log is kept
