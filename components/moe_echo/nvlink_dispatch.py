"""``nvlink`` dispatcher: each token crosses NVLink once per rank that holds any of its experts.

R ranks, X = R·e ids (e = local experts, echo slots included), T tokens per rank (the same on every
rank), K choices. Each token moves once per destination rank, not once per (token, choice): the
owner expands it into its experts' rows locally and, in combine, sums its experts' weighted outputs
for the token before the sum crosses back (as DeepEP's and HybridEP's intranode kernels do). At
K=6 over 2 ranks that is ~3× fewer bytes on the wire than one row per choice.

Per MoE layer every rank holds, in symmetric memory (``symmetric.py``):

    counts   [R, X]      row s = rank s's routed rows per id (each rank writes its row everywhere)
    tok      [R·T, D]    row s·T + t = source s's token t (dispatch), then this rank's weighted sum of
                         its experts' outputs for that token (combine)
    meta_row [R·T, K]    row s·T + t = where each choice of source s's token t lands in ``x`` (-1: not here)
    meta_w   [R·T, K]    its routing weights
    x        [N_cap, D]  expert-major rows (expert j's rows from source 0, then source 1, ...),
                         N_cap = round_up(capacity_factor · T · K, 128); local, filled from ``tok``
and, shared by all layers, the backward's token-row gradients (``grad_tok`` [R·T, D]), ``grad_y``
[N_cap, D] and ``grad_w`` [R·T, K].

    dispatch:  slot ranks + counts ─write counts to all peers─► barrier ─► layout tail ─► meta rows to the
               ranks the tokens go to ─► token rows there ─► barrier ─► local expand tok → x   (kernels.route_layout)
    combine:   tok[s·T+t] = Σ_k w · y[row] (owner, local) ─► barrier ─► y_TD[t] = Σ_r peer_r tok[s·T+t]
    backward:  combine: g[t] to every rank t went to ─► barrier ─► owner: grad_y[row] = w · g,
               grad_w = <g, y[row]> ─► barrier ─► sources read their grad_w
               dispatch: grad_tok[s·T+t] = Σ_k grad_x[row] (owner) ─► barrier ─► Σ_r peer rows

With ``wire = "fp8"`` (``[moe_echo] dispatch_precision``) the rows sent toward the experts (the tokens, and in
backward the output gradients) cross as e4m3 + a power-of-two scale per 128 columns, padded to ``WIRE_ALIGN``
bytes (2112 bytes a row of 2048 instead of 4096), into a wire buffer beside ``tok`` / ``grad_tok``. After the
barrier the kernels that read those rows read the wire instead, dequantising on the way: the local expand into
expert rows, and the combine's backward (gathered experts: the wire rows are dequantised into ``tok`` /
``grad_tok`` first). Sums and gradients sent back stay in bf16.

With ``fp8_rows`` (FP8 experts) the kernels that write the expert rows also write them as FP8 rows (one
power-of-two scale per row, ``kernels.fp8.quant_rows`` bit for bit) and hand them to the experts through
``handle.fp8_rows``: the local expand (x) and the combine's backward (the experts' output gradient). The experts
then quantise neither [N, D] tensor themselves. Where the experts read nothing else (``fp8_plain`` False: FP8
weight gradients) those kernels write the FP8 rows alone, and the [N, D] bf16 tensors handed over are stand-ins of
their shape: 2 bytes an element less for each kernel to write.

What moves the token rows (``copies``, ``[moe_echo] nvlink_copy``):
    ``copy_engine``: the copy engines, no SM. A send copies the whole [T, D] block into rows s·T.. of
        every rank (rows of tokens that go nowhere there cross too and are never read: their meta rows are -1).
        A sum-back has the owner sum the peers' tokens first; after the barrier the copy engines pull block s of
        every peer's sums into a local staging [R·T, D] on a side stream while the SMs sum this rank's own
        tokens, then one local pass adds the blocks (the same fp32 sums, in the same rank order, as the kernel).
    ``kernel`` (default): Triton kernels on ``programs`` CTAs write each row only into, and read its sums only
        from, the ranks the token goes to.

No host read anywhere (counts, offsets and overflow stay on the device); every shape comes from
the capacity, so the step can be captured in a CUDA graph. Assignments that do not fit are not
sent and are counted in ``handle.dropped`` — the training loop gates the step and replays it (never
a silent drop). Buffer reuse is race-free: a layer's buffers are rewritten one full step later
(``tok`` within a step too, by its owner, after every peer's write into it passed a barrier); each
source only writes and reads its own region s·T.. of a peer's shared buffers, and each shared
backward buffer is rewritten only after a barrier that every reader of its previous contents has passed.
"""

