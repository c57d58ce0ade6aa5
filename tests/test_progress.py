"""The lines announcing slow first-use start-up phases (before the run looks hung)."""

import os
import shutil

from loco_megatron.data.corpus import default_corpus_dir, ensure_default_corpus


def test_corpus_and_tokenizer_builds_are_announced_only_when_they_run(cache_dir, tmp_path):
    """Guards against a silent first start (tokenizer training and corpus tokenising take
    seconds to minutes with no output) and against announcing a build that the cache makes
    unnecessary."""
    ensure_default_corpus(cache_dir, 4096)  # the session's corpus (built once)
    lines = []
    ensure_default_corpus(cache_dir, 4096, lines.append)
    assert lines == []
    # A cache holding the corpus files except the tokenizer and the index: both phases run.
    fresh = tmp_path / "cache"
    shutil.copytree(default_corpus_dir(cache_dir, 4096), default_corpus_dir(str(fresh), 4096))
    for name in ("tokenizer.model", "corpus_text_document.idx"):
        os.remove(default_corpus_dir(str(fresh), 4096) / name)
    prefix, model = ensure_default_corpus(str(fresh), 4096, lines.append)
    assert [line.split(" (")[0] for line in lines] == ["training the default tokenizer",
                                                      "building the default corpus"], lines
    assert os.path.isfile(model) and os.path.isfile(prefix + ".idx")


def test_cpu_kernel_build_is_announced_on_first_use_only(tmp_path, monkeypatch):
    """Guards against the ~1 min first compile of the C++ kernels passing without a word,
    and against the line on every start once torch's extensions folder holds the library
    (or after the source changed, when ninja rebuilds, without it)."""
    from loco_megatron.loco import cpu_kernels
    from loco_helpers import resolve_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = object()  # stands in for the compiled module: the build itself is tests/test_cpu_kernels.py's

    def resolve(lines):
        return resolve_kernels("cpu", "cpu", False, 4, 256, 8, True, cpu_builder=lambda: built,
                               announce=lines.append)

    lines = []
    assert resolve(lines) == "cpu" and lines == [cpu_kernels.BUILD_NOTE]
    library = tmp_path / cpu_kernels.NAME / f"{cpu_kernels.NAME}.so"
    library.write_bytes(b"")  # built after the source was last changed: loads without compiling
    lines = []
    assert resolve(lines) == "cpu" and lines == []
    os.utime(library, (0, 0))  # older than the source: ninja rebuilds, so it is announced again
    assert resolve(lines) == "cpu" and lines == [cpu_kernels.BUILD_NOTE]
    assert "first use only" in cpu_kernels.BUILD_NOTE
