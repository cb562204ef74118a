"""The routed experts over token chunks, communication beside compute (``[moe_echo] overlap_chunks``).

    x_TD, ids_TK, w_TK ─split in C chunks of T / C tokens─►
        comm stream:  D0  D1  [E0] C0  D2  [E1] C1  D3 ...          (Di: dispatch of chunk i, Ci: its combine)
        main stream:      [D0] E0  [D1] E1  [D2] E2 ...              (Ei: the experts on chunk i)
    ─► y_TD = cat(C0, C1, ...)

[X] is a wait on an event recorded after X on the other stream: the experts of chunk i start when its
dispatch is done, its combine when its experts are, so chunk i + 1's dispatch and chunk i − 1's combine run
while the experts compute chunk i. Autograd runs each backward op on the stream its forward ran on, so the
backward overlaps the same way (the combines' backward, a dispatch, beside the experts' weight-gradient GEMMs).

Every chunk is an ordinary dispatch of T / C tokens: capacities are sized per chunk, overflow and the
capacity it needed are counted per chunk into the layer's buffers (the step gate replays as before), and the
result equals the layer's one dispatch wherever neither overflows. ECHO's plan covers the whole layer (it is
made once, before the split) and every chunk moves its share of each clone's quota (``planner.rewrite``), so
each chunk's ranks are as level as the layer's; its clone weights are fetched once and shared by the chunks (their gradients
sum over the chunks before going home). No host read is added, and the stream fork and join are event waits,
so the step stays capturable. A dispatcher with per-layer buffers cannot have two dispatches of a layer alive
at once: those marked ``reentrant`` (no such buffers) are split as they are, ``nvlink`` through a
``chunk_view(i)`` per chunk (buffers of its own), ``deepep`` not at all.
"""

import contextlib

import torch

from components.errors import UserError
from components.streams import side_stream


AUTO_CHUNKS = 2  # overlap_chunks = "auto" where the dispatcher's ``overlap_from_ep`` says splitting pays


def _in_flight_twice(dispatcher) -> bool:
    """True where two chunks of a layer can be dispatched at once: no per-layer buffers, or a view per chunk."""
    return dispatcher.reentrant or hasattr(dispatcher, "chunk_view")


def _can_split(cfg, dispatcher) -> bool:
    return _in_flight_twice(dispatcher) and not cfg.gathered_experts and not cfg.echo_recompute


def chunks_for(cfg, dispatcher, tokens: int, echo: bool) -> int:
    """How many chunks a layer of ``tokens`` tokens goes in: ``overlap_chunks``, at most ``tokens``; ``"auto"``:
    2 where the layer can split and the dispatcher spans at least its ``overlap_from_ep`` ranks (``hierarchical``:
    always; ``nvlink``: EP >= 4 with ECHO on, ``echo`` saying whether the layer runs it), else 1; 1 where nothing
    crosses GPUs."""
    chunks = cfg.overlap_chunks
    if not dispatcher.communicates:
        return 1
    if chunks == "auto":
        start = dispatcher.overlap_from_ep
        splits = (0 < start <= getattr(dispatcher, "ep_size", 1) and (echo or not dispatcher.overlap_needs_echo)
                  and _can_split(cfg, dispatcher))
        chunks = AUTO_CHUNKS if splits else 1
    return max(1, min(chunks, tokens))


def check_overlap(cfg, dispatcher) -> None:
    """One-line error where ``[moe_echo] overlap_chunks`` cannot apply to this layer (``cfg``: MoEEchoConfig)."""
    chunks = cfg.overlap_chunks
    if chunks == "auto":
        return
    if chunks < 1:
        raise UserError(f"[moe_echo] overlap_chunks = {chunks}: must be >= 1 (1: no split)")
    if chunks == 1 or not dispatcher.communicates:
        return
    fix = "set overlap_chunks = 1"
    if not _in_flight_twice(dispatcher):
        raise UserError(f"[moe_echo] overlap_chunks = {chunks} needs a dispatcher that can have chunks in flight "
                        f"('nvlink', 'padded', 'hierarchical' or 'alltoall'; this run's is "
                        f"{type(dispatcher).__name__}); choose one of them or {fix}")
    if cfg.gathered_experts:
        raise UserError(f"[moe_echo] overlap_chunks = {chunks} does not apply to gathered_experts = true; {fix}")
    if cfg.echo_recompute:
        raise UserError(f"[moe_echo] overlap_chunks = {chunks} does not combine with echo_recompute = true "
                        f"(the chunks share one fetch of the clone weights); {fix}")


