"""The gateway's table of engine workers: who is ready, who is alive, who is least busy."""

from __future__ import annotations

import dataclasses

from engine.serving import protocol
from gateway.errors import OpenAIError


@dataclasses.dataclass(slots=True)
class WorkerInfo:
    identity: bytes  # ZeroMQ routing id (= worker id)
    worker_id: str
    model: str
    max_model_len: int
    pid: int
    last_seen: float  # monotonic seconds
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    available_methods: list[str] = dataclasses.field(default_factory=list)
    stats: protocol.WorkerStats = dataclasses.field(default_factory=protocol.WorkerStats)
    request_ids: set[str] = dataclasses.field(default_factory=set)  # in flight on this worker


class WorkerTable:
    def __init__(self, served_model_name: str | None):
        self.alias = served_model_name
        self.workers: dict[bytes, WorkerInfo] = {}

    def __len__(self) -> int:
        return len(self.workers)

    def get(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.get(identity)

    def add(self, identity: bytes, ready: protocol.Ready, now: float) -> WorkerInfo:
        info = WorkerInfo(identity=identity, worker_id=ready.worker_id, model=ready.model,
                          max_model_len=ready.max_model_len, pid=ready.pid, last_seen=now,
                          speculative_method=ready.speculative_method,
                          num_speculative_tokens=ready.num_speculative_tokens,
                          available_methods=list(ready.available_methods))
        self.workers[identity] = info
        return info

    def remove(self, identity: bytes) -> WorkerInfo | None:
        return self.workers.pop(identity, None)

    def served_name(self, worker: WorkerInfo) -> str:
        """The name clients see: the configured alias, else the worker's model name."""
        return self.alias or worker.model

    def model_names(self) -> list[str]:
        return sorted({self.served_name(w) for w in self.workers.values()})

    def pick(self, model: str | None) -> WorkerInfo:
        """The worker serving `model` with the fewest requests in flight (ties: emptiest KV cache)."""
        if not self.workers:
            raise OpenAIError(503, "No engine worker is ready; try again shortly.", code="no_workers",
                              headers={"Retry-After": "1"})
        candidates = [w for w in self.workers.values() if model is None or model in (self.alias, w.model)]
        if not candidates:
            known = ", ".join(self.model_names())
            raise OpenAIError(404, f"The model `{model}` does not exist. Available: {known}.",
                              param="model", code="model_not_found")
        return min(candidates, key=lambda w: (len(w.request_ids), w.stats.kv_usage))

    def expired(self, now: float, timeout: float) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if now - w.last_seen > timeout]
