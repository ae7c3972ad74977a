"""LoraManager: the engine core's LoRA adapters: registered by name, resident in slots, mapped per step.

Each registration gets a fresh id (a name unloaded and loaded again is another adapter: its prefix-cache
entries and slot are not the old one's). Requests hold their adapter by id: unloading a name while
requests still use it only takes the name away, and the weights go when the last of them ends.

The model holds `max_loras` adapters at once (izh.model.lora's slots). The scheduler admits a request only
while the running requests use at most `max_loras` distinct adapters (izh.engine.scheduler), so before
each step `prepare` can always give every scheduled adapter a slot: one it already has, a free one, or
the least recently used slot whose adapter no running request uses (LRU eviction of inactive adapters).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from izh.engine.scheduler import ScheduledRequest
from izh.errors import LoraAdapterError, ModelNotFound
from izh.model.config import ModelConfig
from izh.model.lora import LoraAdapter, LoraModel, load_peft_adapter

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedAdapter:
    """What the frontend learns of a loaded adapter."""

    name: str
    path: str
    rank: int
    lora_id: int


class LoraManager:
    """Adapters by name and id, their slots in `lora_model`, and each step's token-to-slot map."""

    def __init__(self, lora_model: LoraModel, model_config: ModelConfig) -> None:
        self.lora_model = lora_model
        self.model_config = model_config
        self.max_loras = lora_model.num_slots
        self.max_lora_rank = lora_model.max_rank
        self._adapters: dict[int, LoraAdapter] = {}
        """By id: registered ones, and unloaded ones that requests still use."""
        self._ids: dict[str, int] = {}
        """Registered names -> id."""
        self._refs: Counter[int] = Counter()
        """Unfinished requests per adapter id."""
        self._slots: list[int | None] = [None] * self.max_loras
        """The adapter id in each slot."""
        self._last_used: list[int] = [0] * self.max_loras
        self._clock = 0
        self._next_id = 1
        self.num_slot_loads = 0
        """Adapters copied into a slot so far (each eviction costs one)."""

    # --- registration ---------------------------------------------------------------------------

    def add(self, name: str, path: str) -> LoadedAdapter:
        """Read and register the adapter at `path` as `name` (LoraAdapterError: a 400 saying why not)."""
        if not name or name.strip() != name:
            raise LoraAdapterError(f"bad LoRA adapter name {name!r}", param="lora_name")
        if name in self._ids:
            raise LoraAdapterError(f"a LoRA adapter named {name!r} is already loaded", param="lora_name")
        adapter = load_peft_adapter(
            name, str(Path(path).resolve()), self.model_config, max_rank=self.max_lora_rank
        )
        lora_id = self._next_id
        self._next_id += 1
        self._adapters[lora_id] = adapter
        self._ids[name] = lora_id
        logger.info(
            "LoRA adapter %s loaded from %s (r=%d, %s)", name, path, adapter.rank, adapter.target_modules
        )
        return LoadedAdapter(name, adapter.path, adapter.rank, lora_id)

    def remove(self, name: str) -> None:
        """Unregister `name` (ModelNotFound when it is not loaded); its weights stay while requests use them."""
        lora_id = self._ids.pop(name, None)
        if lora_id is None:
            raise ModelNotFound(f"the LoRA adapter {name!r} is not loaded", param="lora_name")
        if not self._refs[lora_id]:
            self._drop(lora_id)
        logger.info("LoRA adapter %s unloaded", name)

    def loaded(self) -> list[LoadedAdapter]:
        return [
            LoadedAdapter(name, self._adapters[i].path, self._adapters[i].rank, i)
            for name, i in self._ids.items()
        ]

    def _drop(self, lora_id: int) -> None:
        del self._adapters[lora_id]
        self._refs.pop(lora_id, None)
        for slot, held in enumerate(self._slots):
            if held == lora_id:
                self._slots[slot] = None  # its weights stay in the buffers until the slot is reused

    # --- requests -------------------------------------------------------------------------------

    def acquire(self, name: str) -> int:
        """The id of the adapter `name` for a new request, held until `release` (404 when not loaded)."""
        lora_id = self._ids.get(name)
        if lora_id is None:
            raise ModelNotFound(f"the LoRA adapter {name!r} is not loaded", param="model")
        self._refs[lora_id] += 1
        return lora_id

    def release(self, lora_id: int) -> None:
        self._refs[lora_id] -= 1
        if self._refs[lora_id] <= 0:
            del self._refs[lora_id]
            if lora_id not in self._ids.values():
                self._drop(lora_id)

    def name_of(self, lora_id: int) -> str:
        return self._adapters[lora_id].name

    # --- steps ----------------------------------------------------------------------------------

    def prepare(
        self, scheduled: list[ScheduledRequest], running_ids: Iterable[int]
    ) -> list[ScheduledRequest] | None:
        """Put every adapter of the step in a slot and group the step's tokens by slot for the model.
        `running_ids`: the adapters of every running request (their slots are never taken). Returns None
        when the step has no adapter tokens; else the step's requests in the order the runner must batch
        them: the base model's first, then by slot (so that a decode step's adapter tokens lie in equal,
        consecutive segments the deltas read in place). Call `finish` after the forward."""
        if not any(s.request.lora_id for s in scheduled):
            self.lora_model.clear_batch()
            return None
        protected = set(running_ids)
        self._clock += 1
        slot_of: dict[int, int] = {}
        for s in scheduled:
            lora_id = s.request.lora_id
            if lora_id and lora_id not in slot_of:
                slot_of[lora_id] = self._slot_for(lora_id, protected | set(slot_of))
        ordered = sorted(scheduled, key=lambda s: slot_of.get(s.request.lora_id, -1))
        segments = [(slot_of.get(s.request.lora_id, -1), s.num_scheduled_tokens) for s in ordered]
        ranks = [self._adapters[i].rank if i is not None and i in self._adapters else 0 for i in self._slots]
        self.lora_model.set_batch(segments, ranks)
        return ordered

    def _slot_for(self, lora_id: int, protected: set[int]) -> int:
        """The slot holding `lora_id`, loading it into a free or the least recently used unprotected one."""
        slots = self._slots
        if lora_id in slots:
            slot = slots.index(lora_id)
        else:
            free = [i for i, held in enumerate(slots) if held is None]
            if free:
                slot = free[0]
            else:
                candidates = [i for i, held in enumerate(slots) if held not in protected]
                if not candidates:  # the scheduler's max_loras bound makes this impossible
                    raise RuntimeError(f"no LoRA slot free for adapter {lora_id}: slots hold {slots}")
                slot = min(candidates, key=self._last_used.__getitem__)
                logger.debug("LoRA slot %d: evicting adapter %s", slot, slots[slot])
            self.lora_model.set_slot(slot, self._adapters[lora_id])
            slots[slot] = lora_id
            self.num_slot_loads += 1
        self._last_used[slot] = self._clock
        return slot

    def finish(self) -> None:
        self.lora_model.clear_batch()
