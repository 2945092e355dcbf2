"""Log-probs as clients read them: SGLang's meta_info lists and OpenAI's two shapes.

SGLang (`/generate`, `meta_info`): `input_token_logprobs` / `output_token_logprobs` are lists
of `[logprob, token_id, text]` (text None unless `return_text_in_logprobs`; the prompt's
first token has logprob None); `input_top_logprobs` / `output_top_logprobs` hold, per
position, the `top_logprobs_num` most likely tokens as such triples (the prompt's first
position: None); `input_token_ids_logprobs` / `output_token_ids_logprobs` the asked-for
ids' triples per position (None when not asked).

OpenAI completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` (with
`echo` the prompt's tokens come first; its first token's log-prob and top are null). OpenAI
chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglite.logprobs import MAX_TOP_LOGPROBS, LogprobOptions
from sglite.messages import LogprobDelta
from sglite.server.inputs import RequestError

TokenText = Callable[[int], str]
Triple = list  # [logprob | None, token_id, text | None]


class LogprobLists:
    """One request's log-probs in SGLang's shape, appended to as deltas arrive."""

    KEYS = (
        "input_token_logprobs",
        "output_token_logprobs",
        "input_top_logprobs",
        "output_top_logprobs",
        "input_token_ids_logprobs",
        "output_token_ids_logprobs",
    )

    def __init__(self, opts: LogprobOptions, token_text: TokenText):
        self.opts = opts
        self._text = token_text if opts.return_text_in_logprobs else None
        self.lists: dict[str, list] = {key: [] for key in self.KEYS}

    def add(self, delta: LogprobDelta) -> None:
        for side, entries in (("input", delta.input), ("output", delta.output)):
            tokens = self.lists[f"{side}_token_logprobs"]
            top = self.lists[f"{side}_top_logprobs"]
            selected = self.lists[f"{side}_token_ids_logprobs"]
            for e in entries:
                tokens.append(self._triple(e.logprob, e.token_id))
                first = e.logprob is None
                top.append(None if first else [self._triple(*p) for p in e.top or ()])
                selected.append(
                    None if first or e.selected is None else [self._triple(*p) for p in e.selected]
                )

    def _triple(self, logprob: float | None, token_id: int) -> Triple:
        return [logprob, token_id, self._text(token_id) if self._text else None]

    def meta(self) -> dict[str, Any]:
        return {key: list(value) for key, value in self.lists.items()}


def completion_logprobs(
    triples: list[Triple], tops: list[list[Triple] | None], text_offset: int = 0
) -> dict[str, Any]:
    """OpenAI completions' `logprobs` object for these positions (texts must be set)."""
    offsets, pos = [], text_offset
    for t in triples:
        offsets.append(pos)
        pos += len(t[2])
    return {
        "tokens": [t[2] for t in triples],
        "token_logprobs": [t[0] for t in triples],
        "top_logprobs": [None if top is None else {p[2]: p[0] for p in top} for top in tops],
        "text_offset": offsets,
    }


def chat_logprobs(triples: list[Triple], tops: list[list[Triple] | None]) -> dict[str, Any]:
    """OpenAI chat's `logprobs` object (`content` entries) for these positions."""

    def entry(t: Triple) -> dict[str, Any]:
        return {"token": t[2], "logprob": t[0], "bytes": text_bytes(t[2])}

    return {
        "content": [
            {**entry(t), "top_logprobs": [entry(p) for p in top or ()]}
            for t, top in zip(triples, tops)
        ],
        "refusal": None,
    }


def openai_options(
    logprobs: int | bool | None, top_logprobs: int | None, *, echo: bool = False
) -> LogprobOptions | None:
    """Options for an OpenAI request: completions' `logprobs` (an int, the top-k) with
    `echo` (prompt log-probs too), or chat's `logprobs` (bool) with `top_logprobs`."""
    if isinstance(logprobs, bool):  # chat
        if top_logprobs is not None and not logprobs:
            raise RequestError("top_logprobs: requires logprobs=true", param="top_logprobs")
        top, param = (top_logprobs or 0), "top_logprobs"
        if not logprobs:
            return None
    else:
        if logprobs is None:
            return None
        top, param = logprobs, "logprobs"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"{param}: must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}", param=param
        )
    return LogprobOptions(0 if echo else -1, top, None, return_text_in_logprobs=True)


def openai_logprobs(
    meta: dict[str, Any], *, chat: bool, echo: bool = False, skip_output: int = 0
) -> dict[str, Any]:
    """The OpenAI `logprobs` object of one choice from its meta_info: the prompt's entries
    first when `echo`, then the output's from index `skip_output` (streaming deltas)."""
    triples = meta["output_token_logprobs"][skip_output:]
    tops = meta["output_top_logprobs"][skip_output:]
    if echo:
        triples = meta["input_token_logprobs"] + triples
        tops = meta["input_top_logprobs"] + tops
    return chat_logprobs(triples, tops) if chat else completion_logprobs(triples, tops)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-ins for the 256 bytes (GPT-2's scheme): printable
    Latin-1 bytes stand for themselves, the other bytes for the characters from U+0100 on."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(0x100 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_alphabet()


def token_bytes(piece: str) -> bytes | None:
    """The raw bytes of a vocabulary piece (`convert_ids_to_tokens`) when it spells bytes:
    a SentencePiece byte token `<0xNN>` or a byte-level BPE piece; None otherwise."""
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        try:
            return bytes([int(piece[3:5], 16)])
        except ValueError:
            return None
    if piece and all(ch in _BYTE_LEVEL for ch in piece):
        return bytes(_BYTE_LEVEL[ch] for ch in piece)
    return None


def display_text(text: str, raw: bytes | None) -> str:
    """A token's text for log-prob entries: its text, or OpenAI's `bytes:\\xNN...` form when
    it is only part of a character (its text would be U+FFFD, shared by many tokens)."""
    if "\ufffd" not in text or raw is None:
        return text
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def text_bytes(text: str) -> list[int]:
    """The `bytes` field of OpenAI chat entries, for texts made by `display_text`."""
    if text.startswith("bytes:\\x"):
        try:
            return list(bytes(int(h, 16) for h in text[len("bytes:") :].split("\\x")[1:]))
        except ValueError:
            pass
    return list(text.encode("utf-8"))


class TokenTexts:
    """Token id -> the text log-prob entries show for it (cached: ids repeat)."""

    MAX_CACHED = 1 << 17

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if "\ufffd" in text:  # part of a character: show its bytes
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                text = display_text(text, token_bytes(piece) if isinstance(piece, str) else None)
            if len(self._cache) < self.MAX_CACHED:
                self._cache[token_id] = text
        return text
