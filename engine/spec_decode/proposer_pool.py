"""The engine's proposers: the configured one, plus others that requests ask for by name.

A request may choose another installed method (`"speculative": {"method": "suffix"}`); the pool
builds it on first use with that method's default options and the server's K, binds it to the
target, and from then on routes each request's events to the proposer it started with. One
`propose()` call per proposer per step.

A third-party proposer's drafts are checked against the contract (`proposers.base.Drafts`) request
by request before they reach the step: a draft outside the vocabulary would fail the step's
verification, and a failed step fails every running request. A request's bad drafts are dropped
(it decodes that step without them, so its output is unchanged); a `propose()` that raises or
returns a malformed Drafts drafts nothing that step. Each problem is logged once, naming the
proposer. Built-in proposers (the registry's word: declared by this distribution) are held to the
contract by tests, and their drafts go unchecked.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import numpy as np

from engine.errors import InvalidRequest

log = logging.getLogger("speculant.engine")


class ProposerPool:
    def __init__(self, default, spec, bind):
        self.default = default  # the configured proposer (None: no speculation on this server)
        self.spec = spec
        self.bind = bind  # bind(proposer): hand it the target (engine_setup.bind_proposer)
        self.by_method = {spec.method: default} if default is not None else {}
        self.of_request: dict[str, object] = {}
        self.warned: set[tuple[str, str]] = set()  # (proposer class, problem) pairs already logged
        self.builtin: dict[int, object] = {}  # id -> each proposer of by_method that is built in (kept alive)
        self._note_builtins()

    def _note_builtins(self) -> None:
        from proposers.registry import is_builtin

        self.builtin = {id(p): p for method, p in self.by_method.items() if is_builtin(method)}

    def reset(self) -> None:
        """Fresh proposers of the same configuration (no state carried over); no request may be running."""
        if self.of_request:
            raise ValueError("engines: cannot reset the proposers of an engine with running requests")
        if self.default is not None:
            self.default = type(self.default)(self.spec, self.default.vocab_size)
            self.bind(self.default)
            self.by_method = {self.spec.method: self.default}
            self._note_builtins()

    @property
    def uses_hidden_states(self) -> bool:
        return any(p.uses_hidden_states for p in self.by_method.values())

    def get(self, method: str | None):
        """The proposer for a request's method choice (None = the server's)."""
        if method is None or method == getattr(self.spec, "method", None):
            return self.default
        if self.default is None:
            raise InvalidRequest("speculative.method: this server runs without speculative decoding",
                                 "speculative.method")
        proposer = self.by_method.get(method)
        if proposer is None:
            proposer = self._build(method)
        return proposer

    def _build(self, method: str):
        from proposers.registry import load_proposer_class

        try:
            cls = load_proposer_class(method)
            spec = dataclasses.replace(self.spec, method=method, options=cls.options_dict({}))
            proposer = cls(spec, self.default.vocab_size)
            self.bind(proposer)
        except ValueError as exc:
            raise InvalidRequest(f"speculative.method: {exc}", "speculative.method") from None
        self.by_method[method] = proposer
        self._note_builtins()
        log.info("built proposer %r for a request that asked for it", method)
        return proposer

    # ---------------------------------------------------------------- routing

    def start(self, request_id: str, method: str | None, prompt_token_ids) -> None:
        proposer = self.get(method)
        if proposer is not None:
            self.of_request[request_id] = proposer
            proposer.start_request(request_id, prompt_token_ids)

    def of(self, request_id: str):
        return self.of_request.get(request_id)

    def extend(self, request_id: str, token_ids) -> None:
        proposer = self.of_request.get(request_id)
        if proposer is not None:
            proposer.extend_request(request_id, token_ids)

    def observe_hidden(self, request_id: str, start: int, hidden_fn) -> None:
        proposer = self.of_request.get(request_id)
        if proposer is not None and proposer.uses_hidden_states:
            proposer.observe_hidden(request_id, start, hidden_fn())

    def stop(self, request_id: str) -> None:
        proposer = self.of_request.pop(request_id, None)
        if proposer is not None:
            proposer.stop_request(request_id)

    def propose(self, asks: list):
        """Drafts for every ask, one `propose()` per proposer, in the asks' order; each ask's
        source and the seconds per source are always filled in."""
        from proposers.base import Drafts

        groups: dict[int, list[int]] = {}
        for i, ask in enumerate(asks):
            groups.setdefault(id(self.of_request[ask.request_id]), []).append(i)
        if len(groups) == 1:  # every ask with one proposer, the usual case: its own Drafts, completed
            return self._complete(self.of_request[asks[0].request_id], asks)
        out = Drafts.empty(len(asks))
        out.probs, out.sources, out.seconds = [None] * len(asks), [None] * len(asks), {}
        for indices in groups.values():
            got = self._complete(self.of_request[asks[indices[0]].request_id], [asks[i] for i in indices])
            for j, i in enumerate(indices):
                out.token_ids[i], out.probs[i], out.sources[i] = got.token_ids[j], got.probs[j], got.sources[j]
            for source, seconds in got.seconds.items():
                out.seconds[source] = out.seconds.get(source, 0.0) + seconds
        return out

    def _complete(self, proposer, asks: list):
        """One proposer's Drafts for its asks, with probs, sources and seconds filled in."""
        start = time.perf_counter()
        got = self._call(proposer, asks)
        elapsed = time.perf_counter() - start
        first_source = proposer.draft_sources[0]
        got.probs = got.probs or [None] * len(asks)
        got.sources = [src or first_source for src in got.sources] if got.sources else [first_source] * len(asks)
        got.seconds = got.seconds or {first_source: elapsed}
        return got

    def _call(self, proposer, asks: list):
        """proposer.propose(asks): a plugin's checked (module docstring), a built-in's as it comes."""
        from proposers.base import Drafts

        if id(proposer) in self.builtin:
            return proposer.propose(asks)
        try:
            got = proposer.propose(asks)
        except Exception as exc:  # a plugin's bug costs its drafts, not the step
            self._warn(proposer, f"propose() raised {type(exc).__name__}; no drafts this step", exc)
            return Drafts.empty(len(asks))
        n = len(asks)
        if not isinstance(got, Drafts) or len(got.token_ids) != n or any(
                x is not None and len(x) != n for x in (got.probs, got.sources)):
            self._warn(proposer, "propose() must return a Drafts with one entry per request; no drafts this step")
            return Drafts.empty(n)
        for j, ids in enumerate(got.token_ids):
            q = got.probs[j] if got.probs else None
            problem = draft_problem(ids, q, proposer.vocab_size)
            if problem is not None:
                got.token_ids[j] = np.empty(0, np.int32)
                if got.probs:
                    got.probs[j] = None
                self._warn(proposer, f"{problem}; the request decodes this step without its drafts")
        return got

    def _warn(self, proposer, problem: str, exc: Exception | None = None) -> None:
        """Log a plugin's problem once per proposer class and problem (with the traceback of an exception)."""
        name = type(proposer).__qualname__
        if (name, problem) not in self.warned:
            self.warned.add((name, problem))
            log.warning("proposer %s (%s): %s (logged once)", name, type(proposer).__module__, problem, exc_info=exc)


def draft_problem(ids, q, vocab_size: int) -> str | None:
    """What is wrong with one request's drafts (token ids, and q rows or None), or None."""
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.dtype.kind not in "iu":
        return "draft token ids must be a 1-D integer array"
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        return f"draft token id outside the vocabulary [0, {vocab_size})"
    if q is None:
        return None
    if not isinstance(q, np.ndarray) or q.dtype != np.float32 or q.shape != (len(ids), vocab_size):
        return f"draft probs must be a float32 [num_drafts, {vocab_size}] array"
    if not (np.isfinite(q).all() and q.min(initial=0.0) >= 0.0):
        return "draft probs must be finite and non-negative"
    return None
