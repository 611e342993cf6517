"""Proposer discovery through the `speculant.proposers` entry-point group.

Built-ins (naive, ngram, suffix) register through the same group as third-party plugins, so the
engine looks every method up by name here and never branches on it. Rules:
- Only the selected proposer is imported (`EntryPoint.load()` on demand).
- A plugin that fails to import, is not a `Proposer` subclass, lacks `propose` or declares another
  `api_version` is logged with its distribution and skipped: recorded in `broken`, never raised
  past `load_proposer_class` (which turns it into a ValueError for the user).
- `SPECULANT_PROPOSERS=a,b` allows only those names (unset = all).
- Names are unique: a plugin cannot replace a built-in (the built-in wins, the plugin is reported
  broken), and two plugins claiming one name are both refused.
- From a source checkout that is not pip-installed, the built-ins are read from pyproject.toml.
"""

from __future__ import annotations

import functools
import logging
import os
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

from proposers.base import Proposer

logger = logging.getLogger(__name__)

GROUP = "speculant.proposers"
ALLOWLIST_ENV = "SPECULANT_PROPOSERS"
BUILTIN_DISTRIBUTION = "speculant"
_PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@dataclass(frozen=True, slots=True)
class ProposerInfo:
    name: str
    distribution: str
    version: str
    error: str | None = None  # None = loads and passes the contract checks (or was not checked)


def _distribution(ep: EntryPoint) -> tuple[str, str]:
    """(name, version) of the distribution that declares `ep`."""
    if ep in _SOURCE_CHECKOUT:
        return _SOURCE_CHECKOUT[ep]
    dist = getattr(ep, "dist", None)
    if dist is None:
        return ("unknown", "")
    return (dist.name or "unknown", dist.version or "")


def _is_builtin(ep: EntryPoint) -> bool:
    name, _ = _distribution(ep)
    if name != "unknown":
        return name == BUILTIN_DISTRIBUTION
    return ep.value.split(":")[0].split(".")[0] == "proposers"


_SOURCE_CHECKOUT: dict[EntryPoint, tuple[str, str]] = {}


def source_checkout_entry_points() -> list[EntryPoint]:
    """Built-in entry points from pyproject.toml, for running from a checkout without pip install."""
    if not _PYPROJECT.is_file():
        return []
    with _PYPROJECT.open("rb") as f:
        project = tomllib.load(f).get("project", {})
    table = project.get("entry-points", {}).get(GROUP, {})
    eps = [EntryPoint(name, value, GROUP) for name, value in table.items()]
    for ep in eps:
        _SOURCE_CHECKOUT[ep] = (BUILTIN_DISTRIBUTION, f"{project.get('version', '')} (source checkout)")
    return eps


def check_proposer_class(obj: object) -> None:
    """The plugin contract; raises TypeError saying what to fix."""
    if not isinstance(obj, type) or not issubclass(obj, Proposer):
        raise TypeError(f"{obj!r} is not a subclass of proposers.base.Proposer")
    if obj.propose is Proposer.propose:
        raise TypeError(f"{obj.__name__} does not implement propose(requests) -> Drafts")
    if obj.api_version != Proposer.api_version:
        raise TypeError(
            f"{obj.__name__} targets proposer API version {obj.api_version}; "
            f"this speculant supports version {Proposer.api_version}"
        )


