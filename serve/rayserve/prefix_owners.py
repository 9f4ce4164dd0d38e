"""Which replica holds a prompt's prefix: the router's memory (router.py), as plain data.

Each replica's prefix cache holds the KV of the prompts it served, by blocks of tokens; the router cannot see
tokens (the ingress does not tokenize), so it keys on text the same way: a prompt's text cut in blocks of
`block` characters, each prefix (the first block, the first two, ...) hashed and mapped to the replica that took
the last request starting with it. A new request goes to the owner of its longest known prefix: a shared system
prompt or a conversation's earlier turns. Prefixes shorter than a block are not worth a cache's lookup and have
no owner; the table forgets its oldest entries past `capacity`, and a dead replica's at once.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection

from refusion.runtime.core.errors import RefusionError

ROUTED: dict[str, Callable[[], list[str]]] = {}  # an application's replicas now, by its router in this process


def replicas_of(app_name: str) -> list[str]:
    """The replicas this process's router for `app_name` routes to ([] before the router's first request)."""
    routed = ROUTED.get(app_name)
    return routed() if routed is not None else []


class PrefixOwners:
    def __init__(self, block: int = 64, capacity: int = 1 << 16):
        if block < 1 or capacity < 1:
            raise RefusionError(f"PrefixOwners(block={block!r}, capacity={capacity!r}): both must be >= 1.")
        self.block, self.capacity = block, capacity
        self._owner: OrderedDict[int, str] = OrderedDict()  # a prefix's hash -> its replica, oldest first

    def _keys(self, text: str) -> list[int]:
        """The hashes of the text's whole-block prefixes, shortest first."""
        keys, key = [], 0
        for start in range(0, len(text) - self.block + 1, self.block):
            key = hash((key, text[start:start + self.block]))
            keys.append(key)
        return keys

    def owner(self, text: str, live: Collection[str]) -> str | None:
        """The live replica that took the longest prefix of `text` last, or None."""
        for key in reversed(self._keys(text)):
            replica = self._owner.get(key)
            if replica is not None and replica in live:
                return replica
        return None

    def record(self, text: str, replica: str) -> None:
        """`replica` took a request whose prompt is `text`: it owns each of its prefixes now."""
        for key in self._keys(text):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)

    def forget(self, replica: str) -> None:
        """A replica that died: its cache died with it."""
        for key in [key for key, owner in self._owner.items() if owner == replica]:
            del self._owner[key]

    def __len__(self) -> int:
        return len(self._owner)
