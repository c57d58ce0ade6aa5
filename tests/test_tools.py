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


def test_preprocess_workers_and_compressed_inputs(tmp_path):
    """Guards against --workers reordering or dropping documents and against .gz/.zst
    inputs being read wrongly: plain .jsonl in one process, and the same documents as
    .jsonl.gz + .jsonl.zst (+ a .txt) with two workers, give identical token files."""
    import gzip

    import zstandard

    docs = [{"text": f"def h{i}(z):\n    return z * {i}\n" * 3} for i in range(120)]
    lines = "\n".join(json.dumps(d) for d in docs) + "\n"
    (tmp_path / "all.jsonl").write_text(lines)
    half = len(lines.splitlines()) // 2
    first, second = lines.splitlines()[:half], lines.splitlines()[half:]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(("\n".join(first) + "\n").encode()))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(("\n".join(second) + "\n").encode()))
    (tmp_path / "c.txt").write_text("one text document\nof two lines\n\nand another\n")
    (tmp_path / "c_ref.jsonl").write_text(json.dumps({"text": "one text document\nof two lines\n"}) + "\n"
                                          + json.dumps({"text": "and another\n"}) + "\n")
    tok = subprocess.run([sys.executable, "tools/train_tokenizer.py", "--input", str(tmp_path / "all.jsonl"),
                          "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "300"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert tok.returncode == 0, tok.stderr

    def run(inputs, prefix, workers):
        proc = subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", *map(str, inputs),
                               "--tokenizer-model", str(tmp_path / "tok.model"), "--output-prefix",
                               str(tmp_path / prefix), "--workers", str(workers)],
                              cwd=REPO, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    run([tmp_path / "all.jsonl", tmp_path / "c_ref.jsonl"], "one", 1)
    out = run([tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst", tmp_path / "c.txt"], "two", 2)
    assert "122 documents" in out and "2 worker(s)" in out
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
