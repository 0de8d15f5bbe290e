"""Input distribution: the ids of this rank's samples go to the ranks whose TBEs look them up, in a constant number
of vectorized ops per step whatever the number of tables, pieces and ranks.

IdRouter is built once per plan from the layout (every rank computes every rank's layout, so the permutations are
known on both sides without metadata exchange). Per step:

  sender    whole-table pieces (TW, CW slices, DP replicas; Routing.whole_table): one fbgemm permute_2D_sparse_data
            puts every destination's features in order (a CW table appears once per slice); their [features, B]
            lengths travel as they are (they do not grow with the world: each piece is one destination's).
            Row-sharded tables (Routing.by_row): one permute selects them, each id's range is id // block (the
            ceil block of neocfg.sharding.row_ranges), the destination and that destination's feature index come
            from two precomputed tables, and the ids are grouped by destination with one sort. Instead of
            per-(destination, feature, sample) lengths (which grow with world x tables x B), each id travels with
            its segment (destination feature x B + sample): the volume is proportional to the ids.
  exchange  one all-to-all of the per-destination counts (the one host sync: the split sizes), then one of the
            payload [whole lengths | whole ids | (id, segment) pairs] per destination.
  receiver  whole pieces: one permute from (source, feature) to (feature, source) order; by-row pieces: the bag of
            each id (feature, source, sample) from its segment, one stable sort and one bincount; then one permute
            into the TBEs' feature order and one cumsum per TBE group.

Ids keep their order inside every bag (stable permutes and sorts), so pooled sums add in the unsharded order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

from neocfg.batch import Batch
from neocfg.runtime.layout import Layout
from neocfg.sharding import Routing, row_block

_permute_1d = torch.ops.fbgemm.permute_1D_sparse_data


@dataclass
class LocalLookups:
    """What this rank's TBE groups look up for one step: per group (indices, offsets); bags = world x B per feature."""

    per_group: list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class PendingIds:
    """A step's ids in flight: the payload all-to-all started asynchronously (exchange split in two)."""

    recv: torch.Tensor
    recv_counts: torch.Tensor
    n_pairs: int
    work: object                 # the async all-to-all's handle
    payload: torch.Tensor        # kept alive until the all-to-all is done


@dataclass
class Routed:
    """A step's ids on their way: the payload for every destination (destination-major) and its per-destination
    counts [world, 2] = (whole-table ids, row-sharded ids)."""

    payload: torch.Tensor
    counts: torch.Tensor


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    """fbgemm offsets [0, cumsum...] of the bags' lengths."""
    flat = lengths.reshape(-1)
    return torch.cat([flat.new_zeros(1), torch.cumsum(flat, 0)])