import contextlib
import copy
import functools
import itertools
from dataclasses import dataclass

import torch

from components.streams import side_stream
from components.tensors import shape_only
from kernels.fp8 import FP8, dequant_blocks, quant_rows
from kernels.moe_rows import _use_triton, combine_backward, gather_sum
from kernels.peer_rows import peer_gather_sum, peer_route_meta, peer_scatter, use_triton
from kernels.route_layout import layout_tail, slot_ranks

from .comm import WIRE_BLOCK, fp8_parts, fp8_rows, wire_scales
from .dispatcher import DispatchHandle, ExpertParallel, FixedCapacity, capacity_rows
from .row_ops import Fp8Rows
from .symmetric import SymmBuffer, workspace_for

_instance_ids = itertools.count()
WIRE_ALIGN = 64  # bytes of an fp8 wire row are a multiple of this: the copy kernels move its 4-byte words in 16-byte
# vectors (Triton specialises row widths divisible by 16 words)


def fp8_wire_bytes(D: int) -> int:
    """Bytes a token row of width D crosses as on the fp8 wire: e4m3 values, a 4-byte scale per 128, padding."""
    return -(-(D + 4 * wire_scales(D)) // WIRE_ALIGN) * WIRE_ALIGN


def nvlink_capacity(num_tokens: int, top_k: int, capacity_factor: float) -> int:
    """Receive rows per rank: round_up(ceil(capacity_factor · T · K), 128)."""
    return capacity_rows(capacity_factor, num_tokens * top_k, 128)


@functools.lru_cache(maxsize=None)
def _to_all_peers(R: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """([1, R] = r, [1, R] = rank): one row sent to every peer, at row ``rank`` there (made once)."""
    to_all = torch.arange(R, device=device).view(1, R)
    return to_all, torch.full_like(to_all, rank)


def all_gather_rows(ws, name: str, row_X: torch.Tensor) -> torch.Tensor:
    """[R, X]: every rank's ``row_X`` (this rank writes its row into every peer's buffer; one
    device barrier). The buffer is per name, rewritten one full step later."""
    R, X, dev = ws.world, row_X.shape[0], row_X.device
    buf = ws.buffer(name, (R, X), row_X.dtype, dev)
    to_all, at_row = _to_all_peers(R, ws.rank, dev)
    peer_scatter(row_X.view(1, X), to_all, at_row, buf.ptrs_R, buf.peers, programs=R)
    ws.barrier(buf)
    return buf.local.clone()


@dataclass
class NVLinkHandle(DispatchHandle):
    rank_TK: torch.Tensor
    row_TK: torch.Tensor
    rank_TR: torch.Tensor  # token routes: [T, R] = r, and the row in r's ``tok`` (-1: t goes nowhere on r)
    row_TR: torch.Tensor
    w_TK: torch.Tensor
    out_dtype: torch.dtype
    x_dtype: torch.dtype
    meta_row: SymmBuffer  # [R·T, K] int32: where source s's token t's choices land here (-1: not here)
    meta_w: SymmBuffer  # [R·T, K]: their routing weights
    tok: SymmBuffer  # [R·T, D]: received tokens (dispatch), then this rank's partial sums (combine)
    stage_row_TR: torch.Tensor | None = None  # copy-engine pull: row r·T + t of the staging (-1 where row_TR is)


class NVLinkDispatcher(FixedCapacity, ExpertParallel):
    """Sync-free dispatch over peer memory (NVLink); ``programs`` = CTAs (≈ SMs) the copy kernels use."""

    LOCAL_PROGRAMS = 4096  # CTAs of the kernels that only touch this rank's memory (expand, sums)
    # overlap_chunks = "auto": 2 chunks from EP=4 on with ECHO (v2lite_1b at EP=4 on 4xH200: 1.01x the unsplit
    # step, twice). Without ECHO the ranks wait for the busiest one and the split only adds kernel time (0.99x); at
    # EP=2 the copy kernels lose more SM time than the split hides (0.985-0.99x)
    overlap_from_ep, overlap_needs_echo = 4, True
    # echo = "auto": ECHO from EP=4 on (v2lite_1b natural routing, 4xH200: 1.00-1.04x, rank load 1.6 -> 1.0); at
    # EP=2 0.99-1.03x
    echo_from_ep = 4

    def __init__(self, num_experts: int, group, ep_size: int, capacity_factor: float, programs: int = 32,
                 workspace=None, name: str | None = None, block_t: int | None = None, copies: str = "kernel",
                 fp8_rows: bool = False, fp8_plain: bool = True):
        ExpertParallel.__init__(self, num_experts, group, ep_size)
        FixedCapacity.__init__(self, capacity_factor)
        self.programs = programs
        self.block_t = block_t  # tokens per CTA iteration of the peer kernels (None: kernels.peer_rows.peer_block_t)
        if copies not in ("copy_engine", "kernel"):
            raise ValueError(f"[moe_echo] nvlink_copy = {copies!r}: use 'copy_engine' or 'kernel'")
        self.copies = copies  # what moves token rows, their sums and gradients across ranks (``nvlink_copy``)
        self.fp8_rows = fp8_rows  # FP8 experts: hand them the expert rows and their gradient as FP8 rows too
        # False: the experts read the FP8 rows alone (FP8 weight gradients), so on the kernels the bf16 rows are
        # not written (stand-ins of their shape are handed over: ``Fp8Rows.plain``)
        self.fp8_plain = fp8_plain
        self.ws = workspace if workspace is not None else workspace_for(group)
        self.rank = self.ws.rank
        # buffer names must agree across ranks: layers are built in the same order on every rank
        self.name = name or f"nvlink{next(_instance_ids)}"

    def chunk_view(self, i: int) -> "NVLinkDispatcher":
        """This dispatcher with buffers of its own for token chunk ``i`` of a pipelined layer (``overlap_chunks``:
        the chunks of one layer are in flight at once): its forward buffers, and the backward buffers the layers
        share, one set per chunk index (a chunk's output gradient stays in one until its experts' backward has
        read it, while the other chunks' combines run their backward)."""
        if i == 0:
            return self
        view = copy.copy(self)
        view.name, view.chunk = f"{self.name}/chunk{i}", i
        return view

    chunk = 0  # chunk_view's index: which set of the layers' shared backward buffers this one uses

    def _shared(self, role: str, shape: tuple, dtype, device) -> SymmBuffer:
        return self.ws.buffer(f"{self._shared_name(role)}/{'x'.join(map(str, shape))}/{dtype}", shape, dtype, device)

    def _shared_name(self, role: str) -> str:
        """The name prefix of a buffer the layers share (one per chunk index)."""
        return f"shared/{f'chunk{self.chunk}/' if self.chunk else ''}{role}"

    def _ranks_TR(self, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, R] = r: the destination column of the token routes, [T, R] = r·T + t: the staging row of a
        copy-engine pull), kept: the same every step."""
        cached = getattr(self, "_ranks_cache", None)
        if cached is None or cached[0].shape[0] != T or cached[0].device != device:
            ranks_TR = torch.arange(self.ep_size, device=device).expand(T, self.ep_size).contiguous()
            cached = self._ranks_cache = (ranks_TR, ranks_TR * T + torch.arange(T, device=device)[:, None])
        return cached

    def _tok(self, rows: int, D: int, dtype, device) -> SymmBuffer:
        return self.ws.buffer(f"{self.name}/tok/{dtype}", (rows, D), dtype, device)

    def dispatch(self, x_TD, ids_TK, w_TK):
        x_TD, counts_e, h = self.route(x_TD, ids_TK, w_TK)
        cap, D = nvlink_capacity(*ids_TK.shape, self.capacity_factor), x_TD.shape[1]
        if self.fp8_rows and x_TD.dtype == torch.bfloat16:
            h.fp8_rows = Fp8Rows(plain=self.fp8_plain or not use_triton(x_TD))
        x_buf = self.ws.buffer(f"{self.name}/x", (cap, D), x_TD.dtype, x_TD.device)
        return _NVLinkDispatch.apply(x_TD, self, h, x_buf), counts_e, h

    def route(self, x_TD, ids_TK, w_TK):
        """Everything of ``dispatch`` but moving the tokens: (x_TD in the experts' dtype, counts_e, handle) with
        every rank's routing meta rows written into its peers' buffers (they are read after the token
        send's barrier)."""
        T, K = ids_TK.shape
        R, X, dev = self.ep_size, self.num_experts, x_TD.device
        out_dtype = x_TD.dtype  # combine returns (and accumulates in fp32 into) the caller's dtype
        if torch.is_autocast_enabled(dev.type) and x_TD.is_floating_point():
            x_TD = x_TD.to(torch.get_autocast_dtype(dev.type))  # move the experts' input dtype
        cap = nvlink_capacity(T, K, self.capacity_factor)
        # slot n of id x keeps its order among this rank's slots of x (the NCCL backends' stable sort)
        rank_in_id_N, counts_X = slot_ranks(ids_TK.reshape(-1), X)
        counts_RX = all_gather_rows(self.ws, f"{self.name}/counts", counts_X)
        base_X, counts_e, dropped, needed = layout_tail(counts_RX, self.rank, self.num_local, cap, T * K)
        meta_row = self.ws.buffer(f"{self.name}/meta_row", (R * T, K), torch.int32, dev)
        meta_w = self.ws.buffer(f"{self.name}/meta_w", (R * T, K), w_TK.dtype, dev)
        # every (destination r, token t) meta row is rewritten each step: -1 where t sends nothing to r
        rank_TK, row_TK, row_TR = peer_route_meta(ids_TK, rank_in_id_N.view(T, K), base_X, self.num_local, cap,
                                                  w_TK.detach(), meta_row, meta_w, self.rank, programs=self.programs)
        rank_TR, stage_TR = self._ranks_TR(T, dev)
        D = x_TD.shape[1]
        stage_row_TR = None
        if self.copies == "copy_engine":  # peer r's sums for token t land in staging row r·T + t (row_TR: rank·T + t)
            stage_row_TR = torch.where(row_TR >= 0, stage_TR, row_TR)
        h = NVLinkHandle(rank_TK, row_TK, rank_TR, row_TR, w_TK, out_dtype, x_TD.dtype, meta_row, meta_w,
                         self._tok(R * T, D, x_TD.dtype, dev), stage_row_TR, dropped=dropped, needed_factor=needed)
        return x_TD, counts_e, h

    def combine(self, y_ND, handle: NVLinkHandle):
        return _NVLinkCombine.apply(y_ND, handle.w_TK, self, handle)


def send_rows(disp: NVLinkDispatcher, h: NVLinkHandle, x_TD: torch.Tensor, buf: SymmBuffer) -> None:
    """Row t of x_TD into row s·T + t of ``buf`` [R·T, D] on every rank token t goes to (s = this rank), then a
    barrier: a Triton kernel on ``programs`` CTAs, or (``copies = "copy_engine"``) the whole block on every rank by
    the copy engines, the local block on a side stream beside the peers' (rows of tokens that go nowhere on a
    rank are never read there)."""
    if disp.copies == "kernel":
        peer_scatter(x_TD, h.rank_TR, h.row_TR, buf.ptrs_R, buf.peers, programs=disp.programs, block_t=disp.block_t)
    else:
        T, s = x_TD.shape[0], disp.rank
        x_TD = x_TD.contiguous()
        with _beside(x_TD):
            buf.local[s * T:(s + 1) * T].copy_(x_TD)
        for r, peer in enumerate(buf.peers):
            if r != s:
                peer[s * T:(s + 1) * T].copy_(x_TD)
        _join(x_TD)
    disp.ws.barrier(buf)


@contextlib.contextmanager
def _beside(x: torch.Tensor):
    """Run the body on the copy side stream of x's device, forked from the current stream (``_join`` joins it
    back before anything else runs, so no tensor of the body is freed under it), or inline off CUDA."""
    if not x.is_cuda:
        yield
        return
    side = side_stream(x.device, "nvlink_copies")
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        yield


def _join(x: torch.Tensor) -> None:
    if x.is_cuda:
        torch.cuda.current_stream(x.device).wait_stream(side_stream(x.device, "nvlink_copies"))


def send_fp8(disp: NVLinkDispatcher, h: NVLinkHandle, x_TD: torch.Tensor, rows: int,
             wire_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``send_rows`` of x_TD packed by ``fp8_rows`` into the symmetric ``wire_name`` buffer [rows, WIRE_ALIGN-padded
    bytes] (barrier): (q [rows, D] e4m3, s [rows, D / 128] fp32), views of this rank's wire rows (rows no peer
    sent this step hold stale bytes and are never read)."""
    packed_TW = fp8_rows(x_TD, align=WIRE_ALIGN).view(torch.int32)  # moved as 4-byte words
    shape = (rows, packed_TW.shape[1])
    wire = disp.ws.buffer(f"{wire_name}/{shape[0]}x{shape[1]}", shape, torch.int32, x_TD.device)
    send_rows(disp, h, packed_TW, wire)
    return fp8_parts(wire.local.view(torch.uint8), x_TD.shape[1])


def send_on_wire(disp: NVLinkDispatcher, h: NVLinkHandle, x_TD: torch.Tensor, buf: SymmBuffer,
                 wire_name: str) -> None:
    """``send_rows`` of x_TD into ``buf`` as the dispatcher's ``wire`` carries them: as they are (bf16), or (``fp8``)
    by ``send_fp8``, then dequantised into every row of ``buf.local``."""
    if disp.wire != "fp8":
        send_rows(disp, h, x_TD, buf)
        return
    q_UD, s_UB = send_fp8(disp, h, x_TD, buf.local.shape[0], wire_name)
    dequant_blocks(q_UD, s_UB, WIRE_BLOCK, buf.local)


def send_tokens(disp: NVLinkDispatcher, h: NVLinkHandle, x_TD: torch.Tensor) -> None:
    """Each token into ``tok`` of every rank it goes to; after the barrier every token row and meta row is in
    place on every rank."""
    send_on_wire(disp, h, x_TD, h.tok, f"{disp.name}/wire")


def sum_back(disp: NVLinkDispatcher, h: NVLinkHandle, y_ND: torch.Tensor, into: SymmBuffer, weighted: bool,
             out_dtype) -> torch.Tensor:
    """y_TD[t] = Σ over the ranks t went to of Σ_k (w ·) y_ND[row of (t, k)] there: each owner sums its rows per
    source token into ``into`` [R·T, D] (fp32 accumulation), then each source adds its tokens' sums (fp32, in rank
    order): read from the peers by a kernel, or (``copies = "copy_engine"``) pulled by the copy engines first."""
    if disp.copies == "copy_engine":
        return _sum_back_copy_engine(disp, h, y_ND, into, weighted, out_dtype)
    owner_sums(y_ND, h, into, weighted)
    disp.ws.barrier(into)
    return peer_gather_sum(h.rank_TR, h.row_TR, into.ptrs_R, into.peers, out_dtype=out_dtype, programs=disp.programs,
                           block_t=disp.block_t)


def _sum_back_copy_engine(disp: NVLinkDispatcher, h: NVLinkHandle, y_ND: torch.Tensor, into: SymmBuffer,
                          weighted: bool, out_dtype) -> torch.Tensor:
    """``sum_back`` with the copy engines: the sums the peers pull first; after the barrier, block s (this rank)
    of every peer's ``into`` is copied into block r of a local staging [R·T, D] on the side stream while the own
    tokens' sums go into block s; then y_TD[t] = Σ_r staging[r·T + t] (where row_TR[t, r] ≥ 0), one local pass."""
    R, s = disp.ep_size, disp.rank
    T, D = h.row_TR.shape[0], y_ND.shape[1]
    for rows in (slice(0, s * T), slice((s + 1) * T, R * T)):  # the other sources' tokens
        if rows.stop > rows.start:
            owner_sums(y_ND, h, into.local[rows], weighted, rows)
    disp.ws.barrier(into)
    stage_UD = torch.empty(R * T, D, dtype=into.local.dtype, device=y_ND.device)
    with _beside(y_ND):
        for r, peer in enumerate(into.peers):
            if r != s:
                stage_UD[r * T:(r + 1) * T].copy_(peer[s * T:(s + 1) * T])
    mine = slice(s * T, (s + 1) * T)
    owner_sums(y_ND, h, stage_UD[mine], weighted, mine)
    _join(y_ND)
    out_TD = torch.empty(T, D, dtype=out_dtype, device=y_ND.device)
    return gather_sum(stage_UD, h.stage_row_TR, out=out_TD)


def owner_sums(y_ND: torch.Tensor, h: NVLinkHandle, into: SymmBuffer | torch.Tensor, weighted: bool,
               rows: slice = slice(None)) -> None:
    """into[u] = Σ_k (w ·) y_ND[row of choice k of token u here] for the token rows u = s·T + t in ``rows`` (zero
    where none is here): local. ``into``: a SymmBuffer (its local [R·T, D] part) or the [len(rows), D] target.
    Most of a token's K choices lie on other ranks (-1: nothing read), so at hidden sizes ≥ 4096 two tokens per CTA
    iteration keep more loads in flight (0.79 vs 0.93 ms at 2·16384 tokens × 7168, K=8, on H200;
    ``benchmarks/row_kernels.py``, kernel ``combine_share``); at 2048 one is faster."""
    D = y_ND.shape[1]
    out = into.local if isinstance(into, SymmBuffer) else into
    gather_sum(y_ND, h.meta_row.local[rows], h.meta_w.local[rows] if weighted else None, out=out,
               block_t=2 if D >= 4096 else 1)


def grad_tokens(disp: NVLinkDispatcher, h: NVLinkHandle, grad_TD: torch.Tensor) -> SymmBuffer:
    """Each token's output gradient into the shared ``grad_tok`` [R·T, D] of every rank it went to (barrier)."""
    gt = disp._shared("grad_tok", tuple(h.tok.local.shape), grad_TD.dtype, grad_TD.device)
    send_on_wire(disp, h, grad_TD, gt, disp._shared_name("grad_wire"))
    return gt


def pull_grad_w(disp: NVLinkDispatcher, h: NVLinkHandle, gw_UK: torch.Tensor) -> torch.Tensor:
    """[T, K]: each choice's routing-weight gradient, which lies with the rank holding its expert at row
    rank·T + t of that rank's ``gw_UK`` [R·T, K] (published in a shared buffer; one barrier)."""
    T = h.w_TK.shape[0]
    gw = disp._shared("grad_w", tuple(h.meta_w.local.shape), h.w_TK.dtype, gw_UK.device)
    gw.local.copy_(gw_UK)
    disp.ws.barrier(gw)
    mine = slice(disp.rank * T, (disp.rank + 1) * T)
    gw_RTK = torch.stack([p[mine] for p in gw.peers])
    return gw_RTK.gather(0, h.rank_TK.unsqueeze(0)).squeeze(0) * (h.row_TK >= 0)


class _NVLinkDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, disp: NVLinkDispatcher, h: NVLinkHandle, x_buf: SymmBuffer):
        tok_UD, scale_U = h.tok.local, None
        if disp.wire == "fp8":  # expanded straight from the wire rows
            tok_UD, scale_U = send_fp8(disp, h, x_TD, tok_UD.shape[0], f"{disp.name}/wire")
        else:
            send_tokens(disp, h, x_TD)
        r = disp.rank
        fp8 = _fp8_rows_like(x_buf.local) if h.fp8_rows is not None else None
        plain = fp8 is None or h.fp8_rows.plain
        peer_scatter(tok_UD, None, h.meta_row.local, x_buf.ptrs_R[r:r + 1], [x_buf.local],
                     programs=disp.LOCAL_PROGRAMS, x_scales=scale_U, scale_block=WIRE_BLOCK, fp8_out=fp8, plain=plain)
        if fp8 is not None:
            h.fp8_rows.x = fp8
        ctx.disp, ctx.h = disp, h
        return x_buf.local.view(x_buf.local.shape) if plain else shape_only(x_buf.local)

    @staticmethod
    def backward(ctx, grad_ND):
        disp, h = ctx.disp, ctx.h
        gt = disp._shared("grad_tok", tuple(h.tok.local.shape), grad_ND.dtype, grad_ND.device)
        return sum_back(disp, h, grad_ND, gt, weighted=False, out_dtype=h.x_dtype), None, None, None


class _NVLinkCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_ND, w_TK, disp: NVLinkDispatcher, h: NVLinkHandle):
        tok = disp._tok(*h.tok.local.shape, y_ND.dtype, y_ND.device)  # = h.tok when y has x's dtype
        ctx.save_for_backward(y_ND)
        ctx.disp, ctx.h = disp, h
        return sum_back(disp, h, y_ND, tok, weighted=True, out_dtype=h.out_dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        (y_ND,) = ctx.saved_tensors
        disp, h = ctx.disp, ctx.h
        if disp.wire == "fp8":  # the gradient rows read straight from the wire
            g_UD, scale_U = send_fp8(disp, h, grad_TD, h.tok.local.shape[0], disp._shared_name("grad_wire"))
        else:
            g_UD, scale_U = grad_tokens(disp, h, grad_TD).local, None
        gy = disp._shared("grad_y", tuple(y_ND.shape), y_ND.dtype, y_ND.device)
        fused = h.fp8_rows is not None and _use_triton(g_UD, y_ND)
        fp8 = _fp8_rows_like(gy.local) if fused else None
        plain = h.fp8_rows is None or h.fp8_rows.plain
        _, gw_UK = combine_backward(g_UD, y_ND, h.meta_w.local, h.meta_row.local, grad_y_out=gy.local,
                                    g_scales=scale_U, scale_block=WIRE_BLOCK, fp8_out=fp8, plain=plain)
        grad_y_ND = gy.local.view(gy.local.shape) if plain else shape_only(gy.local)
        if h.fp8_rows is not None:  # off the kernels, quantised here (the experts would, the same way)
            h.fp8_rows.put_grad(grad_y_ND, *(fp8 if fused else quant_rows(grad_y_ND)))
        return grad_y_ND, pull_grad_w(disp, h, gw_UK), None, None


def _fp8_rows_like(x_ND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for x_ND's rows as FP8 rows: (q [N, D] e4m3, s [N] fp32)."""
    return (torch.empty(x_ND.shape, dtype=FP8, device=x_ND.device),
            torch.empty(x_ND.shape[0], dtype=torch.float32, device=x_ND.device))
