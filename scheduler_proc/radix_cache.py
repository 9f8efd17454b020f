"""The prefix cache: a radix tree keyed by token ids whose nodes own KV slot indices
(SGLang's RadixAttention, on indices only: no tensor, no clock, so the scheduling core and the
tests drive it directly).

Each edge holds a run of tokens and the KV slots computed for them. `match_prefix` finds the
longest cached prefix of a token sequence; `insert` adds a request's computed tokens (keeping the
slots the tree already had for a shared part: the caller frees its own copies of those); a
request using cached slots locks their node (and so every ancestor) until it ends; `evict` frees
the least recently used unlocked leaves. With page_size > 1 matches and inserts cover whole
pages only. Sizes are kept per state: evictable (unlocked) and protected (locked) tokens.
"""

from __future__ import annotations

import heapq
from typing import Iterator

import numpy as np

_EMPTY = np.empty(0, dtype=np.int32)


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access")

    def __init__(self, key: list[int], value: np.ndarray, parent: "TreeNode | None"):
        self.children: dict[object, TreeNode] = {}
        self.parent = parent
        self.key = key  # the tokens of the edge into this node
        self.value = value  # their KV slots
        self.lock_ref = 0  # requests using this node or a descendant
        self.last_access = 0


class RadixCache:
    def __init__(self, page_size: int = 1):
        if page_size < 1:
            raise ValueError(f"page_size={page_size}: at least 1")
        self.page_size = page_size
        self.root = TreeNode([], _EMPTY, None)
        self.root.lock_ref = 1  # never evicted
        self.clock = 0  # logical time of the last access (LRU)
        self.evictable_size = 0  # tokens in unlocked nodes
        self.protected_size = 0  # tokens in locked nodes

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- lookups ---------------------------------------------------------------------------

    def match_prefix(self, tokens: list[int]) -> tuple[np.ndarray, TreeNode]:
        """The slots of the longest cached prefix of `tokens` (whole pages), and the node where
        it ends (split there if the match ends inside an edge), to lock while the slots are used."""
        node, slots, pos = self._walk(tokens)
        return (np.concatenate(slots) if slots else _EMPTY), node

    def insert(self, tokens: list[int], slots: np.ndarray) -> tuple[int, TreeNode]:
        """Adds `tokens` (their whole pages) with their `slots`. Returns how many leading tokens
        the tree held already (it keeps its own slots for them: the caller's copies there are
        duplicates to free) and the node where the inserted sequence ends."""
        n = len(tokens) - len(tokens) % self.page_size
        node, _, pos = self._walk(tokens[:n])
        if pos < n:
            leaf = TreeNode(list(tokens[pos:n]), np.asarray(slots[pos:n], dtype=np.int32), node)
            leaf.last_access = self.clock
            node.children[self._child_key(leaf.key)] = leaf
            self.evictable_size += n - pos  # (a new leaf is unlocked, whatever its parent)
            node = leaf
        return pos, node

    def _walk(self, tokens: list[int]) -> tuple[TreeNode, list[np.ndarray], int]:
        """Follows `tokens` from the root as far as whole pages match, splitting the last edge
        where the match ends inside it. Returns (the node reached, the slots along the way,
        tokens matched)."""
        self.clock += 1
        node, slots, pos = self.root, [], 0
        page = self.page_size
        while len(tokens) - pos >= page:
            child = node.children.get(self._child_key(tokens[pos:pos + page]))
            if child is None:
                break
            n = common_prefix(child.key, tokens, pos)
            n -= n % page
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self.clock
            slots.append(child.value)
            pos += n
            node = child
        return node, slots, pos

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Splits the edge into `child` after n tokens; returns the new upper node."""
        parent = child.parent
        upper = TreeNode(child.key[:n], child.value[:n], parent)
        upper.lock_ref, upper.last_access = child.lock_ref, child.last_access
        parent.children[self._child_key(upper.key)] = upper
        child.key, child.value, child.parent = child.key[n:], child.value[n:], upper
        upper.children[self._child_key(child.key)] = child
        return upper

    def _child_key(self, key: list[int]) -> object:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    # ---- locks -----------------------------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        """A request uses the slots from the root down to `node`: none of them may be evicted."""
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlocking a node nobody locked"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
            node = node.parent

    # ---- freeing ---------------------------------------------------------------------------

    def evict(self, num_tokens: int) -> np.ndarray:
        """Removes least recently used unlocked leaves until at least num_tokens slots are freed
        (or nothing unlocked is left); returns the freed slots for the allocator."""
        heap = [(leaf.last_access, id(leaf), leaf) for leaf in self._leaves() if leaf.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[np.ndarray] = []
        count = 0
        while heap and count < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._child_key(leaf.key)]
            freed.append(leaf.value)
            count += len(leaf.key)
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return np.concatenate(freed) if freed else _EMPTY

    def reset(self) -> np.ndarray:
        """Empties the tree (nothing may be locked); returns every slot it held."""
        if self.protected_size:
            raise RuntimeError(f"{self.protected_size} cached tokens are in use by running requests")
        slots = [n.value for n in self._nodes() if n is not self.root]
        self.root.children = {}
        self.evictable_size = 0
        return np.concatenate(slots) if slots else _EMPTY

    # ---- introspection ---------------------------------------------------------------------

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _leaves(self) -> Iterator[TreeNode]:
        return (n for n in self._nodes() if not n.children and n is not self.root)

    def all_slots(self) -> np.ndarray:
        slots = [n.value for n in self._nodes() if n is not self.root]
        return np.concatenate(slots) if slots else _EMPTY

    def check(self) -> None:
        """Asserts the tree's invariants (tests): sizes, keys, locks."""
        evictable = protected = 0
        for node in self._nodes():
            if node is self.root:
                continue
            assert len(node.key) == len(node.value) > 0 and len(node.key) % self.page_size == 0
            assert node.parent.children[self._child_key(node.key)] is node
            assert node.lock_ref >= sum(c.lock_ref for c in node.children.values())
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert (evictable, protected) == (self.evictable_size, self.protected_size)


def common_prefix(key: list[int], tokens: list[int], pos: int = 0) -> int:
    """How many leading tokens of `key` equal tokens[pos:]."""
    n = min(len(key), len(tokens) - pos)
    if key[:n] == tokens[pos:pos + n]:
        return n
    i = 0
    while key[i] == tokens[pos + i]:
        i += 1
    return i
