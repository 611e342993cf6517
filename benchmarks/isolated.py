"""Run a benchmark's peer in a child process, so that a native crash costs only its own figures.

    result = run_isolated("benchmarks.model_peer", job)   # dict, or a status string

The child is `python -m MODULE JOB.json RESULT.json`: its `main` reads the job and writes the
result, both JSON (stdout and stderr stay the library's, for its own logging). A child killed by a
signal (a llama.cpp built for another CPU segfaults on its first forward) gives
"crashed (signal N, NAME)"; any other failure "failed (exit status N)".
"""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import tempfile


def exit_status(rc: int) -> str:
    """A child's return code as the peer's status: killed by a signal, or exited with an error."""
    if rc < 0:
        try:
            return f"crashed (signal {-rc}, {signal.Signals(-rc).name})"
        except ValueError:
            return f"crashed (signal {-rc})"
    return f"failed (exit status {rc})"


def run_isolated(module: str, job: dict) -> dict | str:
    with tempfile.TemporaryDirectory(prefix="speculant-peer-") as tmp:
        job_path, result_path = pathlib.Path(tmp) / "job.json", pathlib.Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        rc = subprocess.run([sys.executable, "-m", module, str(job_path), str(result_path)]).returncode
        if rc == 0 and result_path.exists():
            return json.loads(result_path.read_text())
    return exit_status(rc)


def child_main(run) -> int:
    """The child's side: result = run(job), from and to the paths in argv."""
    job = json.loads(pathlib.Path(sys.argv[1]).read_text())
    pathlib.Path(sys.argv[2]).write_text(json.dumps(run(job)))
    return 0
