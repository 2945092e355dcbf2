"""Tensor parallelism through the real server on CPU (gloo): one scheduler process per rank.

The tiny Llama (4 heads over 2 KV heads) served at --tp-size 2 gives the same greedy answers
as at --tp-size 1 (completions and chat through the `openai` client, concurrent, one
streamed, one constrained by a regex); so does a two-node launch simulated on 127.0.0.1
(`--nnodes 2 --node-rank 0/1`, the overlap loop), and node 1 ends with code 0 when node 0
shuts down. Failures are named: a rank killed while
it generates takes the server down (non-zero exit, "TP rank 1"), a tp size that does not
split the model (2 of 3 heads) is refused listing the sizes that work, and a rank that never joins fails
start-up naming it. Nothing waits on timing beyond bounded process exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from fixtures.serving import REPO, child_env, free_port, start_server

PROMPTS = ["The capital of France is", "Hello world! How are", "def f(x):\n    return"]
CHATS = ["What is the capital of Japan?", "Say hello."]
MAX_TOKENS = 10
REGEX = "[0-9]{3}-[a-z]{2}"


def _args(model_dir, *extra: str) -> list[str]:
    return ["--model-path", str(model_dir), "--max-total-tokens", "2048",
            "--served-model-name", "m", "--dist-timeout", "20", *extra]  # fmt: skip


def _answers(url: str) -> dict:
    """Greedy answers of one workload: concurrent completions and chats, a streamed chat,
    a regex-constrained /generate."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    greedy = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}

    def complete(prompt: str) -> str:
        return client.completions.create(model="m", prompt=prompt, **greedy).choices[0].text

    def chat(text: str) -> str:
        msgs = [{"role": "user", "content": text}]
        reply = client.chat.completions.create(model="m", messages=msgs, **greedy)
        return reply.choices[0].message.content

    with ThreadPoolExecutor(len(PROMPTS) + len(CHATS)) as pool:
        completions = list(pool.map(complete, PROMPTS))
        chats = list(pool.map(chat, CHATS))
    stream = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": CHATS[0]}], stream=True, **greedy
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    sp = {"regex": REGEX, "temperature": 0, "max_new_tokens": 20}
    r = httpx.post(url + "/generate", json={"text": PROMPTS[0], "sampling_params": sp}, timeout=60)
    assert r.status_code == 200, r.text
    return {"completions": completions, "chats": chats, "streamed": streamed, "regex": r.json()}


@pytest.fixture(scope="module")
def tp1_answers(tiny_chat_model_dir, tmp_path_factory):
    srv = start_server(
        _args(tiny_chat_model_dir), tmp_path_factory.mktemp("tp1") / "log", fake=False
    )
    try:
        answers = _answers(srv.url)
    finally:
        assert srv.stop() == 0, srv.log()
    assert answers["streamed"] == answers["chats"][0]
    assert re.fullmatch(REGEX, answers["regex"]["text"]), answers["regex"]
    return answers


@pytest.fixture(scope="module")
def tp2(tiny_chat_model_dir, tmp_path_factory):
    srv = start_server(
        _args(tiny_chat_model_dir, "--tp-size", "2"),
        tmp_path_factory.mktemp("tp2") / "log",
        fake=False,
    )
    yield srv
    srv.stop()


def _same(got: dict, want: dict) -> None:
    for key in ("completions", "chats", "streamed"):
        assert got[key] == want[key], key
    assert got["regex"]["text"] == want["regex"]["text"]
    assert got["regex"]["output_ids"] == want["regex"]["output_ids"]


def test_tp2_serves_the_same_greedy_answers_as_tp1(tp2, tp1_answers):
    _same(_answers(tp2.url), tp1_answers)
    info = httpx.get(tp2.url + "/get_server_info", timeout=10).json()
    assert info["tp_size"] == 2
    assert "scheduler_tp1 ready (pid" in tp2.log()


def test_two_nodes_on_one_machine_serve_like_tp1(tiny_chat_model_dir, tmp_path, tp1_answers):
    addr = f"127.0.0.1:{free_port()}"
    common = _args(tiny_chat_model_dir, "--tp-size", "2", "--nnodes", "2",
                   "--dist-init-addr", addr, "--no-disable-overlap-schedule")  # fmt: skip
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "wb") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "sglite.launch_server", *common, "--node-rank", "1"],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO,
            start_new_session=True,
        )  # fmt: skip
    try:
        node0 = start_server([*common, "--node-rank", "0"], tmp_path / "node0.log", fake=False)
        try:
            _same(_answers(node0.url), tp1_answers)
        finally:
            assert node0.stop() == 0, node0.log()
        assert node1.wait(60) == 0  # node 0 stopped the TP group: node 1 ends by itself
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait()
    text = node1_log.read_text()
    assert "node 1 of 2: starting TP ranks 1..1 of 2" in text, text
    assert "TP rank 1: the TP group was asked to stop; exiting" in text, text
    assert "TP rank 1 stopped with its TP group" in text, text
    assert "Uvicorn" not in text  # no HTTP server on node 1


def test_a_rank_killed_mid_run_takes_the_server_down_naming_it(tp2):
    pid = int(re.search(r"scheduler_tp1 ready \(pid (\d+)", tp2.log()).group(1))
    body = {"text": PROMPTS[0], "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}  # fmt: skip
    try:
        with httpx.stream("POST", tp2.url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data:"):  # it generates: kill rank 1 now
                    os.kill(pid, signal.SIGKILL)
                    break
    except httpx.HTTPError:
        pass  # the server may already be closing the connection
    assert tp2.proc.wait(60) == 1
    log = tp2.log()
    assert "the scheduler process of TP rank 1 died (exit code -9)" in log, log
    assert "TP rank 0: lost contact with TP rank 1" in log, log


def _failed_start(args: list[str], tmp_path) -> str:
    with pytest.raises(RuntimeError) as e:
        start_server(args, tmp_path / "log", fake=False, timeout=120)
    assert "server exited with 1" in str(e.value)
    return str(e.value)


def test_a_tp_size_that_does_not_split_the_model_is_refused(tiny_model_dir, tmp_path):
    from sglite.model_executor.model_runner import ModelRunner

    three_heads = tiny_model_dir(
        "llama", num_attention_heads=3, num_key_value_heads=1, hidden_size=48,
        head_dim=16, intermediate_size=96,
    )  # fmt: skip
    log = _failed_start(_args(three_heads, "--tp-size", "2"), tmp_path)
    assert "the scheduler process" not in log  # refused before any rank starts
    with pytest.raises(ValueError, match="tp sizes that work: 1, 3"):  # and by every rank
        ModelRunner(three_heads, device="cpu", tp_size=2, dist_init_addr="127.0.0.1:1")
    assert "--tp-size 2: the model has 3 attention heads; tp sizes that work: 1, 3" in log


def test_a_rank_that_never_joins_fails_the_start_up_naming_it(tiny_chat_model_dir, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    args = _args(tiny_chat_model_dir, "--tp-size", "2", "--nnodes", "2", "--node-rank", "0",
                 "--dist-init-addr", addr, "--dist-timeout", "3")  # fmt: skip
    log = _failed_start(args, tmp_path)
    assert "TP rank(s) 1 of 2 did not join the rendezvous at " + addr in log, log
