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
    """Guards against the first compile of the C++ kernels passing without a word, and
    against the line on every start once the build folder holds a finished build (or a
    ``.so`` still being linked taken for one: only the build's own mark counts)."""
    from loco_megatron.loco import cpu_kernels
    from loco_helpers import resolve_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    built = object()  # stands in for the compiled module: the build itself is tests/test_cpu_kernels.py's

    def resolve(lines):
        return resolve_kernels("cpu", "cpu", False, 4, 256, 8, True, cpu_builder=lambda: built,
                               announce=lines.append)

    lines = []
    assert resolve(lines) == "cpu" and lines == [cpu_kernels.BUILD_NOTE]
    (cpu_kernels.build_directory() / f"{cpu_kernels.NAME}.so").write_bytes(b"")  # linking, not finished
    lines = []
    assert resolve(lines) == "cpu" and lines == [cpu_kernels.BUILD_NOTE]
    (cpu_kernels.build_directory() / cpu_kernels.BUILT_MARK).write_text(cpu_kernels.built_mark())
    lines = []
    assert resolve(lines) == "cpu" and lines == []
    assert "first use only" in cpu_kernels.BUILD_NOTE


def test_slow_phase_prints_its_elapsed_time():
    """Guards against a start-up phase of minutes printing nothing between its first line
    and its end (a user cannot tell it from a hang): a line with the seconds so far at each
    interval, none for a phase shorter than one."""
    import time

    from loco_megatron.progress import progress

    lines = []
    with progress("doing a slow thing", lines.append, every_s=0.2):
        time.sleep(0.7)
    assert len(lines) >= 2 and all(ln.startswith("... still doing a slow thing (") and ln.endswith(" s)")
                                   for ln in lines), lines
    lines.clear()
    with progress("doing a quick thing", lines.append, every_s=5):
        pass
    assert lines == []


def test_build_folder_is_keyed_on_the_sources_and_the_checkout(tmp_path, monkeypatch):
    """Guards against two checkouts sharing torch's one extension folder, each one's first
    run rebuilding the other's kernels (torch's build.ninja names the sources by path) and
    waiting on its lock; and against an edited header reusing a stale build."""
    import shutil

    from loco_megatron.loco import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ours = cpu_kernels.build_directory()
    (ours / cpu_kernels.BUILT_MARK).write_text(cpu_kernels.built_mark())
    assert ours.parent == tmp_path / "ext" and not cpu_kernels.needs_build()
    csrc = tmp_path / "other_checkout" / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)

    def as_checkout(folder):
        monkeypatch.setattr(cpu_kernels, "CSRC", folder)
        monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(folder / f.name for f in cpu_kernels.SOURCES))
        monkeypatch.setattr(cpu_kernels, "HEADERS", tuple(folder / f.name for f in cpu_kernels.HEADERS))
        return cpu_kernels.build_directory()

    theirs = as_checkout(csrc)
    assert theirs != ours and theirs.parent == ours.parent and cpu_kernels.needs_build()
    assert as_checkout(csrc) == theirs  # stable: the second run finds the first one's build
    (csrc / "kernels.h").write_text((csrc / "kernels.h").read_text() + "\n// edited\n")
    assert as_checkout(csrc) not in (ours, theirs)


def test_sources_newer_than_the_build_need_a_build(tmp_path, monkeypatch):
    """Guards against a run taking a build folder's finished-build mark for current when
    its sources were rewritten since (a fresh clone of the same checkout path, a `git
    checkout`): ninja recompiles by modification time, so `--loco-kernels auto` then
    compiled for minutes in the foreground at start-up (three elastic replica jobs sat
    behind one such build) instead of training on torch while the background build ran."""
    import os
    import shutil

    from loco_megatron.loco import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    csrc = tmp_path / "checkout" / "csrc"
    shutil.copytree(cpu_kernels.CSRC, csrc)
    monkeypatch.setattr(cpu_kernels, "CSRC", csrc)
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(csrc / f.name for f in cpu_kernels.SOURCES))
    monkeypatch.setattr(cpu_kernels, "HEADERS", tuple(csrc / f.name for f in cpu_kernels.HEADERS))
    mark = cpu_kernels.build_directory() / cpu_kernels.BUILT_MARK
    mark.write_text(cpu_kernels.built_mark())
    for f in (*cpu_kernels.SOURCES, *cpu_kernels.HEADERS):
        os.utime(f, (mark.stat().st_mtime - 10,) * 2)
    assert not cpu_kernels.needs_build()
    header = cpu_kernels.HEADERS[-1]
    os.utime(header, (mark.stat().st_mtime + 10,) * 2)  # rewritten, same contents: same folder
    assert cpu_kernels.build_directory() == mark.parent and cpu_kernels.needs_build()
    mark.touch()
    os.utime(mark, (header.stat().st_mtime + 1,) * 2)  # rebuilt after it
    assert not cpu_kernels.needs_build()



def test_the_build_folder_and_mark_carry_the_ninja_version(tmp_path, monkeypatch):
    """Guards against a build by one ninja taken for current by another: two versions take
    each other's ``.ninja_log`` for changed commands and rebuild every unit, so a launch
    whose mark said built waited in the foreground. Another ninja version names another
    folder, and a mark naming another ninja, or none (an older version's), needs a build."""
    from loco_megatron.loco import cpu_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    ours = cpu_kernels.build_directory()
    mark = ours / cpu_kernels.BUILT_MARK
    mark.write_text(cpu_kernels.built_mark())
    assert cpu_kernels.built_mark() == f"ninja {cpu_kernels.pinned_ninja()[1]}\n" and not cpu_kernels.needs_build()
    for stale in ("", "ninja 1.11.1\n"):
        mark.write_text(stale)
        assert cpu_kernels.needs_build(), stale
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "pinned_ninja", lambda: ("/usr/bin/ninja", "1.11.1"))
        theirs = cpu_kernels.build_directory()
    assert theirs.parent == ours.parent and theirs != ours and cpu_kernels.build_directory() == ours


