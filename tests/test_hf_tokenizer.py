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

from conftest import REPO, TINY, run_launch, torchrun

TEXTS = ["def f(x):\n    return x + 1\n", " leading space", "héllo 世界 🙂", "</s> is eos, <s> bos", "",
         "a\n\n\tb  "]


def _run(*args, env_extra=None) -> tuple[int, list[str], str]:
    """(exit code, non-progress stderr lines, stdout) of a tool run from the repository root."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env_extra or {})}
    proc = run_launch([sys.executable, *map(str, args)], env, 300)  # on the fork server
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


def _fake_hub_cache(cache: pathlib.Path, repo: str, folder: pathlib.Path) -> None:
    """``folder``'s files as the cached snapshot of hub repo ``repo`` (huggingface_hub's layout)."""
    import shutil

    commit = "0" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    shutil.copytree(folder, root / "snapshots" / commit)


def test_path_or_hub_name_rule(tmp_path, monkeypatch):
    """Guards against a typo'd local path being looked up on the Hugging Face hub (it waited
    77 s on retries) and against a real hub name being refused as a missing path: the rule
    of loco_megatron/data/hub.py, case by case, in a folder holding only runs/ and README.md."""
    from loco_megatron.data.hub import local_path_reason

    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "README.md").write_text("x")
    for hub in ("gpt2", "meta-llama/Meta-Llama-3-8B", "Qwen/Qwen2.5-7B", "bert-base-uncased", "data/hf_tok"):
        assert local_path_reason(hub) is None, hub
    for path, why in (("./tok", "starts with ."), ("/abs/tok", "starts with /"), ("~/tok", "starts with ~"),
                      ("a/b/c", "NAME or ORG/NAME"), ("tok.model", "ends in .model"),
                      ("org/tokenizer.json", "ends in .json"), ("my tok", "characters"), ("a--b", "characters"),
                      ("runs/tok", "runs/ is a folder here"), ("README.md", "exists here")):
        assert why in (local_path_reason(path) or ""), (path, local_path_reason(path))


def test_missing_local_tokenizer_and_dataset_paths_are_one_line_without_the_network(work, tmp_path):
    """Guards against a missing local tokenizer or dataset path being tried on the hub: with a
    data/ folder in the working directory, --tokenizer-model data/hf_tokk waited 77 s in
    pretrain_gpt.py (57 s in tools/preprocess_data.py) on 24 lines of 'Name or service not known
    ... Retrying in 8s [Retry 5/5]' and ended cut mid-word ('...and couldn't fi'). Every run
    here has the network cut (tests/no_network.py: any lookup or connect is exit 99) and must
    end with exit 2 and one line; a hub name with HF_HUB_OFFLINE set and no cached copy too."""
    (tmp_path / "data").mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HOME": str(tmp_path / "hf")}
    hf = ["--tokenizer-type", "HuggingFaceTokenizer"]
    ds = str(work / "ds")  # (a missing dataset is named first: here the tokenizer is what is missing)
    cases = [
        (["pretrain_gpt.py", "--data-path", ds, *hf, "--tokenizer-model", "data/hf_tokk"],
         "pretrain_gpt.py: error: --tokenizer-model: data/hf_tokk does not exist (read as a local path: data/ is a "
         "folder here)"),
        (["pretrain_gpt.py", "--data-path", ds, "--tokenizer-model", "data/tok.model"],
         "pretrain_gpt.py: error: --tokenizer-model: data/tok.model does not exist"),
        (["tools/preprocess_data.py", "--input", str(work / "docs.parquet"), "--json-keys", "content", *hf,
          "--tokenizer-model", "data/hf_tok", "--output-prefix", "data/ds"],
         "error: --tokenizer-model: data/hf_tok does not exist (read as a local path: data/ is a folder here)"),
        (["tools/preprocess_data.py", "--hf-dataset", "./corpus_hf", *hf, "--tokenizer-model", str(work / "tok"),
          "--output-prefix", "data/ds"],
         "error: --hf-dataset: ./corpus_hf does not exist (read as a local path: it starts with .)"),
        (["tools/train_tokenizer.py", *hf, "--input", "data/corpus.parquet", "--output-prefix", "data/tok"],
         "error: data/corpus.parquet does not exist"),
    ]
    for args, line in cases:
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "no_network.py"), str(REPO / args[0]), *args[1:]],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "warn" not in ln.lower()]
        assert (proc.returncode, lines) == (2, [line]), (args, proc.returncode, proc.stderr[-2000:])
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "no_network.py"), str(REPO / "tools/preprocess_data.py"),
                           "--input", str(work / "docs.parquet"), "--json-keys", "content", *hf, "--tokenizer-model",
                           "someorg/not-cached", "--output-prefix", "data/ds"], cwd=tmp_path,
                          env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --tokenizer-model: someorg/not-cached is not a local file or folder, and as a Hugging Face hub name "
        "it is not in the local hub cache (HF_HUB_OFFLINE is set: nothing is downloaded)"], proc.stderr[-2000:]
    assert list((tmp_path / "data").iterdir()) == []


def test_dry_run_reads_the_vocabulary_of_every_tokenizer_form(work, tmp_path, monkeypatch):
    """Guards against a dry run that does not read the tokenizer a real start would: with
    --tokenizer-type HuggingFaceTokenizer, a tokenizer.json crashed with a sentencepiece
    RuntimeError traceback and the folder printed 'vocabulary 32000 assumed (... is not here)'
    although it held fewer tokens, so the memory estimate was wrong. Each form (sentencepiece
    .model, HF folder, tokenizer.json, a hub name read offline from the hub cache) gives its
    own vocabulary (counted here from its files); a tokenizer that is not here is one line
    naming --dry-run-vocab-size, which, when given, is used and printed as such; no form
    touches the network."""
    import socket

    import huggingface_hub.constants
    import sentencepiece

    from loco_megatron.cli import parse_config
    from loco_megatron.config import ConfigError
    from loco_megatron.data.corpus import stdlib_documents
    from loco_megatron.data.tokenizer import train_sentencepiece
    from loco_megatron.training.preflight import dry_run

    attempts = []
    for name in ("getaddrinfo", "create_connection"):
        monkeypatch.setattr(socket, name, lambda *a, **k: attempts.append(a) or (_ for _ in ()).throw(OSError("cut")))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    _fake_hub_cache(tmp_path / "hub", "someorg/tinytok", work / "tok")
    sp = train_sentencepiece(stdlib_documents()[:10], str(tmp_path / "sp"), 500)
    sp_pieces = sentencepiece.SentencePieceProcessor(model_file=sp).get_piece_size()
    hf_tokens = len(json.loads((work / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    assert (sp_pieces, hf_tokens) == (500, 400)
    hf = ["--tokenizer-type", "HuggingFaceTokenizer"]

    def report(*flags, offline=True):
        return dry_run(parse_config(["--data-path", "nowhere/ds", *flags]), 2, offline)

    for flags, vocab in (([f"--tokenizer-model={sp}"], sp_pieces), ([*hf, f"--tokenizer-model={work / 'tok'}"], hf_tokens),
                         ([*hf, f"--tokenizer-model={work / 'tok' / 'tokenizer.json'}"], hf_tokens),
                         ([*hf, "--tokenizer-model=someorg/tinytok"], hf_tokens)):
        assert f"vocabulary {vocab} from {flags[-1].split('=', 1)[1]};" in report(*flags), flags
    with pytest.raises(ConfigError) as e:
        report(*hf, "--tokenizer-model=someorg/not-cached")
    assert str(e.value) == ("--tokenizer-model: someorg/not-cached is not a local file or folder, and as a Hugging "
                            "Face hub name it is not in the local hub cache (HF_HUB_OFFLINE is set: nothing is "
                            "downloaded); a dry run reads the vocabulary from it (or state it: --dry-run-vocab-size N)")
    out = report(*hf, "--tokenizer-model=someorg/not-cached", "--dry-run-vocab-size=128256")
    assert "vocabulary 128256 (--dry-run-vocab-size: someorg/not-cached is not on this machine)" in out
    out = report(f"--tokenizer-model={tmp_path / 'gone.model'}", "--dry-run-vocab-size=32000")
    assert f"vocabulary 32000 (--dry-run-vocab-size: {tmp_path / 'gone.model'} is not on this machine)" in out
    with pytest.raises(ConfigError, match=r"tokenizer.json is a JSON file, not a sentencepiece .model file \(for a "
                                          r"Hugging Face tokenizer add --tokenizer-type HuggingFaceTokenizer\)$"):
        report(f"--tokenizer-model={work / 'tok' / 'tokenizer.json'}")
    assert attempts == []


def test_launch_render_reads_a_hf_tokenizer_json(work, tmp_path):
    """Guards against tools/launch.py render (run before sbatch) crashing on a Hugging Face
    tokenizer.json with a sentencepiece RuntimeError traceback: it prints the dry run with the
    tokenizer's own vocabulary and every node's command."""
    env = dict(os.environ, PYTHONPATH=str(REPO), SLURM_JOB_NODELIST="a,b", SLURM_NNODES="2", SLURM_JOB_ID="5")
    proc = subprocess.run([sys.executable, "tools/launch.py", "render", "--config", "configs/tiny_gpt.yaml",
                           "--run-dir", str(tmp_path / "run"), "--nproc-per-node", "1", "--", "--data-path",
                           str(work / "ds"), "--tokenizer-type", "HuggingFaceTokenizer",
                           "--tokenizer-model", str(work / "tok" / "tokenizer.json")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"vocabulary 400 from {work / 'tok' / 'tokenizer.json'};" in proc.stdout, proc.stdout
    assert sum(1 for line in proc.stdout.splitlines() if "tools/torchrun.py" in line) == 2
