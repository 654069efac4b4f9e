"""The collector kept off the heap an engine's startup built (``LLMEngine(freeze_gc=True)``).

Python's cyclic collector stops the world, and a pass over its oldest generation walks every
tracked object: after startup, the model's modules and parameters, the engine's state and every
import (~200k objects for a small model on this CPU). Those objects live as long as the engine,
and reference counting frees nearly all of the step loop's garbage, so such a pass finds almost
nothing and costs a step its length. Measured (``benchmarks/bench_gc.py``, this CPU's tiny
Llama, fresh serving processes, ``docs/benchmarks/gc_cpu.*``): one oldest-generation pause of
82-94 ms inside each 486-step run, 3 such passes freeing 30 objects in all; none once frozen.
The H200's DeepSeek-V3 mixed load had 2.9 ms of collection a step, 44 ms at most
(``docs/benchmarks/engine_gpu.md``).

:func:`freeze_startup_heap` collects once, then ``gc.freeze()`` moves every tracked object to
the permanent generation, as vLLM's engine core does after its startup. Younger generations are
still collected, so cycles the engine creates later are still reclaimed. Freezing is
process-wide: it lasts while any engine that froze is alive and ends (``gc.unfreeze()``) when
the last one is freed, so the frozen objects go back to the collector once nothing serves.
"""

from __future__ import annotations

import gc
import threading
import weakref

__all__ = ["freeze_startup_heap", "frozen_owners"]

_lock = threading.RLock()  # (re-entrant: a collection inside the lock may free an owner)
_owners = 0  # live objects that froze the heap


def freeze_startup_heap(owner: object) -> None:
    """Collect, then freeze the heap until ``owner`` (and every other owner) is freed."""
    global _owners
    gc.collect()
    with _lock:
        gc.freeze()
        _owners += 1
    weakref.finalize(owner, _release)


def _release() -> None:
    global _owners
    with _lock:
        _owners -= 1
        if _owners == 0:
            gc.unfreeze()


def frozen_owners() -> int:
    """How many live objects hold the heap frozen."""
    return _owners
