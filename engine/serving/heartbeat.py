"""A worker's heartbeat, sent from its own thread so that a long engine step cannot silence it.

The gateway drops a worker after SPECULANT_WORKER_TIMEOUT seconds without a message. A prefill of
a long prompt can take longer than that on a loaded machine; the step runs in the main thread and
this thread keeps beating meanwhile (the Numba kernels and NumPy release the GIL often enough:
a decoder layer is one call of at most a few hundred milliseconds).

ZeroMQ sockets are not thread-safe: the worker's socket is shared under `lock`, which the main
thread holds only while it polls, receives or sends, never across a step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Heartbeat(threading.Thread):
    """Calls `beat()` every `interval` seconds until `stop()`."""

    def __init__(self, beat: Callable[[], None], interval: float):
        super().__init__(name="speculant-heartbeat", daemon=True)
        self._beat = beat
        self._interval = interval
        self._stopping = threading.Event()

    def run(self) -> None:
        self._beat()
        while not self._stopping.wait(self._interval):
            self._beat()

    def stop(self) -> None:
        self._stopping.set()
        if self.is_alive():
            self.join(timeout=5 * self._interval)
