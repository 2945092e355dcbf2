"""RequestLimits: how much work one HTTP request may ask for, checked before any tokenization.

Each limit is a `--max-*` flag (README, "Running it on a network"); a request over one is
refused with HTTP 400 (413 for the body, in server/request_guard.py) and a short message
that names the field, the count and the flag, never the offending value itself. The offline
Engine has no limits (`RequestLimits()`): its caller is trusted.

Where each is checked: the counts of a body's top-level lists (`check_body_counts`, on the
parsed JSON before it is validated into a model, as pydantic's cost grows with them), the
characters of a prompt (before it is tokenized), the sequences of a request (prompts
times n, before any prompt is tokenized), logit_bias and grammar texts (with the sampling
parameters, before the grammar's syntax check, with a JSON schema's nesting), log-probs per
token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sglite.server.body import find_problem
from sglite.server.errors import RequestError

CHARS_PER_CONTEXT_TOKEN = 32  # the default --max-prompt-chars: far above any real text
MIN_PROMPT_CHARS = 1_000_000
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class RequestLimits:
    """None: no limit."""

    max_prompts_per_request: int | None = None
    max_sequences_per_request: int | None = None
    max_prompt_chars: int | None = None
    max_chat_messages: int | None = None
    max_top_logprobs_num: int | None = None
    max_logit_bias: int | None = None
    max_grammar_chars: int | None = None
    max_json_depth: int | None = None

    @classmethod
    def from_args(cls, args: Any, context_length: int) -> RequestLimits:
        """The limits `args` (ServerArgs) set; the prompt-character limit by default follows
        the model's context length."""
        chars = args.max_prompt_chars
        if chars is None:
            chars = max(MIN_PROMPT_CHARS, CHARS_PER_CONTEXT_TOKEN * context_length)
        return cls(
            max_prompts_per_request=args.max_prompts_per_request,
            max_sequences_per_request=args.max_sequences_per_request,
            max_prompt_chars=chars,
            max_chat_messages=args.max_chat_messages,
            max_top_logprobs_num=args.max_top_logprobs_num,
            max_logit_bias=args.max_logit_bias,
            max_grammar_chars=args.max_grammar_chars,
            max_json_depth=args.max_json_depth,
        )

    def _check(self, name: str, count: int, what: str, param: str) -> None:
        """`what` says what was counted, with `{n}` for the count."""
        limit = getattr(self, name)
        if limit is not None and count > limit:
            raise RequestError(
                f"{what.format(n=count)}; at most {limit} are allowed ({_flag(name)})",
                param=param,
            )

    # ------------------------------------------------------------------ checks
    def check_body_counts(self, data: Any) -> None:
        """The batch and message counts of a parsed body (any route: the fields mean the same
        everywhere), before the body is validated into a model."""
        if not isinstance(data, dict):
            return
        for key in ("text", "prompt", "input_ids"):
            value = data.get(key)
            # a flat list of token ids is one prompt; a list of strings or lists is a batch
            if isinstance(value, list) and value and isinstance(value[0], (str, list)):
                self.check_prompts(len(value), key)
        messages = data.get("messages")
        if isinstance(messages, list):
            self._check("max_chat_messages", len(messages), "messages: {n} messages", "messages")

    def check_prompts(self, count: int, param: str) -> None:
        self._check("max_prompts_per_request", count, param + ": {n} prompts in one request", param)

    def check_sequences(self, count: int) -> None:
        """Sequences one request starts (each prompt times its n)."""
        self._check(
            "max_sequences_per_request", count, "n: the request asks for {n} sequences "
            "(prompts times n)", "n",
        )  # fmt: skip

    def check_chars(self, num_chars: int, param: str) -> None:
        self._check("max_prompt_chars", num_chars, param + ": {n} characters", param)

    def check_sampling(self, data: dict[str, Any], param: str | None) -> None:
        """logit_bias and the grammar texts of a sampling-parameters dict (unvalidated)."""
        prefix = f"{param}." if param else ""
        bias = data.get("logit_bias")
        if isinstance(bias, dict):
            name = prefix + "logit_bias"
            self._check("max_logit_bias", len(bias), name + ": {n} entries", param or name)
        for key in GRAMMAR_FIELDS:
            text = data.get(key)
            if isinstance(text, str):
                name = prefix + key
                self._check("max_grammar_chars", len(text), name + ": {n} characters", param or key)
        schema = data.get("json_schema")
        if isinstance(schema, str) and self.max_json_depth is not None:
            self._check_schema_depth(schema, prefix + "json_schema", param or "json_schema")

    def _check_schema_depth(self, text: str, name: str, param: str) -> None:
        """A JSON schema nested deeper than --max-json-depth (its syntax check alone costs
        seconds at a few hundred levels); not JSON at all is the grammar check's to report."""
        try:
            schema = json.loads(text)
        except (ValueError, RecursionError):
            return
        problem = find_problem(schema, self.max_json_depth, strings=False, numbers=False)
        if problem is not None:
            raise RequestError(
                f"{name}: the schema is nested deeper than {self.max_json_depth} levels "
                "(--max-json-depth)",
                param=param,
            )

    def check_logprob_fields(self, fields: dict[str, Any]) -> None:
        """top_logprobs_num and the length of token_ids_logprob (native log-prob fields)."""
        top = fields.get("top_logprobs_num")
        if isinstance(top, int):
            what = "top_logprobs_num: {n} log-probs per token"
            self._check("max_top_logprobs_num", top, what, "top_logprobs_num")
        ids = fields.get("token_ids_logprob")
        if isinstance(ids, list):
            what = "token_ids_logprob: {n} log-probs per token"
            self._check("max_top_logprobs_num", len(ids), what, "token_ids_logprob")
