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
