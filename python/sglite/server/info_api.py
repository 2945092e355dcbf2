"""The info routes: /get_model_info, /get_server_info (also under SGLang's newer names
/model_info, /server_info, which SGLang's router asks first) and /v1/models.

/get_server_info has SGLang's flat shape: the server args, the model facts and the
scheduler's stats at the top level (summed over --dp-size replicas), and each replica's own
stats in `internal_states` (one entry per replica, with its `dp_rank` when there are several).

None of them shows where the model lives on the host: the model and tokenizer paths are
shown as given on the command line (a Hub id, a folder the operator named) or as the served
name (the default model), never the local snapshot or cache folder they were resolved to
(`~/.cache/...`), unless the server runs with --expose-local-paths.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI

from sglite.server.dp_dispatcher import merge_stats
from sglite.server.errors import RequestError
from sglite.version import __version__

PATH_KEYS = ("model_path", "tokenizer_path")


def shown_paths(tm: Any, given_args: Any) -> dict[str, Any]:
    """What the info routes show as model_path and tokenizer_path."""
    if getattr(tm.server_args, "expose_local_paths", False):
        return {
            "model_path": tm.model_info.get("model_path") or tm.server_args.model_path,
            "tokenizer_path": tm.model_info.get("tokenizer_path"),
        }
    model = given_args.model_path or tm.served_model_name
    return {"model_path": model, "tokenizer_path": given_args.tokenizer_path or model}


def add_info_routes(app: FastAPI, tm: Any, given_args: Any) -> None:
    """Register the routes on `app`; `given_args`: the ServerArgs as given, before the
    model and tokenizer were resolved to local folders."""
    paths = shown_paths(tm, given_args)

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info() -> dict[str, Any]:
        info = tm.model_info
        return {
            **paths,
            "served_model_name": tm.served_model_name,
            "is_generation": True,
            "context_length": tm.context_length,
            "vocab_size": tm.vocab_size,
            "max_total_tokens": info.get("max_total_tokens"),
            "model_type": info.get("model_type"),
            "architectures": info.get("architectures"),
        }

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info() -> dict[str, Any]:
        replicas = await tm.get_replica_stats()
        stats = merge_stats(replicas)
        info = tm.model_info
        return {
            **tm.server_args.to_dict(),
            **info,
            **paths,
            "max_total_num_tokens": info.get("max_total_tokens"),  # SGLang's name
            "served_model_name": tm.served_model_name,
            **stats,
            "tree_core": stats.get("tree_core") or info.get("tree_core"),
            "internal_states": replicas,
            "version": __version__,
        }

    def model_card() -> dict[str, Any]:
        return {
            "id": tm.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglite",
            "root": paths["model_path"],
            "max_model_len": tm.context_length,
        }

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> dict[str, Any]:
        if model != tm.served_model_name:
            raise RequestError(
                f"model {model!r} not found; this server serves {tm.served_model_name!r}",
                404,
                param="model",
            )
        return model_card()
