"""One peer of `speculant bench peers`, run in its own process (see benchmarks/isolated.py).

    python -m benchmarks.peer_child JOB.json RESULT.json
"""

from __future__ import annotations

import pathlib

from benchmarks.isolated import child_main
from benchmarks.peers import run_peer
from benchmarks.peers_systems import PeerOptions


def _run(job: dict) -> dict:
    opts = PeerOptions(pathlib.Path(job["model_path"]), job["threads"], job["max_model_len"], job["num_lookup_tokens"])
    return run_peer(job["name"], opts, job["texts"], job["our_ids"], job["max_tokens"])


if __name__ == "__main__":
    raise SystemExit(child_main(_run))
