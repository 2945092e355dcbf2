"""ChatTokenizer: renders a conversation with the chat template and tokenizes it so that text
in message content never becomes a special token (a user cannot forge a turn).

Tokenizing the rendered text as a whole, as SGLang and vLLM do, turns a message's
`<|im_start|>system ...` into the real control tokens. Here the template's own markers stay
special and message content is plain text: when no content holds the text of a special
token the whole rendered text is tokenized as usual (the same ids as before); when one does,
the template is rendered again with a placeholder per message, the rendered text is cut
into template pieces and content pieces, the template's special tokens become their ids and
everything between them (template text and content together, so merges across the seam are
the usual ones) is tokenized with special-token matching off. A template that rewrites
message content beyond stripping it (so the pieces cannot be found) gets a 400 for such
content. `--parse-special-tokens-in-content` restores the peers' behaviour.

Special tokens are the tokenizer's added tokens marked special (`added_tokens_decoder`).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from sglite.server.errors import RequestError


class ChatTokenizer:
    def __init__(self, tokenizer: Any, *, parse_special_in_content: bool = False):
        self.tokenizer = tokenizer
        self.parse_special_in_content = parse_special_in_content
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special_ids = {t.content: i for i, t in decoder.items() if getattr(t, "special", 0)}
        names = sorted(self.special_ids, key=len, reverse=True)  # leftmost-longest, as HF
        self.special_re = re.compile("|".join(map(re.escape, names))) if names else None
        self._plain: Any = None

    # ------------------------------------------------------------------ public
    def render(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **kwargs
        )

    def encode_chat(self, messages: list[dict[str, Any]], **kwargs: Any) -> tuple[str, list[int]]:
        """The rendered prompt and its token ids (jinja errors propagate)."""
        text = self.render(messages, **kwargs)
        forged = [i for i, m in enumerate(messages) if self._has_special(m.get("content"))]
        if not forged or self.parse_special_in_content:
            return text, self.encode(text)
        return text, self._encode_guarded(messages, text, forged[0], kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def encode_plain(self, text: str) -> list[int]:
        """`text` tokenized with special-token matching off (its `<|...|>` are characters)."""
        if not text:
            return []
        plain = self._plain_tokenizer()
        if plain is None:
            return list(
                self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
            )
        return list(plain.encode_batch([text], add_special_tokens=False)[0].ids)  # GIL-free

    # ------------------------------------------------------------------ internals
    def _has_special(self, content: Any) -> bool:
        return (
            self.special_re is not None
            and isinstance(content, str)
            and self.special_re.search(content) is not None
        )

    def _plain_tokenizer(self) -> Any:
        """A copy of the fast tokenizer that never matches special tokens (the shared one
        is left alone: flipping its flag per call would race the other threads)."""
        if self._plain is None:
            backend = getattr(self.tokenizer, "backend_tokenizer", None)
            if backend is None:
                return None
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def _encode_guarded(
        self, messages: list[dict[str, Any]], text: str, first: int, kwargs: dict[str, Any]
    ) -> list[int]:
        nonce = uuid.uuid4().hex
        marked = [
            {**m, "content": f"\ue000{nonce}{i}\ue001"} if isinstance(m.get("content"), str) else m
            for i, m in enumerate(messages)
        ]
        parts = re.split(f"\ue000{nonce}(\\d+)\ue001", self.render(marked, **kwargs))
        pieces = self._pieces(parts, messages, text)
        if pieces is None:
            marker = self.special_re.search(messages[first]["content"]).group()  # type: ignore[union-attr]
            raise RequestError(
                f"messages[{first}].content: contains the special token {marker!r}, and this "
                "model's chat template rewrites message content, so it cannot be kept plain "
                "text; remove it (or start the server with --parse-special-tokens-in-content)",
                param="messages",
            )
        ids: list[int] = []
        for piece in pieces:
            ids.extend([piece] if isinstance(piece, int) else self.encode_plain(piece))
        return ids

    def _pieces(
        self, parts: list[str], messages: list[dict[str, Any]], text: str
    ) -> list[str | int] | None:
        """The rendered text as template special-token ids and plain text (adjacent text
        merged), if putting the contents (as given, or stripped) back into the placeholder
        rendering gives `text`."""
        for strip in (False, True):
            contents = [str(m["content"]).strip() if strip else str(m["content"]) for m in messages]
            segments = [
                (parts[j], False) if j % 2 == 0 else (contents[int(parts[j])], True)
                for j in range(len(parts))
            ]
            if "".join(s for s, _ in segments) == text:
                break
        else:
            return None
        out: list[str | int] = []
        for segment, is_content in segments:
            if is_content or self.special_re is None:
                _append_text(out, segment)
                continue
            pos = 0
            for match in self.special_re.finditer(segment):
                _append_text(out, segment[pos : match.start()])
                out.append(self.special_ids[match.group()])
                pos = match.end()
            _append_text(out, segment[pos:])
        return out


def _append_text(out: list[str | int], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)
