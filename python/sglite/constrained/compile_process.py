"""CompileProcess: one grammar compile at a time in a child process, stopped at a deadline or a
memory cap, so a hostile grammar costs the scheduler neither a thread nor its heap.

xgrammar cannot cancel a compile. Run on a scheduler thread, a compile that timed out kept its
thread busy to the end, and the heap it grew (hundreds of MB for a 20,000-value enum) stayed
with the scheduler after it finished. Here each compile thread owns a child process
(`python -m sglite.constrained.compile_process`), started on its first compile and reused:

- start-up: the parent sends the model's xgrammar TokenizerInfo (serialized) once; the child
  builds its GrammarCompiler and reports its idle resident memory. Starting (importing
  xgrammar) is not charged to any compile's deadline.
- a compile: the parent sends (kind, text); the child answers with the compiled grammar
  serialized (xgrammar's JSON, deserialized by the parent for its matchers), or the error.
  The parent waits at most `timeout_s`, and meanwhile reads the child's resident memory every
  POLL_S: past the deadline (CompileTimeout), or past `max_memory_bytes` above the child's idle
  footprint (GrammarError, too large), it kills the child and starts the next one at once.
- the child refuses a compiled grammar over `max_compiled_bytes` (the scheduler would hold it,
  and deserialize it first).
- a child that grew by more than RECYCLE_BYTES is replaced after it answered: its heap goes
  back to the OS with it. A child that died by itself is started again by the next compile.

Protocol: length-prefixed pickles on the child's stdin and on a private copy of its stdout
(fd 1 is pointed at stderr in the child, so a library's print cannot corrupt the stream). A
child whose parent died reads EOF and exits.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import time
from typing import Any, BinaryIO

from sglite.constrained.base import GrammarError, GrammarKey

POLL_S = 0.02
START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a busy machine
RECYCLE_BYTES = 256 << 20
COMPILED_SHARE = 16  # a compiled grammar may take 1/16 of the compile memory cap
_HEADER = struct.Struct("<Q")


class CompileTimeout(Exception):
    """The compile ran past its deadline and was stopped (the request gets a 503)."""


class CompileCrashed(Exception):
    """The compile process died without an answer (the request gets a 500)."""


def _send(stream: BinaryIO, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read_exact(fd: int, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError("the compile process closed its pipe")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(fd: int) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return pickle.loads(_read_exact(fd, n))


def resident_bytes(pid: int) -> int | None:
    """Resident memory of process `pid` (Linux /proc), None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class CompileProcess:
    """A child that compiles grammars for one TokenizerInfo (`tokenizer_info_json`, which may
    be set after `spawn()`, before the first compile)."""

    def __init__(
        self,
        tokenizer_info_json: str | None,
        *,
        timeout_s: float,
        max_memory_bytes: int,
        max_compiled_bytes: int,
        max_threads: int = 1,
    ):
        self.init = {
            "tokenizer_info": tokenizer_info_json,
            "max_threads": max_threads,
            "max_compiled_bytes": max_compiled_bytes,
        }
        self.timeout_s = timeout_s
        self.max_memory_bytes = max_memory_bytes
        self.proc: subprocess.Popen | None = None
        self.initialized = False  # the child got its TokenizerInfo and answered "ready"
        self.idle_bytes = 0  # the child's resident memory before its first compile
        self.num_started = 0
        self.num_killed = 0

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def compile(self, key: GrammarKey) -> tuple[str, str]:
        """("ok", serialized compiled grammar) or ("invalid", xgrammar's message); raises
        CompileTimeout, GrammarError (memory) or CompileCrashed."""
        proc = self._started()
        try:
            _send(proc.stdin, tuple(key))
        except OSError as e:  # it died since its last answer
            self._lost()
            raise CompileCrashed(f"the compile process is gone: {e}") from None
        deadline = time.monotonic() + self.timeout_s
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], POLL_S)
            if ready:
                break
            if proc.poll() is not None:
                self._lost()
                raise CompileCrashed(f"the compile process exited with code {proc.returncode}")
            used = resident_bytes(proc.pid)
            if used is not None and used - self.idle_bytes > self.max_memory_bytes:
                self.kill()
                mb = self.max_memory_bytes >> 20
                raise GrammarError(
                    f"{key[0]}: the grammar is too large: compiling it took more than {mb} MB "
                    "(--grammar-compile-max-memory-mb)"
                )
            if time.monotonic() >= deadline:
                self.kill()
                raise CompileTimeout(
                    f"{key[0]}: the grammar did not compile within {self.timeout_s:g} s "
                    "(--grammar-compile-timeout); its compile was stopped"
                )
        try:
            status, payload = _recv(fd)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self._lost()
            raise CompileCrashed(f"the compile process died: {e}") from None
        used = resident_bytes(proc.pid)
        if used is not None and used - self.idle_bytes > RECYCLE_BYTES:
            self.kill()  # give its grown heap back; the next compile starts a fresh child
        if status == "too_large":
            mb = self.init["max_compiled_bytes"] >> 20
            raise GrammarError(
                f"{key[0]}: the grammar is too large: it compiles to {payload >> 20} MB, over "
                f"{mb} MB (1/{COMPILED_SHARE} of --grammar-compile-max-memory-mb)"
            )
        if status == "failed":
            raise CompileCrashed(payload)
        return status, payload

    def kill(self, respawn: bool = True) -> None:
        """Stop the child; with `respawn`, start the next one at once (it imports meanwhile)."""
        if self.proc is not None:
            self.num_killed += 1
            self.proc.kill()
            self._lost()
        if respawn:
            self.spawn()

    def close(self) -> None:
        """Stop the child (EOF on its stdin, then kill if it lingers)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def _lost(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:  # a broken pipe
                    pass

    def spawn(self) -> None:
        """Start the child now (it imports xgrammar while the caller does other work)."""
        if self.proc is None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglite.constrained.compile_process"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
            self.num_started += 1
            self.initialized = False

    def _started(self) -> subprocess.Popen:
        if self.proc is not None and self.proc.poll() is None and self.initialized:
            return self.proc
        if self.proc is not None and self.proc.poll() is not None:
            self._lost()
        self.spawn()
        proc = self.proc
        try:
            _send(proc.stdin, self.init)
        except OSError as e:
            self.kill(respawn=False)
            raise CompileCrashed(f"the compile process did not start: {e}") from None
        ready, _, _ = select.select([proc.stdout.fileno()], [], [], START_TIMEOUT_S)
        try:
            if not ready:
                raise EOFError(f"not ready after {START_TIMEOUT_S:g} s")
            status, self.idle_bytes = _recv(proc.stdout.fileno())
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            self.kill(respawn=False)
            raise CompileCrashed(f"the compile process did not start: {e}") from None
        self.initialized = True
        return proc


def _child_main() -> None:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints (libraries) go to stderr, not into the protocol
    fd = sys.stdin.buffer.fileno()
    # first: the parent builds the TokenizerInfo meanwhile. This child imports torch (~0.4 GB
    # RSS) only because xgrammar does at import (its matcher module); it exists only once a
    # constrained request arrived, and compiles need nothing of torch.
    import xgrammar as xgr

    try:
        init = _recv(fd)
    except EOFError:
        return
    info = xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"])
    compiler = xgr.GrammarCompiler(info, max_threads=init["max_threads"], cache_enabled=False)
    _send(out, ("ready", resident_bytes(os.getpid()) or 0))
    while True:
        try:
            kind, text = _recv(fd)
        except EOFError:
            return
        try:
            if kind == "json_schema":
                compiled = compiler.compile_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                compiled = compiler.compile_regex(text)
            elif kind == "ebnf":
                compiled = compiler.compile_grammar(text)
            else:
                _send(out, ("invalid", f"unknown grammar kind {kind!r}"))
                continue
        except RuntimeError as e:  # xgrammar's way of saying the grammar is invalid
            _send(out, ("invalid", str(e)))
            continue
        except Exception as e:  # noqa: BLE001 - reported to the parent, which decides
            _send(out, ("failed", f"{kind}: the grammar failed to compile: {e}"))
            continue
        size = compiled.memory_size_bytes
        if size > init["max_compiled_bytes"]:
            _send(out, ("too_large", size))
        else:
            _send(out, ("ok", compiled.serialize_json()))
        del compiled


if __name__ == "__main__":
    _child_main()
