"""The static decode step replayed as CUDA graphs: one graph per bucket of shapes, fed through
static input buffers (`CompiledDecode` in mode "cudagraph", the default on a CUDA device).

A CUDA graph replays fixed kernels on fixed addresses, so every call of one graph must have the
same shapes and read its inputs from the same tensors. The step's shapes follow the batch size
B, the block table's width nb (it grows with the context) and the pools' shapes; they are
bucketed to powers of two and the inputs padded:

- batch: B -> the next power of two Bb; the rows B..Bb-1 are a dummy sequence (token 0 at
  position 0, empty window ring: positions -1, no entries, no pending rows, block 0 in every
  table column). The step has no op that mixes rows, so a dummy row changes nothing in the real
  rows; its outputs are dropped.
- table: nb -> the next power of two; the extra columns repeat the row's spare (last) column, a
  block that holds no visible entry (entries past the counts are masked).
- pools: the engine's block pool (and one sequence's contiguous rows) are read where they are,
  their addresses part of the graph's key (a pool that grows, a contiguous buffer that doubles,
  gets a graph of its own); several sequences' contiguous rows, which the host copies into one
  padded pool per call anyway, go into a static pool of bucketed blocks and capacity instead
  (so does a pool the host had to move from another device).

Each call copies its inputs into the bucket's buffers (the padding rewritten every time, so no
earlier call's rows linger), replays the graph, and returns views of the graph's outputs cut to
the B real rows (logits cloned; the other outputs are read by the write-back before the next
replay). All graphs share one memory pool: they run one after another on one stream, and no
graph's outputs are read after another graph has replayed (a graph captured later may hold its
outputs where an earlier one keeps intermediates). The static input buffers are ordinary
allocations, never in the pool. At most `max_graphs` graphs are kept (least recently used out).

Why an explicit `torch.cuda.CUDAGraph` over the step rather than torch.compile's
"reduce-overhead" mode: the step already has static shapes, so capturing it needs no compiler
(no Triton build, seconds instead of minutes); reduce-overhead copies every input that is not a
parameter into buffers of its own on each replay (the block pool included, gigabytes) unless
each is marked static, and records a new graph per dynamic size on its own terms; here the
bucketing, padding and copies are this module's plain code, which runs on the CPU too (`capture`
False: the same buffers and padding, the step called instead of replayed), so the tests pin it
on a machine without a GPU.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch


def bucket(n: int) -> int:
    """The power of two >= n (n >= 1): the sizes a graph is captured for."""
    return 1 << max(n - 1, 0).bit_length()


def _put(buf: torch.Tensor, x: torch.Tensor, pad) -> None:
    """buf[:n] := x (n = x's rows; the other dims equal), buf[n:] := pad."""
    n = x.shape[0]
    buf[:n].copy_(x, non_blocking=True)
    buf[n:].fill_(pad)


class _Graph:
    """One bucket: the static input buffers, the step's outputs on them, and (on CUDA) the
    captured graph."""

    def __init__(self, fn, shapes, args, Bb: int, nbb: int, copied: bool):
        ids, pos, hist, rings, ring_pos, pools, table, counts, pending, engram = args
        self.fn, self.shapes = fn, shapes
        self.hist_pad = shapes.cfg.engram_pad_token_id
        B = ids.shape[0]

        def like(x, dim=0, n=Bb):
            size = list(x.shape)
            size[dim] = n
            return x.new_zeros(size)
        self.ids, self.pos, self.hist = like(ids), like(pos), like(hist)
        self.rings, self.ring_pos = like(rings, 1), like(ring_pos, 1)
        self.table = table.new_zeros(Bb, nbb)
        self.counts = {s: like(c) for s, c in counts.items()}
        self.pending = {s: (like(k), like(g)) for s, (k, g) in pending.items()}
        self.engram = None if engram is None else {l: like(e) for l, e in engram.items()}
        self.copied = copied
        # copied pools (one block per sequence, or a pool moved from another device): blocks and
        # capacity bucketed. Pools read in place are not held here (an engine's pool dies with
        # it): the call's own pools, at the addresses the key names, are what the graph was
        # captured on.
        self.pools = {k: p.new_zeros(bucket(p.shape[0]), bucket(p.shape[1]), p.shape[2])
                      for k, p in pools.items()} if copied else None
        self.graph = None
        self.out = None
        self.B = B

    def args(self, pools):
        return (self.ids, self.pos, self.hist, self.rings, self.ring_pos,
                self.pools if self.copied else pools, self.table, self.counts, self.pending,
                self.engram)

    def load(self, args) -> None:
        """Copy one call's inputs into the buffers; the padding rows and columns rewritten."""
        ids, pos, hist, rings, ring_pos, pools, table, counts, pending, engram = args
        B, nb = table.shape
        self.B = B
        _put(self.ids, ids, 0)
        _put(self.pos, pos, 0)
        _put(self.hist, hist, self.hist_pad)
        self.rings[:, :B].copy_(rings, non_blocking=True)
        self.rings[:, B:].zero_()
        self.ring_pos[:, :B].copy_(ring_pos, non_blocking=True)
        self.ring_pos[:, B:].fill_(-1)
        self.table[:B, :nb].copy_(table, non_blocking=True)
        self.table[:B, nb:].copy_(table[:, -1:].expand(B, self.table.shape[1] - nb), non_blocking=True)
        self.table[B:].zero_()
        for s, c in counts.items():
            _put(self.counts[s], c, 0)
        for s, (k, g) in pending.items():
            _put(self.pending[s][0], k, 0)
            _put(self.pending[s][1], g, 0)
        for l, e in (engram or {}).items():
            _put(self.engram[l], e, 0)
        if self.copied:
            for key, p in pools.items():
                buf, (n, cap) = self.pools[key], p.shape[:2]
                buf[:n, :cap].copy_(p, non_blocking=True)
                buf[:n, cap:].zero_()
                buf[n:].zero_()

    def capture(self, pools, mempool) -> None:
        """Warm the step up on a side stream (lazy initialisations, cuBLAS workspaces: nothing may
        allocate host memory or synchronise inside a capture), then capture it."""
        dev = self.ids.device
        with torch.cuda.device(dev):                  # the model's GPU, not the current one
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                self.fn(self.shapes, *self.args(pools))
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, capture_error_mode="thread_local"):
                self.out = self.fn(self.shapes, *self.args(pools))
        self.graph = graph

    def run(self, pools):
        """The step on the buffers: the graph replayed (CUDA) or the step called (CPU)."""
        if self.graph is not None:
            with torch.cuda.device(self.ids.device):
                self.graph.replay()
        else:
            self.out = self.fn(self.shapes, *self.args(pools))
        return self.result()

    def result(self):
        """(logits [B, vocab], out) of the B real rows: the logits a copy, the rest views of the
        graph's outputs (valid until its next replay; the write-back reads them at once)."""
        B = self.B
        logits, out = self.out
        return logits[:B].clone(), {
            "window": out["window"][:, :B],
            "entries": {s: (m[:B], None if i is None else i[:B], e[:B])
                        for s, (m, i, e) in out["entries"].items()},
            "pending": {s: (k[:B], g[:B]) for s, (k, g) in out["pending"].items()},
            "topk": {l: (i[:B], v[:B]) for l, (i, v) in out["topk"].items()},
            "experts": {l: e[:B] for l, e in out["experts"].items()},
        }


