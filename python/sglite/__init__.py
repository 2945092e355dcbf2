"""sglite: a small, fast LLM serving engine (SGLang's design, a Rust tree core).

Heavy parts (torch, the server) are imported lazily so that `import sglite` and
`import sglite.core` stay cheap and free of side effects.
"""

from __future__ import annotations

from sglite.version import __version__

__all__ = ["Engine", "SamplingParams", "__version__"]


def __getattr__(name: str):
    if name == "Engine":
        from sglite.engine import Engine

        return Engine
    if name == "SamplingParams":
        from sglite.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'sglite' has no attribute {name!r}")
