"""SGLang's quick-start command, unchanged but for the model, on the real engine:

    python -m sglite.launch_server --model-path sglite-test/tiny-qwen3 --port P \
        --api-key K --enable-metrics --log-requests

with the tiny Qwen3 checkpoint in a local Hub cache (HF_HOME, HF_HUB_OFFLINE=1) and a
--chat-template file (the tiny tokenizer has none). It starts (logging its progress),
serves the official `openai` client with the key and refuses it without, answers greedy
like transformers on the same snapshot, logs one line per request and exposes SGLang's
metric names.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest

from fixtures.hub_cache import add_to_hub_cache
from fixtures.serving import CHAT_TEMPLATE, start_server

REPO_ID = "sglite-test/tiny-qwen3"
KEY = "K"


@pytest.fixture(scope="module")
def snapshot_and_server(tiny_model_dir, tmp_path_factory):
    hf_home = tmp_path_factory.mktemp("hf_home")
    snapshot = add_to_hub_cache(hf_home, REPO_ID, tiny_model_dir("qwen3"))
    template = tmp_path_factory.mktemp("tpl") / "chatml.jinja"
    template.write_text(CHAT_TEMPLATE)
    log = tmp_path_factory.mktemp("log") / "server.log"
    srv = start_server(
        [
            "--model-path", REPO_ID, "--api-key", KEY, "--enable-metrics", "--log-requests",
            "--max-total-tokens", "4096", "--chat-template", str(template),
        ],
        log,
        fake=False,
        timeout=300,
        env={"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    yield snapshot, srv
    assert srv.stop() == 0, srv.log()


def test_quick_start_command(snapshot_and_server):
    from test_server_e2e import hf_greedy

    snapshot, srv = snapshot_and_server
    log = srv.log()
    for step in ("resolving sglite-test/tiny-qwen3", "Loading weights", "building the KV pool"):
        assert step in log, log[-3000:]

    client = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == [REPO_ID]
    prompt = "The river town woke slowly"
    r = client.completions.create(
        model="default", prompt=prompt, max_tokens=6, temperature=0, extra_body={"rid": "qs-1"}
    )
    assert r.usage.completion_tokens == 6 and r.model == REPO_ID
    out = httpx.post(
        srv.url + "/generate",
        json={"text": prompt, "sampling_params": {"max_new_tokens": 6, "temperature": 0}},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    ).json()
    assert out["text"] == r.choices[0].text
    assert out["output_ids"] == hf_greedy(snapshot, prompt, 6)[: len(out["output_ids"])]
    chat = client.chat.completions.create(
        model=REPO_ID,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert len("".join(c.choices[0].delta.content or "" for c in chat if c.choices)) > 0

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong").models.list()

    metrics = httpx.get(srv.url + "/metrics", timeout=30).text  # open without the key
    count = re.search(
        r'^sglang:time_to_first_token_seconds_count\{model_name="sglite-test/tiny-qwen3"\} (\S+)$',
        metrics,
        re.M,
    )
    assert count and float(count.group(1)) >= 2, metrics
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:e2e_request_latency_seconds_bucket", "sglang:prompt_tokens_total"):  # fmt: skip
        assert name in metrics, name
    line = next(x for x in srv.log().splitlines() if "rid=qs-1 " in x)
    assert "output_tokens=6" in line and "ttft=" in line and '"type":"length"' in line
