"""`medusa`: K independent heads on the target's last feature; head i drafts the token i+2 ahead.

No state beyond the last feature and no attention: each step costs K small residual blocks plus
K draft-vocabulary LM-head rows products, all batched over requests.
"""

from __future__ import annotations

import numpy as np

from proposers.heads.common import HeadProposer, pick_tokens
from proposers.heads.head_file import HeadFile
from proposers.heads.layer import matmul, pack_matrix, silu


class MedusaProposer(HeadProposer):
    head_kind = "medusa"

    def load_modules(self, head: HeadFile) -> None:
        self.blocks = [(pack_matrix(head.module(i)["w"], self.options.weights, self.numerics), head.module(i)["w.bias"])
                       for i in range(head.config["num_modules"])]

    def draft(self, asks):
        feats = np.stack([self.requests[a.request_id].feats[self.requests[a.request_id].n_feat - 1] for a in asks])
        steps = [min(a.max_draft_tokens, len(self.blocks)) for a in asks]
        tokens = [[] for _ in asks]
        probs = [[] for _ in asks]
        for i, (w, b) in enumerate(self.blocks[: max(steps)]):
            live = [r for r in range(len(asks)) if steps[r] > i]
            f = feats[live]  # [live, H]
            logits = self.draft_logits(f + silu(matmul(f, w) + b))  # [live, V_d]
            picked, q = pick_tokens(logits, self.draft_vocab, [asks[r] for r in live], self.vocab_size, self.rng)
            for r, t, qr in zip(live, picked, q):
                tokens[r].append(int(t))
                probs[r].append(qr)
        return [(np.asarray(t, np.int32), None if not p or p[0] is None else np.stack(p)) for t, p in zip(tokens, probs)]
