"""Peak of the bytes held by live tensors on any device (the CPU has no allocator statistics).

:class:`LiveBytesTracker` is a ``TorchDispatchMode``: every storage that an operator returns is
counted when it first appears and released when torch frees it (a weak reference to the
storage, which torch keeps alive exactly as long as its memory), so ``peak_bytes`` is the peak of
memory allocated inside the block, as a caching allocator would report it without its slack.
Storages that existed before the block are not counted when they are named in ``exclude``
(parameters, inputs: an operator returning a view of one, e.g. a weight's transpose, would
otherwise count its storage as new). Autograd's
backward runs its operators through the same mode, so a forward+backward inside the block is
measured whole, recomputed checkpoints included.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytesTracker(TorchDispatchMode):
    """``with LiveBytesTracker() as t: ...`` then ``t.peak_bytes`` and ``t.current_bytes``."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.current_bytes = 0
        """Bytes of the storages created inside the block that are still alive."""
        self.peak_bytes = 0
        """Largest ``current_bytes`` seen."""
        self._live: dict[int, tuple[weakref.ref[Any], int]] = {}

    def _release(self, key: int, ref: weakref.ref[Any]) -> None:
        entry = self._live.get(key)
        if entry is not None and entry[0] is ref:
            del self._live[key]
            self.current_bytes -= entry[1]

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._live or key in self._exclude:
            return
        size = storage.nbytes()

        def release(r: weakref.ref[Any], k: int = key) -> None:
            self._release(k, r)

        ref = weakref.ref(storage, release)
        self._live[key] = (ref, size)
        self.current_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self._track(value)
        return out

    def reset_peak(self) -> None:
        """Start a new peak from the bytes live now."""
        self.peak_bytes = self.current_bytes

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        super().__exit__(exc_type, exc, tb)
