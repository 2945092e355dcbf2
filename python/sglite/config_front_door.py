"""FrontDoorArgs: the limits and timeouts of the HTTP front door, a base of ServerArgs.

These fields are ServerArgs fields like any other (`args.max_request_bytes`, the flag
`--max-request-bytes`); they live here, one group, because they belong together (README
"Running it on a network"; enforced in server/limits.py and server/connections.py, checked in
config_checks.check_front_door) and ServerArgs' file would be too long with them. The CLI
lists them under their own heading.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass(frozen=True)
class FrontDoorArgs:
    """HTTP front door: request size limits and connection timeouts."""

    max_request_bytes: int = _f(
        2 << 20,
        "Largest request body in bytes (HTTP 413 above); parsing JSON holds the GIL, about "
        "1 us per value, so this bounds how long one body can stall the event loop.",
    )
    max_prompts_per_request: int = _f(1024, "Most prompts in one batch request.")
    max_sequences_per_request: int = _f(
        4096, "Most sequences one request may start: its prompts times n."
    )
    max_prompt_chars: int | None = _f(
        None,
        "Most characters in one prompt (or in a chat's message contents), checked before "
        "tokenizing; default: 32 per token of the context length, at least 1,000,000.",
    )
    max_chat_messages: int = _f(4096, "Most messages in one chat request.")
    max_top_logprobs_num: int = _f(
        100,
        "Most log-probs per token a request may ask for beyond the chosen one "
        "(top_logprobs_num, and the length of token_ids_logprob); OpenAI routes stay at 20.",
    )
    max_logit_bias: int = _f(1024, "Most entries in one request's logit_bias.")
    max_grammar_chars: int = _f(128 << 10, "Longest json_schema, regex or ebnf text in characters.")
    max_json_depth: int = _f(64, "Deepest nesting of objects and arrays in a request body.")
    timeout_keep_alive: float = _f(
        5.0, "Seconds an idle keep-alive connection stays open after a response."
    )
    http_header_timeout: float = _f(
        10.0,
        "Seconds a client has to send a request's headers, from connecting or from the end "
        "of the previous response (slow senders are closed).",
    )
    http_body_timeout: float = _f(
        60.0, "Seconds a client has to send a request's body once its headers are in."
    )
    max_connections: int | None = _f(
        None,
        "Most open client connections; one more is answered 503 and closed. Default: "
        "min(4096, what the open-file limit leaves after the server's own files and a "
        "margin) (the soft limit is raised to the hard one at start-up).",
    )
    tokenizer_threads: int = _f(
        4, "Threads that parse, template and tokenize requests off the event loop."
    )