class StepGraphs:
    """The static step `fn` run through bucketed static buffers, replayed as a CUDA graph per
    bucket when `capture` (the model on CUDA), else called on the same buffers (the host logic
    alone, what the CPU tests check)."""

    def __init__(self, fn, capture: bool, max_graphs: int = 64):
        self.fn, self.capture, self.max_graphs = fn, capture, max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()      # least recently used first
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.capture_s: dict[str, float] = {}     # graph label -> seconds to capture it

    def key(self, shapes, args, copied: bool) -> tuple:
        """What one graph serves: flat or paged reads, the batch and table buckets, the pools
        (their addresses and shapes when read in place, their buckets when copied), and whether
        the Engram rows are an input (a table offloaded to host memory)."""
        ids, pools, table = args[0], args[5], args[6]
        if copied:
            pk = tuple((k, bucket(p.shape[0]), bucket(p.shape[1])) for k, p in sorted(pools.items()))
        else:
            pk = tuple((k, p.data_ptr(), tuple(p.shape)) for k, p in sorted(pools.items()))
        return shapes.flat, bucket(ids.shape[0]), bucket(table.shape[1]), copied, pk, args[9] is not None

    @staticmethod
    def label(key) -> str:
        flat, Bb, nbb = key[:3]
        return f"cuda graph: batch {Bb}, {nbb} table blocks" + (", contiguous rows" if flat else "")

    def __call__(self, shapes, args, copied: bool):
        """(logits, out) of `fn(shapes, *args)` for the B real rows (see `_Graph.result`). A new
        bucket is captured on first use; past `max_graphs` the least recently used graph goes
        (its buffers and outputs back to the pool; graphs of a dropped block pool age out)."""
        key = self.key(shapes, args, copied)
        g = self.graphs.get(key)
        if g is None:
            g = _Graph(self.fn, shapes, args, key[1], key[2], copied)
            g.load(args)
            if self.capture:
                t0 = time.perf_counter()
                g.capture(args[5], self.mempool)
                self.capture_s[self.label(key)] = time.perf_counter() - t0
            self.graphs[key] = g
            while len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
            g.load(args)
        return g.run(args[5])
