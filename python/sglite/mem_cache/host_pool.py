"""HostKVPool: the host-memory copy of the KV cache (HiCache's second tier) and its copies.

Same layout as the device pool (`device_pool.like(host_slots, "cpu")`: for a `KVPool` per-layer
K and V buffers `[host_slots + page_size, kv_heads, head_dim]`, for an `MLAKVPool` one latent
row per layer; page 0 reserved), so a host slot index addresses rows exactly like a device
one. The copies move the pool's `buffers` (sglite.mem_cache.memory_pool), whatever they are.
Which host slot is free is the tree core's business (`RadixTree(host_slots=...)` owns a
host `PageAllocator`); this class only holds the bytes and moves them.

Copies are explicit gathers/scatters by slot index arrays: `backup(device_idx, host_idx)`
(device -> host) and `load(host_idx, device_idx)` (host -> device), of every buffer. On CUDA the host buffers
are pinned and the copies run on a side stream that first waits for the compute stream (so
the KV it reads is written); a copy is finished before the call returns (`synchronize`), so
the slots may be used at once. On CPU both pools are RAM, but they are separate buffers and
the copies are real (`index_select` + `index_copy_`). Bytes moved each way are counted.
"""

from __future__ import annotations

import numpy as np
import torch

from sglite.mem_cache.memory_pool import KVPool


class HostKVPool:
    def __init__(self, device_pool: KVPool, host_slots: int) -> None:
        d = device_pool
        self.device_pool = d
        self.device = d.device
        pin = self.device.type == "cuda"
        self.pool = d.like(host_slots, "cpu", pin_memory=pin)
        self.k_buffer, self.v_buffer = self.pool.k_buffer, self.pool.v_buffer
        self.buffers = self.pool.buffers
        self.num_slots, self.page_size, self.dtype = host_slots, d.page_size, d.dtype
        self.stream = torch.cuda.Stream(self.device) if pin else None
        self.bytes_per_slot = d.bytes_per_token
        self.num_bytes_to_host = 0
        self.num_bytes_to_device = 0

    @staticmethod
    def bytes_for(device_pool: KVPool, host_slots: int) -> int:
        return (host_slots + device_pool.page_size) * device_pool.bytes_per_token

    def memory_bytes(self) -> int:
        return self.pool.memory_bytes()

    # ---------------------------------------------------------------- copies
    def backup(self, device_idx: np.ndarray, host_idx: np.ndarray) -> None:
        """host[host_idx] = device[device_idx], every buffer."""
        if len(device_idx) != len(host_idx):
            raise ValueError(f"backup of {len(device_idx)} slots into {len(host_idx)} host slots")
        if not len(device_idx):
            return
        src = torch.as_tensor(np.asarray(device_idx, dtype=np.int64)).to(self.device)
        dst = torch.as_tensor(np.asarray(host_idx, dtype=np.int64))
        with self._on_side_stream():
            for dev_buf, host_buf in zip(self.device_pool.buffers, self.buffers):
                rows = dev_buf.index_select(0, src).to("cpu", non_blocking=False)
                host_buf.index_copy_(0, dst, rows)
        self.num_bytes_to_host += len(device_idx) * self.bytes_per_slot

    def load(self, host_idx: np.ndarray, device_idx: np.ndarray) -> None:
        """device[device_idx] = host[host_idx], every buffer."""
        if len(device_idx) != len(host_idx):
            raise ValueError(f"load of {len(host_idx)} host slots into {len(device_idx)} slots")
        if not len(device_idx):
            return
        src = torch.as_tensor(np.asarray(host_idx, dtype=np.int64))
        dst = torch.as_tensor(np.asarray(device_idx, dtype=np.int64)).to(self.device)
        with self._on_side_stream():
            for dev_buf, host_buf in zip(self.device_pool.buffers, self.buffers):
                rows = host_buf.index_select(0, src)
                if self.stream is not None:
                    rows = rows.pin_memory()
                dev_buf.index_copy_(0, dst, rows.to(self.device, non_blocking=True))
        self.num_bytes_to_device += len(device_idx) * self.bytes_per_slot

    def read_pages(self, host_idx: np.ndarray) -> list[torch.Tensor]:
        """The rows `host_idx` of every buffer, as CPU tensors (copies)."""
        src = torch.as_tensor(np.asarray(host_idx, dtype=np.int64))
        return [b.index_select(0, src) for b in self.buffers]

    def _on_side_stream(self):
        return _SideStream(self.stream, self.device)


class _SideStream:
    """Runs the block on `stream` after the compute stream's queued work; waits for it at exit
    (the copied slots are used right after the call)."""

    def __init__(self, stream, device: torch.device) -> None:
        self.stream = stream
        self.device = device
        self.ctx = None

    def __enter__(self) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            self.ctx = torch.cuda.stream(self.stream)
            self.ctx.__enter__()

    def __exit__(self, *exc) -> None:
        if self.stream is not None:
            self.ctx.__exit__(*exc)
            self.stream.synchronize()
