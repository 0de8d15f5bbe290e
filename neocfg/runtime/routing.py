"""Input distribution: the ids of this rank's samples go to the ranks whose TBEs look them up, in a constant number
of vectorized ops per step whatever the number of tables, pieces and ranks.

IdRouter is built once per plan from the layout (every rank computes every rank's layout, so the permutations are
known on both sides without metadata exchange). Every destination receives from every source one block, laid out
in the destination's TBE feature order, so that the receiver's work is TorchRec's "recat": one permute from
(source, feature) to (feature, source) order.

Row-sharded tables (Routing.by_row) travel in one of two encodings, chosen by the plan (its strategies'
routing_encoding; both sides know it):
  lengths  TorchRec's: fbgemm's block_bucketize_sparse_features splits every row-sharded feature at once into
           row ranges (a counting sort in C++: ids grouped by (range, feature, sample), in order, rebased), and
           each destination gets the [B] lengths of each of its pieces beside their ids. Costs one length per
           (piece, sample) on both sides: cheap when a piece gets several ids per sample (few ranks).
  codes    each id travels with its bag code (the destination's feature, this source, the sample: one int), the
           ids grouped by destination piece with one radix sort of int16 keys; the destination counts its bags
           from the codes (one bincount). Costs are proportional to the ids: the choice at scale (128 ranks, most
           pieces get no id of a given sample).
Whole-table pieces (TW, CW slices, DP replicas' absence aside; Routing.whole_table) send their [B] lengths and
their ids as they are in both encodings (a CW table appears once per slice).

Per step:
  sender    (codes: one sort of the row-sharded ids), then one fbgemm permute_1D_sparse_data of segments
            [batch lengths | row-sharded lengths or piece counts | batch ids | row-sharded ids | codes | headers]
            into the payload, destination by destination: [header | lengths | ids in its TBE order | codes].
  exchange  one all-to-all of the per-destination counts (the one host sync: the split sizes, and the ids of each
            of the destination's TBE groups when it has several), then one of the payloads. The pipelined step
            (send(then=...)) skips the first: every payload's header carries the next batch's counts for its
            destination (IdRouter.header elements), so the receiver knows the next payload's split sizes when this
            one arrives: one all-to-all per step instead of two.
  receiver  one gather of every source's lengths, one permute of the id segments from (source, feature) to
            (feature, source) order, which is the TBE's input order; codes: one scatter-add counting the
            row-sharded bags; one cumsum for the offsets.

Nothing in a step waits on the device except that one host sync (a GPU-ready step): counts are scatter-adds into
fixed sizes (torch.bincount would read the maximum back), the receiver's permute is told its output size (the
received elements), and the TBE groups' id counts ride in the counts exchange.

Ids keep their order inside every bag (stable permutes, sorts and bucketizing), so pooled sums add in the
unsharded order.

Per-id weights (Batch.weights, from a dataset's weight columns) travel as a float payload of the payload's own
layout, zeros beside the lengths, codes and headers: every permute, bucketize and sort above carries it with the
ids (fbgemm's ops take weights), and one more all-to-all of the same split sizes sends it; the TBEs pool with them
as per_sample_weights. Runs without weights send nothing more.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from neocfg.batch import Batch
from neocfg.runtime.layout import Layout
from neocfg.sharding import Routing, row_block
from neocfg.types import IdDtype, RoutingEncoding

_permute_1d = torch.ops.fbgemm.permute_1D_sparse_data
_bucketize = torch.ops.fbgemm.block_bucketize_sparse_features

# The torch dtype of each IdDtype (the plan's strategies choose it: neocfg.planner.strategies.id_dtype).
ID_DTYPES = {IdDtype.int32: torch.int32, IdDtype.int64: torch.int64}
# Elements at the front of every destination's payload: the next batch's (ids, codes) counts for that destination
# when the pipelined step sends them (send(then=...)), else zeros; then, where some rank has several TBE groups, the
# ids of each of its groups (IdRouter.header = HEADER + groups).
HEADER = 2


# How row-sharded ids travel (the plan's strategies choose it: neocfg.planner.strategies.routing_encoding).
RwEncoding = RoutingEncoding


@dataclass
class LocalLookups:
    """What this rank's TBE groups look up for one step: per group (indices, offsets); bags = world x B per feature."""

    per_group: list[tuple[torch.Tensor, torch.Tensor]]
    # recv_counts of the next batch (send()'s argument), from the payload headers, when the senders put them there
    next_counts: Optional[torch.Tensor] = None
    # per group, each index's weight (float32, the indices' order), when the batch carries weights
    weights: Optional[list[torch.Tensor]] = None


