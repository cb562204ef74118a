"""Full-iteration CUDA graphs: forward + backward + clipping + optimizer step replayed as one graph.

    step = StepGraph(device_step, device, warmup=2, enabled=True, why_not=reason_or_None)
    outputs = step(inputs_BS, labels_BS)     # tensors; valid until the next call

``device_step(inputs, labels) -> pytree of tensors`` must be sync-free (no host read, no
host-dependent shapes) and keep every tensor it updates in place (optimizer state, router bias,
counters, the overflow flag). The wrapper:

1. runs the first ``warmup`` calls eagerly — real training steps, which also do the lazy work that
   must not be captured (Triton compiles, NCCL/symmetric-memory buffers, optimizer state, FSDP's
   lazy init). They run on the current stream, like every eager step: warm-up on a side stream
   made the v2lite_6b ECHO + nvlink step at EP=4 read corrupted grouped-GEMM offsets (cause not
   pinned down; it passed with CUDA_LAUNCH_BLOCKING=1, and with warm-up on the current stream);
2. then copies the batch into static input buffers and captures one call into a graph (the CUDA
   RNG's seed/offset is registered by the capture itself, so random ops advance per replay);
3. replays the graph for every later call (copy inputs in, replay, return the static outputs).

The optimizer must be capturable (``make_capturable``): tensor learning rate (the scheduler fills
it in place), device step counters. When capture is impossible the wrapper says why once and
runs eagerly: a backend that sizes buffers on the host (``alltoall``, ``deepep``), no CUDA, or an
error raised while capturing (reported verbatim; every rank then runs eagerly).
``invalidate()`` drops the graph (e.g. after capacities grew); the next calls warm up and
re-capture.
"""

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from components.moe_echo.symmetric import setup_work


