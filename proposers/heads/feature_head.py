"""EAGLE and MTP heads: modules that autoregress on the target's features (see head_file.py).

Draft step j (1-based) of a request whose last true feature sits at row p* = num_tokens - 2 runs
module k = min(j - 1, M - 1) at row p* + max(0, j - M). Before that row, the module first catches
up on the rows it has not computed (its history), so one batched call per step both extends each
request's head KV with true rows and drafts. Rows whose inputs are all true are kept (`n_kv`);
speculative rows are recomputed next time.

The catch-up rows are owed per generated token whether the head drafts this step or a later one (a
request's first draft catches up on its whole prompt), so the time a step reports for the draft
controller (`charged_fraction`) is the share of its rows that drafting every step would run: the
drafts plus one row of history per request. Charged in full, a catch-up made drafting look dearer
than a plain step, so an adaptive head stopped drafting and each rare probe caught up again. A
catch-up computes only what later rows read (`_catch_up`): with an attention window it skips the
rows no later row sees, and the top module's rows before the target need only their K/V.
"""

from __future__ import annotations

import numpy as np

from engine.jit_cache import launch_threads
from engine.kernels.int_linear import host_path
from engine.kernels.layer import product_args, product_key
from proposers.base import DraftRequest
from proposers.heads.common import HeadProposer, pick_tokens
from proposers.heads.head_file import HeadFile
from proposers.heads.layer import DecoderLayer, KVStore, matmul, pack_matrix, rms_norm
from proposers.heads.layer_jit import head_module

WARM_UP_ROWS = 48  # >= every threshold at which a row kernel or the quantizer turns to two threads
# Catch-up rows from which the K/V-only call pays: its products run from Python, one call each. The eagle
# head on the Xeon, rows before the target / whole module on them and the target / K/V then the target:
# 1: 0.15 / 0.21 ms, 3: 0.20 / 0.23, 5: 0.26 / 0.23, 7: 0.34 / 0.27, 31: 1.26 / 0.57, 63: 2.64 / 0.91.
KV_ONLY_MIN_ROWS = 5


class FeatureModule:
    def __init__(self, w: dict[str, np.ndarray], cfg: dict, fmt: str, normed_inputs: bool, numerics: str = "exact",
                 window: int = 0):
        self.fc = pack_matrix(w["fc"], fmt, numerics)  # [H, 2H]
        self.layer = DecoderLayer(w, cfg, fmt, numerics, window)
        self.eps = cfg["rms_eps"]
        self.norms = (w["emb_norm"], w["feat_norm"], w["out_norm"]) if normed_inputs else None
        fc_key = product_key(self.fc)
        self.compiled = None  # fc and the layer as one call for one request (integer products only)
        if self.layer.compiled is not None and fc_key[0] == "int8":
            self.compiled = head_module(fc_key, self.layer.keys, host_path()), product_args(self.fc)

    def forward(self, emb: np.ndarray, feat: np.ndarray, runs) -> np.ndarray:
        """emb, feat [n, H] -> z [n, H] (runs as in DecoderLayer.forward)."""
        if self.norms is not None:
            emb, feat = rms_norm(emb, self.norms[0], self.eps), rms_norm(feat, self.norms[1], self.eps)
        if self.compiled is not None and len(runs) == 1:
            run_module, fc = self.compiled
            return run_module(np.ascontiguousarray(emb, np.float32), np.ascontiguousarray(feat, np.float32), fc,
                              self.layer.compiled[1], *self.layer.run_args(runs[0]))
        return self.layer.forward(matmul(np.concatenate([emb, feat], axis=1), self.fc), runs)

    def fill_kv(self, emb: np.ndarray, feat: np.ndarray, store: KVStore, p0: int) -> None:
        """Only the K/V of rows p0..p0+n-1 into the store (no row's output): the kernels of `forward` up to
        the attention, in its order, so the store holds the bits `forward` would have put there."""
        if self.norms is not None:
            emb, feat = rms_norm(emb, self.norms[0], self.eps), rms_norm(feat, self.norms[1], self.eps)
        self.layer.store_kv(matmul(np.concatenate([emb, feat], axis=1), self.fc), store, p0)

    def head_input(self, z: np.ndarray) -> np.ndarray:
        return z if self.norms is None else rms_norm(z, self.norms[2], self.eps)


