"""FileStorage: HiCache's third tier, KV pages as files in a directory that outlives the server.

A storage page is `page_len` tokens (a multiple of the KV page size; at least
`MIN_STORAGE_PAGE_TOKENS`, so a page-size-1 server does not write one file per token). Page i
of a token sequence is keyed by a hash chain:

    h_0 = sha256(model fingerprint), h_i = sha256(h_{i-1} || page tokens (int64 LE) || namespace)

(hex digests; the namespace is the request's extra_key), so equal pages under different
prefixes, namespaces or models never share a key. One file per page, `<dir>/<h[:2]>/<h>.kv`,
holds that page's rows of every buffer of the KV pool (`torch.save` of a header and one
tensor `[page_len, ...]` per buffer, in the pool's `buffers` order: for MHA each layer's K,
then each layer's V; for MLA each layer's latent row); the header (format, fingerprint,
each tensor's dtype and shape) is checked on every read, so a server with another model or
layout never reads wrong data.

Writes run on one background thread behind a bounded queue: `put` never blocks the
scheduler (a full queue drops the page and counts it). A file appears atomically (written
to a temporary name, then renamed). Reads are synchronous (`get`), on the scheduler thread.

Faults stay contained: a directory that cannot be created or written is refused when the
tier is built (ValueError naming --hicache-storage-dir); a page that does not load (torn,
truncated, garbage, another layout) is a miss and its file is removed; a failing writer (a
full disk) logs its first error once and counts the rest (`num_failed_pages`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import queue
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

FORMAT = "sglite-kv-page-2"
MIN_STORAGE_PAGE_TOKENS = 64
WRITE_QUEUE_PAGES = 256
MAX_LOGGED_BAD_PAGES = 8


def storage_page_len(page_size: int) -> int:
    return max(page_size, -(-MIN_STORAGE_PAGE_TOKENS // page_size) * page_size)


def chain_hashes(
    tokens: np.ndarray, page_len: int, seed: str, extra_key: str | None, prev: list[str]
) -> list[str]:
    """Hashes of every whole page of `tokens`, reusing `prev` (hashes of a prefix of them)."""
    ns = (extra_key or "").encode()
    out = list(prev)
    tokens = np.asarray(tokens, dtype="<i8")
    for i in range(len(out), len(tokens) // page_len):
        h = hashlib.sha256((out[-1] if out else seed).encode())
        h.update(tokens[i * page_len : (i + 1) * page_len].tobytes())
        h.update(ns)
        out.append(h.hexdigest())
    return out


def check_writable(directory: Path) -> None:
    """Create `directory` if needed and prove a file can be written there, or raise."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(
            f"--hicache-storage-dir {str(directory)!r}: the HiCache file tier cannot write "
            f"there ({e.strerror or e}); give a writable directory"
        ) from None