class StepGraph:
    def __init__(self, step_fn, device: torch.device, warmup: int = 2, enabled: bool = True,
                 why_not: str | None = None, log=print):
        self.step_fn, self.device, self.warmup, self.log = step_fn, device, max(1, warmup), log
        self.reason = why_not if enabled else "disabled ([training] cuda_graph = false)"
        if self.reason is None and device.type != "cuda":
            self.reason = "no CUDA device"
        if enabled and self.reason is not None:
            log(f"cuda graph: off — {self.reason}; running eagerly")
        self.graph = None
        self.eager_calls = 0
        self.captures = 0

    @property
    def active(self) -> bool:
        return self.reason is None

    def invalidate(self) -> None:
        self.graph, self.eager_calls = None, 0

    def disable(self, reason: str) -> None:
        """Drop the graph and run eagerly from now on (says why once)."""
        if self.reason is None:
            self.reason = reason
            self.graph = None
            self.log(f"cuda graph: off from here — {reason}")

    def __call__(self, inputs_BS: torch.Tensor, labels_BS: torch.Tensor):
        if not self.active:
            return self.step_fn(inputs_BS, labels_BS)
        if self.graph is None:
            if self.eager_calls < self.warmup:
                self.eager_calls += 1
                return self.step_fn(inputs_BS, labels_BS)
            if not self._capture(inputs_BS, labels_BS):
                return self.step_fn(inputs_BS, labels_BS)
        self.inputs.copy_(inputs_BS, non_blocking=True)
        self.labels.copy_(labels_BS, non_blocking=True)
        self.graph.replay()
        return self.outputs

    def _capture(self, inputs_BS, labels_BS) -> bool:
        with setup_work():
            return self._capture_once(inputs_BS, labels_BS)

    def _capture_once(self, inputs_BS, labels_BS) -> bool:
        self.inputs, self.labels = inputs_BS.clone(), labels_BS.clone()
        torch.cuda.synchronize(self.device)  # once per capture, not per step
        graph, error = torch.cuda.CUDAGraph(), None
        try:
            with torch.cuda.graph(graph):
                outputs = self.step_fn(self.inputs, self.labels)
        except Exception as err:  # reported below; every rank falls back together
            error = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}"
        ok = torch.tensor([0.0 if error else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if float(ok) < 1:  # host read at capture time only
            self.reason = error or "capture failed on another rank"
            self.log(f"cuda graph: off — capture failed ({self.reason}); running eagerly")
            return False
        self.graph, self.outputs = graph, outputs
        self.captures += 1
        self.log(f"cuda graph: captured the training step (capture #{self.captures})")
        return True


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Tensor learning rates (LR schedulers fill them in place: no re-capture, no host read) and
    device step counters. Call after the scheduler is built and any checkpoint is loaded."""
    for group in optimizer.param_groups:
        group["capturable"] = device.type == "cuda"  # torch supports capturable optimizers on GPUs only
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)
    for state in optimizer.state.values():
        if "step" in state and isinstance(state["step"], torch.Tensor):
            state["step"] = state["step"].to(device=device, dtype=torch.float32)


class PinnedRing:
    """Pinned host buffers reused round-robin per (shape, dtype), so that a steady-state step
    allocates no pinned memory (nothing of ours can land on host memory a captured graph staged
    from). ``take`` hands out the least recently used buffer of a key, first waiting for the copy
    that last used it (``done``: an event recorded after that copy; normally long complete)."""

    def __init__(self, depth: int = 32):
        self.depth = depth
        self.pinned = torch.cuda.is_available()  # plain host memory on CPU-only machines (tests)
        self.slots: dict[tuple, list] = {}  # key -> [next index, [(buffer, event or None)] * depth]

    def take(self, shape, dtype) -> tuple[torch.Tensor, int, tuple]:
        key = (tuple(shape), dtype)
        if key not in self.slots:  # all at once: later steps allocate nothing
            self.slots[key] = [0, [[torch.empty(shape, dtype=dtype, pin_memory=self.pinned), None]
                                   for _ in range(self.depth)]]
        entry = self.slots[key]
        i = entry[0] % self.depth
        entry[0] += 1
        buf, event = entry[1][i]
        if event is not None and not event.query():
            event.synchronize()  # only when the host got `depth` copies ahead of the device
        return buf, i, key

    def done(self, key: tuple, i: int, event) -> None:
        self.slots[key][1][i][1] = event


_ring = PinnedRing()


def to_device_async(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor → device without a host wait (staged through a reused pinned buffer)."""
    if device.type != "cuda":
        return x.to(device)
    buf, i, key = _ring.take(x.shape, x.dtype)
    buf.copy_(x)
    out = buf.to(device, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    _ring.done(key, i, event)
    return out


class HostCopy:
    """A pytree of device tensors copied to pinned host memory without waiting; ``get()`` waits for
    that copy only (an event recorded right after it), never for work queued later. The pinned
    buffers come from a ring (``PinnedRing``): a copy's values stay valid for ``depth`` (32) later
    copies of the same shape and dtype — a few steps' worth; callers read them one step late."""

    def __init__(self, tree):
        taken = []

        def copy(t):
            if not isinstance(t, torch.Tensor):
                return t
            if not t.is_cuda:
                return t.detach().clone()
            host, i, key = _ring.take(t.shape, t.dtype)
            taken.append((key, i))
            return host.copy_(t.detach(), non_blocking=True)

        self.tree = tree_map(copy, tree)
        self.event = None
        if taken:
            self.event = torch.cuda.Event(enable_timing=True)  # also times the step (GPU timeline)
            self.event.record()
            for key, i in taken:
                _ring.done(key, i, self.event)

    def get(self):
        if self.event is not None:
            self.event.synchronize()
        return self.tree

    def seconds_since(self, earlier: "HostCopy") -> float | None:
        """GPU-timeline seconds from ``earlier``'s copy to this one (both done: call after ``get``);
        None without CUDA events."""
        if self.event is None or earlier is None or earlier.event is None:
            return None
        return earlier.event.elapsed_time(self.event) / 1000
