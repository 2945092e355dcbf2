"""Hub repo ids as --model-path, resolved against a local cache laid out as huggingface_hub
lays it out (tests/fixtures/hub_cache.py); nothing here reaches the network: in-process
calls pass the cache and offline mode, subprocesses get HF_HOME and HF_HUB_OFFLINE=1 or an
HF_ENDPOINT on a closed local port (connection refused at once)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fixtures.hub_cache import add_to_hub_cache
from fixtures.serving import child_env, free_port
from sglite.models import hub
from sglite.models.loader import resolve_model_path

REPO_ID = "sglite-test/tiny-qwen3"


@pytest.fixture(scope="module")
def hf_home(tiny_model_dir, tmp_path_factory):
    home = tmp_path_factory.mktemp("hf_home")
    add_to_hub_cache(home, REPO_ID, tiny_model_dir("qwen3"))
    # another revision: same repo, no tokenizer_config.json
    add_to_hub_cache(
        home, REPO_ID, tiny_model_dir("qwen3"), revision="v2", skip=("tokenizer_config.json",)
    )
    # an interrupted download: the config, no weights
    add_to_hub_cache(
        home,
        "sglite-test/partial",
        tiny_model_dir("qwen3"),
        skip=("model.safetensors",),
    )
    return home


def _resolve(hf_home, repo_id, **kw):
    return hub.resolve_repo(repo_id, cache_dir=hf_home / "hub", local_files_only=True, **kw)


@pytest.mark.parametrize(
    "path,is_id",
    [
        ("Qwen/Qwen3-0.6B", True),
        ("gpt2", True),
        ("meta-llama/Llama-3.2-1B-Instruct", True),
        ("./models/qwen", False),
        ("/abs/path", False),
        ("~/models/x", False),
        ("a/b/c", False),
        ("model.gguf", False),
        ("org/name.gguf", False),
    ],
)
def test_looks_like_repo_id(path, is_id):
    assert hub.looks_like_repo_id(path) is is_id


def test_resolves_the_cached_snapshot(hf_home, tiny_model_dir):
    path = _resolve(hf_home, REPO_ID)
    assert path.parent.name == "snapshots" and path.parent.parent.name.endswith("tiny-qwen3")
    assert json.loads((path / "config.json").read_text()) == json.loads(
        (tiny_model_dir("qwen3") / "config.json").read_text()
    )
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()


def test_revision_selects_its_snapshot(hf_home):
    main, v2 = _resolve(hf_home, REPO_ID), _resolve(hf_home, REPO_ID, revision="v2")
    assert main != v2
    assert (main / "tokenizer_config.json").exists()
    assert not (v2 / "tokenizer_config.json").exists()


def test_missing_from_the_cache_offline_says_what_to_do(hf_home):
    with pytest.raises(hub.HubError) as e:
        _resolve(hf_home, "sglite-test/not-there")
    msg = str(e.value)
    for words in ("sglite-test/not-there", "not in the local Hub cache", "HF_HUB_OFFLINE"):
        assert words in msg, msg
    assert "hf download sglite-test/not-there" in msg
    with pytest.raises(hub.HubError) as e:
        _resolve(hf_home, REPO_ID, revision="v9")
    assert "--revision v9" in str(e.value)


def test_snapshot_without_weights_is_refused(hf_home):
    with pytest.raises(hub.HubError) as e:
        _resolve(hf_home, "sglite-test/partial")
    assert "*.safetensors" in str(e.value) and "hf download" in str(e.value)


def test_a_local_path_that_does_not_exist_is_not_a_repo_id(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a folder"):
        resolve_model_path(str(tmp_path / "nope"))


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=child_env(extra=env),
        timeout=120,
    )


def test_hf_home_and_offline_are_honoured(hf_home):
    """In a fresh process, as the server runs: HF_HOME picks the cache, HF_HUB_OFFLINE=1
    keeps huggingface_hub off the network."""
    code = (
        "from sglite.models.loader import resolve_model_path;"
        f"print(resolve_model_path({REPO_ID!r}))"
    )
    out = _run(code, {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith(str(hf_home / "hub"))


def test_launch_fails_clearly_when_neither_cached_nor_reachable(tmp_path):
    """`launch_server --model-path org/name` with an empty cache and a Hub that refuses the
    connection: exit 1, the reason and what to do, before any child starts."""
    env = {
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": f"http://127.0.0.1:{free_port()}",
    }
    out = subprocess.run(
        [sys.executable, "-m", "sglite.launch_server", "--model-path", "org/absent"],
        capture_output=True,
        text=True,
        env=child_env(tmp_path, env),
        timeout=120,
    )
    assert out.returncode == 1, out.stderr
    for words in ("org/absent", "not in the local Hub cache", "could not be reached"):
        assert words in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
