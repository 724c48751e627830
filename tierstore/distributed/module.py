"""ShardedEmbeddingBagCollection: pooled bags whose rows live on their owner ranks.

Per step (all tables at once): the ids of every bag are bucketed by owner; an all-to-all of
sizes, then of ids (each owner's ids with the bag structure they belong to); each owner pools
its part of every bag with the single-process module, in the global order (feature, then rank,
then sample), and the pooled bags (table-wise) or partial sums (row-wise) come back by
all-to-all; row-wise partials are summed locally in rank order. Backward sends each bag's output
gradient to the owners that pooled it, and each owner runs the single-process backward (the
fused optimizer over its rows, gradients summed in global position order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, ShapeError, TierstoreError
from ..module import MODES, _pool, _unpack_jagged
from .errors import DistributedError
from .store import ShardedTierStore


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(x.numel() + 1, dtype=torch.int64)
    torch.cumsum(x, 0, out=out[1:])
    return out


def _segments(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Positions of the concatenated segments [starts[i], starts[i] + lengths[i])."""
    total = int(lengths.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.int64)
    base = torch.repeat_interleave(starts - _excl_cumsum(lengths)[:-1], lengths)
    return base + torch.arange(total)


@dataclass
class _Request:
    """What this rank sent for one table: per-owner bag counts and the bags each owner pools."""

    table: str
    dim: int
    bags: int  # this rank's bags of the table (features x batch)
    table_wise: bool
    counts: torch.Tensor  # [world, bags] ids of each bag per owner
    masks: list[torch.Tensor] = field(default_factory=list)  # per owner: the bags it returns


@dataclass
class _Serve:
    """What this rank pools as an owner for one table, from every source rank."""

    table: str
    dim: int
    perm: torch.Tensor  # global (feature, rank, sample) order -> position in source-major order
    mask: torch.Tensor  # source-major bags that are returned (table-wise: all; row-wise: non-empty)
    per_source: list[int]  # returned bags per source rank
    pooled: torch.Tensor | None = None  # the inner (single-process) pooled output, with its graph


