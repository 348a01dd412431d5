"""Checks that a module is freed by reference counting alone, with no garbage collector.

A module caught in a reference cycle (a back reference, a bound method or closure stored
on something it owns) keeps its device memory after ``del`` until Python's cyclic
garbage collector happens to run, e.g. in the middle of the next layer's load. Engines
that rebuild layers (weight reload, resharding) need that memory back at once.
"""

from __future__ import annotations

import gc
import weakref
from collections import Counter
from collections.abc import Callable

# Containers every cycle passes through: naming them says nothing about the culprit.
_PLAIN_CONTAINERS = frozenset({"dict", "list", "tuple", "set", "cell"})
_LISTED_TYPES = 12  # distinct object types named in the failure message


def assert_freed_without_gc(make: Callable[[], object], what: str) -> None:
    """Raise unless the object ``make()`` returns is freed as soon as it is dropped.

    The cyclic garbage collector is off while ``make()`` runs and its result is dropped,
    so only reference counting can free it; ``make`` should build the object and use it
    (load, finalize, forward) before returning it, and keep no reference to it.

    Args:
        make: builds and exercises the object; returns it (the only reference).
        what: the object, for the message.

    Raises:
        AssertionError: the object outlived its last reference; the message names the
            types of the objects found in reference cycles with it, most frequent first.
    """
    gc.collect()
    enabled, debug = gc.isenabled(), gc.get_debug()
    gc.disable()
    try:
        ref = weakref.ref(make())
        if ref() is None:
            return
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kinds = Counter(
            f"{type(obj).__module__}.{type(obj).__qualname__}"
            for obj in gc.garbage
            if type(obj).__name__ not in _PLAIN_CONTAINERS
        )
    finally:
        gc.set_debug(debug)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    listed = ", ".join(f"{name} x{count}" for name, count in kinds.most_common(_LISTED_TYPES))
    raise AssertionError(
        f"{what} outlived its last reference: it sits in a reference cycle, so its memory "
        f"waits for the garbage collector; objects in the cycles: {listed or 'none found'}; "
        "hold back references through weakref (or pass the owner to each call) instead"
    )
