"""A depth-limited, count-annotated suffix trie with path compression, for suffix decoding.

Every suffix of every inserted sequence is inserted, truncated to `max_depth` tokens. A node is one
edge of the trie: the tokens `seq[start:end]` of some sequence, and `count`, the number of inserted
suffixes whose string passes through (or ends on) that edge. Counts are uniform along an edge
because a suffix that ends inside an edge splits it. So for any string s in the trie, count(s) is
the number of occurrences of s in the inserted sequences, and count(s + c) / count(s) is the
empirical probability that c follows s.

Sequences grow one token at a time (`extend`), one growing sequence at a time (`close` it before
starting the next: responses are inserted whole). For it we keep its "active" suffixes:
those whose string already occurred elsewhere and so end on a shared node. A suffix that is
unique owns an *open* leaf, whose edge runs to the end of its (growing) sequence, capped at
`max_depth`: it grows for free. So appending costs O(number of repeated suffixes) <= max_depth,
typically a handful. When a live suffix walks into a shared edge, the edge is split after one
token; when the suffix then continues down the same path, the split is fused back, so a repeat of
a long phrase keeps it one node (arctic-inference's suffix tree does the same in C++).

Edges point into the token lists of the sequences that created them. `remove` (FIFO eviction of
cached responses) decrements counts along the removed sequence's suffixes, drops nodes that reach
zero, and copies the few surviving edges that still point into the removed list.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("seq", "start", "end", "is_open", "count", "children", "best")

    def __init__(self, seq: list[int], start: int, end: int, count: int, is_open: bool = False):
        self.seq = seq  # the token list this edge's tokens live in
        self.start = start
        self.end = end  # exclusive; for an open leaf, the depth cap (the edge stops at len(seq))
        self.is_open = is_open
        self.count = count
        self.children: dict[int, _Node] | None = None  # by first token
        self.best: _Node | None = None  # child with the highest count (first to reach it on ties)


def _length(node: _Node) -> int:
    return (min(node.end, len(node.seq)) if node.is_open else node.end) - node.start


@dataclass(slots=True)
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # path probability at each draft token
    score: float = 0.0  # sum of probs: the expected number of accepted tokens, roughly
    match_len: int = 0


class SuffixTree:
    def __init__(self, max_depth: int):
        if max_depth < 2:
            raise ValueError("max_depth: must be >= 2")
        self.max_depth = max_depth
        self._root = _Node([], 0, 0, 0)
        self._root.children = {}
        self._seqs: dict[Hashable, list[int]] = {}
        # The one growing sequence, if any -> its active suffixes as (node, depth), deepest first.
        self._active: dict[Hashable, list[tuple[_Node, int]]] = {}

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        return len(self._seqs[seq_id])

    def token_ids(self, seq_id: Hashable) -> list[int]:
        """The sequence's tokens (the trie's own list: do not modify it)."""
        return self._seqs[seq_id]

    def extend(self, seq_id: Hashable, token_ids: Iterable[int]) -> None:
        """Append tokens to a sequence, creating it if new."""
        seq = self._seqs.get(seq_id)
        if seq_id not in self._active:
            if seq is not None:
                raise ValueError(f"sequence {seq_id!r} was closed")
            if self._active:  # fusing edges is only safe while no other sequence is growing
                raise ValueError(f"close sequence {next(iter(self._active))!r} before starting another")
            seq = self._seqs[seq_id] = []
            self._active[seq_id] = []
        active = self._active[seq_id]
        for token in token_ids:
            active = self._append(seq, active, int(token))
        self._active[seq_id] = active

    def close(self, seq_id: Hashable) -> None:
        """The sequence will not grow any more: forget its active suffixes."""
        self._active.pop(seq_id, None)

    def _append(self, seq: list[int], active: list[tuple[_Node, int]], token: int) -> list[tuple[_Node, int]]:
        pos = len(seq)
        seq.append(token)  # open leaves of this sequence grow by one here, for free
        root, max_depth = self._root, self.max_depth
        new_active: list[tuple[_Node, int]] = []
        # Deepest first: a fuse below only ever swallows nodes deeper than every entry still to come.
        for node, depth in (*active, (root, 0)):
            if depth >= max_depth:
                continue
            child = node.children.get(token) if node.children else None
            if child is None:  # the suffix becomes unique: it gets an open leaf and leaves `active`
                leaf = _Node(seq, pos, pos + max_depth - depth, 1, is_open=True)
                if node.children is None:
                    node.children = {}
                node.children[token] = leaf
                if node.best is None:
                    node.best = leaf
                continue
            if _length(child) > 1:
                child = self._split(node, child, 1)
            child.count += 1
            if child.count > node.best.count:
                node.best = child
            if (node is not root and node.count == child.count and len(node.children) == 1
                    and child.seq is node.seq and child.start == node.end and not node.is_open):
                node.end, node.is_open = child.end, child.is_open  # fuse the split back
                node.children, node.best = child.children, child.best
                child = node
            new_active.append((child, depth + 1))
        return new_active

    @staticmethod
    def _split(parent: _Node, child: _Node, k: int) -> _Node:
        """Cut `child`'s edge after k tokens; the new upper node takes its place under `parent`."""
        upper = _Node(child.seq, child.start, child.start + k, child.count)
        upper.children = {child.seq[child.start + k]: child}
        upper.best = child
        parent.children[child.seq[child.start]] = upper
        if parent.best is child:
            parent.best = upper
        child.start += k
        return upper

    def remove(self, seq_id: Hashable) -> None:
        """Remove every suffix of a sequence (FIFO eviction of a cached response)."""
        seq = self._seqs.pop(seq_id)
        self._active.pop(seq_id, None)
        num_tokens = len(seq)
        for i in range(num_tokens):
            self._remove_suffix(seq, i, min(num_tokens, i + self.max_depth))

    def _remove_suffix(self, seq: list[int], pos: int, end: int) -> None:
        node = self._root
        while pos < end:
            token = seq[pos]
            child = node.children[token]
            child.count -= 1
            if child.count == 0:  # nothing else passes here, nor below
                del node.children[token]
                if node.best is child:
                    node.best = max(node.children.values(), key=_count) if node.children else None
                return
            if node.best is child and node is not self._root:
                node.best = max(node.children.values(), key=_count)
            if child.seq is seq:  # keep the edge alive without keeping the removed list
                length = _length(child)
                child.seq, child.start, child.end = seq[child.start: child.start + length], 0, length
                child.is_open = False
            pos += _length(child)
            node = child

    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float = 1.0,
                  max_spec_offset: float = 0.0, min_token_prob: float = 0.1,
                  exclude_context: bool = False) -> SuffixDraft:
        """Best draft over every match length of the context's suffix (ties -> the longer match).

        `exclude_context`: the context itself is a live sequence of this tree (a request's local
        tree), so its own occurrence at the end is not evidence of what follows.
        """
        best = SuffixDraft()
        num_context = len(context)
        for match_len in range(1, min(num_context, self.max_depth - 1) + 1):
            found = self._match(context, num_context - match_len)
            # Longer suffixes occur at most as often: once none occurs (besides the context's
            # own live occurrence), none will.
            if found is None or found[0].count <= exclude_context:
                break
            max_tokens = min(max_spec_tokens, int(match_len * max_spec_factor + max_spec_offset))
            if max_tokens <= 0:
                continue
            draft = self._walk(found[0], found[1], max_tokens, min_token_prob, exclude_context)
            if draft.token_ids and draft.score >= best.score:
                draft.match_len = match_len
                best = draft
        return best

    def _match(self, context: Sequence[int], i: int) -> tuple[_Node, int] | None:
        """Walk context[i:] from the root; returns (node, tokens of its edge consumed) or None."""
        node, off, num_context = self._root, 0, len(context)
        while i < num_context:
            token = context[i]
            if off == _length(node):  # at a node end: step into the child starting with token
                node = node.children.get(token) if node.children else None
                if node is None:
                    return None
                off = 1
            elif node.seq[node.start + off] == token:
                off += 1
            else:
                return None
            i += 1
        return node, off

    @staticmethod
    def _walk(node: _Node, off: int, max_tokens: int, min_token_prob: float, exclude_context: bool) -> SuffixDraft:
        """Follow the most frequent path from a match; prob *= count(child) / count(node) per edge."""
        draft = SuffixDraft()
        prob = 1.0
        while len(draft.token_ids) < max_tokens:
            if off < _length(node):
                draft.token_ids.append(node.seq[node.start + off])
                draft.probs.append(prob)
                draft.score += prob
                off += 1
                exclude_context = False  # the live occurrence ended at a node end, not here
                continue
            child = node.best
            denominator = node.count - (1 if exclude_context else 0)
            exclude_context = False
            if child is None or denominator <= 0:
                break
            prob *= child.count / denominator
            if prob < min_token_prob:
                break
            node, off = child, 0
        return draft

    def counts(self) -> dict[tuple[int, ...], int]:
        """count(s) for every string s in the trie (for tests and debugging; O(size * depth))."""
        out: dict[tuple[int, ...], int] = {}
        stack = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in (node.children or {}).values():
                path = prefix
                for k in range(_length(child)):
                    path = (*path, child.seq[child.start + k])
                    out[path] = child.count
                stack.append((child, path))
        return out


def _count(node: _Node) -> int:
    return node.count
