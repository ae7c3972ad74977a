"""The stored responses (`store: true`): a bounded in-memory map, least recently used evicted first.

Each entry is a final Response, its input items (for GET /v1/responses/{id}/input_items) and the
conversation up to and including it (its previous responses' items, its input, its output), which a
later request's `previous_response_id` continues. Entries are keyed by the API key id that made them:
a key never sees another key's responses. At most `max_entries` are kept (`server.responses_store_max`);
storing one more evicts the least recently stored or read. Nothing survives a restart.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from izh.api.responses.protocol import ResponseObject

DEFAULT_MAX_ENTRIES = 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: ResponseObject
    input_items: list[dict[str, Any]]
    conversation: list[dict[str, Any]]
    """Every item of the conversation so far, this response's output included (instructions aside)."""


class ResponseStore:
    """Stored responses by (key id, response id), LRU-bounded to `max_entries` (0 stores nothing)."""

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 0:
            raise ValueError(f"max_entries must be >= 0, got {max_entries}")
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, key_id: str, entry: StoredResponse) -> None:
        if self.max_entries == 0:
            return
        key = (key_id, entry.response.id)
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, key_id: str, response_id: str) -> StoredResponse | None:
        key = (key_id, response_id)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def delete(self, key_id: str, response_id: str) -> bool:
        return self._entries.pop((key_id, response_id), None) is not None
