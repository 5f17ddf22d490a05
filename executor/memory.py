"""Measure the activation memory autograd keeps, with saved-tensor hooks (CPU and GPU).

``ActivationMeter`` counts the bytes of every distinct storage autograd saves for backward
while it is active, and when each is released, so its ``peak_bytes`` is the peak of kept
activations over a forward+backward (including what checkpointed layers rematerialise in
backward). Tensors kept by a non-reentrant checkpoint as its inputs are counted through
:func:`keep_checkpoint_input`. Parameters are not activations and are not counted.
"""

from __future__ import annotations

import threading
from types import TracebackType
from typing import Any

import torch

_active: threading.local = threading.local()


class _Holder:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, tensor: torch.Tensor, key: tuple[int, int]) -> None:
        self.meter = meter
        self.tensor = tensor
        self.key = key

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Context manager: ``with ActivationMeter() as m: loss.backward()`` then ``m.peak_bytes``.

    Enter it before the forward and leave it after the backward.
    """

    def __init__(self) -> None:
        self.current_bytes = 0
        """Bytes kept now."""
        self.peak_bytes = 0
        """Largest ``current_bytes`` seen."""
        self._refs: dict[tuple[int, int], list[int]] = {}
        self._params: set[int] = set()
        self._hooks: Any = None

    def ignore_parameters(self, module: torch.nn.Module) -> ActivationMeter:
        """Do not count the parameters of ``module`` (saved by linear layers)."""
        self._params |= {p.untyped_storage().data_ptr() for p in module.parameters()}
        return self

    def _pack(self, tensor: torch.Tensor) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self._params or storage.nbytes() == 0:
            return tensor
        key = (ptr, storage.nbytes())
        entry = self._refs.get(key)
        if entry is None:
            self._refs[key] = [1, storage.nbytes()]
            self.current_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        else:
            entry[0] += 1
        return _Holder(self, tensor, key)

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Holder) else packed

    def _release(self, key: tuple[int, int]) -> None:
        entry = self._refs.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._refs[key]
            self.current_bytes -= entry[1]

    def __enter__(self) -> ActivationMeter:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        _active.meter = self
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        _active.meter = None
        self._hooks.__exit__(exc_type, exc, tb)


class _Keep(torch.autograd.Function):
    """Identity that saves its input, so the meter sees a checkpoint's kept input."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> torch.Tensor:
        return grads[0]


def keep_checkpoint_input(x: torch.Tensor) -> torch.Tensor:
    """Under an active meter, count ``x`` as kept until backward; otherwise return it as is."""
    if getattr(_active, "meter", None) is None or not x.requires_grad:
        return x
    out = _Keep.apply(x)
    assert isinstance(out, torch.Tensor)
    return out
