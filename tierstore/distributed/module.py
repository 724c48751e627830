"""ShardedEmbeddingBagCollection: pooled bags whose rows live on their owner ranks.

Per step (all tables at once): each table's ids go to the ranks that serve its parts (see
`parts.py`: table-, row-, column-wise, data-parallel); an all-to-all of sizes, then of ids (with
the bag structure they belong to); each owner pools its part of every bag with the
single-process module, in the global order (feature, then rank, then sample); pooled bags,
row-wise partial sums or (exact row-wise) unique rows come back by all-to-all and the requester
assembles them. Backward sends each bag's output gradient to the owners that pooled it, and each
owner runs the single-process backward (the fused optimizer over its rows, gradients summed in
global position order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import tierstore.distributed.colwise as colwise
import tierstore.validate as validate

from ..bagpaths import Gathered
from ..errors import ConfigError, ShapeError, TierstoreError, UnknownTableError
from ..jagged import JaggedBatch, either_weights
from ..module import _pool
from .errors import DistributedError
from .parts import Part, Request, build_request, comm_dtype_of, id_dtype_of, make_parts, pool_rows
from .store import ShardedTierStore

MODES = ("sum", "mean")  # "max" would need a max-combine of partial bags across row shards


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
class _Serve:
    """What this rank pools as an owner for one part, from every source rank."""

    part: Part
    perm: torch.Tensor  # global (feature, rank, sample) order -> position in source-major order
    bwd_mask: torch.Tensor  # source-major bags whose gradient comes back here
    per_source: list[int]  # those bags per source rank
    pooled: torch.Tensor | None = None  # the inner (single-process) pooled output, with its graph
    gathered: Gathered | None = None  # exact row-wise: the rows gathered for the global batch
    ids: torch.Tensor | None = None  # exact / colrow: the global batch, for the update
    offsets: torch.Tensor | None = None
    psw: torch.Tensor | None = None


class _ShardedBags(torch.autograd.Function):
    """The collective forward/backward of a sharded collection (one call per step)."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, ebc: ShardedEmbeddingBagCollection,
                batch: int, tables: list, train: bool, err: Exception | None) -> torch.Tensor:
        out, requests, serves = ebc.forward_step(batch, tables, train, err)
        ctx.ebc, ctx.requests, ctx.serves, ctx.batch = ebc, requests, serves, batch
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        ctx.ebc.backward_step(grad.detach().cpu().contiguous(), ctx.batch, ctx.requests, ctx.serves)
        ctx.serves = ctx.requests = None
        return None, None, None, None, None, None


