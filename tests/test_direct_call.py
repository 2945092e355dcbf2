"""The decoder's modules are called straight into `forward` (sglite.layers.module), and
through torch's call once a hook asks for it."""

from __future__ import annotations

import torch
from torch import nn

from sglite.layers.layernorm import RMSNorm
from sglite.layers.module import DirectCall


def test_a_call_runs_forward_directly_until_a_hook_is_registered():
    norm = RMSNorm(8, 1e-6)
    x = torch.randn(2, 8)
    entered = []
    original = nn.Module.__call__
    try:  # count the calls that go through torch's __call__
        nn.Module.__call__ = lambda self, *a, **k: entered.append(1) or original(self, *a, **k)
        assert torch.equal(norm(x), norm.forward(x))
        assert entered == []  # the direct way
        seen = []
        handle = norm.register_forward_hook(lambda m, i, o: seen.append(o.shape))
        norm(x)
        assert seen == [(2, 8)] and entered == [1]  # the hook ran, through torch's call
        handle.remove()
        glob = nn.modules.module.register_module_forward_hook(lambda m, i, o: seen.append("g"))
        norm(x)
        glob.remove()
        assert seen[-1] == "g"
    finally:
        nn.Module.__call__ = original
    assert isinstance(norm, DirectCall)
