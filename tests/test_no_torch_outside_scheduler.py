"""Only the scheduler imports torch: the main process (HTTP server, TokenizerManager), the
detokenizer and the grammar child's parent side load none of it (~0.4 GB of RSS each)."""

from __future__ import annotations

import subprocess
import sys

from fixtures.serving import build_tiny_tokenizer, child_env

# What the main process and the detokenizer import and run at start-up, short of the
# children and the sockets: the entry modules, the tokenizer, the resolved config.
START_UP = """
import sys
import sglite.cli, sglite.launcher, sglite.process_group, sglite.server.http_server
import sglite.server.tokenizer_manager, sglite.detokenizer, sglite.constrained.compile_process
from sglite.config import ServerArgs
from sglite.detokenizer import make_decode_fn
from sglite.launcher import check_tp_size_early
from sglite.server.tokenizer import tokenizer_for

args = ServerArgs(model_path=sys.argv[1]).resolved("cpu")
check_tp_size_early(args.replace(tp_size=2))
tokenizer = tokenizer_for(args)
decode = make_decode_fn(tokenizer)
assert decode(tokenizer.encode("hello world"), True).strip() == "hello world"
loaded = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
print("torch modules:", loaded)
sys.exit(1 if loaded else 0)
"""


def test_main_process_and_detokenizer_start_without_torch(tmp_path):
    folder = build_tiny_tokenizer(tmp_path / "tok")
    (folder / "config.json").write_text(
        '{"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}'
    )
    run = subprocess.run(
        [sys.executable, "-c", START_UP, str(folder)],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