class IdRouter:
    """Built once per (layout, batch size); route() and receive() run a constant number of ops per step."""

    def __init__(self, layout: Layout, batch_size: int, device: torch.device) -> None:
        self.world, self.rank, self.b = layout.world, layout.rank, batch_size
        b, world = batch_size, layout.world
        whole = Routing.whole_table
        kinds = layout.routings
        # ---- sender: whole-table pieces, destination-major, in each destination's TBE order
        perm, piece_dest, self.whole_per_dest = [], [], []
        rw_idx: dict[tuple[int, int], int] = {}    # (destination, table) -> feature index among its by-row ones
        for d, r in enumerate(layout.ranks):
            n_whole, n_rw = 0, 0
            for s in r.features:
                if kinds[s.table] is whole:
                    perm.append(s.table)
                    piece_dest.append(d)
                    n_whole += 1
                else:
                    rw_idx[(d, s.table)] = n_rw
                    n_rw += 1
            self.whole_per_dest.append(n_whole)
        lt = dict(dtype=torch.long, device=device)
        self.whole_perm = torch.tensor(perm, **lt)
        per_dest = torch.tensor(self.whole_per_dest, **lt)
        self.whole_piece_dest = torch.tensor(piece_dest, **lt)
        self.len_per_dest = per_dest * b                                   # static: lengths sent to each rank
        # ---- sender: row-sharded tables; range i of table t is held by dest_of[t, i] as its feature feat_of[t, i]
        # row-sharded tables in the order every holder lists them (TBE group, then table), so that each
        # destination receives its ids in (its feature, sample) order
        group_of = {s.table: key for r in layout.ranks for key, shards in r.groups for s in shards}
        self.rw_tables = sorted((t for t in range(len(layout.rows)) if kinds[t] is Routing.by_row),
                                key=lambda t: (group_of[t], t))
        self.rw_perm = torch.tensor(self.rw_tables, **lt)
        self.rw_perm32 = self.rw_perm.to(torch.int32)
        parts = max((len(layout.table_holders(t)) for t in self.rw_tables), default=1)
        self.rw_parts = parts
        dest_of = torch.zeros(len(self.rw_tables), parts, **lt)
        feat_of = torch.zeros(len(self.rw_tables), parts, **lt)
        block = []
        for i, t in enumerate(self.rw_tables):
            holders = layout.table_holders(t)   # (rank, shard) in row order
            block.append(row_block(layout.rows[t], len(holders)))
            for j, (d, _) in enumerate(holders):
                dest_of[i, j], feat_of[i, j] = d, rw_idx[(d, t)]
        self.dest_of, self.feat_of = dest_of.view(-1), feat_of.view(-1)
        self.rw_block = torch.tensor(block, **lt)
        # sort keys as narrow as they can be (radix sorts run per byte)
        self.dest_dtype = torch.int16 if world < 2**15 else torch.int32
        # ---- receiver
        me = layout.me.features
        self.nf_whole = self.whole_per_dest[self.rank]
        self.nf_rw = len(me) - self.nf_whole
        f = self.nf_whole
        # payload segments of destination d: its lengths block (d), its whole pieces' tables (world + t), its pairs
        # (world + T + d)
        t_all = len(layout.rows)
        payload_perm = []
        for d in range(world):
            payload_perm += [d] + [world + t for t, pd in zip(perm, piece_dest) if pd == d] + [world + t_all + d]
        self.payload_perm = torch.tensor(payload_perm, dtype=torch.int32, device=device)
        # received segments, per source s: lengths (s * (f + 2)), ids of its feature i (s * (f + 2) + 1 + i),
        # pairs (s * (f + 2) + f + 1); wanted: ids feature-major (feature, source), then the pairs source by source
        k = f + 2
        self.recv_perm = torch.tensor([s * k + 1 + i for i in range(f) for s in range(world)]
                                      + [s * k + f + 1 for s in range(world)], dtype=torch.int32, device=device)
        self.recv_len_pos = torch.arange(f * b, **lt).repeat(world)
        # stacked = [whole features, by-row features] -> TBE order
        stacked, nw, nr = [], 0, 0
        for s in me:
            if kinds[s.table] is whole:
                stacked.append(nw)
                nw += 1
            else:
                stacked.append(self.nf_whole + nr)
                nr += 1
        self.tbe_perm = torch.tensor(stacked, **lt)
        self.tbe_perm32 = self.tbe_perm.to(torch.int32)
        self.recv_rw_perm = torch.tensor([s * self.nf_rw + i for i in range(self.nf_rw) for s in range(world)],
                                         dtype=torch.int32, device=device)
        self.tbe_identity = stacked == list(range(len(stacked)))
        self.group_sizes = [len(shards) for _, shards in layout.me.groups]
        self.device = device

    # ------------------------------------------------------------ sender

    def route(self, batch: Batch) -> Routed:
        b, world = self.b, self.world
        lengths, values = batch.lengths.long(), batch.values.long()
        totals = lengths.sum(dim=1)                                            # ids per table
        lw = lengths.index_select(0, self.whole_perm)                          # [whole pieces, B], by destination
        n1 = values.new_zeros(world).index_add_(0, self.whole_piece_dest, totals.index_select(0, self.whole_perm))
        # row-sharded tables: range, destination, feature and segment of every id, grouped by destination
        if self.rw_tables:
            lr = lengths.index_select(0, self.rw_perm)
            vr = _permute_1d(self.rw_perm32, totals, values, None, None)[1]
            n = vr.numel()
            ar = torch.arange(lr.shape[0], device=vr.device)
            t = torch.repeat_interleave(ar, lr.sum(dim=1), output_size=n)      # row-sharded table of each id
            sample = torch.repeat_interleave(torch.arange(lr.numel(), device=vr.device), lr.reshape(-1),
                                             output_size=n) - t * b
            blk = self.rw_block.index_select(0, t)
            bucket = torch.div(vr, blk, rounding_mode="floor")                 # its row range
            flat = t * self.rw_parts + bucket
            dest = self.dest_of.index_select(0, flat)
            pairs = torch.stack([vr - bucket * blk, self.feat_of.index_select(0, flat) * b + sample], dim=1)
            pairs = pairs.index_select(0, torch.sort(dest.to(self.dest_dtype), stable=True)[1])  # by destination
            n2 = torch.bincount(dest, minlength=world)
        else:
            pairs, n2 = values.new_zeros((0, 2)), values.new_zeros(world)
        # the payload, destination by destination: [its whole pieces' lengths | their ids | its pairs], by one
        # permute of segments of [lengths of every whole piece | the batch's ids | the pairs]
        sizes = torch.cat([self.len_per_dest, totals, 2 * n2])
        src = torch.cat([lw.reshape(-1), values, pairs.reshape(-1)])
        payload = _permute_1d(self.payload_perm, sizes, src, None, None)[1]
        return Routed(payload, torch.stack([n1, n2], dim=1))

    # ------------------------------------------------------------ receiver

    def receive(self, recv: torch.Tensor, recv_counts: torch.Tensor, n_pairs: int) -> LocalLookups:
        """recv: every source's payload (source-major); recv_counts [world, 2] as sent; n_pairs: their sum of
        row-sharded ids (known on the host from the split sizes)."""
        b, world = self.b, self.world
        fw, fr = self.nf_whole, self.nf_rw
        n1, n2 = recv_counts[:, 0], recv_counts[:, 1]
        a = fw * b
        start = _excl_cumsum(a + n1 + 2 * n2)
        lens = recv.index_select(0, torch.repeat_interleave(start, a, output_size=a * world) + self.recv_len_pos)
        lens = lens.view(world, fw, b)
        # one permute of segments: per source [lengths | ids of feature 0 | ... | pairs] -> ids feature-major
        # (feature, source), then every source's pairs
        sizes = torch.cat([torch.full((world, 1), a, dtype=torch.long, device=recv.device), lens.sum(dim=2),
                           (2 * n2).view(world, 1)], dim=1).view(-1)
        out = _permute_1d(self.recv_perm, sizes, recv, None, None)[1]
        n_whole = out.numel() - 2 * n_pairs
        parts_l, parts_v = [], []
        if fw:
            parts_l.append(lens.transpose(0, 1).reshape(fw, world * b))
            parts_v.append(out[:n_whole])
        if fr:
            m = n_pairs
            pairs = out[n_whole:].view(m, 2)
            src = torch.repeat_interleave(torch.arange(world, device=recv.device), n2, output_size=m)
            seg = pairs[:, 1]
            feat = torch.div(seg, b, rounding_mode="floor")
            # each source sent its ids in (feature, sample) order: one permute of the (source, feature) segments
            # gives (feature, source, sample), ids kept in order inside every bag
            src_feat = torch.bincount(src * fr + feat, minlength=world * fr)
            parts_v.append(_permute_1d(self.recv_rw_perm, src_feat, pairs[:, 0].contiguous(), None, m)[1])
            bag = (feat * world + src) * b + (seg - feat * b)
            parts_l.append(torch.bincount(bag, minlength=fr * world * b).view(fr, world * b))
        if not parts_l:
            return LocalLookups([])
        lengths = torch.cat(parts_l) if len(parts_l) > 1 else parts_l[0]
        values = torch.cat(parts_v) if len(parts_v) > 1 else parts_v[0]
        if not self.tbe_identity:
            values = _permute_1d(self.tbe_perm32, lengths.sum(dim=1), values, None, None)[1]
            lengths = lengths.index_select(0, self.tbe_perm)
        if len(self.group_sizes) == 1:
            return LocalLookups([(values, _offsets(lengths))])
        out_groups, f0, v0 = [], 0, 0
        counts = torch.stack([g.sum() for g in lengths.split(self.group_sizes)]).tolist()   # a 2nd host sync
        for nf, n in zip(self.group_sizes, counts):
            out_groups.append((values[v0:v0 + n], _offsets(lengths[f0:f0 + nf])))
            f0, v0 = f0 + nf, v0 + n
        return LocalLookups(out_groups)

    # ------------------------------------------------------------ both

    def exchange(self, group, batch: Batch) -> LocalLookups:
        """Route, send (two all-to-alls, one host sync for the split sizes), receive."""
        return self.finish(self.start(group, batch))

    def start(self, group, batch: Batch) -> PendingIds:
        """Route and exchange the counts (the host sync), then start the payload all-to-all without waiting."""
        routed = self.route(batch)
        recv_counts = torch.empty_like(routed.counts)
        dist.all_to_all_single(recv_counts, routed.counts, group=group)
        send_sizes = self.send_sizes(routed.counts)
        recv_sizes = self.nf_whole * self.b + recv_counts[:, 0] + 2 * recv_counts[:, 1]
        host = torch.cat([send_sizes, recv_sizes, recv_counts[:, 1].sum().view(1)]).tolist()   # the host sync
        w = self.world
        recv = routed.payload.new_empty(sum(host[w:2 * w]))
        work = dist.all_to_all_single(recv, routed.payload, host[w:2 * w], host[:w], group=group, async_op=True)
        return PendingIds(recv, recv_counts, host[-1], work, routed.payload)

    def finish(self, pending: PendingIds) -> LocalLookups:
        """Wait for the payload, then build the TBE groups' inputs."""
        pending.work.wait()
        return self.receive(pending.recv, pending.recv_counts, pending.n_pairs)

    def send_sizes(self, counts: torch.Tensor) -> torch.Tensor:
        """Payload elements for each destination."""
        return self.len_per_dest + counts[:, 0] + 2 * counts[:, 1]


def deliver(routed: list[Routed], routers: list[IdRouter], dest: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """What exchange()'s all-to-alls hand rank `dest`, computed in one process from every rank's Routed (for the
    tests and bench/bench_routing.py): receive()'s arguments."""
    pieces, counts = [], []
    for r, router in zip(routed, routers):
        pieces.append(r.payload.split(router.send_sizes(r.counts).tolist())[dest])
        counts.append(r.counts[dest])
    recv_counts = torch.stack(counts)
    return torch.cat(pieces), recv_counts, int(recv_counts[:, 1].sum())
