#!/usr/bin/env python3
"""A second, held-out corpus for the sweeps (benchmarks/sweep.py): English prose, not code.

The text is Debian's own documentation in English, from six packages of Debian's main
archive (free licences, as their copyright files say):

    debian-handbook       The Debian Administrator's Handbook       GPL-2+ or CC-BY-SA-3.0
    debian-reference-en   Debian Reference                          GPL-2+
    developers-reference  Debian Developer's Reference              GPL-2
    maint-guide           Debian New Maintainers' Guide             GPL-2+ (parts MIT, public domain)
    debian-policy         Debian Policy Manual (policy.html)        GPL-2+
    harden-doc            Securing Debian Manual                    GPL-2

    apt-get install debian-handbook debian-reference-en developers-reference maint-guide debian-policy harden-doc
    python benchmarks/heldout_corpus.py            # -> ~/.cache/loco_megatron/debian-docs-v4096

It builds the corpus with the project's own tools, as docs/data.md does for any data:
HTML pages -> one section (a heading and its text) per JSON line (``docs.jsonl``, sorted
by package and page, so the same packages give the same file) -> a sentencepiece tokenizer of
its own (``tools/train_tokenizer.py``, the built-in corpus's vocabulary size) ->
``tools/preprocess_data.py`` -> ``corpus_text_document.bin/.idx``. It prints the
``--data-path ... --tokenizer-model ...`` flags a training takes. A page's navigation, table
of contents, scripts and styles are not text; every section of a page is one document, so
the 98/2 split of documents puts whole sections into validation. The sweep never chooses a
setting on this corpus (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import html.parser
import json
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {  # package -> its English HTML pages (glob patterns)
    "debian-handbook": ["/usr/share/doc/debian-handbook/html/en-US/*.html"],
    "debian-reference-en": ["/usr/share/debian-reference/*.en.html"],
    "developers-reference": ["/usr/share/developers-reference/*.html"],
    "maint-guide": ["/usr/share/doc/maint-guide/html/*.en.html"],
    "debian-policy": ["/usr/share/doc/debian-policy/policy.html/*.html"],
    "harden-doc": ["/usr/share/doc/harden-doc/html/en-US/*.html"],
}
SKIP_PAGES = {"search.html", "genindex.html", "index.html", "developers-reference.html"}
"""Pages that are no prose: the search form, the index, the tables of contents, and the
developers-reference's one-page copy of the whole book (its chapters are read one by one)."""
_SKIP_TAGS = {"script", "style", "head", "nav"}
_SKIP_CLASSES = ("navheader", "navfooter", "toc", "sphinxsidebar", "related", "footer", "breadcrumb", "docnav",
                 "headerlink", "legalnotice")
_BLOCKS = {"p", "div", "section", "br", "li", "tr", "pre", "table", "dt", "dd", "blockquote", "title"}
_HEADINGS = {"h1", "h2", "h3", "h4"}
_VOID = {"br", "img", "hr", "meta", "link", "input", "col", "area", "base", "wbr", "source"}


class _Sections(html.parser.HTMLParser):
    """Collects a page's text, a new section at each heading; skips what :data:`_SKIP_TAGS`
    and :data:`_SKIP_CLASSES` name (and everything inside it)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.sections: list[list[str]] = [[]]
        self.stack: list[tuple[str, bool]] = []  # (tag, skipped) of the open elements

    def _skipping(self) -> bool:
        return any(skipped for _, skipped in self.stack)

    def handle_starttag(self, tag, attrs):
        classes = dict(attrs).get("class") or ""
        skip = tag in _SKIP_TAGS or any(c in classes.split() for c in _SKIP_CLASSES)
        if tag in _HEADINGS and not self._skipping():
            self.sections.append([])
        if tag in _BLOCKS or tag in _HEADINGS:
            self.sections[-1].append("\n")
        if tag not in _VOID:
            self.stack.append((tag, skip))

    def handle_endtag(self, tag):
        # HTML closes what it left open: pop to the matching tag (a stray end tag pops nothing).
        for i in range(len(self.stack) - 1, -1, -1):
            if self.stack[i][0] == tag:
                del self.stack[i:]
                break
        if tag in _BLOCKS or tag in _HEADINGS:
            self.sections[-1].append("\n")

    def handle_data(self, data):
        if not self._skipping():
            self.sections[-1].append(data)


def page_sections(text: str) -> list[str]:
    """The sections of one HTML page as plain text (runs of blank space folded, empty ones dropped)."""
    parser = _Sections()
    parser.feed(text)
    parser.close()
    out = []
    for parts in parser.sections:
        lines = [re.sub(r"[ \t\r\f\v]+", " ", ln).strip() for ln in "".join(parts).split("\n")]
        body = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        if len(body) >= 200:  # a heading alone, or a caption: no document
            out.append(body)
    return out


def pages(package: str) -> list[pathlib.Path]:
    """The package's English pages, sorted (the corpus's order)."""
    found = sorted(p for pattern in PACKAGES[package] for p in pathlib.Path("/").glob(pattern.lstrip("/"))
                   if p.name not in SKIP_PAGES)
    return found


def write_jsonl(path: pathlib.Path) -> tuple[int, int]:
    """``docs.jsonl``: one ``{"text", "package", "page"}`` per section; returns (documents, characters)."""
    missing = [p for p in PACKAGES if not pages(p)]
    if missing:
        sys.exit(f"error: no pages of {', '.join(missing)}: apt-get install {' '.join(missing)}")
    docs = chars = 0
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for package in PACKAGES:
            for page in pages(package):
                for text in page_sections(page.read_text(encoding="utf-8", errors="replace")):
                    f.write(json.dumps({"text": text, "package": package, "page": page.name}) + "\n")
                    docs, chars = docs + 1, chars + len(text)
    tmp.replace(path)
    return docs, chars


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096, help="the tokenizer's (the built-in corpus's: 4096)")
    ap.add_argument("--out", default=None, help="default: ~/.cache/loco_megatron/debian-docs-v{vocab-size}")
    args = ap.parse_args()
    out = pathlib.Path(args.out or pathlib.Path.home() / ".cache" / "loco_megatron" / f"debian-docs-v{args.vocab_size}")
    out.mkdir(parents=True, exist_ok=True)
    prefix, model = out / "corpus_text_document", out / "tokenizer.model"
    if not (pathlib.Path(f"{prefix}.idx").is_file() and model.is_file()):
        docs, chars = write_jsonl(out / "docs.jsonl")
        print(f"{docs} sections, {chars:,} characters -> {out / 'docs.jsonl'}", flush=True)
        for tool, flags in (("train_tokenizer.py", ["--output-prefix", str(out / "tokenizer"), "--vocab-size",
                                                    str(args.vocab_size)]),
                            ("preprocess_data.py", ["--tokenizer-model", str(model), "--output-prefix", str(prefix)])):
            cmd = [sys.executable, str(REPO / "tools" / tool), "--input", str(out / "docs.jsonl"), *flags]
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"error: {tool} failed (command: {' '.join(cmd)})")
    print(f"--data-path {prefix} --tokenizer-model {model}")


if __name__ == "__main__":
    main()
