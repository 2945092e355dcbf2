"""IPC plumbing: the three ZMQ addresses of a server instance and typed push/pull sockets.

Who binds what (only the long-lived ends bind, so a restart never races on a file):

    scheduler_input   TokenizerManager binds PUSH    scheduler connects PULL
    detokenizer       detokenizer binds PULL         scheduler connects PUSH
    tokenizer         TokenizerManager binds PULL    detokenizer and scheduler connect PUSH

Every socket carries records of `sglite.messages`, encoded with its codec. Addresses are
`ipc://` files in a fresh private temp directory; `IpcNames.cleanup()` removes it.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from sglite.messages import decode, encode


@dataclass(frozen=True)
class IpcNames:
    """The ZMQ endpoints of one server instance (picklable: passed to child processes)."""

    scheduler_input: str
    detokenizer: str
    tokenizer: str
    dir: str | None = None  # the temp directory holding the socket files, if allocated

    @classmethod
    def allocate(cls) -> IpcNames:
        """Fresh endpoints in a new private temp directory (honours TMPDIR)."""
        base = tempfile.mkdtemp(prefix="sglite-")
        # Short names: a unix socket path must fit in ~107 bytes.
        return cls(
            scheduler_input=f"ipc://{base}/sched",
            detokenizer=f"ipc://{base}/detok",
            tokenizer=f"ipc://{base}/tok",
            dir=base,
        )

    def cleanup(self) -> None:
        """Remove the socket files and their directory (idempotent)."""
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            return
        for addr in (self.scheduler_input, self.detokenizer, self.tokenizer):
            if addr.startswith("ipc://"):
                Path(addr[len("ipc://") :]).unlink(missing_ok=True)


def _open(ctx: zmq.Context, kind: int, addr: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    # Unbounded queues: a slow peer must never block the sender's event loop.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(addr)
    else:
        sock.connect(addr)
    return sock


class Sender:
    """A PUSH socket that sends `messages` records."""

    def __init__(self, ctx: zmq.Context, addr: str, *, bind: bool = False):
        self.sock = _open(ctx, zmq.PUSH, addr, bind)

    def send(self, msg: Any) -> None:
        """Send without blocking; raises zmq.Again when no peer is connected."""
        self.sock.send(encode(msg), flags=zmq.NOBLOCK, copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)


class Receiver:
    """A PULL socket that yields `messages` records (blocking, with optional timeout)."""

    def __init__(self, ctx: zmq.Context, addr: str, *, bind: bool = False):
        self.sock = _open(ctx, zmq.PULL, addr, bind)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        """The next record; None when `timeout_ms` passes first (None = wait forever)."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        return decode(self.sock.recv())

    def recv_nowait(self) -> list[Any]:
        """Every record already queued, without waiting."""
        out = []
        while True:
            try:
                out.append(decode(self.sock.recv(flags=zmq.NOBLOCK)))
            except zmq.Again:
                return out

    def close(self) -> None:
        self.sock.close(linger=0)


class AsyncReceiver:
    """A PULL socket for asyncio code (the TokenizerManager's event loop)."""

    def __init__(self, ctx: zmq.asyncio.Context, addr: str, *, bind: bool = False):
        self.sock = _open(ctx, zmq.PULL, addr, bind)

    async def recv(self) -> Any:
        return decode(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
