"""SamplingParams: the per-request decoding knobs (SGLang's field names), validated once.

Construct it directly (`SamplingParams(temperature=0.7)`) or from a request body with
`SamplingParams.from_dict(d)`, which also rejects unknown keys. Every invalid value raises a
`ValueError` that names the field and the allowed range. `temperature == 0` means greedy.

Penalty semantics (shared with `sglite.model_executor.sampler`): `frequency_penalty` and
`presence_penalty` act on the tokens generated so far (OpenAI/vLLM semantics);
`repetition_penalty` acts on the prompt and the generated tokens (transformers semantics).
`logit_bias` ({token id: bias in [-100, 100]}, OpenAI's) is added to the logits after the
penalties.

Defaults: a field a request leaves out takes the model's `generation_config.json` value when
the server runs with `--sampling-defaults model` (SGLang's default), for the keys in
`MODEL_DEFAULT_KEYS`; see `model_sampling_defaults`.

Structured output (SGLang's names; at most one per request): `json_schema` (a JSON Schema as a
JSON string), `regex`, `ebnf` (a GBNF-style grammar with a `root` rule). The output then
follows the grammar (sglite.constrained); the request finishes when the grammar is complete and
the model emits EOS, or by max_new_tokens / stop strings as usual. `min_new_tokens` cannot be
combined with one: the grammar decides where the output may end.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

# Below this temperature a request is sampled greedily (SGLang uses the same threshold).
GREEDY_TEMPERATURE = 1e-6
MAX_LOGIT_BIAS = 100.0
# generation_config.json keys that become request defaults (same names in SamplingParams)
MODEL_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_number(
    name: str, value: Any, low: float, high: float, *, low_open: bool = False
) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        raise ValueError(f"{name} must be in {left}{low}, {high}], got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if not _is_number(self.temperature) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature!r}")
        _check_number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}")
        _check_number("min_p", self.min_p, 0.0, 1.0)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0, low_open=True)
        self._check_stop()
        if self.stop_token_ids is not None:
            if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
                _is_int(t) and t >= 0 for t in self.stop_token_ids
            ):
                raise ValueError(
                    f"stop_token_ids must be a list of integers >= 0, got {self.stop_token_ids!r}"
                )
        _check_bool("ignore_eos", self.ignore_eos)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("no_stop_trim", self.no_stop_trim)
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")
        self._check_logit_bias()
        self._check_grammar()

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise ValueError(
                f"logit_bias must be an object mapping token ids to biases, got {self.logit_bias!r}"
            )
        for key, bias in self.logit_bias.items():
            token = str(key)
            if not token.isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            _check_number(f"logit_bias[{token}]", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)

    def _check_stop(self) -> None:
        stop = self.stop
        if stop is None:
            return
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}"
            )

    def _check_grammar(self) -> None:
        given = [k for k in GRAMMAR_KINDS if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of json_schema, regex and ebnf, got {given}")
        if not given:
            return
        kind, text = given[0], getattr(self, given[0])
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"{kind} must be a non-empty string, got {text!r}")
        if kind == "json_schema":
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema: invalid schema: not valid JSON ({e})") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(
                    "json_schema: invalid schema: a schema is a JSON object (or true/false), "
                    f"got {type(schema).__name__}"
                )
        if self.min_new_tokens:
            raise ValueError(
                f"min_new_tokens cannot be combined with {kind}: the grammar decides where "
                "the output may end"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a request body; unknown keys are an error, not silently dropped."""
        if data is None:
            return cls()
        if not isinstance(data, dict):
            raise ValueError(f"sampling_params must be an object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; "
                f"known: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_vocab(self, vocab_size: int) -> None:
        """Reject stop token ids the model cannot produce (called once the model is known)."""
        bad = [t for t in self.stop_token_ids or () if t >= vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids {bad} are out of range for a vocabulary of {vocab_size} tokens"
            )
        bad = [t for t in self.logit_bias_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"logit_bias token ids {bad} are out of range for a vocabulary of {vocab_size} "
                "tokens"
            )

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def logit_bias_ids(self) -> list[int]:
        return [int(k) for k in self.logit_bias or ()]

    @property
    def grammar_key(self) -> tuple[str, str] | None:
        """(kind, text) of the request's grammar, or None when unconstrained."""
        for kind in GRAMMAR_KINDS:
            text = getattr(self, kind)
            if text is not None:
                return kind, text
        return None

    @property
    def stop_strs(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def model_sampling_defaults(model_dir: str | Path | None) -> dict[str, Any]:
    """The request defaults a model ships in its generation_config.json (the keys of
    MODEL_DEFAULT_KEYS it sets to valid values); {} when it has none."""
    if model_dir is None:
        return {}
    path = Path(model_dir) / "generation_config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if config.get("top_k") == 0:  # transformers' "disabled"
        config["top_k"] = -1
    out = {}
    for key in MODEL_DEFAULT_KEYS:
        if config.get(key) is None:
            continue
        try:
            SamplingParams(**{key: config[key]})
        except (TypeError, ValueError):  # a value sglite would refuse: not a default
            continue
        out[key] = config[key]
    return out
