"""Hooks that do not keep their owner alive.

Note: a hook stored on a tensor lives in C++, where Python's garbage collector cannot see
it. A hook that refers (even indirectly) to the tensor it is registered on therefore forms
a cycle that is never collected, and the model leaks with its optimizer. Module hooks that
refer to their owner form cycles the collector does find, but only later: until then the
optimizer keeps its process group alive, and one still alive when the interpreter shuts
down can abort it. Every hook ZeroOptimizer registers therefore holds only a weak
reference to its owner plus plain data (indices).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable


def weak_hook(method: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``method(*args, *hook_args)`` while ``method``'s object is alive, a no-op after."""
    owner = weakref.ref(method.__self__)
    func = method.__func__

    def hook(*hook_args: Any) -> Any:
        obj = owner()
        return None if obj is None else func(obj, *args, *hook_args)

    return hook
