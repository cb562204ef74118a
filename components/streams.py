"""Side CUDA streams, one per (device, role), made once: a CUDA graph captured with one keeps replaying on it, so
it must outlive every capture. Roles keep unrelated work apart (the shared experts' GEMMs must not queue the
dispatcher's copies behind them)."""

import torch

_STREAMS: dict[tuple[int, str], torch.cuda.Stream] = {}


def side_stream(device: torch.device, role: str) -> torch.cuda.Stream:
    """The side stream of ``role`` on CUDA ``device`` (its current device when the index is unset)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, role)
    if key not in _STREAMS:
        _STREAMS[key] = torch.cuda.Stream(device=index)
    return _STREAMS[key]
