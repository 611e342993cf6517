"""How much CPU other processes took while a benchmark ran: the machine's busy time (/proc/stat) less our own.

The 1-minute load average is a poor judge of that: it lingers for minutes after a run that just ended (a
benchmark started right after another saw 1.35 and was flagged as competed-with though nothing else ran)."""

from __future__ import annotations

import os
import resource
import time

_BUSY_FIELDS = (0, 1, 2, 5, 6)  # user, nice, system, irq, softirq of /proc/stat's "cpu" line (guest is in user)


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return None
    return sum(int(fields[i]) for i in _BUSY_FIELDS) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    """CPU time of this process, all its threads (an in-process engine's compute threads among them); any other
    process, a child of ours included, is another."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    return own.ru_utime + own.ru_stime


class OtherLoad:
    """Started at construction; `cores()`: the CPU other processes used since, in cores (None without /proc/stat)."""

    def __init__(self):
        self._start = (time.monotonic(), _busy_seconds(), _own_seconds())

    def cores(self) -> float | None:
        wall0, busy0, own0 = self._start
        busy, wall = _busy_seconds(), time.monotonic() - wall0
        if busy is None or busy0 is None or wall <= 0:
            return None
        return max(0.0, (busy - busy0) - (_own_seconds() - own0)) / wall
