"""ModelRunner: owns the model, the KV memory and the attention backend; runs forward and sample.

Start-up, in order: pick device and dtype, read the config, load the weights (packed for
oneDNN on CPU), size the KV pool from the model's `kv_layout()` (per-head K/V, or MLA's
latent rows) in `kv_cache_dtype` (default: the model's dtype; sglite.mem_cache.kv_dtype; the
log line gives its dtype and bytes per token, for MLA next to what MHA would need, and for
another dtype than the model's how many tokens the same memory holds in the model's)
to `max_total_tokens`, or on CUDA `mem_fraction_static` of the GPU memory, or on CPU from
the context length (sglite.mem_cache.kv_sizing), create the tree
core's `PageAllocator` over those slots, the `ReqToTokenPool`, and the attention backend; on
CUDA, last, capture the decode CUDA graphs (`cuda_graph_runner.py`; `disable_cuda_graph`,
`cuda_graph_max_bs`, default min(160, max_running_requests)). On CPU there are no graphs
(`NoCudaGraphs`); decode batches of the dense skeleton over panel weights run as one native
call instead (`native_step.py`; the start-up log says whether, or why not).

Per step the caller (the scheduler, or a test) allocates slots with `runner.allocator`,
writes the request rows of `runner.req_to_token_pool`, builds a `ForwardBatch`
(`ForwardBatch.extend(...)` / `.decode(...)` with `runner.req_to_token_pool` and
`runner.kv_pool`), then calls `logits = runner.forward(batch)` and
`next_ids = runner.sample(logits, SamplingBatchInfo.build(...))`.

Tensor parallelism (`tp_size` > 1, one ModelRunner per rank, each in its own process, all
running the same batches): the runner first checks that tp_size splits the model (else a
ValueError naming the sizes that do), joins the TP group at `dist_init_addr` (rank 0
listens there; `dist_timeout` seconds to rendezvous), loads its shard of the weights and
builds a KV pool of its own KV heads (MLA's latent pool: the same on every rank), sized to
the smallest budget of any rank. CUDA decode
graphs are off under TP for now. Every rank's forward returns the same full logits.
Expert parallelism (`ep_size` > 1, dividing tp_size): each MoE layer's experts split over
ep_size groups of ranks (sglite.layers.moe.experts), each rank reading only its experts.
Sampling: rank 0 samples and broadcasts its tokens, so every rank returns rank 0's tokens
(even for unseeded requests, which draw from torch's RNG, whose state may differ by rank).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from sglite.attention import create_attention_backend, default_backend
from sglite.distributed import (
    DEFAULT_TIMEOUT_S,
    check_tp_size,
    init_tp_group,
    local_head_counts,
)
from sglite.mem_cache.kv_dtype import resolve_kv_cache_dtype
from sglite.mem_cache.kv_sizing import default_cpu_kv_size
from sglite.mem_cache.memory_pool import ReqToTokenPool, kv_slots_for_budget
from sglite.model_executor import native_step
from sglite.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    NoCudaGraphs,
    default_cuda_graph_max_bs,
)
from sglite.model_executor.forward_batch import ForwardBatch
from sglite.model_executor.sampler import Sampler, SamplingBatchInfo
from sglite.models.loader import load_model, resolve_model_path
from sglite.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
DEFAULT_MEM_FRACTION_STATIC = 0.88


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda was requested but torch sees no CUDA device")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, got {device}")
    return device


def resolve_dtype(
    dtype: str | torch.dtype | None, device: torch.device, checkpoint_dtype: str | None = None
) -> torch.dtype:
    """`auto` on CUDA is SGLang's rule: bfloat16 for a bfloat16 checkpoint, else float16;
    on CPU float32, the fastest CPU path of this engine (bfloat16 only when asked)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if checkpoint_dtype == "bfloat16" else torch.float16
    if dtype not in DTYPES:
        raise ValueError(
            f"unknown dtype {dtype!r}; choose auto, half, float16, bfloat16, float or float32"
        )
    return DTYPES[dtype]


