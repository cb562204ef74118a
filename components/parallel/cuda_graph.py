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
2. then copies the batch into static input buffers and captures one step into a graph (the CUDA
   RNG's seed/offset is registered by the capture itself, so random ops advance per replay);
3. replays the graph for every later step (copy inputs in, replay, return the static outputs).

The optimizer must be capturable (``make_capturable``): tensor learning rate (the scheduler fills
it in place), device step counters. When capture is impossible the wrapper says why once and
runs eagerly: a backend that sizes buffers on the host (``alltoall``, ``deepep``), no CUDA, or (one
process) an error raised while capturing, reported verbatim. A capture that fails in a multi-GPU run
stops the run with that error: the aborted capture holds FSDP's stream events, so no eager step
can follow it.
``invalidate()`` drops the graph (e.g. after capacities grew); the next calls warm up and
re-capture; ``after_replay(recapture)`` applies the run's policy after an overflow replay.
"""

import torch
import torch.distributed as dist

from components.debug import setup_work


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

    def after_replay(self, recapture: bool) -> None:
        """An overflowed step was replayed on the exact path (its capacity may have grown).
        ``recapture``: drop the graph and warm up again before capturing — also when nothing was
        captured yet: a grown capacity allocates its buffers (peer memory, pointer tables) on the
        first step that uses it, which must be an eager one. Otherwise run eagerly from now on."""
        if not self.active:
            return
        if recapture:
            self.invalidate()
        else:
            self.disable("an overflow was replayed on the exact path ([training] cuda_graph_after_replay = 'eager')")

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
            if dist.is_initialized() and dist.get_world_size() > 1:
                # FSDP's and the dispatchers' stream events were recorded inside the aborted
                # capture: an eager step would wait on them and fail with "invalid argument"
                raise RuntimeError(f"cuda graph: capture of the training step failed ({self.reason}); a "
                                   "multi-GPU step cannot continue eagerly after a failed capture — set "
                                   "[training] cuda_graph = false to train without graphs")
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