class _ShardedBags(torch.autograd.Function):
    """The collective forward/backward of a sharded collection (one call per step)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ebc: ShardedEmbeddingBagCollection,
                batch: int, tables: list, train: bool, err: Exception | None) -> torch.Tensor:
        out, requests, serves = ebc._forward(batch, tables, train, err)
        ctx.ebc, ctx.requests, ctx.serves, ctx.batch = ebc, requests, serves, batch
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.ebc._backward(grad.detach().cpu().contiguous(), ctx.batch, ctx.requests, ctx.serves)
        ctx.serves = ctx.requests = None
        return None, None, None, None, None, None


class ShardedEmbeddingBagCollection(nn.Module):
    """TieredEmbeddingBagCollection over a ShardedTierStore: same inputs, THIS rank's batch.

    Forward and backward are collective: every rank calls them once per step, in the same
    order (a rank may have an empty table or a different batch size).
    """

    def __init__(self, store: ShardedTierStore, features: Mapping[str, str] | Sequence[str],
                 mode: str = "sum") -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if isinstance(features, Mapping):
            feats = dict(features)
        else:
            feats = dict(f if isinstance(f, (tuple, list)) else (f, f) for f in features)
        if not feats:
            raise ConfigError("features must not be empty")
        for table in feats.values():
            store.local._table(table)  # raises UnknownTableError
        self.store = store
        self.mode = mode
        self.features = feats
        self.feature_names = list(feats)
        self.dims = [store.specs[t].dim for t in feats.values()]
        self._by_table: dict[str, list[str]] = {}
        for f, t in feats.items():
            self._by_table.setdefault(t, []).append(f)
        for f, t in feats.items():  # lets a plain Prefetcher over the local store read batches
            store.local.feature_tables.setdefault(f, t)

    def _sharded_prefetcher(self, batches: Any, depth: int = 2, **kwargs: Any) -> Any:
        """The Prefetcher of a sharded collection (tierstore.prefetch.Prefetcher dispatches here)."""
        from .prefetch import ShardedPrefetcher

        return ShardedPrefetcher(self, batches, depth, **kwargs)

    # input --------------------------------------------------------------------------------
    def _split(self, keys: Any, values: Any, lengths: Any, offsets: Any, weights: Any
               ) -> tuple[int, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
        """Validated (batch, [(table, ids, lengths, weights)]) of this rank's input."""
        keys, values, lengths, weights = _unpack_jagged(keys, values, lengths, offsets, weights)
        if len(keys) == 0 or lengths.numel() % len(keys):
            raise ShapeError("lengths must hold one entry per (feature, sample)")
        missing = [f for f in self.feature_names if f not in keys]
        if missing:
            raise ShapeError(f"input lacks features {missing}")
        if weights is not None and self.mode != "sum":
            raise ConfigError("weights are only supported with mode='sum'")
        batch = lengths.numel() // len(keys)
        starts = _excl_cumsum(lengths)
        kpos = {k: i for i, k in enumerate(keys)}
        local = self.store.local
        out = []
        for table, feats in self._by_table.items():
            parts, lens, wparts = [], [], []
            for f in feats:
                i = kpos[f]
                lo, hi = int(starts[i * batch]), int(starts[(i + 1) * batch])
                parts.append(values[lo:hi])
                lens.append(lengths[i * batch : (i + 1) * batch])
                if weights is not None:
                    wparts.append(weights[lo:hi])
            ids = local._ids(local._table(table), torch.cat(parts))
            w = torch.cat(wparts).detach().to("cpu", torch.float32) if weights is not None else None
            out.append((table, ids, torch.cat(lens), w))
        return batch, out

    def forward(self, keys: Any, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, as_dict: bool = False
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Pooled embeddings of this rank's batch: [batch, sum of dims] or {feature: [batch, dim]}."""
        err: TierstoreError | None = None
        try:
            batch, tables = self._split(keys, values, lengths, offsets, weights)
        except TierstoreError as exc:  # told to the other ranks in the sizes exchange, then raised
            err, batch, tables = exc, 0, []
        train = torch.is_grad_enabled()
        anchor = torch.empty(0, requires_grad=train)
        out = _ShardedBags.apply(anchor, self, batch, tables, train, err)
        if not as_dict:
            return out
        cols = _excl_cumsum(torch.tensor(self.dims)).tolist()
        return {f: out[:, cols[i] : cols[i + 1]] for i, f in enumerate(self.feature_names)}

    # the collective step ------------------------------------------------------------------------
    def _forward(self, batch: int, tables: list, train: bool, err: Exception | None
                 ) -> tuple[torch.Tensor, list[_Request], list[_Serve | None]]:
        store, comm = self.store, self.store.comm
        world, rank = store.world_size, store.rank
        mean = self.mode == "mean"
        nt = len(self._by_table)
        if err is not None:  # bad input here: a sizes row with the error flag, then raise
            sizes = torch.zeros(world, 3 + nt, dtype=torch.int64)
            sizes[:, 2] = 1
            comm.exchange_sizes("fwd:sizes", sizes)
            raise err
        # 1. bucket ids by owner (stable: each owner's ids keep their order)
        requests: list[_Request] = []
        send_ids: list[list[torch.Tensor]] = [[] for _ in range(world)]
        send_w: list[list[torch.Tensor]] = [[] for _ in range(world)]
        sizes = torch.zeros(world, 3 + nt, dtype=torch.int64)  # batch, weights?, error?, ids
        sizes[:, 0] = batch
        any_w = any(w is not None for _, _, _, w in tables)
        row_mean = mean and any(store.plan.placement(t).kind == "row" for t, *_ in tables)
        for j, (table, ids, lens, w) in enumerate(tables):
            placement = store.plan.placement(table)
            nb = lens.numel()
            bag_of = torch.repeat_interleave(torch.arange(nb), lens)
            own = store.plan.owners(table, ids)
            order = torch.argsort(own, stable=True)
            per_owner = torch.bincount(own, minlength=world)
            counts = torch.bincount(own * nb + bag_of, minlength=world * nb).view(world, nb)
            req = _Request(table, store.specs[table].dim, nb, placement.kind == "table", counts)
            ids_sorted = ids.index_select(0, order).split(per_owner.tolist())
            if placement.kind == "row" and mean:  # owners pool sums scaled by the full bag length
                w = (1.0 / lens.clamp(min=1).to(torch.float32)).index_select(0, bag_of)
            w_sorted = w.index_select(0, order).split(per_owner.tolist()) if w is not None else None
            for o in range(world):
                if placement.kind == "table" and o != placement.owner:
                    req.masks.append(torch.zeros(nb, dtype=torch.bool))
                    continue
                req.masks.append(torch.ones(nb, dtype=torch.bool) if req.table_wise
                                 else counts[o] > 0)
                send_ids[o] += [counts[o], ids_sorted[o]]
                sizes[o, 3 + j] = per_owner[o]
                send_w[o].append(w_sorted[o] if w_sorted is not None
                                 else torch.ones(int(per_owner[o])))
            requests.append(req)
        # weights travel when any rank has them (or row-wise mean scales); agree on it first
        sizes[:, 1] = int(any_w)
        recv_sizes = comm.exchange_sizes("fwd:sizes", sizes)
        bad = torch.nonzero(recv_sizes[:, 2]).flatten().tolist()
        if bad:
            raise DistributedError(f"rank {rank}: the forward's input was invalid on rank(s) {bad}; "
                                   "see their errors")
        src_batch = recv_sizes[:, 0].tolist()
        need_w = bool(recv_sizes[:, 1].any()) or row_mean
        nfeat = [len(self._by_table[t]) for t, *_ in tables]
        served = [store.plan.placement(t).kind == "row" or store.plan.placement(t).owner == rank
                  for t, *_ in tables]
        # 2. ids (with each owner's per-bag counts) to their owners
        send_splits = [sum(int(x.numel()) for x in send_ids[o]) for o in range(world)]
        recv_n = [int(recv_sizes[r, 3:].sum()) for r in range(world)]
        recv_splits = [recv_n[r] + sum(nfeat[j] * src_batch[r] for j in range(nt) if served[j])
                       for r in range(world)]
        flat = torch.cat([x for o in range(world) for x in send_ids[o]] or
                         [torch.empty(0, dtype=torch.int64)])
        got = comm.exchange("fwd:ids", flat, send_splits, recv_splits)
        got_w = None
        if need_w:
            wflat = torch.cat([x for o in range(world) for x in send_w[o]] or [torch.empty(0)])
            got_w = comm.exchange("fwd:weights", wflat.to(torch.float32),
                                  [int(sizes[o, 3:].sum()) for o in range(world)], recv_n)
        # 3. owners pool their part of every bag, in global order, with the single-process module
        pieces = got.split(recv_splits)
        wpieces = got_w.split(recv_n) if got_w is not None else None
        cursor = [0] * world
        wcursor = [0] * world
        serves: list[_Serve | None] = []
        back: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, (table, _, _, _) in enumerate(tables):
            if not served[j]:
                serves.append(None)
                continue
            placement = store.plan.placement(table)
            cnts, idss, ws = [], [], []
            for r in range(world):
                nb = nfeat[j] * src_batch[r]
                n = int(recv_sizes[r, 3 + j])
                c = cursor[r]
                cnts.append(pieces[r][c : c + nb])
                idss.append(pieces[r][c + nb : c + nb + n])
                cursor[r] = c + nb + n
                if wpieces is not None:
                    ws.append(wpieces[r][wcursor[r] : wcursor[r] + n])
                    wcursor[r] += n
            cnt_sm = torch.cat(cnts)
            ids_sm = torch.cat(idss)
            # global bag order: feature, then source rank, then sample
            bag_base = _excl_cumsum(torch.tensor([nfeat[j] * b for b in src_batch]))[:-1]
            perm = torch.cat([torch.arange(src_batch[r]) + bag_base[r] + f * src_batch[r]
                              for f in range(nfeat[j]) for r in range(world)]) \
                if sum(src_batch) else torch.empty(0, dtype=torch.int64)
            cnt_g = cnt_sm.index_select(0, perm)
            pos = _segments(_excl_cumsum(cnt_sm)[:-1].index_select(0, perm), cnt_g)
            ids_g = ids_sm.index_select(0, pos)
            offs_g = _excl_cumsum(cnt_g)[:-1]
            psw = torch.cat(ws).index_select(0, pos) if wpieces is not None else None
            inner_mode = self.mode if placement.kind == "table" else "sum"
            if placement.kind == "table" and psw is not None and mean:
                psw = None
            with torch.set_grad_enabled(train):
                pooled = _pool(store.local, table, ids_g, offs_g, psw, inner_mode)
            mask = torch.ones_like(cnt_sm, dtype=torch.bool) if placement.kind == "table" \
                else cnt_sm > 0
            per_source = [int(m.sum()) for m in mask.split([nfeat[j] * b for b in src_batch])]
            flat_pooled = pooled.detach().cpu()  # the wire and the bookkeeping are on the CPU
            sm = torch.empty_like(flat_pooled)
            sm.index_copy_(0, perm, flat_pooled)  # back to source-major order
            rows = sm[mask].split(per_source)
            for r in range(world):
                back[r].append(rows[r].reshape(-1))
            serves.append(_Serve(table, store.specs[table].dim, perm, mask, per_source,
                                 pooled if train else None))
        # 4. pooled bags / partials back to the requesting ranks
        out = self._exchange_pooled("fwd:pooled", back, requests, serves, src_batch)
        feats_out: dict[str, torch.Tensor] = {}
        for req, blocks in zip(requests, out):
            acc = None
            for o in range(world):
                blk = blocks[o]
                if blk is None:
                    continue
                if req.table_wise:
                    acc = blk
                else:
                    if acc is None:
                        acc = torch.zeros(req.bags, req.dim)
                    acc[req.masks[o]] += blk
            if acc is None:
                acc = torch.zeros(req.bags, req.dim)
            for k, f in enumerate(self._by_table[req.table]):
                feats_out[f] = acc[k * batch : (k + 1) * batch]
        pooled_all = torch.cat([feats_out[f] for f in self.feature_names], dim=1) \
            if batch else torch.zeros(0, sum(self.dims))
        return pooled_all.to(store.local.device), requests, serves

    def _exchange_pooled(self, what: str, send: list[list[torch.Tensor]], requests: list[_Request],
                         serves: list[_Serve | None], src_batch: list[int]
                         ) -> list[list[torch.Tensor | None]]:
        """Owners -> requesters: per table, each owner's block [returned bags, dim] (None: none)."""
        comm, world = self.store.comm, self.store.world_size
        send_splits = [sum(int(x.numel()) for x in send[r]) for r in range(world)]
        recv_splits = [sum(int(req.masks[o].sum()) * req.dim for req in requests)
                       for o in range(world)]
        flat = torch.cat([x for r in range(world) for x in send[r]] or [torch.empty(0)])
        got = comm.exchange(what, flat, send_splits, recv_splits).split(recv_splits)
        out: list[list[torch.Tensor | None]] = []
        cursor = [0] * world
        for req in requests:
            blocks: list[torch.Tensor | None] = []
            for o in range(world):
                placement = self.store.plan.placement(req.table)
                if placement.kind == "table" and placement.owner != o:
                    blocks.append(None)
                    continue
                k = int(req.masks[o].sum()) * req.dim
                blocks.append(got[o][cursor[o] : cursor[o] + k].view(-1, req.dim))
                cursor[o] += k
            out.append(blocks)
        return out

    def _backward(self, grad: torch.Tensor, batch: int, requests: list[_Request],
                  serves: list[_Serve | None]) -> None:
        comm, world = self.store.comm, self.store.world_size
        cols = _excl_cumsum(torch.tensor(self.dims)).tolist()
        fcol = {f: (cols[i], cols[i + 1]) for i, f in enumerate(self.feature_names)}
        # 1. each bag's output gradient to the owners that pooled it
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for req in requests:
            g = torch.cat([grad[:, fcol[f][0] : fcol[f][1]] for f in self._by_table[req.table]]) \
                if batch else torch.zeros(0, req.dim)
            for o in range(world):
                p = self.store.plan.placement(req.table)
                if p.kind == "table" and p.owner != o:
                    continue
                send[o].append(g[req.masks[o]].reshape(-1))
        send_splits = [sum(int(x.numel()) for x in send[o]) for o in range(world)]
        recv_splits = [sum(s.per_source[r] * s.dim for s in serves if s is not None)
                       for r in range(world)]
        flat = torch.cat([x for o in range(world) for x in send[o]] or [torch.empty(0)])
        got = comm.exchange("bwd:grads", flat.contiguous(), send_splits, recv_splits)
        pieces = got.split(recv_splits)
        cursor = [0] * world
        # 2. owners run the single-process backward: the fused update of their rows
        for s in serves:
            if s is None:
                continue
            parts = []
            for r in range(world):
                k = s.per_source[r] * s.dim
                parts.append(pieces[r][cursor[r] : cursor[r] + k].view(-1, s.dim))
                cursor[r] += k
            g_sm = torch.zeros(s.mask.numel(), s.dim)
            g_sm[s.mask] = torch.cat(parts)
            if s.pooled is not None and s.pooled.requires_grad:
                torch.autograd.backward(s.pooled, g_sm.index_select(0, s.perm).to(s.pooled.device))
            s.pooled = None