@dataclass
class PendingIds:
    """A step's ids in flight: the payload all-to-all started asynchronously (exchange split in two)."""

    recv: torch.Tensor
    recv_counts: torch.Tensor
    n_codes: int
    work: object                 # the async all-to-all's handle
    payload: torch.Tensor        # kept alive until the all-to-all is done
    carries_next: bool = False   # the headers hold the next batch's counts (every rank sends alike)
    group_ids: Optional[list[int]] = None   # ids of each of this rank's TBE groups (from the host sync)
    # the weights' payload received, its all-to-all's handle and the sent payload (kept alive), when weighted
    weights: Optional[tuple[torch.Tensor, object, torch.Tensor]] = None


@dataclass
class Exchanged:
    """A batch's ids exchanged ahead of its step (ShardedEmbeddings.prepare, in the data source's prefetch thread)
    by `router`: what this rank's TBEs look up."""

    router: "IdRouter"
    lookups: LocalLookups


@dataclass
class Routed:
    """A step's ids on their way: the payload for every destination (destination-major) and its per-destination
    counts [world, header] = (ids, codes, then the ids of each of the destination's TBE groups where some rank has
    several)."""

    payload: torch.Tensor
    counts: torch.Tensor
    weights: Optional[torch.Tensor] = None   # float32, the payload's layout: each id's weight, 0 elsewhere


