"""NumPy views of vLLM's persistent CPU buffers, made once per buffer instead of once per step.

The view builder reads three int64 prefixes a forward (input ids, positions, the layer's slot
mapping), each a slice of a buffer the model runner allocates once. A torch slice and `.numpy()`
cost about 2 µs each here; a cached NumPy view sliced in NumPy costs a tenth of that.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

_MAX_BUFFERS = 8  # distinct buffers cached at once; more means the runner reallocates: start over


class HostViews:
    """`prefix(t, n)` equals `t[:n].numpy()` for a 1-D CPU tensor `t`.

    The NumPy view of a buffer is kept by its data pointer, dtype and stride and reused while
    the tensor a step hands in starts at the same address and fits it. Holding the view holds
    the buffer's storage, so no other tensor can be given that address while it is cached.
    Anything else (a tensor on another device, 2-D, non-unit stride) takes the plain path.
    """

    def __init__(self) -> None:
        self._views: dict[tuple[int, torch.dtype, int], npt.NDArray[np.generic]] = {}

    def prefix(self, t: torch.Tensor, n: int) -> npt.NDArray[np.generic]:
        """`t[:n]` as a NumPy array sharing `t`'s memory."""
        if t.ndim != 1 or not t.is_cpu:
            return t[:n].numpy()
        n = min(n, t.shape[0])  # what `t[:n]` holds, whatever the cached view's length
        key = (t.data_ptr(), t.dtype, t.stride(0))
        view = self._views.get(key)
        if view is None or len(view) < n:
            if len(self._views) >= _MAX_BUFFERS:
                self._views.clear()
            view = self._views[key] = t.numpy()
        return view[:n]
