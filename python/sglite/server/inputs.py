"""Request validation: turns request fields into tokenized, checked `Prompt`s.

Every check the server makes on input fields lives here (with the request limits of
server/limits.py, the raw body's checks of server/body.py and the chat tokenization of
server/chat_tokens.py) and runs once, in the main process, before anything reaches the
scheduler; limits that need no tokens come before any tokenization. A failure raises
`RequestError` with the HTTP status (400 for bad input) and a message that names the field
and says what is allowed.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from sglite.constrained import edge_check
from sglite.core.budget import PrefillBudget
from sglite.logprobs import LogprobOptions
from sglite.sampling_params import SamplingParams, model_sampling_defaults
from sglite.server.chat_tokens import ChatTokenizer
from sglite.server.errors import RequestError
from sglite.server.limits import RequestLimits

logger = logging.getLogger(__name__)

MAX_N = 128  # parallel samples per prompt


@dataclass
class Prompt:
    """One validated sequence to generate, ready to send."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    logprob: LogprobOptions | None = None
    priority: int | None = None  # --enable-priority-scheduling
    chat_output: Any = None  # chat: the ChatPlan that reads the output (server/chat_request.py)


class InputProcessor:
    """Tokenizes and validates prompts and sampling parameters for one model."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        context_length: int,
        vocab_size: int,
        max_total_tokens: int | None = None,
        page_size: int = 1,
        is_rid_free: Callable[[str], bool] = lambda rid: True,
        sampling_defaults: dict[str, Any] | None = None,
        check_grammar: Callable[[tuple[str, str]], None] | None = None,
        limits: RequestLimits | None = None,
        parse_special_in_content: bool = False,
    ):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = vocab_size
        self.max_total_tokens = max_total_tokens
        self.page_size = page_size
        self.is_rid_free = is_rid_free
        self.sampling_defaults = dict(sampling_defaults or {})  # fields a request leaves out
        # structured output: a syntax check of the grammar (sglite.constrained.edge_check)
        self.check_grammar = check_grammar
        self.limits = limits or RequestLimits()  # none by default (the offline Engine)
        self.chat = ChatTokenizer(tokenizer, parse_special_in_content=parse_special_in_content)

    @classmethod
    def for_server(
        cls,
        tokenizer: Any,
        server_args: Any,
        model_info: dict[str, Any],
        is_rid_free: Callable[[str], bool],
        limits: RequestLimits | None = None,
    ) -> InputProcessor:
        """The checks a server (or Engine) makes: the model's limits from the scheduler's
        ready info, sampling defaults per --sampling-defaults (logged), the grammar
        backend's syntax check, the request `limits` (HTTP only)."""
        defaults: dict[str, Any] = {}
        if getattr(server_args, "sampling_defaults", "model") == "model":
            defaults = model_sampling_defaults(model_info.get("model_path"))
            if defaults:
                logger.info(
                    "sampling defaults from the model's generation_config.json: %s", defaults
                )
        return cls(
            tokenizer,
            context_length=int(model_info["context_length"]),
            vocab_size=int(model_info["vocab_size"]),
            max_total_tokens=model_info.get("max_total_tokens"),
            page_size=server_args.page_size,
            is_rid_free=is_rid_free,
            sampling_defaults=defaults,
            check_grammar=edge_check(getattr(server_args, "grammar_backend", "xgrammar")),
            limits=limits,
            parse_special_in_content=getattr(server_args, "parse_special_tokens_in_content", False),
        )

    def max_new_tokens_limit(self, prompt_len: int) -> int:
        """The most new tokens a prompt may ask for: it must fit in the context and be
        admissible into the idle KV cache (the admission rule of the tree core's budget,
        which the scheduler applies too)."""
        limit = self.context_length - prompt_len
        if self.max_total_tokens is not None:
            limit = min(
                limit,
                PrefillBudget.max_new_tokens_limit(
                    self.max_total_tokens, self.page_size, prompt_len
                ),
            )
        return limit

    def tokenize(self, text: Any, param: str) -> list[int]:
        if not isinstance(text, str):
            raise RequestError(f"{param} must be a string, got {type(text).__name__}", param=param)
        if not text:
            raise RequestError(f"{param} is empty; give a non-empty prompt", param=param)
        self.limits.check_chars(len(text), param)
        return self.encode(text, param)

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (TypeError, ValueError) as e:  # e.g. a lone surrogate from the Engine's caller
            raise RequestError(f"{param}: the text cannot be tokenized ({e})", param=param) from e

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """Render the conversation (with the tools and the template's own variables, e.g.
        enable_thinking) and tokenize it; special-token text in message content stays plain
        text (server/chat_tokens.py)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise RequestError(
                "messages: this model has no chat template; use /v1/completions", param="messages"
            )
        num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
        self.limits.check_chars(num_chars, "messages")
        try:
            return self.chat.encode_chat(messages, tools=tools, **(template_kwargs or {}))
        except RequestError:
            raise
        except Exception as e:  # jinja errors: unsupported role order, ...
            raise RequestError(
                f"messages: the chat template rejected them ({e})", param="messages"
            ) from e

    def check_ids(self, ids: Any, param: str) -> list[int]:
        if not isinstance(ids, list) or not ids:
            raise RequestError(f"{param} must be a non-empty list of token ids", param=param)
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise RequestError(
                    f"{param}[{j}] = {t!r} is not a token id in [0, {self.vocab_size})", param=param
                )
        return ids

    def sampling_params(
        self,
        data: Any,
        param: str | None = "sampling_params",
    ) -> tuple[SamplingParams, int]:
        """Build SamplingParams (and the `n` of parallel sampling) from a request dict;
        `param` prefixes error messages (None: the keys are top-level request fields)."""
        if data is not None and not isinstance(data, dict):
            raise RequestError(f"{param} must be an object", param=param)
        self.limits.check_sampling(data or {}, param)
        data = {**self.sampling_defaults, **(data or {})}
        n = data.pop("n", 1)
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
            raise RequestError(f"n must be an integer in [1, {MAX_N}], got {n!r}", param="n")
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        try:
            sp = SamplingParams.from_dict(data)
            sp.check_vocab(self.vocab_size)
            if sp.grammar_key is not None and self.check_grammar is not None:
                self.check_grammar(sp.grammar_key)
        except (ValueError, TypeError) as e:
            raise RequestError(f"{param}: {e}" if param else str(e), param=param) from e
        return sp, n

    def logprob_options(self, fields: dict[str, Any]) -> LogprobOptions | None:
        """SGLang's log-prob request fields (`return_logprob` and its options) -> options, or
        None when log-probs are not asked for."""
        ask = fields.get("return_logprob", False)
        if not isinstance(ask, bool):
            raise RequestError(
                f"return_logprob must be true or false, got {ask!r}", param="return_logprob"
            )
        if not ask:
            return None
        opts = {k: v for k, v in fields.items() if k != "return_logprob" and v is not None}
        self.limits.check_logprob_fields(opts)
        try:
            return LogprobOptions.from_request(**opts, vocab_size=self.vocab_size)
        except ValueError as e:
            raise RequestError(str(e), param=str(e).split()[0]) from e

    def check_logprob_start(self, opts: LogprobOptions | None, prompt_len: int) -> None:
        if opts is not None and opts.logprob_start_len > prompt_len:
            raise RequestError(
                f"logprob_start_len ({opts.logprob_start_len}) is beyond the prompt "
                f"({prompt_len} tokens)",
                param="logprob_start_len",
            )

    def check_length(
        self, prompt_len: int, sp: SamplingParams, param: str, max_param: str = "max_new_tokens"
    ) -> None:
        ctx, cap = self.context_length, self.max_total_tokens
        if prompt_len >= ctx:
            raise RequestError(
                f"{param}: the prompt has {prompt_len} tokens; the model's "
                f"context length is {ctx} tokens (prompt and output together)",
                param=param,
            )
        limit = self.max_new_tokens_limit(prompt_len)
        if limit < 1:
            raise RequestError(
                f"{param}: the prompt has {prompt_len} tokens but the KV cache holds only {cap}",
                param=param,
            )
        if sp.max_new_tokens > limit:
            where = (
                f"the model's context length ({ctx} tokens)"
                if prompt_len + sp.max_new_tokens > ctx
                else f"the KV cache ({cap} tokens)"
            )
            raise RequestError(
                f"{max_param}: the prompt ({prompt_len} tokens) plus {max_param} "
                f"({sp.max_new_tokens}) does not fit in {where}; ask for at most {limit} new "
                "tokens",
                param=max_param,
            )

    def make_prompts(
        self,
        ids: list[int],
        sp: SamplingParams,
        n: int,
        *,
        param: str,
        text: str | None = None,
        rid: str | None = None,
        max_param: str = "max_new_tokens",
        logprob: LogprobOptions | None = None,
    ) -> list[Prompt]:
        """n validated copies of one prompt (distinct seeds when a seed is given)."""
        self.check_length(len(ids), sp, param, max_param)
        self.check_logprob_start(logprob, len(ids))
        if rid is not None and (not self.is_rid_free(rid) or not isinstance(rid, str) or not rid):
            raise RequestError(f"rid: {rid!r} is not a free request id", param="rid")
        base = rid or uuid.uuid4().hex
        out = []
        for i in range(n):
            sp_i = sp if i == 0 or sp.seed is None else replace(sp, seed=sp.seed + i)
            out.append(Prompt(base if n == 1 else f"{base}_{i}", ids, sp_i, text, logprob))
        return out

    def prepare_generate(
        self,
        text: Any = None,
        input_ids: Any = None,
        sampling_params: Any = None,
        rid: Any = None,
        logprob: dict[str, Any] | None = None,
    ) -> tuple[list[Prompt], bool]:
        """Validate a native /generate (or Engine.generate) call: (prompts, is_batch).
        `logprob`: SGLang's log-prob fields (`return_logprob`, `logprob_start_len`,
        `top_logprobs_num`, `token_ids_logprob`, `return_text_in_logprobs`), each one value
        for all prompts or a list with one per prompt."""
        if (text is None) == (input_ids is None):
            raise RequestError("exactly one of text and input_ids must be given", param="text")
        if text is not None:
            is_batch = isinstance(text, list)
            items = text if is_batch else [text]
            param = "text"
        else:
            is_batch = (
                isinstance(input_ids, list)
                and bool(input_ids)
                and all(isinstance(x, list) for x in input_ids)
            )
            items = input_ids if is_batch else [input_ids]
            param = "input_ids"
        if not items:
            raise RequestError(f"{param} is an empty batch", param=param)
        sps = _per_item(sampling_params, len(items), "sampling_params")
        if isinstance(rid, str) and is_batch:
            rid = [f"{rid}_{i}" for i in range(len(items))]
        rids = _per_item(rid, len(items), "rid")
        self.limits.check_prompts(len(items), param)
        lp_fields = _logprob_fields_per_item(logprob or {}, len(items), is_batch)
        # every check that needs no tokens comes first, for the whole batch
        params = [self.sampling_params(sp_dict) for sp_dict in sps]
        self.limits.check_sequences(sum(n for _, n in params))
        options = [self.logprob_options(fields) for fields in lp_fields]
        prompts: list[Prompt] = []
        for i, (item, (sp, n), r) in enumerate(zip(items, params, rids)):
            where = f"{param}[{i}]" if is_batch else param
            ids = self.tokenize(item, where) if text is not None else self.check_ids(item, where)
            prompts += self.make_prompts(
                ids,
                sp,
                n,
                param=where,
                rid=r,
                text=item if text is not None else None,
                logprob=options[i],
            )
        if len({p.rid for p in prompts}) != len(prompts):
            raise RequestError("rid: request ids must be unique", param="rid")
        return prompts, is_batch or len(prompts) > 1


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    """One value per prompt: a list must have one entry per prompt; a single value is shared."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise RequestError(
            f"{name} must have one entry per prompt ({count}), got {len(value)}", param=name
        )
    return value


def _logprob_fields_per_item(
    fields: dict[str, Any], count: int, is_batch: bool
) -> list[dict[str, Any]]:
    """Each log-prob field is one value for every prompt or (in a batch) a list with one
    per prompt; `token_ids_logprob` is per prompt when it is a list of lists."""
    out: list[dict[str, Any]] = [{} for _ in range(count)]
    for key, value in fields.items():
        per_item = is_batch and isinstance(value, list)
        if key == "token_ids_logprob":
            per_item = per_item and all(isinstance(v, list) for v in value) and bool(value)
        values = _per_item(value, count, key) if per_item else [value] * count
        for d, v in zip(out, values):
            d[key] = v
    return out