class ModuleState:
    """One request's rows of one module: head KV and outputs z by row; rows < n_kv are true."""

    def __init__(self, cfg: dict, first_row: int, hidden_size: int):
        self.store = KVStore(cfg["num_kv_heads"], cfg["head_dim"])
        self.z = np.zeros((256, hidden_size), np.float32)  # [capacity, H]
        self.n_kv = self.done = first_row

    def put(self, first: int, z: np.ndarray) -> None:
        if first + len(z) > len(self.z):
            grown = np.zeros((max(first + len(z), 2 * len(self.z)), self.z.shape[1]), np.float32)
            grown[: len(self.z)] = self.z
            self.z = grown
        self.z[first : first + len(z)] = z


class FeatureHeadProposer(HeadProposer):
    normed_inputs = False

    def load_modules(self, head: HeadFile) -> None:
        cfg = head.config
        self.window = self.options.attention_window
        if self.window is None:  # the rows a training window held: the most the head ever attended to
            self.window = int(cfg.get("training", {}).get("config", {}).get("seq_len", 0))
        self.modules = [FeatureModule(head.module(i), cfg, self.options.weights, self.normed_inputs,
                                      self.numerics, self.window)
                        for i in range(cfg["num_modules"])]
        self.module_states: dict[str, list[ModuleState]] = {}
        self._warm_up(cfg)

    def _warm_up(self, cfg: dict) -> None:
        """Throwaway rows through every module, one and a prompt's catch-up of WARM_UP_ROWS (the row
        kernels' threaded builds), whole and K/V alone: compiles (or loads) the head's kernels now, not
        inside a request's first drafts, where the time would also be charged to the head's cost."""
        launch_threads()  # a head bound without a CpuRunner (see jit_cache.launch_threads)
        for n in (1, WARM_UP_ROWS):
            rows = np.zeros((n, self.hidden_size), np.float32)
            for module in self.modules:
                module.head_input(module.forward(rows, rows, [(KVStore(cfg["num_kv_heads"], cfg["head_dim"]), 0, 0, n)]))
                module.fill_kv(rows, rows, KVStore(cfg["num_kv_heads"], cfg["head_dim"]), 0)

    def stop_request(self, request_id) -> None:
        super().stop_request(request_id)
        self.module_states.pop(request_id, None)

    def model_steps(self, ask: DraftRequest) -> int:
        return ask.max_draft_tokens

    def draft(self, asks: list[DraftRequest]) -> list[tuple[np.ndarray, np.ndarray | None]]:
        states = [self.requests[a.request_id] for a in asks]
        mods = [self._module_states(a.request_id, s.feat_lo) for a, s in zip(asks, states)]
        drafted: list[list[int]] = [[] for _ in asks]  # each request's drafts so far (after its tokens)
        steps = [self.model_steps(a) for a in asks]
        probs: list[list] = [[] for _ in asks]
        self.rows_run = 0
        M = len(self.modules)
        for j in range(1, max(steps) + 1):
            live = [r for r in range(len(asks)) if steps[r] >= j]
            k = min(j - 1, M - 1)
            rows = [states[r].n_feat - 1 + max(0, j - M) for r in live]
            z = self._compute(k, [states[r] for r in live], [mods[r] for r in live], [drafted[r] for r in live], rows)
            logits = self.draft_logits(self.modules[k].head_input(z))  # [live, V_d]
            tokens, q = pick_tokens(logits, self.draft_vocab, [asks[r] for r in live], self.vocab_size, self.rng)
            for r, t, qr in zip(live, tokens, q):
                drafted[r].append(int(t))
                probs[r].append(qr)
        self.charged_fraction = min(1.0, (sum(steps) + len(asks)) / max(self.rows_run, 1))
        return [(np.asarray(d, np.int32), None if not p or p[0] is None else np.stack(p)) for d, p in zip(drafted, probs)]

    def _module_states(self, request_id: str, first_row: int) -> list[ModuleState]:
        mods = self.module_states.get(request_id)
        if mods is None:
            mods = self.module_states[request_id] = [ModuleState(self.head.config, first_row, self.hidden_size)
                                                     for _ in self.modules]
        for m in mods:
            m.done = m.n_kv
        return mods

    def _compute(self, k: int, states, mods, drafted, targets: list[int]) -> np.ndarray:
        """Run module k over each request's rows done..target; returns z at each target row [R, H]."""
        embs, feats, runs = [], [], []
        for s, m, d, target in zip(states, mods, drafted, targets):
            ms = m[k]
            self._catch_up(k, s, m, d, target)
            embs.append(self.embed_tokens(_token_ids(s, d, ms.done + 1 + k, target + 2 + k)))
            feats.append(self._features(k, s, m, ms.done, target + 1))
            runs.append((ms.store, ms.done, s.feat_lo, target + 1 - ms.done))
        z = self.modules[k].forward(np.concatenate(embs), np.concatenate(feats), runs)  # [sum rows, H]
        self.rows_run += len(z)
        out, offset = [], 0
        for s, m, (_, first, _, n) in zip(states, mods, runs):
            ms = m[k]
            ms.put(first, z[offset : offset + n])
            true_end = min(first + n, s.num_tokens - 1 - k, s.n_feat if k == 0 else m[k - 1].n_kv)
            ms.n_kv = max(ms.n_kv, true_end)
            ms.done = first + n
            out.append(z[offset + n - 1])
            offset += n
        return np.stack(out)

    def _catch_up(self, k: int, state, mods: list[ModuleState], drafted, target: int) -> None:
        """Before module k runs its rows done..target in full, skip the rows no later row will see and run
        the rows whose outputs nobody reads for their K/V alone.

        Within a window of W keys, a row r sees rows r+1-W..r. The top module's target row sees rows from
        target+1-W; a lower module's outputs are read by the module above from there on, and those rows
        see rows from target+2-2W. The top module's outputs are read only at its target row (a row past
        the features below reads its own row before, and that is the target or later), so its rows before
        the target need only their K/V; a lower module's, only those before target+1-W. On a 1,400-token
        prompt, eagle's first draft then runs 1,399 rows' fc and q/k/v products instead of 1,400 rows'
        whole layer with attention over every row before each."""
        ms, top, window = mods[k], k == len(self.modules) - 1, self.window
        if window and (first := target + 1 - window if top else target + 2 - 2 * window) > ms.done:
            ms.done = first  # the rows before are never computed: no row that is will see them
        full_from = target if top else (target + 1 - window if window else ms.done)
        end = min(full_from, state.n_feat if k == 0 else mods[k - 1].done)
        if end - ms.done < KV_ONLY_MIN_ROWS:
            return
        emb = self.embed_tokens(_token_ids(state, drafted, ms.done + 1 + k, end + 1 + k))
        self.modules[k].fill_kv(emb, self._features(k, state, mods, ms.done, end), ms.store, ms.done)
        self.rows_run += end - ms.done
        ms.n_kv = max(ms.n_kv, min(end, state.num_tokens - 1 - k, state.n_feat if k == 0 else mods[k - 1].n_kv))
        ms.done = end

    @staticmethod
    def _features(k: int, state, mods: list[ModuleState], lo: int, hi: int) -> np.ndarray:
        """[hi - lo, H] feature of each row lo..hi-1: the target's (module 0) or the module below's output
        at that row; past what those cover, this module's own output at the row before (EAGLE-style)."""
        have = min(max(state.n_feat if k == 0 else mods[k - 1].done, lo), hi)
        below = state.feats if k == 0 else mods[k - 1].z
        return np.concatenate([below[lo:have], mods[k].z[have - 1 : hi - 1]])


def _token_ids(state, drafted: list[int], lo: int, hi: int) -> np.ndarray:
    """[hi - lo] int32 ids at positions lo..hi-1 of a request's tokens followed by its drafts."""
    n = state.num_tokens
    if hi <= n:
        return state.tokens[lo:hi]
    return np.concatenate([state.tokens[lo:n], np.asarray(drafted[max(lo - n, 0) : hi - n], np.int32)])
