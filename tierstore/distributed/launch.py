"""Run a function on N local gloo ranks (unit tests, benchmarks, laptops): no torchrun needed."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import pickle
import socket
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .errors import DistributedError


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn: Callable, args: tuple, q: Any,
           timeout_s: float, threads: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        q.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))  # tensors by value
    except BaseException:
        q.put((rank, "err", traceback.format_exc()))
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def run_local(world: int, fn: Callable, *args: Any, timeout_s: float = 600.0,
              preload: Sequence[str] = (), threads: int = 1) -> dict[int, Any]:
    """fn(rank, world, *args) on `world` gloo ranks of this machine; {rank: result}.

    Ranks fork from a clean server process (torch preloaded), so they start fast and inherit no
    threads. `fn` must be importable by name (a module-level function). A rank that fails or
    dies (e.g. `kill -9`) makes this raise DistributedError, with every rank's error.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "tierstore", "tierstore.distributed", *preload])
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q, timeout_s, threads),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead: dict[int, float] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DistributedError(f"local ranks did not finish in {timeout_s:g} s")
            try:
                rank, status, value = q.get(timeout=min(left, 1.0))
            except Exception:  # nothing new: a rank that exited without a word died (kill -9)
                for r, p in enumerate(procs):
                    if r not in results and r not in errors and p.exitcode is not None:
                        dead.setdefault(r, time.monotonic())
                        if time.monotonic() - dead[r] > 2.0:  # its last message had time to land
                            errors[r] = f"died with exit code {p.exitcode} before returning"
                continue
            if status == "ok":
                results[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise DistributedError("\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items())))
    return results
