"""The data tools end to end: text/jsonl -> tokenizer -> .bin/.idx usable for training."""

import json
import re
import sys

from conftest import run_launch


def test_train_tokenizer_then_preprocess(tmp_path):
    """Guards against the tools writing files pretrain_gpt.py then refuses or misreads."""
    src = tmp_path / "docs.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"def g{i}(y):\n    return y - {i}\n" * 5}) for i in range(60)))
    tok = run_launch([sys.executable, "tools/train_tokenizer.py", "--input", str(src),
                      "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "300"], None, 120)
    assert tok.returncode == 0, tok.stderr
    pre = run_launch([sys.executable, "tools/preprocess_data.py", "--input", str(src),
                      "--tokenizer-model", str(tmp_path / "tok.model"), "--output-prefix", str(tmp_path / "ds")],
                     None, 120)
    assert pre.returncode == 0, pre.stderr
    from loco_megatron.data.indexed import check_indexed_dataset
    from loco_megatron.data.tokenizer import load_tokenizer

    check_indexed_dataset(str(tmp_path / "ds"), load_tokenizer(str(tmp_path / "tok.model")),
                          str(tmp_path / "tok.model"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    proc = run_launch([sys.executable, "tools/preprocess_data.py", "--input", str(bad),
                       "--tokenizer-model", str(tmp_path / "tok.model"), "--output-prefix", str(tmp_path / "ds2")],
                      None, 120)
    assert proc.returncode != 0 and "bad.jsonl:1" in proc.stderr
    assert not (tmp_path / "ds2.bin").exists()


def test_bad_inputs_give_one_line_and_no_partial_files(tmp_path):
    """Guards against a non-UTF-8 .jsonl (UnicodeDecodeError traceback, *.tmp<pid>.bin left
    behind), a malformed JSON line or an empty input (sentencepiece RuntimeError traceback;
    an empty dataset written with exit 0), and a vocabulary the corpus cannot fill (its
    sentencepiece message was cut mid-word: 'Please set it to a valu)')."""
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": f"def g{i}(y):\n    return y - {i}\n" * 5}) for i in range(60)))
    cases = {"latin.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "latin.jsonl:2 is not valid UTF-8"),
             "malformed.jsonl": (b'{"text": "ok"}\n{"text": "x"\n', "malformed.jsonl:2 is not a JSON object"),
             "empty.jsonl": (b"\n", "empty.jsonl holds no documents")}
    out = tmp_path / "out"

    def run(*args):
        proc = run_launch([sys.executable, *args], None, 120)
        lines = [line for line in proc.stderr.splitlines() if line.strip() and "doc/s" not in line]
        return proc.returncode, lines

    tok = str(tmp_path / "tok")
    assert run("tools/train_tokenizer.py", "--input", str(good), "--output-prefix", tok, "--vocab-size", "300")[0] == 0
    for name, (data, needle) in cases.items():
        (tmp_path / name).write_bytes(data)
        for tool in (["tools/train_tokenizer.py", "--vocab-size", "300"],
                     ["tools/preprocess_data.py", "--tokenizer-model", tok + ".model"]):
            rc, lines = run(*tool, "--input", str(tmp_path / name), "--output-prefix", str(out / name))
            assert rc == 2 and len(lines) == 1 and needle in lines[0], (tool, lines)
    rc, lines = run("tools/train_tokenizer.py", "--input", str(good), "--output-prefix", str(out / "big"),
                    "--vocab-size", "100000")
    # sentencepiece's whole message, not cut mid-word ("Please set it to a valu)")
    assert rc == 2 and len(lines) == 1 and re.search(r"Vocabulary size too high \(100000\)\. Please set it to a "
                                                     r"value <= \d+\.\)$", lines[0]), lines
    assert not out.exists() or list(out.iterdir()) == []


def test_larger_tokenizer_is_refused_for_a_dataset_without_meta(tmp_path, cache_dir):
    """Guards against training on garbage when a dataset made by other tools (no .meta.json
    fingerprint) is paired with a tokenizer whose vocabulary is larger than the dataset's:
    every id is in range, but decode + encode does not reproduce them."""
    import pytest

    from loco_megatron.config import ConfigError
    from loco_megatron.data.corpus import ensure_default_corpus, stdlib_documents
    from loco_megatron.data.indexed import check_indexed_dataset, write_indexed_dataset
    from loco_megatron.data.tokenizer import load_tokenizer, train_sentencepiece

    _, big = ensure_default_corpus(cache_dir, 4096)
    docs = stdlib_documents()[:20]
    small = train_sentencepiece(docs, str(tmp_path / "small"), 1000)
    prefix = str(tmp_path / "ds")
    write_indexed_dataset(docs, load_tokenizer(small), prefix, small)
    (tmp_path / "ds.meta.json").unlink()  # as if built by Megatron-LM's preprocess_data.py
    check_indexed_dataset(prefix, load_tokenizer(small), small)  # its own tokenizer passes
    with pytest.raises(ConfigError, match="not the tokenizer the dataset was built with"):
        check_indexed_dataset(prefix, load_tokenizer(big), big)


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
    tok = run_launch([sys.executable, "tools/train_tokenizer.py", "--input", str(tmp_path / "all.jsonl"),
                      "--output-prefix", str(tmp_path / "tok"), "--vocab-size", "300"], None, 120)
    assert tok.returncode == 0, tok.stderr

    def run(inputs, prefix, workers):
        proc = run_launch([sys.executable, "tools/preprocess_data.py", "--input", *map(str, inputs),
                           "--tokenizer-model", str(tmp_path / "tok.model"), "--output-prefix",
                           str(tmp_path / prefix), "--workers", str(workers)], None, 300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    run([tmp_path / "all.jsonl", tmp_path / "c_ref.jsonl"], "one", 1)
    out = run([tmp_path / "a.jsonl.gz", tmp_path / "b.jsonl.zst", tmp_path / "c.txt"], "two", 2)
    assert "122 documents" in out and "2 worker(s)" in out
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"one{ext}").read_bytes() == (tmp_path / f"two{ext}").read_bytes()