def _log_cpu_kernels() -> None:
    """Apply SGL_CPU_ISA and say which instructions the CPU kernels run."""
    from sglite import env
    from sglite.layers import quant_kernels

    cap = env.cpu_isa()
    if quant_kernels.unavailable_reason() is not None:
        logger.info("CPU kernels: none (%s)", quant_kernels.unavailable_reason())
        return
    if cap is not None:
        quant_kernels.limit_isa(cap)
    best = (quant_kernels.isas() or ("scalar",))[0]
    why = f"SGL_CPU_ISA={cap}" if cap is not None else "the best this CPU has"
    logger.info("CPU kernels: %s (%s)", best, why)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ModelRunner:
    def __init__(
        self,
        model_path: str | os.PathLike | None,
        *,
        dtype: str | torch.dtype | None = None,
        kv_cache_dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        page_size: int = 1,
        max_total_tokens: int | None = None,
        mem_fraction_static: float | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        attention_backend: str | None = None,
        tree_core: str | None = None,
        disable_cuda_graph: bool = False,
        cuda_graph_max_bs: int | None = None,
        trust_remote_code: bool = False,
        tp_size: int = 1,
        tp_rank: int = 0,
        ep_size: int = 1,
        dist_init_addr: str | None = None,
        dist_timeout: float | None = None,
        quantization: str | None = None,
        quant_kernel: str = "int16",
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.device = resolve_device(device)
        if self.device.type == "cpu":
            _log_cpu_kernels()
        if self.device.type == "cuda" and tp_size > 1:  # one GPU per rank
            if self.device.index is None:
                self.device = torch.device("cuda", tp_rank)
            torch.cuda.set_device(self.device)
        self.page_size = page_size
        self.model_path = resolve_model_path(model_path, trust_remote_code=trust_remote_code)
        self.tokenizer_path = self.model_path
        self.model_config = self._resolve_config(context_length, trust_remote_code)
        cfg = self.model_config
        check_tp_size(tp_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.num_local_heads, self.num_local_kv_heads = local_head_counts(
            cfg.num_heads, cfg.num_kv_heads, tp_size
        )
        self.tp_group = init_tp_group(
            tp_size, tp_rank, dist_init_addr, self.device, dist_timeout or DEFAULT_TIMEOUT_S
        )
        self.dtype = resolve_dtype(dtype, self.device, self.model_config.torch_dtype)
        self.kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        logger.info(
            "loading %s (%s, %d layers) on %s as %s",
            self.model_path,
            self.model_config.architecture,
            self.model_config.num_layers,
            self.device,
            str(self.dtype).removeprefix("torch."),
        )
        self.model = load_model(
            self.model_path,
            self.model_config,
            dtype=self.dtype,
            device=self.device,
            tp_group=self.tp_group,
            ep_size=ep_size,
            quantization=quantization,
            quant_kernel=quant_kernel,
        )
        if self.device.type == "cpu":
            logger.info("packing the linear weights for oneDNN")
            self.model.prepack()
        self._init_memory(max_total_tokens, mem_fraction_static, max_running_requests, tree_core)
        self.attention_backend_name = attention_backend or default_backend(self.device.type)
        self.attn_backend = create_attention_backend(self.attention_backend_name, self)
        self.sampler = Sampler()
        self.graph_runner = self._init_cuda_graphs(disable_cuda_graph, cuda_graph_max_bs)
        self.native_step = native_step.build(self) if self.device.type == "cpu" else None

    # ---------------------------------------------------------------- start-up
    def _resolve_config(self, context_length: int | None, trust_remote_code: bool) -> ModelConfig:
        config = ModelConfig.from_pretrained(self.model_path, trust_remote_code=trust_remote_code)
        ctx = context_length or config.context_length
        if context_length is not None and context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        if context_length is not None and context_length > config.context_length:
            logger.warning(
                "context_length %d exceeds the model's %d; quality beyond it is not guaranteed",
                context_length,
                config.context_length,
            )
        return dataclasses.replace(config, context_length=ctx)

    def _init_memory(
        self,
        max_total_tokens: int | None,
        mem_fraction_static: float | None,
        max_running_requests: int | None,
        tree_core: str | None,
    ) -> None:
        import sglite.core

        cfg, ps = self.model_config, self.page_size
        layout = self.model.kv_layout()  # per-head K/V (this rank's heads) or MLA's latent
        per_slot = layout.bytes_per_token(self.kv_dtype)
        if max_total_tokens is not None:
            num_slots = max_total_tokens // ps * ps
        elif self.device.type == "cuda":
            frac = mem_fraction_static or DEFAULT_MEM_FRACTION_STATIC
            if not 0 < frac < 1:
                raise ValueError(f"mem_fraction_static must be in (0, 1), got {frac}")
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - frac))
            logger.info(
                "profiling memory: %.1f of %.1f GiB free after the weights; %.2f GiB for KV "
                "(--mem-fraction-static %.2f)",
                free / 2**30, total / 2**30, max(budget, 0) / 2**30, frac,
            )  # fmt: skip
            num_slots = kv_slots_for_budget(budget, per_slot, ps)
        else:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            size = default_cpu_kv_size(cfg.context_length, per_slot, ps, ram)
            logger.info("KV pool size: %d tokens: %s", size.num_slots, size.reason)
            num_slots = size.num_slots
        if self.tp_size > 1:  # every rank holds the same slots: the smallest pool wins
            num_slots = self.tp_group.min_int(num_slots)
        if num_slots < ps:
            raise ValueError(
                f"the KV pool would hold {num_slots} tokens; raise --max-total-tokens"
                + (" or --mem-fraction-static" if self.device.type == "cuda" else "")
            )
        self.max_total_num_tokens = num_slots
        if max_running_requests is not None and max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {max_running_requests}")
        self.max_running_requests = max_running_requests or min(4096, max(16, num_slots // 32))
        logger.info("building the KV pool: %d tokens", num_slots)
        self.kv_pool = layout.build(num_slots, ps, self.kv_dtype, self.device)
        self.req_to_token_pool = ReqToTokenPool(
            self.max_running_requests, cfg.context_length, self.device
        )
        core = sglite.core.load(tree_core, page_size=ps)
        self.allocator = core.PageAllocator(num_slots, ps)
        logger.info(
            "KV pool: %d tokens of %s, %s B/token (%s), %.2f GiB, page size %d, %d request "
            "rows%s",
            num_slots, _name(self.kv_dtype), f"{per_slot:,}", layout.describe(self.kv_dtype),
            self.kv_pool.memory_bytes() / (1 << 30), ps, self.max_running_requests,
            self._kv_dtype_comparison(layout),
        )  # fmt: skip

    def _kv_dtype_comparison(self, layout) -> str:
        """For the pool log line: what the same memory would hold in the model's dtype."""
        if self.kv_dtype == self.dtype:
            return ""
        per_slot = layout.bytes_per_token(self.dtype)
        fit = kv_slots_for_budget(self.kv_pool.memory_bytes(), per_slot, self.page_size)
        return f"; in {_name(self.dtype)} ({per_slot:,} B/token) this memory holds {fit} tokens"

    def _init_cuda_graphs(
        self, disable: bool, max_bs: int | None
    ) -> CudaGraphRunner | NoCudaGraphs:
        if max_bs is not None and max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {max_bs}")
        if self.device.type != "cuda" or disable:
            return NoCudaGraphs()
        if self.tp_size > 1:
            logger.info("CUDA graphs are not captured under tensor parallelism yet; eager decode")
            return NoCudaGraphs()
        if not self.attn_backend.supports_cuda_graph:
            logger.info(
                "attention backend %s has no CUDA graph support; decode runs eagerly",
                self.attention_backend_name,
            )
            return NoCudaGraphs()
        return CudaGraphRunner(self, max_bs or default_cuda_graph_max_bs(self.max_running_requests))

    # ---------------------------------------------------------------- per step
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits of the last token of each request `[B, vocab]`
        (`[T, vocab]` for every token when `batch.return_all_logits`). A decode batch on
        CUDA replays a captured graph: its logits are valid until the next forward."""
        batch.attn_backend = self.attn_backend
        with torch.inference_mode():
            if self.graph_runner.can_run(batch):
                return self.graph_runner.replay(batch)
            self.attn_backend.init_forward_metadata(batch)
            if self.native_step is not None and self.native_step.can_run(batch):
                return self.native_step.forward(batch)
            return self.model(batch.input_ids, batch.positions, batch)

    def sample(self, logits: torch.Tensor, sampling_info: SamplingBatchInfo) -> torch.Tensor:
        """Next token per request, `[B]` int64 on the runner's device. Under TP every rank
        must call it (a collective): rank 0 samples, the others receive its tokens."""
        with torch.inference_mode():
            if self.tp_size == 1:
                return self.sampler(logits, sampling_info)
            if self.tp_rank == 0:
                next_ids = self.sampler(logits, sampling_info)
            else:
                next_ids = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
            return self.tp_group.broadcast(next_ids, src=0)
