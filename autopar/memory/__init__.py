"""Chunked memory manager: parameters, gradients and optimizer states in chunks placed on device or host.

- :mod:`.layout`: packing parameters into chunks and choosing the chunk size;
- :mod:`.store`: :class:`ChunkStore` (placement, prefetch, ZeRO-3 gather / reduce-scatter), the
  :class:`MemoryTracker` and the :class:`CollectiveCounter`;
- :mod:`.adamw`: AdamW over whole flat chunks (:func:`chunk_adamw_step`, :class:`ChunkAdamW`);
- :mod:`.schedule`: :class:`ChunkScheduler`, hooks that gather and release chunks as a module runs;
- :mod:`.bench`: ``python -m autopar.memory bench``, the chunk AdamW against torch's AdamW.
"""

from autopar.memory.adamw import ChunkAdamW, chunk_adamw_step
from autopar.memory.layout import ChunkLayout, ParamSpec, Slot, choose_chunk_size, pack, packing_waste
from autopar.memory.schedule import ChunkScheduler
from autopar.memory.store import Chunk, ChunkStore, CollectiveCounter, MemoryTracker, Residence

__all__ = [
    "Chunk",
    "ChunkAdamW",
    "ChunkLayout",
    "ChunkScheduler",
    "ChunkStore",
    "CollectiveCounter",
    "MemoryTracker",
    "ParamSpec",
    "Residence",
    "Slot",
    "chunk_adamw_step",
    "choose_chunk_size",
    "pack",
    "packing_waste",
]