class ProposerRegistry:
    """Proposers known to this process. Tests build one from explicit entry points."""

    def __init__(self, eps: Iterable[EntryPoint] | None = None, allowlist: str | None = None,
                 use_env: bool = True):
        if eps is None:
            eps = list(entry_points(group=GROUP))
            if not any(_distribution(ep)[0] == BUILTIN_DISTRIBUTION for ep in eps):
                eps = source_checkout_entry_points() + eps
        if allowlist is None and use_env:
            allowlist = os.environ.get(ALLOWLIST_ENV)
        self.allowed = None if allowlist is None else {n.strip() for n in allowlist.split(",") if n.strip()}
        self.broken: dict[str, tuple[str, str]] = {}  # name -> (distribution, error repr)
        self._eps: dict[str, EntryPoint] = {}  # the entry point each selectable name resolves to
        self._refused: list[ProposerInfo] = []  # entry points that lost a name clash
        self._failed: set[str] = set()  # names whose entry point failed to load or check
        self._classes: dict[str, type[Proposer]] = {}
        self._add_all(list(eps))

    def _add_all(self, eps: list[EntryPoint]) -> None:
        by_name: dict[str, list[EntryPoint]] = {}
        for ep in eps:
            if self.allowed is not None and ep.name not in self.allowed:
                logger.info("proposer %r from %s skipped: not in %s", ep.name, _distribution(ep)[0], ALLOWLIST_ENV)
                continue
            same = by_name.setdefault(ep.name, [])
            if not any(o.value == ep.value and _distribution(o) == _distribution(ep) for o in same):
                same.append(ep)  # the same distribution seen twice on sys.path is one entry
        for name, candidates in by_name.items():
            builtins = [ep for ep in candidates if _is_builtin(ep)]
            if builtins or len(candidates) == 1:
                winner = (builtins or candidates)[0]  # of two speculant copies, the first on sys.path
                self._eps[name] = winner
                for ep in candidates:
                    if ep is not winner:
                        owner = "the built-in proposer" if builtins else _distribution(winner)[0]
                        self._refuse(name, ep, f"name {name!r} is already taken by {owner}")
            else:
                dists = ", ".join(_distribution(ep)[0] for ep in candidates)
                for ep in candidates:
                    self._refuse(name, ep, f"name {name!r} is claimed by several distributions: {dists}")
                self.broken[name] = (dists, self.broken[name][1])
        for name in sorted((self.allowed or set()) - set(by_name)):
            logger.warning("%s names %r, but no installed proposer has that name", ALLOWLIST_ENV, name)

    def _refuse(self, name: str, ep: EntryPoint, error: str) -> None:
        dist, version = _distribution(ep)
        logger.error("proposer %r from %s refused: %s", name, dist, error)
        self.broken[name] = (dist, error)
        self._refused.append(ProposerInfo(name, dist, version, error))

    def names(self) -> list[str]:
        """Selectable names: allowed, unique, and not found broken so far."""
        return sorted(n for n in self._eps if n not in self._failed)

    def load_proposer_class(self, name: str) -> type[Proposer]:
        """Import and check one proposer; ValueError (listing the working names) if it cannot be used."""
        if name in self._classes:
            return self._classes[name]
        if name not in self._eps or name in self._failed:
            reason = f" ({self.broken[name][1]})" if name in self.broken else ""
            raise ValueError(f"unknown proposer {name!r}{reason}; installed: {', '.join(self.names()) or 'none'}")
        ep = self._eps[name]
        try:
            cls = ep.load()
            check_proposer_class(cls)
        except Exception as exc:  # a plugin's bug must not take the server down
            dist = _distribution(ep)[0]
            logger.error("failed to load proposer %r from %s (%s): %r", name, dist, ep.value, exc, exc_info=True)
            self._failed.add(name)
            self.broken[name] = (dist, repr(exc))
            raise ValueError(
                f"proposer {name!r} from {dist} cannot be loaded: {exc!r}; "
                f"installed: {', '.join(self.names()) or 'none'}"
            ) from None
        self._classes[name] = cls
        return cls

    def is_builtin(self, name: str) -> bool:
        """Whether `name` resolves to one of this distribution's own proposers (an unknown name: False)."""
        ep = self._eps.get(name)
        return ep is not None and _is_builtin(ep)

    def installed(self, check: bool = True) -> list[ProposerInfo]:
        """Every known proposer, refused ones included; `check` imports each one to test it."""
        infos = list(self._refused)
        for name, ep in self._eps.items():
            if check:
                try:
                    self.load_proposer_class(name)
                except ValueError:
                    pass
            error = self.broken[name][1] if name in self._failed else None
            infos.append(ProposerInfo(name, *_distribution(ep), error))
        return sorted(infos, key=lambda i: (i.name, i.error is not None, i.distribution))


@functools.cache
def default_registry() -> ProposerRegistry:
    """The process-wide registry, built on first use from the installed entry points."""
    return ProposerRegistry()


def load_proposer_class(name: str) -> type[Proposer]:
    return default_registry().load_proposer_class(name)


def installed(check: bool = True) -> list[ProposerInfo]:
    return default_registry().installed(check)


def is_builtin(name: str) -> bool:
    return default_registry().is_builtin(name)


def cli_list(args=None) -> int:
    """`speculant proposers`: a table of installed proposers; exit status 1 if any is broken."""
    rows = [("NAME", "DISTRIBUTION", "VERSION", "STATUS")]
    infos = installed(check=True)
    rows += [(i.name, i.distribution, i.version or "-", "ok" if i.error is None else f"BROKEN: {i.error}")
             for i in infos]
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:3], widths, strict=True)), row[3])
    return 1 if any(i.error for i in infos) else 0
