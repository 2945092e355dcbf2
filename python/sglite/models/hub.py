"""Hugging Face Hub model ids: turning `--model-path Qwen/Qwen3-0.6B` into a local folder.

A model path that is an existing folder or file is used as it is. Anything else that reads
as a repo id (`name` or `org/name`) is resolved by `huggingface_hub.snapshot_download`,
limited to the files the loader and tokenizer read (configs, safetensors, tokenizer files,
chat templates; `*.py` only with --trust-remote-code), at `--revision`. huggingface_hub
itself honours HF_HOME / HF_HUB_CACHE (where the cache is), HF_HUB_OFFLINE (cache only),
HF_ENDPOINT and HF_TOKEN, reuses what the cache already holds, falls back to the cached
snapshot when the Hub cannot be reached, and draws the download progress bars.

The snapshot is checked before it is returned: a cache holding a config but no weights
(an interrupted download) is an error that says how to complete it, not a crash later in
a child process.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

logger = logging.getLogger(__name__)

# What sglite reads from a checkpoint; everything else (*.bin, *.pth, *.gguf, onnx/, ...)
# would only cost download time and disk.
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
TOKENIZER_FILES = ["*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
REMOTE_CODE_FILES = ["*.py"]
SKIPPED = ["original/*", "onnx/*", "openvino/*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


class HubError(RuntimeError):
    """A repo id that could not be turned into a usable local folder; says what to do."""


def is_local(path: str) -> bool:
    return Path(path).expanduser().exists()


def looks_like_repo_id(path: str) -> bool:
    """`org/name` or `name`, and nothing that reads as a file path (./x, ~/x, x.gguf)."""
    return bool(_REPO_ID.match(path)) and not path.endswith((".gguf", ".safetensors"))


def resolve_repo(
    repo_id: str,
    *,
    revision: str | None = None,
    tokenizer_only: bool = False,
    trust_remote_code: bool = False,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> Path:
    """The local snapshot folder of `repo_id` at `revision`, downloading what is missing.

    `cache_dir` and `local_files_only` default to huggingface_hub's own settings (HF_HOME,
    HF_HUB_OFFLINE); tests pass them to stay off the network."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    patterns = list(TOKENIZER_FILES if tokenizer_only else MODEL_FILES)
    if trust_remote_code:
        patterns += REMOTE_CODE_FILES
    where = Path(cache_dir) if cache_dir is not None else Path(constants.HF_HUB_CACHE)
    offline = local_files_only or constants.HF_HUB_OFFLINE
    at = f"{repo_id}@{revision}" if revision else repo_id
    logger.info(
        "resolving %s from the Hugging Face Hub (cache %s%s)",
        at,
        where,
        ", offline" if offline else "",
    )
    try:
        folder = snapshot_download(
            repo_id,
            revision=revision,
            allow_patterns=patterns,
            ignore_patterns=SKIPPED,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
    except LocalEntryNotFoundError as e:
        if offline:
            why = "the Hub is not consulted (HF_HUB_OFFLINE=1)"
        else:
            why = f"the Hub could not be reached ({_first_line(e)})"
        raise HubError(
            f"--model-path {at!r} is not a local folder or file, and as a Hugging Face repo id "
            f"it is not in the local Hub cache ({where}) while {why}. Download it where "
            f"there is network (`hf download {repo_id}`"
            + (f" --revision {revision}" if revision else "")
            + "), point HF_HOME at a cache that has it, or pass a local folder."
        ) from None
    except GatedRepoError:
        raise HubError(
            f"--model-path {at!r}: the repo is gated; accept its terms on huggingface.co and "
            "log in (`hf auth login` or HF_TOKEN)"
        ) from None
    except RepositoryNotFoundError:
        raise HubError(
            f"--model-path {at!r}: no such repo on the Hugging Face Hub (or it is private: "
            "log in with `hf auth login` or HF_TOKEN); a local folder must exist"
        ) from None
    except RevisionNotFoundError:
        raise HubError(
            f"--revision {revision!r}: {repo_id} has no such branch, tag or commit"
        ) from None
    except HfHubHTTPError as e:
        raise HubError(f"--model-path {at!r}: the Hub answered {_first_line(e)}") from None
    path = Path(folder)
    _check_snapshot(path, at, tokenizer_only)
    logger.info("using %s from %s", at, path)
    return path


def _check_snapshot(path: Path, at: str, tokenizer_only: bool) -> None:
    needed = [] if tokenizer_only else ["config.json"]
    missing = [name for name in needed if not (path / name).is_file()]
    if not tokenizer_only and not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise HubError(
            f"--model-path {at!r}: the snapshot in {path} lacks {', '.join(missing)} "
            "(an interrupted download, or a repo without safetensors weights, which sglite "
            "cannot load); complete it with `hf download` or pass a local folder"
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
