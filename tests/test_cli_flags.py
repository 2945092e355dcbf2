"""The command line as copied from SGLang's docs: its flags parse to the same meanings,
flags sglite lacks are refused by name, bad values are refused with the flag's name;
--dtype auto, --chat-template and --tokenizer-mode resolve as documented."""

from __future__ import annotations

import pytest
import torch

from sglite.cli import parse_server_args
from sglite.config import ServerArgs
from sglite.model_executor.model_runner import resolve_dtype


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_server_args(argv, prog="launch_server")
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,flag,what",
    [
        (["--quantization-param-path", "q.json"], "--quantization-param-path", "quantization"),
        (["--speculative-algorithm", "EAGLE"], "--speculative-algorithm", "speculative"),
        (["--speculative-num-steps", "3"], "--speculative-num-steps", "speculative"),
        (["--lora-paths", "a=/x"], "--lora-paths", "LoRA"),
        (["--enable-lora"], "--enable-lora", "LoRA"),
        (["--enable-dp-attention"], "--enable-dp-attention", "data-parallel attention"),
    ],
)
def test_sglang_flags_without_support_are_refused_by_name(argv, flag, what, capsys):
    err = _refused(["--model-path", "m", *argv], capsys)
    assert f"{flag}: sglite does not support" in err and what in err
    assert "unrecognized arguments" not in err


def test_sglang_flags_with_a_no_op_value_are_accepted():
    args = parse_server_args(
        "--model-path m --dp-size 1 --dp=1 --load-format safetensors "
        "--pp-size 1 --port 31000".split()
    )
    assert args.model_path == "m" and args.port == 31000


def test_quantization_takes_the_modes_sglite_has(capsys):
    args = parse_server_args("--model-path m.gguf --quantization gguf --quant-kernel exact".split())
    assert args.quantization == "gguf" and args.quant_kernel == "exact"
    assert parse_server_args(["--model-path", "m"]).quant_kernel == "int16"  # the default
    assert parse_server_args(["--model-path", "m"]).quantization is None
    for method in ("w8a8_int8", "fp8", "awq", "gptq"):
        assert (
            parse_server_args(["--model-path", "m", "--quantization", method]).quantization
            == method
        )
    err = _refused(["--model-path", "m", "--quantization", "bitsandbytes"], capsys)
    assert "--quantization: invalid choice: 'bitsandbytes'" in err and "gguf" in err


def test_unknown_flags_still_get_argparse_message(capsys):
    err = _refused(["--no-such-flag"], capsys)
    assert "unrecognized arguments: --no-such-flag" in err


def test_the_sglang_quick_start_command_parses():
    args = parse_server_args(
        "--model-path Qwen/Qwen3-0.6B --port 30000 --api-key K --enable-metrics "
        "--log-requests --log-requests-level 2 --enable-cache-report --max-queued-requests 8 "
        "--revision main --tokenizer-mode slow --trust-remote-code --dtype half "
        "--chat-template t.jinja --allowed-origins https://a.example,https://b.example "
        "--tp 1".split()
    )
    assert args.model_path == "Qwen/Qwen3-0.6B" and args.port == 30000
    assert args.api_key == "K" and args.enable_metrics and args.log_requests
    assert args.log_requests_level == 2 and args.enable_cache_report
    assert args.max_queued_requests == 8 and args.revision == "main"
    assert args.tokenizer_mode == "slow" and args.trust_remote_code and args.dtype == "half"
    assert args.chat_template == "t.jinja" and args.tp_size == 1
    assert args.cors_origins == ["https://a.example", "https://b.example"]


def test_defaults_follow_sglang():
    args = parse_server_args([])
    assert args.max_queued_requests is None  # unlimited
    assert not args.enable_metrics and not args.log_requests and not args.enable_cache_report
    assert args.api_key is None and args.cors_origins == ["*"] and args.dtype == "auto"
    assert args.tp_size == 1 and args.log_requests_level == 0


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--max-queued-requests", "0"], "--max-queued-requests"),
        (["--api-key", " "], "--api-key"),
        (["--allowed-origins", " , "], "--allowed-origins"),
        (["--tp", "0"], "--tp-size"),
        (["--log-requests-level", "4"], "--log-requests-level"),
        (["--dtype", "int8"], "--dtype"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
        (["--tokenizer-mode", "fast"], "--tokenizer-mode"),
    ],
)
def test_bad_values_name_the_flag(argv, words, capsys):
    assert words in _refused(argv, capsys)


def test_server_info_dict_masks_the_api_key():
    assert ServerArgs(api_key="secret").to_dict()["api_key"] == "***"
    assert ServerArgs().to_dict()["api_key"] is None


