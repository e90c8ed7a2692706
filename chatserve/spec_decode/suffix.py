"""Suffix decoding (vLLM's ``suffix``, after Snowflake's SuffixDecoding): drafts from suffix trees
over the request's own tokens and over the outputs of recent requests.

Where prompt lookup (``ngram``) takes the continuation of the *latest* occurrence of a short n-gram,
a suffix tree counts *every* continuation of *every* context up to ``max_tree_depth`` tokens, so the
drafter can (1) match the longest context that has been seen, (2) follow the most frequent
continuation token by token while its estimated probability (the product of the branch
frequencies) stays above ``min_token_prob``, and (3) learn from other requests: agent loops,
tool calls and templated answers repeat what earlier responses said, which prompt lookup over one
request never sees.

Two kinds of tree, one structure:

- one per running request over its prompt and output (grown by the tokens accepted since the last
  step: O(depth) per token), dropped when it finishes;
- one global tree over the outputs of the last ``max_cached_requests`` finished requests, the
  oldest removed exactly (its counts taken back) when the bound is passed.

The draft of the tree whose guess has the larger expected number of accepted tokens (the sum of the
cumulative probabilities) wins, and its length is at most ``max_spec_factor`` x the match length (a
one-token match is weak evidence).

Cost: a node per (position, depth) that is not shared, so at most ``depth`` nodes per token (a
Python object of ~100 bytes each): a 2,000-token prompt at depth 24 is <= 48k nodes (~5 MiB, ~30 ms
to build once); the global tree's bound is in requests, each of whose outputs costs as much.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


class _Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.count = 0  # occurrences of the path from the root to here


class SuffixTree:
    """Every substring of length <= ``depth`` of the inserted texts, with its number of occurrences."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2; got {depth}")
        self.depth = depth
        self.root = _Node()
        self.num_nodes = 0

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append ``token`` to a text whose open suffixes end at ``active`` (oldest first; each a
        node of depth < ``depth``); returns the new open suffixes."""
        grown: list[_Node] = []
        for node in (*active, self.root):
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            grown.append(child)
        if len(grown) >= self.depth:  # the oldest reached full depth: it cannot grow further
            del grown[0]
        return grown

    def insert_start(self, tokens: Sequence[int], start: int) -> None:
        """Count the substrings of ``tokens`` that begin at ``start`` (up to ``depth`` long)."""
        node = self.root
        for token in tokens[start : start + self.depth]:
            child = node.children.get(token)
            if child is None:
                child = node.children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            node = child

    def insert(self, tokens: Sequence[int]) -> None:
        for start in range(len(tokens)):
            self.insert_start(tokens, start)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back one earlier ``insert(tokens)``: counts drop, nodes left with none go."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.depth]:
                child = node.children.get(token)
                if child is None:
                    break
                child.count -= 1
                if child.count <= 0:  # its whole subtree counted only removed occurrences
                    del node.children[token]
                    self.num_nodes -= _size(child) + 1
                    break
                node = child

    def match(self, context: Sequence[int], max_len: int) -> tuple[int, _Node | None]:
        """The longest suffix of ``context`` (at most ``max_len`` tokens) that is a path here with a
        continuation: (its length, its node), or (0, None)."""
        for length in range(min(max_len, len(context)), 0, -1):
            node: _Node | None = self.root
            for token in context[len(context) - length :]:
                node = node.children.get(token)  # type: ignore[union-attr]
                if node is None:
                    break
            if node is not None and node.children:
                return length, node
        return 0, None

    @staticmethod
    def draft(node: _Node, max_tokens: int, min_prob: float) -> tuple[list[int], float]:
        """The most frequent continuation below ``node`` while its estimated probability stays at
        least ``min_prob``: (tokens, expected number accepted)."""
        tokens: list[int] = []
        prob = 1.0
        score = 0.0
        while len(tokens) < max_tokens and node.children:
            total = 0
            best_token, best = -1, None
            for token, child in node.children.items():
                total += child.count
                if best is None or child.count > best.count:
                    best_token, best = token, child
            assert best is not None
            prob *= best.count / total
            if prob < min_prob:
                break
            tokens.append(best_token)
            score += prob
            node = best
        return tokens, score


def _size(node: _Node) -> int:
    """Nodes strictly below ``node``."""
    total, stack = 0, list(node.children.values())
    while stack:
        child = stack.pop()
        total += 1
        stack.extend(child.children.values())
    return total


# A request's tree is built over the newest WINDOW tokens at once (~6k node inserts, ~4 ms), the
# older ones BACKFILL starts a step (~1 ms, on the step loop, until the prompt is covered)
# (a 2,000-token prompt built at once would stall the step loop ~60 ms: 48k node inserts).
WINDOW = 256
BACKFILL = 64


@dataclass
class _RequestTree:
    tree: SuffixTree
    active: list[_Node] = field(default_factory=list)  # open suffixes at the end of the text
    upto: int = 0  # tokens the open suffixes have consumed
    backfill: int = 0  # substrings starting before this position are not in the tree yet


class SuffixDrafter:
    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 256,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1) -> None:
        self.depth = max_tree_depth
        self.max_cached_requests = max_cached_requests
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.global_tree = SuffixTree(max_tree_depth)
        self._cached: deque[tuple[int, ...]] = deque()  # finished outputs in the global tree, oldest first
        self._requests: dict[int, _RequestTree] = {}

    def _request_tree(self, seq_id: int, token_ids: Sequence[int]) -> SuffixTree:
        state = self._requests.get(seq_id)
        if state is None:
            base = max(0, len(token_ids) - max(WINDOW, self.depth))
            state = self._requests[seq_id] = _RequestTree(SuffixTree(self.depth), upto=base, backfill=base)
        tree = state.tree
        for token in token_ids[state.upto :]:
            state.active = tree.extend(state.active, token)
        state.upto = len(token_ids)
        if state.backfill:  # every start below it has its full depth of tokens after it already
            low = max(0, state.backfill - BACKFILL)
            for start in range(low, state.backfill):
                tree.insert_start(token_ids, start)
            state.backfill = low
        return tree

    def propose(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int, max_tokens: int) -> list[int]:
        if max_tokens <= 0 or not token_ids:
            return []
        best: list[int] = []
        best_score = 0.0
        # a match may use the depth the draft does not need: the two share max_tree_depth
        max_match = max(1, self.depth - max_tokens)
        for tree in (self._request_tree(seq_id, token_ids), self.global_tree):
            length, node = tree.match(token_ids, max_match)
            if node is None:
                continue
            limit = min(max_tokens, max(1, int(self.max_spec_factor * length)))
            tokens, score = tree.draft(node, limit, self.min_token_prob)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def finish(self, seq_id: int, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self._requests.pop(seq_id, None)
        if self.max_cached_requests <= 0:
            return
        output = tuple(token_ids[num_prompt_tokens:])
        if len(output) < 2:
            return
        self.global_tree.insert(output)
        self._cached.append(output)
        while len(self._cached) > self.max_cached_requests:
            self.global_tree.remove(self._cached.popleft())

    @property
    def num_cached_requests(self) -> int:
        return len(self._cached)
