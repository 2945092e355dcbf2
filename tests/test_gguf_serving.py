"""A .gguf as --model-path, end to end: converted once in the main process (config and
tokenizer; the scheduler reads the weights from the .gguf, kept packed), so the tokenizer
manager, the detokenizer and the scheduler all load the folder; served under the path as
given; greedy output (--quant-kernel exact) equal to transformers on the dequantized model. And start-up refusals
(an unsupported architecture in config.json, an unsupported GGUF architecture) end the
process with one clear line and status 1, not a traceback.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import openai
import pytest

import sglite
from fixtures.serving import child_env, free_port, start_server
from test_server_e2e import hf_greedy

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def smollm2_gguf():
    from sglite.models import gguf

    try:
        return gguf.smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def greedy_ref(smollm2_gguf):
    from transformers import AutoTokenizer

    from sglite.models.gguf import convert_gguf_to_hf

    folder = convert_gguf_to_hf(smollm2_gguf, weights=True)  # cached: the fp32 reference
    tok = AutoTokenizer.from_pretrained(str(folder))
    return tok.decode(hf_greedy(folder, PROMPT, 8))


def test_launch_server_with_a_gguf_path(smollm2_gguf, greedy_ref, tmp_path):
    srv = start_server(
        [
            "--model-path",
            str(smollm2_gguf),
            "--max-total-tokens",
            "4096",
            "--quant-kernel",
            "exact",
        ],
        tmp_path / "server.log",
        fake=False,
        timeout=600,
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == [str(smollm2_gguf)]
        r = client.completions.create(
            model=str(smollm2_gguf), prompt=PROMPT, max_tokens=8, temperature=0
        )
        assert r.choices[0].text == greedy_ref and r.model == str(smollm2_gguf)
        chat = client.chat.completions.create(
            model=str(smollm2_gguf),
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=16,
            temperature=0,
        )  # the chat template came from the GGUF
        assert "Paris" in chat.choices[0].message.content
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    log = srv.log()
    # converted (here: found in the cache) once, by the main process, before the children
    assert "[MainProcess] sglite.models.gguf.convert: using " in log
    assert "converted from SmolLM2-135M-Instruct.Q4_1.gguf" in log
    assert "could not load a tokenizer" not in log and "Traceback" not in log
    assert "GGUF blocks kept packed" in log


def test_engine_with_a_gguf_path(smollm2_gguf, greedy_ref):
    with sglite.Engine(
        model_path=str(smollm2_gguf), max_total_tokens=2048, quant_kernel="exact"
    ) as engine:
        out = engine.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})
    assert out["text"] == greedy_ref


def test_every_process_of_a_dp_server_sees_the_converted_folder(tiny_model_dir, tmp_path):
    """With --dp-size 2 (fake schedulers: each reads tokenizer.json from its model_path),
    both replicas, the detokenizer and the tokenizer manager start from the one folder."""
    import httpx

    from fixtures.gguf_writer import write_gguf

    path = write_gguf(tiny_model_dir("llama"), tmp_path / "tiny.gguf", qtype="Q8_0")
    srv = start_server(
        ["--model-path", str(path), "--dp-size", "2", "--expose-local-paths"],
        tmp_path / "server.log",
        fake=True,
        tmpdir=tmp_path,
        env={"SGL_CACHE_DIR": str(tmp_path / "cache")},
    )
    try:
        for text in ("The river town", "woke slowly"):  # round robin: both replicas
            r = httpx.post(srv.url + "/generate", json={"text": text}, timeout=30)
            assert r.status_code == 200 and r.json()["text"], r.text
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["served_model_name"] == str(path)
        # --expose-local-paths: the info routes show the converted folder all processes use
        assert info["model_path"].startswith(str(tmp_path / "cache" / "gguf" / "tiny-"))
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
    assert srv.log().count("sglite.models.gguf.convert: converted tiny.gguf") == 1


# ---------------------------------------------------------------------- refusals
def _launch(model_path, tmp_path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sglite.launch_server", "--model-path", str(model_path)]
    return subprocess.run(
        [*cmd, "--port", str(free_port())],
        capture_output=True,
        text=True,
        env=child_env(tmp_path, {"SGL_CACHE_DIR": str(tmp_path / "cache")}),
        timeout=300,
    )


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def test_unsupported_architecture_is_one_line(tiny_model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    line = _one_error_line(_launch(model, tmp_path))
    assert "the scheduler process failed to start: model architecture 'FooForCausalLM' is " in line
    assert "not supported; supported: " in line and "LlamaForCausalLM" in line


def test_unsupported_gguf_architecture_is_one_line_before_any_child(tiny_model_dir, tmp_path):
    from fixtures.gguf_writer import write_gguf

    path = write_gguf(tiny_model_dir("llama"), tmp_path / "odd.gguf", arch="falcon")
    proc = _launch(path, tmp_path)
    line = _one_error_line(proc)
    assert "odd.gguf: GGUF architecture 'falcon' is not supported; supported: " in line
    assert "scheduler" not in proc.stderr  # refused in the main process: no child started

    from sglite.launcher import StartupError

    with pytest.raises(StartupError, match="GGUF architecture 'falcon' is not supported"):
        sglite.Engine(model_path=str(path))


def test_a_refusal_keeps_its_traceback_at_debug_level_and_a_bug_shows_it(caplog):
    import logging

    from sglite.messages import ReadyMsg
    from sglite.process_group import ProcessGroup

    def failed(exc: Exception) -> ReadyMsg:
        try:
            raise exc
        except Exception as e:  # noqa: BLE001 - the child's catch-all
            return ReadyMsg.failed("scheduler", e)

    with caplog.at_level(logging.DEBUG, logger="sglite.launcher"):
        err = ProcessGroup._startup_error("scheduler", failed(ValueError("field x = 3 is odd")))
    assert str(err) == "the scheduler process failed to start: field x = 3 is odd"
    (record,) = caplog.records
    assert record.levelno == logging.DEBUG and "Traceback" in record.getMessage()

    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="sglite.launcher"):
        err = ProcessGroup._startup_error("scheduler", failed(KeyError("rms_norm_eps")))
    assert str(err) == "the scheduler process failed to start: KeyError: 'rms_norm_eps'"
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and "Traceback" in record.getMessage()
