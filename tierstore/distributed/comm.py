"""Collectives of the sharded store on its own process group: all-to-all, agreement, counters."""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import ConfigError, TierstoreError
from .errors import DistributedError, RankFailureError

DEFAULT_TIMEOUT_S = 300.0


@dataclass
class CommStats:
    """Bytes sent to other ranks and seconds spent inside collectives, per named phase."""

    bytes_sent: int = 0
    seconds: float = 0.0
    calls: int = 0

    def as_dict(self) -> dict:
        """Plain dict for reports."""
        return {"bytes_sent": self.bytes_sent, "seconds": self.seconds, "calls": self.calls}


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    """Validate a timeout (seconds or timedelta)."""
    if timeout is None:
        return DEFAULT_TIMEOUT_S
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


class Comm:
    """One process group of the sharded store; every call is collective over its ranks."""

    def __init__(self, timeout_s: float, backend: str = "gloo", name: str = "step") -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ConfigError("tierstore.distributed needs torch.distributed initialized "
                              "(dist.init_process_group) before a sharded store is opened")
        self.timeout_s = timeout_s
        self.name = name
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = backend
        self.device = torch.device("cuda", torch.cuda.current_device()) \
            if backend == "nccl" else torch.device("cpu")
        self.group = dist.new_group(backend=backend,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        self.stats: dict[str, CommStats] = {}

    def _fail(self, what: str, exc: BaseException) -> RankFailureError:
        return RankFailureError(
            f"rank {self.rank}: collective '{what}' on the {self.name} group failed; a peer rank "
            f"died or did not answer within {self.timeout_s:g} s: {exc}")

    def _count(self, what: str, nbytes: int, t0: float) -> None:
        st = self.stats.setdefault(what, CommStats())
        st.bytes_sent += nbytes
        st.seconds += time.perf_counter() - t0
        st.calls += 1

    def exchange(self, what: str, send: torch.Tensor, send_splits: Sequence[int],
                 recv_splits: Sequence[int]) -> torch.Tensor:
        """all_to_all_single of a 1-D tensor: send_splits[r] elements go to rank r."""
        send_splits, recv_splits = [int(s) for s in send_splits], [int(s) for s in recv_splits]
        out = torch.empty(sum(recv_splits), dtype=send.dtype, device=self.device)
        t0 = time.perf_counter()
        if self.world == 1:
            out.copy_(send)
        else:
            try:
                dist.all_to_all_single(out, send.to(self.device).contiguous(), recv_splits,
                                       send_splits, group=self.group)
            except (RuntimeError, dist.DistError) as exc:
                raise self._fail(what, exc) from exc
        sent = (sum(send_splits) - send_splits[self.rank]) * send.element_size()
        self._count(what, sent, t0)
        return out.cpu()

    def exchange_sizes(self, what: str, sizes: torch.Tensor) -> torch.Tensor:
        """Each rank sends row r of `sizes` [world, k] (int64) to rank r; returns [world, k]."""
        k = sizes.shape[1]
        out = self.exchange(what, sizes.reshape(-1).to(torch.int64), [k] * self.world,
                            [k] * self.world)
        return out.view(self.world, k)

    def all_gather_int(self, what: str, values: Sequence[int]) -> torch.Tensor:
        """[world, k] int64: every rank's `values`."""
        mine = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        out = [torch.empty_like(mine) for _ in range(self.world)]
        t0 = time.perf_counter()
        if self.world == 1:
            out = [mine]
        else:
            try:
                dist.all_gather(out, mine, group=self.group)
            except (RuntimeError, dist.DistError) as exc:
                raise self._fail(what, exc) from exc
        self._count(what, (self.world - 1) * mine.numel() * 8, t0)
        return torch.stack(out).cpu()

    def agree(self, what: str, err: BaseException | None) -> None:
        """Collective: raise on every rank when any rank failed (its own error where it failed)."""
        flags = self.all_gather_int(what, [0 if err is None else 1])[:, 0]
        if err is not None:
            raise err
        bad = torch.nonzero(flags).flatten().tolist()
        if bad:
            raise DistributedError(f"rank {self.rank}: '{what}' failed on rank(s) {bad}; "
                                   "see their errors")

    def broadcast_object(self, what: str, obj: object, src: int = 0) -> object:
        """Collective: rank `src`'s picklable `obj` on every rank."""
        box = [obj]
        t0 = time.perf_counter()
        if self.world > 1:
            try:
                dist.broadcast_object_list(box, src=src, group=self.group)
            except (RuntimeError, dist.DistError) as exc:
                raise self._fail(what, exc) from exc
        self._count(what, 0, t0)
        return box[0]

    def barrier(self, what: str) -> None:
        """Collective barrier under the timeout."""
        self.all_gather_int(what, [0])

    def destroy(self) -> None:
        """Release the process group (best effort)."""
        try:
            dist.destroy_process_group(self.group)
        except Exception:
            pass


def guarded(comm: Comm, what: str, fn):
    """Run `fn` locally, agree on success over the group, return its result (raise everywhere on error)."""
    err: BaseException | None = None
    result = None
    try:
        result = fn()
    except TierstoreError as exc:
        err = exc
    comm.agree(what, err)
    return result
