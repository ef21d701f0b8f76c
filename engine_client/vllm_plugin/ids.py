"""A stable positive ``lora_int_id`` per content id.

vLLM identifies a loaded adapter by ``lora_int_id`` (caches, slots): it must be > 0 and
unique per adapter within one engine. The id is the content id's leading 64 bits folded
into ``1 .. 2**31 - 1`` (kept within int32 in case an engine stores ids in such tensors),
so the same content gets the same id in every process and identical content shares its
loaded weights. Two content ids that fold to one id would make vLLM run the first one's
weights for the second, so a table remembers which content owns each id in this process
and gives a later colliding content the next free id (stable for the process's life).
"""

from __future__ import annotations

import threading

MAX_LORA_ID = 2**31 - 1


def derived_id(content_id: str) -> int:
    """The id a content id gets when nothing collides with it."""
    return int(content_id[:16], 16) % MAX_LORA_ID + 1


class IdTable:
    """content id -> lora_int_id, collision-free within the process. Thread-safe."""

    def __init__(self) -> None:
        self._by_content: dict[str, int] = {}
        self._owner: dict[int, str] = {}
        self._lock = threading.Lock()

    def id_for(self, content_id: str) -> int:
        with self._lock:
            got = self._by_content.get(content_id)
            if got is not None:
                return got
            i = derived_id(content_id)
            while i in self._owner:
                i = i % MAX_LORA_ID + 1
            self._by_content[content_id] = i
            self._owner[i] = content_id
            return i
