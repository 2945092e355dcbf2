"""SGLang launch flags that sglite recognises but does not implement yet, and their refusal.

A command copied from SGLang's documentation should fail with a sentence that names the flag
and says it is not supported, not with argparse's "unrecognized arguments". Families of
flags (`--speculative-*`, `--disaggregation-*`, ...) are matched by prefix. Given with the
value that means what sglite does anyway (`--pp-size 1`, `--load-format auto`), such a
flag is accepted and dropped (`drop_no_ops`). A flag that sglite's own parser has is never
refused here, so implementing one (as `--dp-size` was) only means adding its ServerArgs field.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# flag -> what it is, for the message
UNSUPPORTED: dict[str, str] = {
    "--quantization-param-path": "weight quantization",
    "--load-format": "weight formats other than safetensors and GGUF",
    "--enable-dp-attention": "data-parallel attention",
    "--pp-size": "pipeline parallelism",
    "--pipeline-parallel-size": "pipeline parallelism",
    "--lora-paths": "LoRA adapters",
    "--enable-lora": "LoRA adapters",
    "--max-lora-rank": "LoRA adapters",
    "--max-loras-per-batch": "LoRA adapters",
    "--lora-backend": "LoRA adapters",
    "--enable-torch-compile": "torch.compile",
    "--torch-compile-max-bs": "torch.compile",
    "--is-embedding": "embedding models",
    "--enable-multimodal": "multimodal models",
    "--json-model-override-args": "overriding the model config",
}
# flag -> the values with which it asks for nothing sglite does not do already
NO_OP_VALUES: dict[str, frozenset[str]] = {
    "--load-format": frozenset({"auto", "safetensors"}),
    **{
        flag: frozenset({"1"})
        for flag in (
            "--pp-size",
            "--pipeline-parallel-size",
        )
    },  # fmt: skip
}
UNSUPPORTED_PREFIXES: dict[str, str] = {
    "--speculative-": "speculative decoding",
    "--disaggregation-": "prefill/decode disaggregation",
    "--hicache-": "the hierarchical (host memory) KV cache",
    "--lora-": "LoRA adapters",
    "--moe-": "mixture-of-experts parallelism",
}


def unsupported_reason(flag: str) -> str | None:
    """What the SGLang flag `flag` (`--name`, without `=value`) does, if sglite lacks it."""
    if flag in UNSUPPORTED:
        return UNSUPPORTED[flag]
    for prefix, what in UNSUPPORTED_PREFIXES.items():
        if flag.startswith(prefix):
            return what
    return None


def drop_no_ops(argv: Sequence[str], known: Iterable[str]) -> list[str]:
    """`argv` without the unsupported flags given with a value that changes nothing."""
    known = set(known)
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in NO_OP_VALUES and flag not in known:
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            if value in NO_OP_VALUES[flag]:
                i += 1 if eq else 2
                continue
        out.append(arg)
        i += 1
    return out


def find_unsupported(argv: Sequence[str], known: Iterable[str]) -> str | None:
    """The error message for the first unsupported SGLang flag in `argv`, or None.

    `known` are the option strings the parser has: those are never refused."""
    known = set(known)
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in known:
            continue
        what = unsupported_reason(flag)
        if what is not None:
            return (
                f"{flag}: sglite does not support {what} yet; remove the flag "
                "(--help lists the flags sglite has)"
            )
    return None


def help_epilog() -> str:
    families = ", ".join(f"{p}*" for p in UNSUPPORTED_PREFIXES)
    return (
        "SGLang flags that sglite recognises but does not support yet (refused with a "
        f"message): {', '.join(sorted(UNSUPPORTED))}, {families}."
    )
