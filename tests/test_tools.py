"""The data tools end to end: text/jsonl -> tokenizer -> .bin/.idx usable for training."""

import json
import subprocess
import sys

from conftest import REPO


def test_train_tokenizer_then_preprocess(tmp_path):
    """Guards against the tools writing files pretrain_gpt.py then refuses or misreads."""
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"def g{i}(y):\n    return y - {i}\n" * 5}) for i in range(60)))
    tok = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(src),
                          "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "300"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tok.returncode == 0, tok.stderr
    pre = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(src),
                          "--tokenizer-model", str(tmp_path / "tok.model"),
                          "--output-prefix", str(tmp_path / "ds")],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert pre.returncode == 0, pre.stderr
    from loco_megatron.data.indexed import check_indexed_dataset
    from loco_megatron.data.tokenizer import load_tokenizer

    check_indexed_dataset(str(tmp_path / "ds"), load_tokenizer(str(tmp_path / "tok.model")),
                          str(tmp_path / "tok.model"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(bad),
                           "--tokenizer-model", str(tmp_path / "tok.model"), "--output-prefix",
                           str(tmp_path / "ds2")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "bad.jsonl:1" in proc.stderr
    assert not (tmp_path / "ds2.bin").exists()
