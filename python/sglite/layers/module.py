"""`DirectCall`: the decoder's modules are called straight into their `forward`.

`nn.Module.__call__` looks for the module's and the global hooks on every call before it
reaches `forward`: about 2 us a call, and a decode step makes ~12 calls a layer. On the CPU,
where a step's Python runs between matrix products that have flushed the caches, that was
2-4 ms of a ~170 ms batch-1 step on a 7B (in-process, the two ways alternated by step).
sglite registers no hooks on these modules and does not trace them; a module built from this
mixin ignores hooks registered on it (`register_forward_hook` and friends), so wrap `forward`
to instrument it.
"""

from __future__ import annotations


class DirectCall:
    """Mixin before `nn.Module` in the bases: `module(...)` is `module.forward(...)`."""

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)