def _count(index: torch.Tensor, n: int) -> torch.Tensor:
    """How often each of 0..n-1 occurs in `index` (int64 [n]): torch.bincount(index, minlength=n) without reading
    the maximum back to the host (a scatter-add into n bins)."""
    return torch.zeros(n, dtype=torch.long, device=index.device).index_add_(
        0, index.long(), torch.ones(1, dtype=torch.long, device=index.device).expand(index.numel()))


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _offsets(lengths: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fbgemm offsets [0, cumsum...] of the bags' lengths, in `dtype` (the indices')."""
    flat = lengths.reshape(-1)
    return torch.cat([flat.new_zeros(1, dtype=dtype), torch.cumsum(flat, 0, dtype=dtype)])


class IdRouter:
    """Built once per (layout, batch size); route() and receive() run a constant number of ops per step."""

    def __init__(self, layout: Layout, batch_size: int, device: torch.device,
                 encoding: RwEncoding, dtype: torch.dtype) -> None:
        """encoding, dtype: the plan's strategies (StepStrategies.routing_encoding, id_dtype)."""
        self.world, self.rank, self.b = layout.world, layout.rank, batch_size
        self.encoding = encoding
        self.device = device
        self.dtype = dtype
        b, world, n_tables = batch_size, layout.world, len(layout.rows)
        lt = dict(dtype=torch.long, device=device)
        whole = Routing.whole_table
        # whole-table pieces anywhere: the batch's lengths and ids are payload segments (else left out of it)
        self.has_whole = any(layout.routings[t] is whole for t in range(n_tables))
        n_wt = n_tables if self.has_whole else 0
        # ---- row-sharded tables (in table order) and their pieces: piece (range j, table i) = j * n_rw + i, the
        # order block_bucketize_sparse_features groups ids in
        self.rw_tables = [t for t in range(n_tables) if layout.routings[t] is Routing.by_row]
        n_rw = len(self.rw_tables)
        rw_index = {t: i for i, t in enumerate(self.rw_tables)}
        holders = [layout.table_holders(t) for t in self.rw_tables]
        self.parts = max((len(h) for h in holders), default=1)
        n_pieces = self.parts * n_rw
        piece_of: dict[tuple[int, int, int], int] = {}                 # (rank, table, row offset) -> piece
        for i, hs in enumerate(holders):
            for j, (d, s) in enumerate(hs):
                piece_of[(d, self.rw_tables[i], s.row_offset)] = j * n_rw + i
        self.rw_block = torch.tensor([row_block(layout.rows[t], len(h)) for t, h in zip(self.rw_tables, holders)],
                                     dtype=self.dtype, device=device)
        self.rw_perm = torch.tensor(self.rw_tables, **lt)
        self.rw_perm32 = self.rw_perm.to(torch.int32)
        self.rw_all = self.rw_tables == list(range(n_tables))
        self.n_rw = n_rw
        if not n_rw:
            self.encoding = RwEncoding.lengths    # nothing row-sharded: whole-table lengths and ids only
        codes = self.encoding is RwEncoding.codes
        self.shift = b.bit_length() - 1 if b & (b - 1) == 0 else None   # B a power of two: shifts, not divisions
        # ---- the payload: segments of src = [lengths of every table (T x B; none without whole-table pieces) |
        # row-sharded lengths (lengths: n_pieces x B) or piece counts (codes: one per held piece,
        # destination-major) | batch ids (T; none without whole-table pieces) | row-sharded ids (per piece; codes:
        # per held piece, destination-major) | codes (one per destination) | headers (one per destination)]
        n_rwl = len(piece_of) if codes else n_pieces      # segments of row-sharded lengths or counts, and ids
        seg_rwl, seg_ids = n_wt, n_wt + n_rwl
        seg_rwv = seg_ids + n_wt
        seg_codes = seg_rwv + n_rwl
        seg_header = seg_codes + (world if codes else 0)
        # TBE groups of the rank that has most: where several, the counts carry each group's ids (see below)
        self.n_groups = max(len(r.groups) for r in layout.ranks)
        self.header = HEADER + (self.n_groups if self.n_groups > 1 else 0)
        perm, perm_dest, head = [], [], []
        perm_first, len_segs, key_segs = [], [], []        # per destination: its first segment, lengths, counts
        code_key = [0] * n_pieces          # piece -> its place among held pieces, destination-major
        code_base = [0] * n_pieces         # piece -> bag code base (its feature at the destination, this source)
        key_piece, key_dest = [], []
        for d, fs in enumerate(layout.ranks[d].features for d in range(world)):
            lens, ids, keys = [], [], []
            for f, s in enumerate(fs):
                if layout.routings[s.table] is whole:
                    lens.append(s.table)
                    ids.append(seg_ids + s.table)
                    continue
                p = piece_of[(d, s.table, s.row_offset)]
                ids.append(seg_rwv + (len(key_piece) if codes else p))
                code_key[p], code_base[p] = len(key_piece), (f * world + self.rank) * b
                keys.append(seg_rwl + len(key_piece))
                key_piece.append(p)
                key_dest.append(d)
                if not codes:
                    lens.append(seg_rwl + p)
            if not codes:
                keys = []
            # header, lengths, (codes: the destination's piece counts, segments of one), ids, (codes: codes)
            d_segs = [seg_header + d] + lens + keys + ids + ([seg_codes + d] if codes else [])
            head.append(self.header + len(lens) * b + len(keys))
            perm_first.append(len(perm))
            len_segs.append(len(lens))
            key_segs.append(len(keys))
            perm += d_segs
            perm_dest += [d] * len(d_segs)
        self.payload_perm = torch.tensor(perm, dtype=torch.int32, device=device)
        # every segment sent once (no CW table's lengths to several slices, none left out): the payload is as long
        # as its sources, known without reading the lengths back
        self.payload_whole = sorted(perm) == list(range(seg_header + world))
        self.perm_dest = torch.tensor(perm_dest, **lt)
        self.head = torch.tensor(head, **lt)                  # static payload head per destination (header included)
        self.header_segs = torch.full((world,), self.header, **lt)
        self.header_pos = torch.arange(self.header, **lt).repeat(world)
        self.code_key = torch.tensor(code_key, dtype=torch.int16 if len(key_piece) < 2**15 else torch.int32,
                                     device=device)
        self.code_base = torch.tensor(code_base, dtype=self.dtype, device=device)
        self.key_piece = torch.tensor(key_piece, **lt)
        self.key_dest = torch.tensor(key_dest, **lt)
        self.n_pieces = n_pieces
        # ---- ids per (destination, TBE group), when some rank has several groups: the payload segments of ids
        # (id_seg, in payload order) summed into bins destination x group (id_bin)
        id_seg, id_bin = [], []
        if self.n_groups > 1:
            for d, r in enumerate(layout.ranks):
                group_of = [g for g, (_, shards) in enumerate(r.groups) for _ in shards]
                first = perm_first[d] + 1 + len_segs[d] + key_segs[d]     # past the header, lengths and counts
                for f in range(len(r.features)):
                    id_seg.append(first + f)
                    id_bin.append(d * self.n_groups + group_of[f])
        self.id_seg = torch.tensor(id_seg, **lt)
        self.id_bin = torch.tensor(id_bin, **lt)
        self.lengths_segs = torch.full((n_tables,), b, **lt)
        self.rwl_segs = torch.full((n_rwl,), 1 if codes else b, **lt)
        # ---- receiver: per source [head (header first) | ids of feature 0 | ... | ids of feature F-1 | codes]
        me = layout.me.features
        n_f = len(me)
        self.n_f = n_f
        whole_rows = [f for f, s in enumerate(me) if layout.routings[s.table] is whole]
        rw_rows = [f for f, s in enumerate(me) if layout.routings[s.table] is not whole]
        self.whole_rows = torch.tensor(whole_rows, **lt)
        self.rw_rows = torch.tensor(rw_rows, **lt)
        self.nf_whole, self.nf_rw = len(whole_rows), len(rw_rows)
        self.my_head = head[self.rank]
        self.head_pos = torch.arange(self.my_head, **lt).repeat(world)
        k = n_f + 2
        self.recv_perm = torch.tensor([s * k + 1 + f for f in range(n_f) for s in range(world)]
                                      + [s * k + n_f + 1 for s in range(world)], dtype=torch.int32, device=device)
        self.group_sizes = [len(shards) for _, shards in layout.me.groups]

    # ------------------------------------------------------------ sender

    def _bag_of_ids(self, lengths: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(feature, sample) of every id of a [F, B] lengths block (ids feature-major, sample order)."""
        bag = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.reshape(-1),
                                      output_size=n)
        if self.shift is not None:
            return bag >> self.shift, bag & (self.b - 1)
        f = torch.div(bag, self.b, rounding_mode="floor")
        return f, bag - f * self.b

    def route(self, batch: Batch) -> Routed:
        dt = self.dtype
        lengths, values = batch.lengths.to(dt), batch.values.to(dt)
        weights = batch.weights
        totals = lengths.sum(dim=1)                                            # ids per table (int64)
        rw_w = None
        if self.n_rw:
            if self.rw_all:
                lr, vr, wr = lengths, values, weights
            else:
                lr = lengths.index_select(0, self.rw_perm)
                vr, wr = _permute_1d(self.rw_perm32, totals, values, weights, None)[1:3]
            if self.encoding is RwEncoding.lengths:
                # ids grouped by (row range, table, sample), in order, rebased: pieces j * n_rw + i, [B] lengths each
                rw_lens, rw_ids, rw_w = _bucketize(lr.reshape(-1), vr, False, False, self.rw_block, self.parts,
                                                   wr)[:3]
                piece_n = rw_lens.view(self.n_pieces, self.b).sum(dim=1)
                n_codes = totals.new_zeros(self.world)
                src, sizes = [rw_lens, rw_ids], [self.rwl_segs, piece_n]
            else:
                n = vr.numel()
                t, sample = self._bag_of_ids(lr, n)
                blk = self.rw_block.index_select(0, t)
                bucket = torch.div(vr, blk, rounding_mode="floor")             # its row range
                piece = bucket * self.n_rw + t
                key = self.code_key.index_select(0, piece)                     # destination-major piece order
                order = torch.sort(key, stable=True)[1]
                rw_ids = (vr - bucket * blk).index_select(0, order)
                rw_w = None if wr is None else wr.index_select(0, order)
                codes = (self.code_base.index_select(0, piece) + sample.to(dt)).index_select(0, order)
                piece_n = _count(piece, self.n_pieces)                         # ids per piece
                counts = piece_n.index_select(0, self.key_piece)               # ... per held piece, by destination
                n_codes = totals.new_zeros(self.world).index_add_(0, self.key_dest, counts)
                src = [counts.to(dt), rw_ids, codes]
                sizes = [self.rwl_segs, counts, n_codes]
        else:
            n_codes = totals.new_zeros(self.world)
            src, sizes = [], []
        if self.has_whole:   # [whole lengths | row-sharded lengths or counts | batch ids | row-sharded ids | codes]
            src = [lengths.reshape(-1), *src[:1], values, *src[1:]]
            sizes = [self.lengths_segs, *sizes[:1], totals, *sizes[1:]]
        src.append(values.new_zeros(self.world * self.header))      # the headers (send() may fill them)
        sizes.append(self.header_segs)
        src = torch.cat(src)
        src_w = None if weights is None else self._weights_src(src, totals, weights, rw_w)
        plen, payload, payload_w = _permute_1d(self.payload_perm, torch.cat(sizes), src, src_w,
                                               src.numel() if self.payload_whole else None)
        total = totals.new_zeros(self.world).index_add_(0, self.perm_dest, plen)
        counts = [(total - self.head - n_codes).view(-1, 1), n_codes.view(-1, 1)]
        if self.n_groups > 1:
            per_group = totals.new_zeros(self.world * self.n_groups).index_add_(
                0, self.id_bin, plen.index_select(0, self.id_seg))
            counts.append(per_group.view(self.world, self.n_groups))
        return Routed(payload, torch.cat(counts, dim=1), payload_w)

    def _weights_src(self, src: torch.Tensor, totals: torch.Tensor, weights: torch.Tensor,
                     rw_w: Optional[torch.Tensor]) -> torch.Tensor:
        """route()'s source segments as weights: the batch ids' and the row-sharded ids' weights where those ids
        are, zeros elsewhere (src: [whole lengths | row-sharded lengths or counts | batch ids | row-sharded ids |
        codes | headers], the first and third only with whole-table pieces)."""
        out = torch.zeros(src.numel(), dtype=torch.float32, device=src.device)
        n_ids = int(weights.numel())
        n_lens = self.lengths_segs.numel() * self.b if self.has_whole else 0
        n_rwl = (self.rwl_segs.numel() * (1 if self.encoding is RwEncoding.codes else self.b)) if self.n_rw else 0
        at = n_lens + n_rwl
        if self.has_whole:
            out[at:at + n_ids] = weights
            at += n_ids
        if rw_w is not None:
            out[at:at + rw_w.numel()] = rw_w
        return out

    # ------------------------------------------------------------ receiver

    def receive(self, recv: torch.Tensor, recv_counts: torch.Tensor, n_codes: int,
                carries_next: bool = False, group_ids: Optional[list[int]] = None,
                recv_w: Optional[torch.Tensor] = None) -> LocalLookups:
        """recv: every source's payload (source-major); recv_counts [world, header] as sent; n_codes: their sum of
        codes (known on the host from the split sizes); carries_next: the headers hold the next batch's counts;
        group_ids: the ids of each of this rank's TBE groups, known on the host from the same sync (send() has
        them; without them, with several groups, they are read back here: a second host sync); recv_w: the weights'
        payload, when the batch carries weights."""
        b, world, n_f = self.b, self.world, self.n_f
        a = self.my_head
        start = _excl_cumsum(a + recv_counts[:, :HEADER].sum(dim=1))
        head = recv.index_select(0, torch.repeat_interleave(start, a, output_size=a * world) + self.head_pos)
        head = head.view(world, a)
        next_counts = head[:, :self.header].long() if carries_next else None
        if not n_f:
            return LocalLookups([], next_counts)
        head = head[:, self.header:]
        if self.encoding is RwEncoding.lengths:
            lens = head.reshape(world, n_f, b)
            seg = lens.sum(dim=2)
        else:
            fw = self.nf_whole
            lens = head[:, :fw * b].reshape(world, fw, b)
            seg = recv_counts.new_empty(world, n_f)
            seg.index_copy_(1, self.whole_rows, lens.sum(dim=2))
            seg.index_copy_(1, self.rw_rows, head[:, fw * b:].long())
        sizes = torch.cat([torch.full((world, 1), a, dtype=torch.long, device=recv.device), seg,
                           recv_counts[:, 1:2]], dim=1).view(-1)
        # every received segment but the heads, once: its length is known (told, so nothing is read back)
        out, out_w = _permute_1d(self.recv_perm, sizes, recv, recv_w, recv.numel() - a * world)[1:3]
        values = out[:out.numel() - n_codes]
        weights = None if out_w is None else out_w[:values.numel()]
        whole_lengths = lens.transpose(0, 1).reshape(-1, world * b)
        if self.encoding is RwEncoding.lengths:
            lengths = whole_lengths
        elif self.nf_rw:
            lengths = _count(out[values.numel():], n_f * world * b).view(n_f, world * b).to(values.dtype)
            if self.nf_whole:
                lengths.index_copy_(0, self.whole_rows, whole_lengths)
        else:
            lengths = whole_lengths
        if len(self.group_sizes) == 1:
            return LocalLookups([(values, _offsets(lengths, values.dtype))], next_counts,
                                None if weights is None else [weights])
        out_groups, group_w, f0, v0 = [], [], 0, 0
        if group_ids is None:   # (tests, benchmarks: the step has them from send's host sync)
            group_ids = recv_counts[:, HEADER:HEADER + len(self.group_sizes)].sum(dim=0).tolist()
        for nf, n in zip(self.group_sizes, group_ids):
            out_groups.append((values[v0:v0 + n], _offsets(lengths[f0:f0 + nf], values.dtype)))
            if weights is not None:
                group_w.append(weights[v0:v0 + n])
            f0, v0 = f0 + nf, v0 + n
        return LocalLookups(out_groups, next_counts, None if weights is None else group_w)

    # ------------------------------------------------------------ both

    def exchange(self, group, batch: Batch) -> LocalLookups:
        """Route, send (two all-to-alls, one host sync for the split sizes), receive."""
        return self.finish(self.start(group, batch))

    def start(self, group, batch: Batch) -> PendingIds:
        """Route and exchange the counts (the host sync), then start the payload all-to-all without waiting."""
        return self.send(group, self.route(batch))

    def send(self, group, routed: Routed, recv_counts: Optional[torch.Tensor] = None,
             then: Optional[Routed] = None) -> PendingIds:
        """Start the payload all-to-all without waiting. recv_counts: what every source sends here (the
        next_counts of the previous payload's lookups); None: exchange them first (an all-to-all). then: the
        next batch, routed: its counts go in the headers, for the receivers' next send (every rank must pass it
        alike)."""
        if recv_counts is None:
            recv_counts = torch.empty_like(routed.counts)
            dist.all_to_all_single(recv_counts, routed.counts, group=group)
        send_sizes = self.send_sizes(routed.counts)
        if then is not None:
            self.carry(routed, then, send_sizes)
        recv_sizes = self.my_head + recv_counts[:, :HEADER].sum(dim=1)
        n_groups = len(self.group_sizes) if self.n_groups > 1 else 0
        host = torch.cat([send_sizes, recv_sizes, recv_counts[:, 1].sum().view(1),
                          recv_counts[:, HEADER:HEADER + n_groups].sum(dim=0)]).tolist()   # the host sync
        w = self.world
        recv = routed.payload.new_empty(sum(host[w:2 * w]))
        work = dist.all_to_all_single(recv, routed.payload, host[w:2 * w], host[:w], group=group, async_op=True)
        weights = None
        if routed.weights is not None:   # the same split sizes, float
            recv_w = routed.weights.new_empty(recv.numel())
            weights = (recv_w, dist.all_to_all_single(recv_w, routed.weights, host[w:2 * w], host[:w], group=group,
                                                      async_op=True), routed.weights)
        return PendingIds(recv, recv_counts, host[2 * w], work, routed.payload, then is not None,
                          host[2 * w + 1:] if n_groups else None, weights)

    def carry(self, routed: Routed, then: Routed, send_sizes: Optional[torch.Tensor] = None) -> None:
        """Put the next batch's per-destination counts (then.counts) in routed's payload headers (in place)."""
        sizes = self.send_sizes(routed.counts) if send_sizes is None else send_sizes
        pos = torch.repeat_interleave(_excl_cumsum(sizes), self.header, output_size=self.header * self.world)
        routed.payload.index_copy_(0, pos + self.header_pos, then.counts.reshape(-1).to(routed.payload.dtype))

    def finish(self, pending: PendingIds) -> LocalLookups:
        """Wait for the payload, then build the TBE groups' inputs (and next_counts when the payload carries
        them)."""
        pending.work.wait()
        if pending.weights is not None:
            pending.weights[1].wait()
        return self.receive(pending.recv, pending.recv_counts, pending.n_codes, pending.carries_next,
                            pending.group_ids, None if pending.weights is None else pending.weights[0])

    def send_sizes(self, counts: torch.Tensor) -> torch.Tensor:
        """Payload elements for each destination."""
        return self.head + counts[:, :HEADER].sum(dim=1)


def deliver(routed: list[Routed], routers: list[IdRouter], dest: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What exchange()'s all-to-alls hand rank `dest`, computed in one process from every rank's Routed (for the
    tests and bench/bench_routing.py): receive()'s arguments."""
    pieces, counts = [], []
    for r, router in zip(routed, routers):
        pieces.append(r.payload.split(router.send_sizes(r.counts).tolist())[dest])
        counts.append(r.counts[dest])
    recv_counts = torch.stack(counts)
    return torch.cat(pieces), recv_counts, int(recv_counts[:, 1].sum())


def deliver_weights(routed: list[Routed], routers: list[IdRouter], dest: int) -> torch.Tensor:
    """The weights' payload the all-to-all hands rank `dest` (deliver()'s companion; receive()'s recv_w)."""
    return torch.cat([r.weights.split(router.send_sizes(r.counts).tolist())[dest]
                      for r, router in zip(routed, routers)])
