"""Hugging Face tokenizers and parquet / HF-datasets input, end to end: tools/train_tokenizer.py
(byte-level BPE folder) -> tools/preprocess_data.py (a parquet file written here) ->
pretrain_gpt.py on 2 gloo ranks with --tokenizer-type HuggingFaceTokenizer -> export, whose
tokenizer must give the training ids; and the one-line errors of mismatched or bad inputs."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from conftest import REPO, TINY, torchrun

TEXTS = ["def f(x):\n    return x + 1\n", " leading space", "héllo 世界 🙂", "</s> is eos, <s> bos", "",
         "a\n\n\tb  "]


def _run(*args, env_extra=None) -> tuple[int, list[str], str]:
    """(exit code, non-progress stderr lines, stdout) of a tool run from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env_extra or {})}
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "doc/s" not in ln and "examples/s" not in ln]
    return proc.returncode, lines, proc.stdout


def _preprocess(work: pathlib.Path, src, prefix: str, *extra) -> tuple[int, list[str], str]:
    return _run("tools/preprocess_data.py", "--input", src, *extra, "--tokenizer-type", "HuggingFaceTokenizer",
                "--tokenizer-model", work / "tok", "--output-prefix", work / prefix)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> pathlib.Path:
    """docs.parquet (columns id, content; 3 row groups), the byte-level BPE folder ``tok``
    trained on it (400 tokens) and the dataset ``ds`` made from it with one worker."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from loco_megatron.data.corpus import stdlib_documents

    root = tmp_path_factory.mktemp("hf")
    docs = stdlib_documents()[:24]
    pq.write_table(pa.table({"id": list(range(len(docs))), "content": docs}), root / "docs.parquet", row_group_size=10)
    rc, lines, out = _run("tools/train_tokenizer.py", "--tokenizer-type", "HuggingFaceTokenizer", "--input",
                          root / "docs.parquet", "--json-keys", "content", "--output-prefix", root / "tok",
                          "--vocab-size", "400")
    assert rc == 0, lines
    rc, lines, _ = _preprocess(root, root / "docs.parquet", "ds", "--json-keys", "content")
    assert rc == 0, lines
    return root


def test_trained_folder_and_dataset_record_the_hf_tokenizer(work):
    """Guards against a tokenizer folder without the eos that training appends (or with one
    the dataset does not end its documents with), parquet rows read out of order or from the
    wrong column, and a .meta.json that does not say the dataset is a Hugging Face one."""
    import pyarrow.parquet as pq
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from loco_megatron.data.tokenizer import load_tokenizer

    config = json.loads((work / "tok" / "tokenizer_config.json").read_text())
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == ("<s>", "</s>", "<pad>")
    tok = load_tokenizer(str(work / "tok"), "HuggingFaceTokenizer")
    assert tok.eod == 1 and tok.vocab_size == 400
    meta = json.loads((work / "ds.meta.json").read_text())
    assert meta["tokenizer_type"] == "HuggingFaceTokenizer" and meta["eod"] == 1
    docs = pq.read_table(work / "docs.parquet").column("content").to_pylist()
    ds = IndexedDataset(str(work / "ds"), mmap=True)
    assert len(ds) == len(docs)
    for i in (0, 11, len(docs) - 1):  # first, second row group, last
        assert ds[i].tolist() == list(tok.tokenize(docs[i])) + [tok.eod]
    assert tok.detokenize(ds[3].tolist()[:-1]) == docs[3]  # byte-level: the text comes back


def test_workers_2_writes_the_same_bytes_as_workers_1(work):
    """Guards against --workers reordering, dropping or re-tokenising documents differently
    (a tokenizer loaded per worker process without the folder's special tokens)."""
    rc, lines, out = _preprocess(work, work / "docs.parquet", "ds_w2", "--json-keys", "content", "--workers", "2")
    assert rc == 0, lines
    assert "24 documents" in out and "2 worker(s)" in out
    for ext in (".bin", ".idx", ".meta.json"):
        assert (work / f"ds{ext}").read_bytes() == (work / f"ds_w2{ext}").read_bytes(), ext


def test_train_two_ranks_and_export_gives_the_training_ids(work, cache_dir, tmp_path):
    """Guards against --tokenizer-type not reaching the trainer (the dataset refused, or the
    embedding sized for another vocabulary), and an exported folder whose tokenizer (loaded
    with AutoTokenizer) encodes text to other ids than the training tokenizer (e.g. adds a BOS
    training never saw) or whose config.json names another eos than the training EOD."""
    from transformers import AutoTokenizer

    from loco_megatron.data.tokenizer import load_tokenizer
    from loco_megatron.export import export_to_hf

    _, metrics = torchrun(2, [*TINY, "--train-iters", "2", "--lr-warmup-iters", "1", "--split", "80,20,0",
                              "--data-path", str(work / "ds"),
                              "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(work / "tok"),
                              "--save", str(tmp_path / "ckpt")], cache_dir, tmp_path)
    losses = [m["train/lm_loss"] for m in metrics if "train/lm_loss" in m]
    assert len(losses) == 2 and all(5.0 < loss < 6.5 for loss in losses), losses  # ln(400) = 5.99 at init
    summary = export_to_hf(str(tmp_path / "ckpt"), str(tmp_path / "hf"), None, tmp_path)
    assert summary.vocab_size == 400
    hf_config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (hf_config["vocab_size"], hf_config["eos_token_id"], hf_config["bos_token_id"]) == (400, 1, 0)
    train_tok = load_tokenizer(str(work / "tok"), "HuggingFaceTokenizer")
    exported = AutoTokenizer.from_pretrained(tmp_path / "hf")
    from loco_megatron.data.corpus import stdlib_documents

    texts = TEXTS + [d[:1500] for d in stdlib_documents()[30:40]]
    for text in texts:
        assert exported(text)["input_ids"] == list(train_tok.tokenize(text)), text[:40]


def test_dataset_of_another_tokenizer_type_is_one_line(work, tmp_path):
    """Guards against training on ids of another tokenizer: a dataset built with the Hugging
    Face tokenizer, run with a sentencepiece one (and the reverse), must stop with one line
    naming the type (not a fingerprint mismatch deep in a traceback, not silence); and
    against resolve_data (what the trainer calls) not passing --tokenizer-type on."""
    from loco_megatron.config import Config, ConfigError, DataConfig
    from loco_megatron.data.corpus import stdlib_documents
    from loco_megatron.data.dataset import resolve_data
    from loco_megatron.data.indexed import write_indexed_dataset
    from loco_megatron.data.tokenizer import load_tokenizer, train_sentencepiece

    sp = train_sentencepiece(stdlib_documents()[:10], str(tmp_path / "sp"), 400)
    write_indexed_dataset(stdlib_documents()[:3], load_tokenizer(sp), str(tmp_path / "sp_ds"), sp)
    assert json.loads((tmp_path / "sp_ds.meta.json").read_text())["tokenizer_type"] == "SentencePieceTokenizer"
    cases = [(str(work / "ds"), sp, "SentencePieceTokenizer", "built with a HuggingFaceTokenizer (its .meta.json), "
              "not a SentencePieceTokenizer"),
             (str(tmp_path / "sp_ds"), str(work / "tok"), "HuggingFaceTokenizer", "built with a "
              "SentencePieceTokenizer (its .meta.json), not a HuggingFaceTokenizer")]
    for prefix, model, kind, needle in cases:
        config = Config(data=DataConfig(data_path=prefix, tokenizer_model=model, tokenizer_type=kind))
        with pytest.raises(ConfigError, match="^--tokenizer-type: ") as e:
            resolve_data(config, str(tmp_path / "cache"))
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    config = Config(data=DataConfig(data_path=str(work / "ds"), tokenizer_model=str(work / "tok"),
                                    tokenizer_type="HuggingFaceTokenizer"))
    assert resolve_data(config, str(tmp_path / "cache")).tokenizer.vocab_size == 400  # its own: accepted


def test_bad_parquet_is_one_line_exit_2_and_no_files(work, tmp_path):
    """Guards against a parquet input without the text column, a non-text column, or a file
    that is not parquet at all ending in a pyarrow traceback or leaving (partial) dataset files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "fake.parquet").write_text("this is not parquet\n")
    pq.write_table(pa.table({"content": [1, 2, 3]}), tmp_path / "ints.parquet")
    cases = [(work / "docs.parquet", [], "has no column 'text' (columns: id, content)"),
             (tmp_path / "ints.parquet", ["--json-keys", "content"], "column 'content' holds int64, not text"),
             (tmp_path / "fake.parquet", [], "fake.parquet is not a parquet file")]
    for i, (src, extra, needle) in enumerate(cases):
        rc, lines, _ = _run("tools/preprocess_data.py", "--input", src, *extra, "--tokenizer-type",
                            "HuggingFaceTokenizer", "--tokenizer-model", work / "tok", "--output-prefix",
                            tmp_path / "out" / f"ds{i}")
        assert rc == 2 and len(lines) == 1 and needle in lines[0], (needle, lines)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_hf_dataset_folder_matches_parquet_input_and_missing_library_is_one_line(work, tmp_path):
    """Guards against --hf-dataset reading another column, split or row order than the same
    parquet file given to --input, and against a missing `datasets` library ending in a
    traceback instead of one line saying what to install."""
    import shutil

    (tmp_path / "folder").mkdir()
    shutil.copy(work / "docs.parquet", tmp_path / "folder" / "train.parquet")
    rc, lines, _ = _run("tools/preprocess_data.py", "--hf-dataset", tmp_path / "folder", "--json-keys", "content",
                        "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", work / "tok" / "tokenizer.json",
                        "--output-prefix", tmp_path / "from_hf", env_extra={"HF_DATASETS_CACHE": str(tmp_path / "c")})
    assert rc == 0, lines
    for ext in (".bin", ".idx", ".meta.json"):  # the tokenizer.json file is the folder's tokenizer
        assert (tmp_path / f"from_hf{ext}").read_bytes() == (work / f"ds{ext}").read_bytes(), ext
    shim = tmp_path / "shim" / "datasets"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named datasets')\n")
    rc, lines, _ = _run("tools/preprocess_data.py", "--hf-dataset", tmp_path / "folder", "--tokenizer-type",
                        "HuggingFaceTokenizer", "--tokenizer-model", work / "tok", "--output-prefix", tmp_path / "x",
                        env_extra={"PYTHONPATH": f"{tmp_path / 'shim'}{os.pathsep}{REPO}"})
    assert rc == 2 and lines == ["error: --hf-dataset needs the datasets library: pip install -r "
                                 "requirements-datasets.txt"], lines
    assert not (tmp_path / "x.bin").exists()


def test_hf_tokenizer_without_eos_and_config_errors_are_one_line(work, tmp_path):
    """Guards against training a dataset with no EOD between documents (a bare tokenizer.json
    defines no eos; megatron's tokenizer then returns eod None) and against
    --tokenizer-type HuggingFaceTokenizer silently falling back to the built-in corpus's
    sentencepiece tokenizer when no --data-path is given."""
    import shutil

    from loco_megatron.config import ConfigError, DataConfig
    from loco_megatron.data.tokenizer import load_tokenizer

    (tmp_path / "bare").mkdir()
    shutil.copy(work / "tok" / "tokenizer.json", tmp_path / "bare" / "tokenizer.json")
    for path in (tmp_path / "bare", tmp_path / "bare" / "tokenizer.json"):
        with pytest.raises(ConfigError, match=r"^--tokenizer-model: .* defines no eos token") as e:
            load_tokenizer(str(path), "HuggingFaceTokenizer")
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^--tokenizer-type: HuggingFaceTokenizer needs --data-path"):
        DataConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(work / "tok"))
    with pytest.raises(ConfigError, match="^--tokenizer-type: 'GPT2BPETokenizer' is not one of"):
        DataConfig(tokenizer_type="GPT2BPETokenizer")
    with pytest.raises(ConfigError, match="is a file but not a tokenizer.json"):
        load_tokenizer(str(work / "docs.parquet"), "HuggingFaceTokenizer")