class ShardedEmbeddingBagCollection(nn.Module):
    """TieredEmbeddingBagCollection over a ShardedTierStore: same inputs, THIS rank's batch.

    Forward and backward are collective: every rank calls them once per step, in the same
    order (a rank may have an empty table or a different batch size). `comm_dtype`
    ("float32", "float16", "bfloat16") is how pooled bags, partial sums, rows and their
    gradients travel (summed in float32 on arrival); `exact=True` makes row-wise tables
    bit-identical to one process (owners return unique rows, the requester pools); `id_dtype`
    (None: int32 when every table has < 2**31 rows, else int64) is how ids and counts travel.
    """

    def __init__(self, store: ShardedTierStore, features: Mapping[str, str] | Sequence[str],
                 mode: str = "sum", *, comm_dtype: str = "float32", exact: bool = False,
                 id_dtype: str | None = None) -> None:
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
            if table not in store.specs:
                raise UnknownTableError(f"unknown table {table!r}; this store has "
                                        f"{sorted(store.specs)}")
        self.store = store
        self.mode = mode
        self.features = feats
        self.feature_names = list(feats)
        self.dims = [store.specs[t].dim for t in feats.values()]
        self.comm_dtype = comm_dtype_of(comm_dtype)
        self.id_dtype = id_dtype_of(id_dtype, store.specs)
        self.exact = bool(exact)
        self._by_table: dict[str, list[str]] = {}
        for f, t in feats.items():
            self._by_table.setdefault(t, []).append(f)
        self.parts = make_parts(store.plan, store.specs, list(self._by_table), self.exact)
        for f, t in feats.items():  # lets a plain Prefetcher over the local store read batches
            if t in store.local.table_specs:
                store.local.feature_tables.setdefault(f, t)

    def _sharded_prefetcher(self, batches: Any, depth: int = 2, **kwargs: Any) -> Any:
        """The Prefetcher of a sharded collection (tierstore.prefetch.Prefetcher dispatches here)."""
        from .prefetch import ShardedPrefetcher

        return ShardedPrefetcher(self, batches, depth, **kwargs)

    # input --------------------------------------------------------------------------------
    def split_batch(self, keys: Any, values: Any, lengths: Any, offsets: Any, weights: Any
               ) -> tuple[int, list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]]]:
        """Validated (batch, [(table, ids, lengths, weights)]) of this rank's input."""
        keys, values, lengths, weights = JaggedBatch.of(keys, values, lengths, offsets, weights).astuple()
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
            ids = validate.row_ids(self.store.specs[table], torch.cat(parts))
            w = torch.cat(wparts).detach().to("cpu", torch.float32) if weights is not None else None
            out.append((table, ids, torch.cat(lens), w))
        return batch, out

    def forward(self, keys: Any, values: torch.Tensor | None = None,
                lengths: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                weights: torch.Tensor | None = None, as_dict: bool = False,
                per_sample_weights: torch.Tensor | None = None
                ) -> torch.Tensor | dict[str, torch.Tensor]:
        """Pooled embeddings of this rank's batch: [batch, sum of dims] or {feature: [batch, dim]}."""
        err: TierstoreError | None = None
        try:  # per_sample_weights: nn.EmbeddingBag's name for the weights
            batch, tables = self.split_batch(keys, values, lengths, offsets,
                                             either_weights(weights, per_sample_weights))
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
    def _wire(self, x: torch.Tensor) -> torch.Tensor:
        """Floats as they travel (comm_dtype)."""
        return x.to(self.comm_dtype)

    def forward_step(self, batch: int, tables: list, train: bool, err: Exception | None
                 ) -> tuple[torch.Tensor, list[Request], list[_Serve | None]]:
        store, comm = self.store, self.store.comm
        world, rank = store.world_size, store.rank
        mean = self.mode == "mean"
        nparts = len(self.parts)
        if err is not None:  # bad input here: a sizes row with the error flag, then raise
            sizes = torch.zeros(world, 3 + nparts, dtype=torch.int64)
            sizes[:, 2] = 1
            comm.exchange_sizes("fwd:sizes", sizes)
            raise err
        # 1. bucket ids by owner, per part
        by_table = {t: (ids, lens, w) for t, ids, lens, w in tables}
        requests = [build_request(p, rank, *by_table[p.table], mean) for p in self.parts]
        sizes = torch.zeros(world, 3 + nparts, dtype=torch.int64)  # batch, weights?, error?, ids
        sizes[:, 0] = batch
        sizes[:, 1] = int(any(w is not None for _, _, _, w in tables))
        for j, req in enumerate(requests):
            for o, (_, ids, _) in req.send.items():
                sizes[o, 3 + j] = ids.numel()
        recv_sizes = comm.exchange_sizes("fwd:sizes", sizes)
        bad = torch.nonzero(recv_sizes[:, 2]).flatten().tolist()
        if bad:
            raise DistributedError(f"rank {rank}: the forward's input was invalid on rank(s) {bad}; "
                                   "see their errors")
        src_batch = recv_sizes[:, 0].tolist()
        row_mean = mean and any(p.kind in ("row", "exact") for p in self.parts)
        need_w = bool(recv_sizes[:, 1].any()) or row_mean
        nfeat = [len(self._by_table[p.table]) for p in self.parts]
        served = [rank in p.owners for p in self.parts]
        # 2. ids (with each owner's per-bag counts) to their owners
        send_ids: list[list[torch.Tensor]] = [[] for _ in range(world)]
        send_w: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for req in requests:
            for o, (counts, ids, w) in req.send.items():
                send_ids[o] += [counts, ids]
                send_w[o].append(w if w is not None else torch.ones(ids.numel()))
        send_splits = [sum(int(x.numel()) for x in send_ids[o]) for o in range(world)]
        recv_n = [int(recv_sizes[r, 3:].sum()) for r in range(world)]
        recv_splits = [recv_n[r] + sum(nfeat[j] * src_batch[r] for j in range(nparts) if served[j])
                       for r in range(world)]
        flat = torch.cat([x for o in range(world) for x in send_ids[o]] or
                         [torch.empty(0, dtype=torch.int64)])
        got = comm.exchange("fwd:ids", flat.to(self.id_dtype), send_splits, recv_splits)
        got = got.to(torch.int64)
        got_w = None
        if need_w:
            wflat = torch.cat([x for o in range(world) for x in send_w[o]] or [torch.empty(0)])
            got_w = comm.exchange("fwd:weights", wflat.to(torch.float32),
                                  [int(sizes[o, 3:].sum()) for o in range(world)], recv_n)
        # 3. owners serve their parts of every bag, in global order
        pieces = got.split(recv_splits)
        wpieces = got_w.split(recv_n) if got_w is not None else None
        cursor, wcursor = [0] * world, [0] * world
        serves: list[_Serve | None] = []
        back: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for j, part in enumerate(self.parts):
            if not served[j]:
                serves.append(None)
                continue
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
            serve, rows = self._serve(part, nfeat[j], src_batch, cnts, idss,
                                      ws if wpieces is not None else None, train)
            for r in range(world):
                if rows[r] is not None:
                    back[r].append(self._wire(rows[r]).reshape(-1))
            serves.append(serve)
        # 4. pooled bags / partials / rows back to the requesting ranks
        blocks = self._exchange_back(back, requests)
        feats_out: dict[str, torch.Tensor] = {}
        acc_of: dict[str, torch.Tensor] = {}
        for req, blk in zip(requests, blocks):
            part = req.part
            dim = store.specs[part.table].dim
            acc = acc_of.setdefault(part.table, torch.zeros(req.bags, dim))
            if part.kind in ("table", "column", "colrow"):
                acc[:, part.col : part.col + part.dim] = blk[part.owners[0]]
            elif part.kind == "data":
                acc.copy_(blk[rank])
            elif part.kind == "row":  # partial sums, added in owner-rank order from zero
                for o in part.owners:
                    if blk[o].shape[0]:
                        acc[req.fwd_mask[o]] += blk[o]
            else:  # exact: the owners' unique rows, pooled here as one process pools them
                rows = torch.cat([blk[o] for o in part.owners])
                acc.copy_(pool_rows(rows, req.exact_index, req.offsets, req.weights, self.mode))
        for t, acc in acc_of.items():
            for k, f in enumerate(self._by_table[t]):
                feats_out[f] = acc[k * batch : (k + 1) * batch]
        pooled_all = torch.cat([feats_out[f] for f in self.feature_names], dim=1) \
            if batch else torch.zeros(0, sum(self.dims))
        return pooled_all.to(store.local.device), requests, serves

    def _serve(self, part: Part, nfeat: int, src_batch: list[int], cnts: list[torch.Tensor],
               idss: list[torch.Tensor], ws: list[torch.Tensor] | None, train: bool
               ) -> tuple[_Serve, list[torch.Tensor | None]]:
        """Pool (or gather) this rank's part of every source's bags; the blocks to send back."""
        local, world, rank = self.store.local, self.store.world_size, self.store.rank
        table = part.table
        cnt_sm = torch.cat(cnts)
        ids_sm = torch.cat(idss)
        # global bag order: feature, then source rank, then sample
        bag_base = _excl_cumsum(torch.tensor([nfeat * b for b in src_batch]))[:-1]
        perm = torch.cat([torch.arange(src_batch[r]) + bag_base[r] + f * src_batch[r]
                          for f in range(nfeat) for r in range(world)]) \
            if sum(src_batch) else torch.empty(0, dtype=torch.int64)
        cnt_g = cnt_sm.index_select(0, perm)
        pos = _segments(_excl_cumsum(cnt_sm)[:-1].index_select(0, perm), cnt_g)
        ids_g = ids_sm.index_select(0, pos)
        offs_g = _excl_cumsum(cnt_g)[:-1]
        psw = torch.cat(ws).index_select(0, pos) if ws is not None else None
        split = [nfeat * b for b in src_batch]
        if part.whole_bags:
            bwd_mask = torch.ones_like(cnt_sm, dtype=torch.bool)
            if self.mode == "mean":
                psw = None
        else:
            bwd_mask = cnt_sm > 0
        per_source = [int(m.sum()) for m in bwd_mask.split(split)]
        serve = _Serve(part, perm, bwd_mask, per_source)
        rows: list[torch.Tensor | None] = [None] * world
        if part.kind == "exact":
            g = local.gather(table, ids_g)
            for r, ids_r in enumerate(idss):
                uniq = torch.unique(ids_r, sorted=True)
                at = torch.searchsorted(g.unique, uniq).to(g.weights.device)
                rows[r] = g.weights.index_select(0, at).cpu()
            if train:
                serve.gathered, serve.offsets, serve.psw = g, offs_g, psw
            return serve, rows
        inner_mode = self.mode if part.whole_bags else "sum"
        if part.kind == "colrow":
            with torch.no_grad():
                pooled = _pool(local, table, ids_g, offs_g, psw, inner_mode)[:, : part.dim]
            if train:
                serve.ids, serve.offsets, serve.psw = ids_g, offs_g, psw
        else:
            with torch.set_grad_enabled(train):
                pooled = _pool(local, table, ids_g, offs_g, psw, inner_mode)
            serve.pooled = pooled if train else None
        flat = pooled.detach().cpu()  # the wire and the bookkeeping are on the CPU
        sm = torch.empty_like(flat)
        sm.index_copy_(0, perm, flat)  # back to source-major order
        fwd_mask = bwd_mask if part.kind == "row" else torch.ones_like(bwd_mask)
        per = sm[fwd_mask].split([int(m.sum()) for m in fwd_mask.split(split)])
        for r in range(world):
            if part.kind != "data" or r == rank:
                rows[r] = per[r]
        return serve, rows

    def _exchange_back(self, send: list[list[torch.Tensor]], requests: list[Request]
                       ) -> list[dict[int, torch.Tensor]]:
        """Owners -> requesters: per part, each owner's block [rows, dim] (float32 on arrival)."""
        comm, world = self.store.comm, self.store.world_size
        send_splits = [sum(int(x.numel()) for x in send[r]) for r in range(world)]
        recv_splits = [sum(req.fwd_rows.get(o, 0) * req.part.dim for req in requests)
                       for o in range(world)]
        flat = torch.cat([x for r in range(world) for x in send[r]] or
                         [torch.empty(0, dtype=self.comm_dtype)])
        got = comm.exchange("fwd:pooled", flat, send_splits, recv_splits).split(recv_splits)
        out: list[dict[int, torch.Tensor]] = []
        cursor = [0] * world
        for req in requests:
            blocks: dict[int, torch.Tensor] = {}
            for o, nrows in req.fwd_rows.items():
                k = nrows * req.part.dim
                blocks[o] = got[o][cursor[o] : cursor[o] + k].view(-1, req.part.dim).to(torch.float32)
                cursor[o] += k
            out.append(blocks)
        return out

    def backward_step(self, grad: torch.Tensor, batch: int, requests: list[Request],
                  serves: list[_Serve | None]) -> None:
        comm, world = self.store.comm, self.store.world_size
        cols = _excl_cumsum(torch.tensor(self.dims)).tolist()
        fcol = {f: cols[i] for i, f in enumerate(self.feature_names)}
        # 1. each bag's output gradient to the owners that pooled it
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for req in requests:
            p = req.part
            g = torch.cat([grad[:, fcol[f] + p.col : fcol[f] + p.col + p.dim]
                           for f in self._by_table[p.table]]) if batch else torch.zeros(0, p.dim)
            g = self._wire(g)
            for o, mask in req.bwd_mask.items():
                send[o].append(g[mask].reshape(-1))
        send_splits = [sum(int(x.numel()) for x in send[o]) for o in range(world)]
        recv_splits = [sum(s.per_source[r] * s.part.dim for s in serves if s is not None)
                       for r in range(world)]
        flat = torch.cat([x for o in range(world) for x in send[o]] or
                         [torch.empty(0, dtype=self.comm_dtype)])
        got = comm.exchange("bwd:grads", flat.contiguous(), send_splits, recv_splits)
        pieces = got.split(recv_splits)
        cursor = [0] * world
        # 2. owners run the single-process backward: the fused update of their rows
        colrows: list[tuple[_Serve, torch.Tensor]] = []
        for s in serves:
            if s is None:
                continue
            parts = []
            for r in range(world):
                k = s.per_source[r] * s.part.dim
                parts.append(pieces[r][cursor[r] : cursor[r] + k].view(-1, s.part.dim))
                cursor[r] += k
            g_sm = torch.zeros(s.bwd_mask.numel(), s.part.dim)
            g_sm[s.bwd_mask] = torch.cat(parts).to(torch.float32)
            g_glob = g_sm.index_select(0, s.perm)
            if s.part.kind == "colrow":
                colrows.append((s, g_glob))
            elif s.gathered is not None:
                g = s.gathered
                self.store.local.apply_bags(s.part.table, g.unique, g.inverse, s.offsets, g_glob,
                                            s.psw, "sum")
            elif s.pooled is not None and s.pooled.requires_grad:
                torch.autograd.backward(s.pooled, g_glob.to(s.pooled.device))
            s.pooled = s.gathered = None
        if any(p.kind == "colrow" for p in self.parts):
            self._colrow_update(colrows)

    def _colrow_update(self, colrows: list[tuple[_Serve, torch.Tensor]]) -> None:
        """Row-wise Adagrad over column shards: exchange the decayed gradient columns, then update."""
        store, world = self.store, self.store.world_size
        local = store.local
        work = []
        send: list[list[torch.Tensor]] = [[] for _ in range(world)]
        for s, g_glob in colrows:
            spec = store.specs[s.part.table]
            grads = validate.bag_gradients(spec, g_glob, s.psw)
            uniq, inv = torch.unique(s.ids, sorted=True, return_inverse=True)
            scale = None
            if self.mode == "mean":
                lens = torch.diff(s.offsets, append=torch.tensor([s.ids.numel()]))
                scale = (1.0 / lens.clamp(min=1).to(torch.float32)).repeat_interleave(lens)
            if s.psw is not None:
                scale = s.psw if scale is None else scale * s.psw
            g = colwise.summed_grads(inv, uniq.numel(), s.offsets, grads, scale)
            cur = local.read(s.part.table, uniq).cpu()
            g = colwise.decayed(spec.optimizer, g, cur[:, : s.part.dim])
            work.append((s, uniq, g, cur[:, s.part.dim]))
            for o in store.plan.placement(s.part.table).shards:
                send[o].append(g.reshape(-1))
        # what each peer sends: its shard's columns of every row this rank updates too
        recv_splits = [0] * world
        for s, uniq, _, _ in work:
            widths = [p.dim for p in self.parts if p.table == s.part.table]
            for o, w in zip(store.plan.placement(s.part.table).shards, widths):
                recv_splits[o] += uniq.numel() * w
        send_splits = [sum(int(x.numel()) for x in send[o]) for o in range(world)]
        flat = torch.cat([x for o in range(world) for x in send[o]] or [torch.empty(0)])
        got = store.comm.exchange("bwd:colsq", flat, send_splits, recv_splits).split(recv_splits)
        cursor = [0] * world
        for s, uniq, _, acc in work:
            cols = []
            widths = [p.dim for p in self.parts if p.table == s.part.table]
            for o, w in zip(store.plan.placement(s.part.table).shards, widths):
                k = uniq.numel() * w
                cols.append(got[o][cursor[o] : cursor[o] + k].view(-1, w))
                cursor[o] += k
            g_full = torch.cat(cols, dim=1)
            spec = store.specs[s.part.table]
            upd = colwise.local_grads(spec.optimizer, g_full, s.part.col, s.part.dim, acc)
            if uniq.numel():
                local.apply_unique(s.part.table, uniq, upd)
            s.ids = None