@pytest.mark.parametrize(
    "dtype,device,checkpoint,expected",
    [
        ("auto", "cpu", "bfloat16", torch.float32),  # CPU: fp32 whatever the checkpoint
        ("auto", "cpu", "float16", torch.float32),
        ("auto", "cuda", "bfloat16", torch.bfloat16),  # CUDA: SGLang's rule
        ("auto", "cuda", "float32", torch.float16),
        ("auto", "cuda", "float16", torch.float16),
        ("auto", "cuda", None, torch.float16),
        ("half", "cpu", None, torch.float16),
        ("float", "cuda", "bfloat16", torch.float32),
        ("bfloat16", "cpu", "float32", torch.bfloat16),
    ],
)
def test_dtype_resolution(dtype, device, checkpoint, expected):
    assert resolve_dtype(dtype, torch.device(device), checkpoint) == expected


def test_every_dtype_choice_resolves():
    choices = ServerArgs.__dataclass_fields__["dtype"].metadata["choices"]
    assert set(choices) == {"auto", "half", "float16", "bfloat16", "float", "float32"}
    for choice in choices:
        assert isinstance(resolve_dtype(choice, torch.device("cpu")), torch.dtype)


def test_every_kv_cache_dtype_choice_resolves():
    from sglite.mem_cache.kv_dtype import resolve_kv_cache_dtype

    choices = ServerArgs.__dataclass_fields__["kv_cache_dtype"].metadata["choices"]
    got = {c: resolve_kv_cache_dtype(c, torch.float32) for c in choices}
    assert got == {
        "auto": torch.float32,
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
    assert resolve_kv_cache_dtype("auto", torch.bfloat16) == torch.bfloat16
    assert parse_server_args(["--kv-cache-dtype", "fp8_e4m3"]).kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="--kv-cache-dtype: must be one of"):
        ServerArgs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype: must be one of"):
        resolve_kv_cache_dtype("e4m3", torch.float32)


def test_front_door_flags_are_server_args_under_their_own_heading(capsys):
    from sglite.cli import build_parser

    args = parse_server_args(["--max-request-bytes", "100", "--http-body-timeout", "5"])
    assert args.max_request_bytes == 100 and args.http_body_timeout == 5.0
    with pytest.raises(ValueError, match="--max-json-depth: must be >= 1"):
        ServerArgs(max_json_depth=0)
    help_text = build_parser().format_help()
    section = help_text.split("\nfront door:")[1]
    assert "--max-request-bytes" in section and "--kv-cache-dtype" not in section


def test_chat_template_from_file_or_string(tmp_path):
    from sglite.server.tokenizer import load_chat_template

    source = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    path = tmp_path / "t.jinja"
    path.write_text(source)
    assert load_chat_template(str(path)) == source
    assert load_chat_template(source) == source
    with pytest.raises(ValueError, match="--chat-template: .* neither a file nor"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="--chat-template: not a valid Jinja"):
        load_chat_template("{% for m in messages %}")


def test_tokenizer_options_reach_transformers(monkeypatch):
    import transformers

    from sglite.server.tokenizer import tokenizer_for

    calls = []
    monkeypatch.setattr(
        transformers.AutoTokenizer,
        "from_pretrained",
        lambda path, **kw: calls.append((path, kw)) or object(),
    )
    args = ServerArgs(model_path="/m", tokenizer_mode="slow", trust_remote_code=True)
    tokenizer_for(args)
    tokenizer_for(ServerArgs(model_path="/m", tokenizer_path="/t"))
    assert calls == [
        ("/m", {"use_fast": False, "trust_remote_code": True}),
        ("/t", {"use_fast": True, "trust_remote_code": False}),
    ]


def test_tensor_parallel_flags_parse_as_sglang():
    args = parse_server_args(
        "--tp 4 --nnodes 2 --node-rank 1 --dist-init-addr 10.0.0.1:5000 --dist-timeout 30".split()
    )
    assert (args.tp_size, args.nnodes, args.node_rank) == (4, 2, 1)
    assert args.dist_init_addr == "10.0.0.1:5000" and args.dist_timeout == 30
    assert list(args.node_tp_ranks) == [2, 3]
    one = parse_server_args(["--nnodes", "1", "--node-rank", "0", "--tp-size", "2"])
    assert one.dist_init_addr is None and list(one.node_tp_ranks) == [0, 1]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--tp-size", "3", "--nnodes", "2", "--dist-init-addr", "h:1"], "--nnodes: must divide"),
        (["--tp-size", "2", "--nnodes", "2"], "--dist-init-addr: is required"),
        (
            ["--tp-size", "2", "--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
            "--node-rank: must be in 0..1",
        ),  # fmt: skip
        (["--tp-size", "2", "--dist-init-addr", "nohost"], "--dist-init-addr: must be HOST:PORT"),
        (["--tp-size", "2", "--dp-size", "2"], "--dp-size: cannot be combined with --tp-size"),
        (["--dist-timeout", "0"], "--dist-timeout"),
    ],
)
def test_bad_tensor_parallel_flags_are_refused_by_name(argv, words, capsys):
    assert words in _refused(argv, capsys)
