"""Request bodies: from raw bytes to a validated pydantic model, refusing bad bytes and numbers.

`decode_body` runs in a tokenizer thread (TokenizerManager.offload), never on the event loop:
json.loads and pydantic hold the GIL for their whole call, so their cost is bounded by the
body size (--max-request-bytes, server/request_guard.py) and the list counts checked on the
parsed JSON before pydantic sees it (RequestLimits.check_body_counts). Everything below is a
400 naming the place, before any work is queued:
- malformed JSON, a body that is not UTF-8, NaN/Infinity (not JSON), a float that overflows;
- a lone UTF-16 surrogate (`"\\ud800"`) in any string or key: it cannot be tokenized,
  logged or sent to the scheduler;
- an integer outside 64 bits (Python's own limit refuses 4,300+ digits while parsing);
- nesting deeper than --max-json-depth (json.loads itself gives up near 1,000 levels).
The walk over the parsed value that finds the last three runs only when a cheap scan of the
raw bytes says one of them may be there (a `\\ud8..`-`\\udf..` escape, a long digit run,
more brackets than the depth limit), so ordinary bodies cost one json.loads.
"""

from __future__ import annotations

import json
import math
import re
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import BaseModel, ValidationError

from sglite.server.errors import RequestError

if TYPE_CHECKING:
    from sglite.server.limits import RequestLimits

M = TypeVar("M", bound=BaseModel)
_UNION_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONG_NUMBER = re.compile(rb"\d{19,}|[eE][+-]?\d{3,}")
INT_RANGE = (-(2**63), 2**64)  # what the scheduler's messages carry


def _field_path(loc: tuple[Any, ...]) -> str:
    parts = [
        str(x) if not isinstance(x, int) else f"[{x}]"
        for x in loc
        if not (isinstance(x, str) and (x in _UNION_TAGS or "[" in x or "-" in x))
    ]
    return ".".join(parts).replace(".[", "[")


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """Pydantic's validation errors as one sentence naming the (first) bad field."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    path = _field_path(tuple(first.get("loc") or ()))
    if not path:
        return f"the request body must be a JSON object ({first.get('msg')})", None
    return f"{path}: {first.get('msg')}", path.split(".")[0].split("[")[0]


def _not_json(name: str) -> Any:
    raise RequestError(f"malformed JSON in the request body: {name} is not a JSON number")


def parse_json(raw: bytes, max_depth: int | None = None) -> Any:
    """The JSON value of a body (a RequestError when it is not JSON)."""
    if not raw.strip():
        raise RequestError("the request body is empty; send a JSON object")
    try:
        return json.loads(raw, parse_constant=_not_json)
    except RequestError:
        raise
    except RecursionError:
        raise RequestError(
            f"the request body is nested too deeply (at most {max_depth or 'about 1000'} "
            "levels of objects and arrays)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"malformed JSON in the request body: {e}") from None
    except ValueError:  # Python's limit on the digits of an integer (4,300)
        raise RequestError(
            "the request body has an integer with thousands of digits; numbers must fit in 64 bits"
        ) from None


def check_value(raw: bytes, data: Any, max_depth: int | None = None) -> None:
    """Refuse lone surrogates, numbers beyond 64 bits and too deep nesting in `data`, the
    parsed `raw`; walks `data` only when a scan of `raw` says one of them may be there."""
    strings = _SURROGATE_ESCAPE.search(raw) is not None
    numbers = _LONG_NUMBER.search(raw) is not None
    deep = max_depth is not None and raw.count(b"[") + raw.count(b"{") > max_depth
    if strings or numbers or deep:
        problem = find_problem(data, max_depth, strings=strings, numbers=numbers)
        if problem is not None:
            raise RequestError(problem[1], param=problem[0].split(".")[0].split("[")[0] or None)


def _path(link: Any) -> str:
    """The dotted path of a value; keys shown escaped (they may hold bad characters) and
    cut short."""
    parts: list[str] = []
    while link is not None:
        link, key = link
        if isinstance(key, int):
            parts.append(f"[{key}]")
        else:
            safe = key.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            parts.append("." + (safe if len(safe) <= 40 else safe[:40] + "..."))
    return "".join(reversed(parts)).lstrip(".")


def _bad_scalar(value: Any, strings: bool, numbers: bool) -> str | None:
    kind = type(value)
    if strings and kind is str and not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return (
                f"has a lone UTF-16 surrogate ({value[e.start]!r} at character {e.start}); "
                "send valid UTF-8 (surrogates only in pairs)"
            )
    elif numbers and kind is int and not INT_RANGE[0] <= value < INT_RANGE[1]:
        return f"the integer has {len(str(abs(value)))} digits; numbers must fit in 64 bits"
    elif numbers and kind is float and not math.isfinite(value):
        return "the number is out of range (a float overflows to infinity)"
    return None


def find_problem(
    data: Any, max_depth: int | None, *, strings: bool = True, numbers: bool = True
) -> tuple[str, str] | None:
    """(path, message) of the first nesting, string or number problem in a parsed JSON
    value, or None. Iterative: the value may be deep."""
    if type(data) not in (dict, list):
        bad = _bad_scalar(data, strings, numbers)
        return None if bad is None else ("", f"the request body {bad}")
    stack: list[tuple[Any, int, Any]] = [(data, 1, None)]
    while stack:
        value, depth, link = stack.pop()
        if max_depth is not None and depth > max_depth:
            where = _path(link) or "the request body"
            return _path(link), f"{where}: nested deeper than {max_depth} levels (--max-json-depth)"
        items = value.items() if type(value) is dict else enumerate(value)
        for key, item in items:  # empty containers are not pushed: they cannot go deeper
            if strings and type(key) is str and _bad_scalar(key, True, False) is not None:
                path = _path((link, key))
                return path, f"{path}: the key {_bad_scalar(key, True, False)}"
            kind = type(item)
            if kind is dict or kind is list:
                if item:
                    stack.append((item, depth + 1, (link, key)))
                continue
            bad = _bad_scalar(item, strings, numbers)
            if bad is not None:
                path = _path((link, key))
                return path, f"{path}: {bad}"
    return None


def decode_body(raw: bytes, model: type[M], limits: RequestLimits) -> M:
    """`raw` as `model`: parsed, its counts checked, its values checked, then validated."""
    data = parse_json(raw, limits.max_json_depth)
    limits.check_body_counts(data)
    check_value(raw, data, limits.max_json_depth)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(e.errors())
        raise RequestError(message, param=param) from None