class FileStorage:
    def __init__(self, directory: str | os.PathLike, fingerprint: str, page_len: int) -> None:
        self.dir = Path(directory)
        check_writable(self.dir)
        self.fingerprint = fingerprint
        self.seed = hashlib.sha256(fingerprint.encode()).hexdigest()
        self.page_len = page_len
        self.num_written_pages = 0
        self.num_dropped_pages = 0
        self.num_read_pages = 0
        self.num_bad_pages = 0
        self.num_failed_pages = 0  # writes that failed (logged once)
        self.known: set[str] = set()  # pages written or queued by this process
        self._queue: queue.Queue = queue.Queue(WRITE_QUEUE_PAGES)
        self._thread = threading.Thread(target=self._writer, name="hicache-file", daemon=True)
        self._thread.start()

    def hashes(self, tokens: np.ndarray, extra_key: str | None, prev: list[str]) -> list[str]:
        return chain_hashes(tokens, self.page_len, self.seed, extra_key, prev)

    def path(self, h: str) -> Path:
        return self.dir / h[:2] / f"{h}.kv"

    def contains(self, h: str) -> bool:
        if h in self.known:
            return True
        if self.path(h).exists():  # written by an earlier server (or another process)
            self.known.add(h)
            return True
        return False

    # ---------------------------------------------------------------- writes
    def put(self, h: str, page: list[torch.Tensor]) -> bool:
        """Queue one page (one `[page_len, ...]` tensor per pool buffer, CPU copies the caller
        no longer touches); False when the queue is full (the page is dropped)."""
        if self.contains(h):
            return True
        try:
            self._queue.put_nowait((h, page))
        except queue.Full:
            self.num_dropped_pages += 1
            return False
        self.known.add(h)
        return True

    def _writer(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception as e:  # a full disk must not kill the server: the page is a miss
                self._write_failed(e)
                self.known.discard(item[0])
            finally:
                self._queue.task_done()

    def _write(self, h: str, page: list[torch.Tensor]) -> None:
        path = self.path(h)
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
        header = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "specs": [[str(t.dtype), list(t.shape)] for t in page],
        }
        try:
            torch.save({"header": header, "buffers": [t.contiguous() for t in page]}, tmp)
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # no half-written file left behind
            raise
        self.num_written_pages += 1

    def _write_failed(self, e: Exception) -> None:
        self.num_failed_pages += 1
        if self.num_failed_pages == 1:  # once: a full disk fails every page after it too
            logger.warning(
                "HiCache file tier: writing a page into %s failed (%s: %s); pages that cannot "
                "be written are misses (counted in hicache_storage_failed_pages, not logged "
                "again)",
                self.dir, type(e).__name__, e,
            )  # fmt: skip

    def flush(self) -> None:
        """Wait until every queued page is on disk (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    # ---------------------------------------------------------------- reads
    def get(self, h: str, specs: list[tuple[torch.dtype, tuple[int, ...]]]):
        """The tensors of page `h` (one per pool buffer, `specs` their dtypes and shapes), or
        None when it is missing or does not load as a page of this server (then its file is
        removed: it would fail again)."""
        path = self.path(h)
        try:
            data = torch.load(path, map_location="cpu", weights_only=True)
        except FileNotFoundError:  # removed by another process, or never finished
            self.known.discard(h)
            return None
        except Exception as e:  # torn or foreign bytes: pickle, zip, key, type errors...
            self._drop_bad(h, f"{type(e).__name__}: {e}")
            return None
        if not isinstance(data, dict):
            self._drop_bad(h, f"holds a {type(data).__name__}, not a page")
            return None
        header, page = data.get("header") or {}, data.get("buffers")
        want = [[str(dtype), list(shape)] for dtype, shape in specs]
        ok = (
            isinstance(header, dict)
            and header.get("format") == FORMAT
            and header.get("fingerprint") == self.fingerprint
            and header.get("specs") == want
            and isinstance(page, list)
            and len(page) == len(specs)
            and all(
                isinstance(t, torch.Tensor) and t.dtype == dtype and tuple(t.shape) == tuple(shape)
                for t, (dtype, shape) in zip(page, specs)
            )
        )
        if not ok:
            self._drop_bad(h, "its header or tensors do not match this server's layout")
            return None
        self.num_read_pages += 1
        return page

    def _drop_bad(self, h: str, why: str) -> None:
        self.num_bad_pages += 1
        self.known.discard(h)
        if self.num_bad_pages <= MAX_LOGGED_BAD_PAGES:
            logger.warning(
                "HiCache file tier: page %s does not load (%s); removed, recomputed%s",
                self.path(h), why[:200],
                "" if self.num_bad_pages < MAX_LOGGED_BAD_PAGES else " (no more such lines)",
            )  # fmt: skip
        try:
            self.path(h).unlink()
        except OSError:
            pass

    def lookup(self, hashes: list[str], start: int) -> int:
        """How many consecutive pages from `start` exist."""
        n = 0
        while start + n < len(hashes) and self.contains(hashes[start + n]):
            n += 1
        return n