def test_a_stale_build_mark_builds_in_the_background_under_auto(tmp_path, monkeypatch):
    """Guards against ``auto`` loading a build whose mark is stale (another ninja's, or an
    older version's without one) in the foreground, where loading recompiles every unit
    while the training waits (14 minutes seen at an elastic replica's start): the run
    starts the background build and trains on torch, and its "built" line waits for a mark
    written after it started, not the stale one; a current mark is loaded at once."""
    import os

    from loco_megatron.loco import cpu_kernels
    from loco_megatron.loco.kernel_choice import BUILDING
    from loco_megatron.training.kernels import BackgroundBuild

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    mark = cpu_kernels.build_directory() / cpu_kernels.BUILT_MARK
    for stale in ("", "ninja 1.11.1\n"):
        mark.write_text(stale)
        kernels, why, used, _ = _resolve(["--loco-bits", "4"], tmp_path, monkeypatch)
        assert (kernels, why, used) == ("torch", BUILDING, ["build"]), stale
    lines = []
    build = BackgroundBuild(False, lines.append)
    build.poll()
    assert len(lines) == 1 and lines[0].startswith("LoCo: building the C++ CPU kernels in the background"), lines
    mark.write_text(cpu_kernels.built_mark())
    os.utime(mark, ns=(mark.stat().st_mtime_ns + 10**9,) * 2)  # written later than the stale one
    build.poll()
    build.poll()
    assert len(lines) == 2 and lines[1].startswith("LoCo: the C++ CPU kernels are built"), lines
    assert _resolve(["--loco-bits", "4"], tmp_path, monkeypatch)[2] == ["load"]

def _resolve(argv, tmp_path, monkeypatch):
    """resolve_loco_kernels on a CPU device for ``argv``, the C++ build and load replaced by
    recorders; returns (kernels, why, what was started or loaded, the lines printed)."""
    import types

    import torch

    from loco_megatron.cli import LaunchEnv, parse_config
    from loco_megatron.loco import cpu_kernels
    from loco_megatron.training.kernels import resolve_loco_kernels

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    used = []
    monkeypatch.setattr(cpu_kernels, "extension", lambda *a: used.append("load"))
    monkeypatch.setattr(cpu_kernels, "start_background_build", lambda: used.append("build") or tmp_path / "log")
    lines = []
    config, why, _ = resolve_loco_kernels(parse_config(argv, note=lines.append),
                                          types.SimpleNamespace(device=torch.device("cpu")), LaunchEnv(), lines.append)
    return config.loco.loco_kernels, why, used, lines


def test_nothing_builds_the_kernels_unless_something_uses_them(tmp_path, monkeypatch):
    """Guards against --loco-bits 0 building (and waiting for) the C++ kernels nothing runs
    (the kernels were resolved for ``loco_bits or 4``), and against a first run waiting for
    the build: ``auto`` starts it in the background and trains on torch, saying so; while
    DiLoCo's quantised outer exchange and the parameter gather do use them."""
    from loco_megatron.loco.kernel_choice import BUILDING

    assert _resolve(["--loco-bits", "0"], tmp_path, monkeypatch) == ("torch", None, [], [])
    for argv in (["--loco-bits", "4"], ["--loco-bits", "0", "--param-gather-bits", "4"],
                 ["--loco-bits", "0", "--diloco-replicas", "1", "--diloco-outer-bits", "4"]):
        kernels, why, used, lines = _resolve(argv, tmp_path, monkeypatch)
        assert (kernels, why, used) == ("torch", BUILDING, ["build"]), argv
        assert len(lines) == 1 and lines[0].startswith("LoCo: building the C++ CPU kernels in the background"), lines
    assert _resolve(["--loco-bits", "0", "--diloco-replicas", "1", "--diloco-outer-bits", "0"], tmp_path,
                    monkeypatch)[:3] == ("torch", None, [])


def test_first_run_trains_at_once_while_the_kernels_build_beside_it(cache_dir, tmp_path, monkeypatch):
    """Guards against a first run waiting minutes, silent, for the C++ build: with an empty
    extensions folder a 2-rank ``auto`` run says the kernels build in the background, trains
    on torch at once (the start-up line says why) and leaves the build to its own process;
    a build that fails (here: no compiler) is recorded, so the next run neither waits for
    nor restarts it and says why torch runs."""
    import time

    from conftest import TINY, torchrun, train_losses
    from loco_megatron.loco import cpu_kernels
    from loco_megatron.loco.kernel_choice import BUILDING

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    args = TINY + ["--train-iters", "3", "--lr-decay-iters", "3", "--loco-bits", "4"]
    proc, metrics = torchrun(2, args, cache_dir, tmp_path, name="first")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("LoCo: building the C++ CPU kernels in the background (first use only; log: ") == 1, \
        proc.stdout
    assert f"kernels: grads torch, params off (megatron's all-gather); torch because {BUILDING}" in proc.stdout
    assert sorted(train_losses(metrics)) == [1, 2, 3]
    deadline = time.monotonic() + 240
    while cpu_kernels.build_failure() is None and time.monotonic() < deadline:
        time.sleep(1)
    kernels, why, used, lines = _resolve(["--loco-bits", "4"], tmp_path, monkeypatch)
    assert (kernels, used, lines) == ("torch", [], []) and why.startswith("the C++ CPU kernels could not be built")
