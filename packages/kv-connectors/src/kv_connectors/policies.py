"""Eviction policies of a fixed-capacity block store: LRU and ARC.

A policy tracks keys (block hashes) of resident blocks and picks victims; it never holds more than
``capacity`` resident keys. ``insert`` returns the keys it evicted to make room, or ``None`` when
no resident key may be evicted (every one is pinned by an in-flight copy): the caller then skips
storing that block, it never overfills.

ARC (Megiddo & Modha, FAST'03) keeps a recency list ``T1`` (seen once) and a frequency list
``T2`` (seen again), plus ghost lists ``B1``/``B2`` of recently evicted keys that steer the target
size ``p`` of ``T1``: a scan of one-time prefixes cannot flush the blocks that are reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Hashable

from kv_connectors.config import EvictionPolicy, check_int

__all__ = ["ARCPolicy", "LRUPolicy", "Policy", "make_policy"]

Key = Hashable
Evictable = Callable[[Key], bool]


class Policy(ABC):
    """Resident keys of a store of ``capacity`` blocks and the order they leave in."""

    def __init__(self, capacity: int, evictable: Evictable | None = None) -> None:
        check_int(type(self).__name__, "capacity", capacity, minimum=1)
        if evictable is not None and not callable(evictable):
            raise TypeError(
                f"{type(self).__name__}.evictable={evictable!r} must be a callable(key) -> bool "
                "or None"
            )
        self.capacity = capacity
        self._evictable: Evictable = evictable or (lambda _k: True)

    @abstractmethod
    def __contains__(self, key: Key) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def touch(self, key: Key) -> None:
        """A resident key was used (a hit)."""

    @abstractmethod
    def insert(self, key: Key) -> list[Key] | None:
        """Make ``key`` resident; return the evicted keys, or ``None`` if nothing could be evicted."""

    def insert_many(self, keys: list[Key]) -> tuple[int, list[Key]]:
        """:meth:`insert` each of ``keys`` in order until one cannot be: how many were inserted
        and every key evicted for them."""
        evicted: list[Key] = []
        for done, key in enumerate(keys):
            out = self.insert(key)
            if out is None:
                return done, evicted
            evicted += out
        return len(keys), evicted

    @abstractmethod
    def remove(self, key: Key) -> None:
        """Drop a resident key (its block was invalidated)."""

    @abstractmethod
    def resident(self) -> list[Key]:
        """Resident keys, next victim first."""

    def _pop_victim(self, lst: OrderedDict[Key, None]) -> Key | None:
        for key in lst:  # least recent first
            if self._evictable(key):
                del lst[key]
                return key
        return None


class LRUPolicy(Policy):
    """Least recently used goes first."""

    def __init__(self, capacity: int, evictable: Evictable | None = None) -> None:
        super().__init__(capacity, evictable)
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def touch(self, key: Key) -> None:
        self._order.move_to_end(key)

    def insert(self, key: Key) -> list[Key] | None:
        done, evicted = self.insert_many([key])
        return evicted if done else None

    def insert_many(self, keys: list[Key]) -> tuple[int, list[Key]]:
        # (insert is this of one key.) One loop with the victim search's common case inline
        # (the least recent key evictable): a saved request's few hundred inserts, a call each,
        # were most of request_finished's time
        order, cap, evictable = self._order, self.capacity, self._evictable
        evicted: list[Key] = []
        for done, key in enumerate(keys):
            if key in order:
                order.move_to_end(key)
                continue
            if len(order) >= cap:
                first = next(iter(order))
                if evictable(first):
                    del order[first]
                    victim: Key | None = first
                else:
                    victim = self._pop_victim(order)
                    if victim is None:
                        return done, evicted
                evicted.append(victim)
            order[key] = None
        return len(keys), evicted

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def resident(self) -> list[Key]:
        return list(self._order)


class ARCPolicy(Policy):
    """Adaptive replacement: recency (``T1``) vs frequency (``T2``), tuned by ghost hits."""

    def __init__(self, capacity: int, evictable: Evictable | None = None) -> None:
        super().__init__(capacity, evictable)
        self.p = 0.0  # target size of T1
        self.t1: OrderedDict[Key, None] = OrderedDict()
        self.t2: OrderedDict[Key, None] = OrderedDict()
        self.b1: OrderedDict[Key, None] = OrderedDict()
        self.b2: OrderedDict[Key, None] = OrderedDict()

    def __contains__(self, key: Key) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def touch(self, key: Key) -> None:
        if key in self.t1:
            del self.t1[key]
        else:
            del self.t2[key]
        self.t2[key] = None

    def _replace(self, in_b2: bool) -> Key | None:
        """Evict from T1 or T2 per ARC's rule into its ghost list; the other list if all pinned."""
        prefer_t1 = bool(self.t1) and (
            len(self.t1) > self.p or (in_b2 and len(self.t1) == int(self.p))
        )
        order = ((self.t1, self.b1), (self.t2, self.b2))
        for lst, ghost in order if prefer_t1 else order[::-1]:
            victim = self._pop_victim(lst)
            if victim is not None:
                ghost[victim] = None
                return victim
        return None

    def insert(self, key: Key) -> list[Key] | None:
        if key in self:
            self.touch(key)
            return []
        c = self.capacity
        in_b1, in_b2 = key in self.b1, key in self.b2
        if in_b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
        elif in_b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
        evicted: list[Key] = []
        if len(self) >= c:
            victim = self._replace(in_b2)
            if victim is None:
                return None
            evicted.append(victim)
        if in_b1 or in_b2:
            (self.b1 if in_b1 else self.b2).pop(key)
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()
        return evicted

    def _trim_ghosts(self) -> None:
        # |T1| + |B1| <= c and the directory (all four lists) <= 2c, as in the paper.
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while self.b2 and len(self) + len(self.b1) + len(self.b2) > 2 * c:
            self.b2.popitem(last=False)

    def remove(self, key: Key) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def resident(self) -> list[Key]:
        return list(self.t1) + list(self.t2)


def make_policy(
    policy: EvictionPolicy, capacity: int, evictable: Evictable | None = None
) -> Policy:
    if policy is EvictionPolicy.LRU:
        return LRUPolicy(capacity, evictable)
    return ARCPolicy(capacity, evictable)
