"""Tensor-parallel communication: the TP process group and the collectives the model needs.

`init_tp_group(tp_size, tp_rank, dist_init_addr, device)` returns a `TPGroup`:

- tp_size 1: `NullTPGroup`, no process group at all; its collectives return their input, and
  the layers never call them (a tp_size 1 forward runs exactly the ops it ran before TP).
- tp_size > 1: `TorchTPGroup` over `torch.distributed` (gloo on CPU, NCCL on CUDA). Every rank
  connects to `dist_init_addr` ("host:port", rank 0 listens there); the rendezvous gives up
  after `timeout_s` with a RuntimeError naming the ranks that did not arrive, instead of
  hanging.

Contract: every rank calls the same collectives in the same order with tensors of the same
shape (the model's forward does, since every rank runs the same batch). All-reduce and
all-gather leave the same values on every rank.
"""

from __future__ import annotations

import datetime
import logging

import torch

from sglite.tp_sizes import check_tp_size as check_tp_size
from sglite.tp_sizes import local_head_counts as local_head_counts
from sglite.tp_sizes import valid_tp_sizes as valid_tp_sizes

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 60.0


class TPGroup:
    """The ranks that split one model. `size` ranks, this process is `rank`."""

    size: int = 1
    rank: int = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (may reuse `x`'s storage)."""
        raise NotImplementedError

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """The ranks' `x` concatenated along `dim`, in rank order."""
        raise NotImplementedError

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` of rank `src` on every rank (written into `x`)."""
        raise NotImplementedError

    def min_int(self, value: int) -> int:
        """The smallest `value` of any rank (start-up agreement, e.g. the KV pool size)."""
        raise NotImplementedError

    def broadcast_bytes(self, data: bytes | None, flag: bool = False) -> tuple[bytes, bool]:
        """(rank 0's `data` on every rank (the others pass None), whether any rank raised
        `flag`), over a CPU (gloo) group of its own, so a thread may call it while another
        runs the model's collectives."""
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def destroy(self) -> None:
        raise NotImplementedError


class NullTPGroup(TPGroup):
    """tp_size 1: no process group; every collective is the identity."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        return x

    def min_int(self, value: int) -> int:
        return value

    def broadcast_bytes(self, data: bytes | None, flag: bool = False) -> tuple[bytes, bool]:
        return data or b"", flag

    def barrier(self) -> None:
        pass

    def destroy(self) -> None:
        pass


NULL_TP_GROUP = NullTPGroup()


class TorchTPGroup(TPGroup):
    """A torch.distributed process group of `size` ranks (this process's default group)."""

    def __init__(self, size: int, rank: int, group, cpu_group=None) -> None:
        self.size, self.rank, self.group = size, rank, group
        self.cpu_group = cpu_group if cpu_group is not None else group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        import torch.distributed as dist

        dist.broadcast(x, src=src, group=self.group)
        return x

    def min_int(self, value: int) -> int:
        import torch.distributed as dist

        device = "cuda" if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def broadcast_bytes(self, data: bytes | None, flag: bool = False) -> tuple[bytes, bool]:
        import torch.distributed as dist

        # one collective when there is nothing to say (the common case), two otherwise: a
        # sum of (rank 0's length, the others give 0; the flags), then the bytes
        size = len(data) if self.rank == 0 and data else 0
        head = torch.tensor([size, int(flag)], dtype=torch.int64)
        dist.all_reduce(head, group=self.cpu_group)
        n, flagged = int(head[0]), bool(head[1])
        if not n:
            return b"", flagged
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cpu_group)
        return (data if self.rank == 0 else buf.numpy().tobytes()), flagged

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def destroy(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def split_cpu_threads(ranks_on_node: int) -> int:
    """CPU TP: give each of this node's ranks its share of the cores (at least one) as its
    torch threads, instead of every rank starting one thread per core. Returns the count."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(ranks_on_node, 1))
    torch.set_num_threads(threads)
    return threads


def _parse_addr(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def _rendezvous(host: str, port: int, tp_size: int, tp_rank: int, addr: str, timeout_s: float):
    """Meet at rank 0's TCPStore; every rank checks in under its own key, so rank 0 can name
    the ranks that never arrived (RuntimeError after `timeout_s`)."""
    import time

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(
            host, port, tp_size, is_master=tp_rank == 0, timeout=timeout, wait_for_workers=False
        )
        store.set(f"sglite/joined/{tp_rank}", "1")
    except (RuntimeError, OSError) as e:
        where = "listen" if tp_rank == 0 else "reach TP rank 0"
        raise RuntimeError(
            f"TP rank {tp_rank}/{tp_size}: could not {where} at {addr} within {timeout_s:g} s "
            f"({e}); is every node started with the same --dist-init-addr?"
        ) from e
    if tp_rank != 0:
        return store
    deadline = time.monotonic() + timeout_s
    missing = list(range(1, tp_size))
    while missing and time.monotonic() < deadline:
        missing = [r for r in missing if not store.check([f"sglite/joined/{r}"])]
        time.sleep(0.05 if missing else 0)
    if missing:
        raise RuntimeError(
            f"TP rank(s) {', '.join(map(str, missing))} of {tp_size} did not join the "
            f"rendezvous at {addr} within {timeout_s:g} s (--dist-timeout); are they started "
            "(with --nnodes, every node with its --node-rank and the same --dist-init-addr)?"
        )
    return store


def init_tp_group(
    tp_size: int,
    tp_rank: int,
    dist_init_addr: str | None,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> TPGroup:
    """Join the TP group (see the module docstring). tp_size 1 creates nothing."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(
            f"tp_rank must be in [0, tp_size), got tp_rank={tp_rank}, tp_size={tp_size}"
        )
    if tp_size == 1:
        return NULL_TP_GROUP
    if dist_init_addr is None:
        raise ValueError(
            f"tp_size {tp_size} needs dist_init_addr (host:port where rank 0 listens, the same "
            "on every rank)"
        )
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed group")
    host, port = _parse_addr(dist_init_addr)
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _rendezvous(host, port, tp_size, tp_rank, dist_init_addr, timeout_s)
    try:
        dist.init_process_group(
            backend, store=store, world_size=tp_size, rank=tp_rank, timeout=timeout
        )
    except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError
        raise RuntimeError(
            f"TP rank {tp_rank}/{tp_size}: joining the process group at {dist_init_addr} "
            f"failed within {timeout_s:g} s ({e})"
        ) from e
    cpu_group = dist.new_group(backend="gloo", timeout=timeout)  # for broadcast_bytes
    group = TorchTPGroup(tp_size, tp_rank, dist.group.WORLD, cpu_group)
    group.barrier()  # every rank is there (and NCCL's communicator is built) before loading
    logger.info(
        "TP rank %d/%d joined the group at %s (%s)", tp_rank, tp_size, dist_init_addr, backend
    )
    return group
