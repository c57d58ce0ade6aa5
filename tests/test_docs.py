"""The README and docs/ name files that exist.

Guards against docs drifting from the tree: a renamed module (``loco_megatron/config.py``
became a package and the README kept naming the old file), a removed script, or a
relative link to a page that was never written.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level names of the repository: a token starting with one of these is a repo path.
PREFIXES = ("loco_megatron/", "tools/", "benchmarks/", "configs/", "docs/", "tests/", ".ci/")
FILES = ("pretrain_gpt.py",)
TOKEN = re.compile(r"[`\s\[]((?:%s)[A-Za-z0-9_./{}*-]*|requirements[a-z-]*\.txt|%s)" % (
    "|".join(re.escape(p) for p in PREFIXES), "|".join(re.escape(f) for f in FILES)))
LINK = re.compile(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)")


def _named_paths(page: Path) -> set[str]:
    text = page.read_text()
    found = {m.group(1).rstrip(".,:;") for m in TOKEN.finditer(text)}
    # Relative links resolve against the page's own folder.
    for m in LINK.finditer(text):
        target = (page.parent / m.group(1)).resolve()
        found.add(str(target.relative_to(ROOT)) if target.is_relative_to(ROOT) else m.group(1))
    return found


def _exists(path: str) -> bool:
    # Placeholders (`{a,b}` alternatives, `*` globs, `_R` rank suffixes) count when any
    # file matches; everything else must exist as written.
    if "{" in path:
        head, rest = path.split("{", 1)
        alts, tail = rest.split("}", 1)
        return any(_exists(head + a + tail) for a in alts.split(","))
    if "*" in path:
        return any(ROOT.glob(path))
    return (ROOT / path).exists()


def test_every_named_path_exists():
    """A path named in the README or in docs/ (module, script, config, page) that does not
    exist: the README once named ``loco_megatron/config.py`` after it became a package."""
    missing = [f"{page.relative_to(ROOT)}: {p}" for page in PAGES for p in sorted(_named_paths(page))
               if not _exists(p)]
    assert not missing, "named in the docs but missing:\n" + "\n".join(missing)


def test_path_check_catches_a_missing_file(tmp_path):
    """The check itself must fail on a page naming a file that is not there (a regex that
    matches nothing would pass every page)."""
    page = tmp_path / "page.md"
    page.write_text("See `loco_megatron/no_such_module.py` and `tools/launch.py`.\n")
    named = _named_paths(page)
    assert "loco_megatron/no_such_module.py" in named and "tools/launch.py" in named
    assert not _exists("loco_megatron/no_such_module.py") and _exists("tools/launch.py")


# The generated flag reference opens with its generator's comment, not a purpose.
GUIDES = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "configuration.md"]
# Lab-notebook phrases: history belongs in commit messages, not in a guide.
HISTORY = re.compile(r"\bcommit [0-9a-f]{7}\b|\bused to \b|\(fixed\)|\bre-?measured\b|\bissue \d+\b|"
                     r"\bstill not (?:met|missed)\b|\bscratch build\b|\bshared with other engineers\b|\(was: ", re.I)
README_MAX_LINES = 250


def _opening(text: str) -> str:
    """The first paragraph after the page's ``# title`` (blank-line separated)."""
    body = text.split("\n", 1)[1] if text.startswith("# ") else text
    return next((p for p in re.split(r"\n\s*\n", body) if p.strip()), "")


def _opens_with_purpose(text: str) -> bool:
    return "you can" in _opening(text).lower()


def test_each_docs_page_opens_with_its_purpose():
    """A page that opens with internals (docs/fsdp.md began with the wrapper class it uses)
    leaves the reader to guess what it is for: the first paragraph after the title says
    what the reader can do with the page."""
    bad = [p.name for p in GUIDES if not _opens_with_purpose(p.read_text())]
    assert not bad, "pages whose first paragraph does not say what you can do with them: " + ", ".join(bad)


def test_purpose_check_catches_a_page_opening_with_internals():
    """The check itself must fail on a page whose purpose comes only after its internals (a
    rule that matched anywhere in the page would pass every page)."""
    internals = "# FSDP\n\n`--use-megatron-fsdp` wraps the GPTModel in megatron-core's FSDP.\n\nYou can run it.\n"
    assert not _opens_with_purpose(internals)
    assert _opens_with_purpose("# FSDP\n\nWith this page you can shard the model.\n\nInternals.\n")


def test_no_docs_page_reads_like_a_lab_notebook():
    """History in a guide (`commit 28ad35a`, "used to fall", "CPU heap corruption (fixed)",
    "Re-measured after ...", "issue 22") tells the reader what once was instead of what is;
    it goes to commit messages."""
    hits = [f"{p.relative_to(ROOT)}:{n}: {m.group(0)!r}" for p in [ROOT / "README.md", *GUIDES]
            for n, line in enumerate(p.read_text().splitlines(), 1) for m in HISTORY.finditer(line)]
    assert not hits, "history in the docs:\n" + "\n".join(hits)


def test_readme_is_short():
    """The README is the first page a user reads; past 250 lines it stops being read whole."""
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"