class _FetchedOnce:
    """ECHO's clones (``echo.EchoClones``) as the chunks of one layer ask for them: ``extend(w, i, out)`` and
    ``extend.slot_gradients(w, i)`` made by the first call for weight i and returned again after, so the chunks
    share one fetch of the clones and one pull of their gradients; every other attribute (``fp8_weights``, which
    the clones make once themselves) is the clones' own, present only where they have it."""

    def __init__(self, extend):
        self._extend, self._done = extend, {}

    def _once(self, key, make):
        if key not in self._done:
            self._done[key] = make()
        return self._done[key]

    def __call__(self, w, i, out=None):
        return self._once(("weights", i), lambda: self._extend(w, i, out))

    def __getattr__(self, name):
        attr = getattr(self._extend, name)
        if name == "slot_gradients":
            return lambda w, i=0: self._once(("slot_gradients", i), lambda: attr(w, i))
        return attr


def fetched_once(extend):
    """``extend`` (ECHO's clones, or None) for the chunks of one layer (``_FetchedOnce``)."""
    return None if extend is None else _FetchedOnce(extend)


def pipelined_routed(dispatcher, experts, count, x_TD, ids_TK, w_TK, chunks: int, extend=None,
                     beside=None) -> torch.Tensor:
    """The routed experts' y_TD [T, D] as dispatch -> experts -> combine over ``chunks`` token chunks.

    ``experts(x_ND, counts_e, extend, fp8_rows) -> y_ND`` and ``count(handle)`` (overflow bookkeeping) are the
    layer's (``fp8_rows``: the chunk's handle's, ``row_ops.Fp8Rows`` or None);
    on CUDA, dispatch and combine run on the ``moe_comm`` side stream (on CPU: in order, one stream).
    ``beside`` (two callables): work for the current stream at the pipeline's two ends, where it has nothing
    else to do: the first is issued while chunk 0 is dispatched, the second while the last chunk is combined
    (autograd runs their backward beside those ops' backward the same way)."""
    xs, ids, ws = x_TD.chunk(chunks), ids_TK.chunk(chunks), w_TK.chunk(chunks)
    view = getattr(dispatcher, "chunk_view", None)
    ds = [view(i) if view is not None else dispatcher for i in range(len(xs))]
    extend = fetched_once(extend)
    comm = side_stream(x_TD.device, "moe_comm") if x_TD.is_cuda else None
    main = torch.cuda.current_stream(x_TD.device) if comm is not None else None
    on_comm = (lambda: torch.cuda.stream(comm)) if comm is not None else contextlib.nullcontext
    if comm is not None:  # fork: the inputs are ready; their memory stays theirs until comm is done with it
        comm.wait_stream(main)
        for t in (x_TD, ids_TK, w_TK):
            t.record_stream(comm)

    def dispatched(i):
        with on_comm():
            x_ND, counts_e, handle = ds[i].dispatch(xs[i], ids[i], ws[i])
            count(handle)
            done = _event(comm)
        return x_ND, counts_e, handle, done

    ys, nxt = [], dispatched(0)
    if beside is not None:
        beside[0]()
    for i in range(len(xs)):
        x_ND, counts_e, handle, done = nxt
        if i + 1 < len(xs):
            nxt = dispatched(i + 1)
        if comm is not None:
            main.wait_event(done)
            x_ND.record_stream(main)
            counts_e.record_stream(main)
        y_ND = experts(x_ND, counts_e, extend, handle.fp8_rows)
        computed = _event(main)
        with on_comm():
            if comm is not None:
                comm.wait_event(computed)
                y_ND.record_stream(comm)
            ys.append(ds[i].combine(y_ND, handle))
    if beside is not None:
        beside[1]()
    if comm is not None:  # join
        main.wait_stream(comm)
        for y in ys:
            y.record_stream(main)
    return torch.cat(ys) if len(ys) > 1 else ys[0]


def _event(stream):
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev
