"""Triton kernels of sglite. They depend on torch and triton only, never on sglite.

Layout shared by all launchers: KV pool buffers are [num_slots, Hkv, D] indexed by slot id;
a request's cached tokens are addressed CSR-style (``kv_indptr`` [B+1], ``kv_indices`` the
flattened slot ids), which covers any page size. MLA's latent pool is [num_slots, 1, Dc + Dr]
(``mla_decode_attention``: the values are the first Dc dims of each row). Quantized linears
(``fp8_linear``, ``int4_linear``, quant_gemm.py) take the weights as FP8 / AWQ / GPTQ
checkpoints store them. Every launcher validates shapes, dtypes,
devices and strides on the host and raises ValueError on a broken contract.
"""

from ._common import interpreted
from .decode_attention import decode_attention, num_kv_splits
from .extend_attention import extend_attention
from .kv_indices import fill_kv_indices
from .kv_store import store_kv
from .mla_decode import mla_decode_attention
from .quant_gemm import fp8_linear, int4_linear

__all__ = [
    "decode_attention",
    "extend_attention",
    "fill_kv_indices",
    "fp8_linear",
    "int4_linear",
    "interpreted",
    "mla_decode_attention",
    "num_kv_splits",
    "store_kv",
]
