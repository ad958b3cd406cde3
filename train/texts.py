"""Offline text, from Python's standard library and Debian documentation packages.

These texts are inputs only: the repository holds this recipe, never the texts.  Each
source yields paragraphs in a fixed order (sorted files), so a paragraph is named by
(source, index) and rebuilt from the installed package when a shard is read.

    apt-get install python3.11-doc debian-reference-en git-doc fortunes wordnet-base
"""

from __future__ import annotations

import functools
import html.parser
import inspect
import re
from pathlib import Path

PACKAGES = "python3.11-doc debian-reference-en git-doc fortunes wordnet-base"
STDLIB_MODULES = ["json", "csv", "collections", "itertools", "functools", "pathlib", "datetime", "random", "heapq",
                  "bisect", "textwrap", "string", "statistics", "fractions", "decimal", "zipfile", "tarfile", "gzip",
                  "shutil", "tempfile", "glob", "fnmatch", "argparse", "logging", "unittest", "doctest", "pprint",
                  "copy", "enum", "dataclasses", "contextlib", "abc", "typing", "hashlib", "hmac", "secrets",
                  "base64", "struct", "array", "queue", "threading", "sched", "calendar", "difflib", "html",
                  "urllib.parse", "email", "mimetypes", "sqlite3", "pickle", "shelve", "configparser", "uuid", "math"]


def _clean(text: str) -> str:
    return " ".join(text.split())


def _prose(block: str, low: int = 80, high: int = 700) -> str | None:
    """A paragraph of running prose (not code, tables or headings), or None."""
    text = _clean(block)
    if not low < len(text) < high or text.count(" ") < 10:
        return None
    if sum(c.isalpha() for c in text) < 0.7 * len(text):
        return None
    return text


_REST_ROLE = re.compile(r":[a-z:]+:`~?([^`<]*?)(?: <[^>]*>)?`")


def _rest_paragraphs(path: Path) -> list[str]:
    """Prose paragraphs of a reStructuredText or AsciiDoc file (directives, code and tables dropped)."""
    out = []
    for block in path.read_text(errors="replace").split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines or lines[0].startswith((" ", "\t", "..", "|", "+", "=", "-", "*", ":", "[", "//")):
            continue
        text = _REST_ROLE.sub(r"\1", "\n".join(lines)).replace("``", "").replace("`", "").replace("**", "")
        para = _prose(text)
        if para:
            out.append(para)
    return out


class _ParagraphParser(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.paragraphs, self.current, self.depth = [], None, 0

    def handle_starttag(self, tag, attrs):
        if tag == "p":
            self.current = []

    def handle_endtag(self, tag):
        if tag == "p" and self.current is not None:
            self.paragraphs.append("".join(self.current))
            self.current = None

    def handle_data(self, data):
        if self.current is not None:
            self.current.append(data)


def _html_paragraphs(path: Path) -> list[str]:
    parser = _ParagraphParser()
    parser.feed(path.read_text(errors="replace"))
    return [p for p in map(_prose, parser.paragraphs) if p]


def _fortunes(path: Path) -> list[str]:
    return [p for p in (_prose(b, 60, 600) for b in path.read_text(errors="replace").split("\n%\n")) if p]


def _stdlib_docstrings() -> list[str]:
    import importlib

    out = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        docs = [module.__doc__] + [obj.__doc__ for _, obj in inspect.getmembers(module, inspect.isfunction)
                                   if getattr(obj, "__module__", None) == module.__name__]
        out += [p for doc in docs for p in (_prose(b) for b in (doc or "").split("\n\n")) if p]
    return out


def stdlib_functions() -> list[str]:
    """Short standard-library functions (4-14 lines, comments and docstrings dropped), for code tasks."""
    import importlib

    functions = []
    for name in STDLIB_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for _, obj in inspect.getmembers(module, inspect.isfunction):
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            try:
                source = inspect.getsource(obj)
            except (OSError, TypeError):
                continue
            lines = [line for line in source.splitlines() if not line.strip().startswith(("#", '"""', "'''"))]
            if 4 <= len(lines) <= 14 and '"""' not in source:
                functions.append("\n".join(lines))
    return functions


def _files(root: str, pattern: str) -> list[Path]:
    return sorted(Path(root).glob(pattern)) if Path(root).is_dir() else []


def _from_files(files, reader) -> list[str]:
    return [p for f in files for p in reader(f)]


SOURCES = {
    "stdlib-docstrings": _stdlib_docstrings,
    "python-docs": lambda: _from_files(_files("/usr/share/doc/python3.11-doc/html/_sources", "**/*.rst.txt"),
                                       _rest_paragraphs),
    "git-docs": lambda: _from_files(_files("/usr/share/doc/git-doc", "*.txt"), _rest_paragraphs),
    "debian-reference": lambda: _from_files(_files("/usr/share/doc/debian-reference-en/docs", "*.en.html"),
                                            _html_paragraphs),
    "fortunes": lambda: _from_files([f for f in _files("/usr/share/games/fortunes", "*") if not f.suffix],
                                    _fortunes),
}


@functools.lru_cache(maxsize=None)
def paragraphs(source: str) -> tuple[str, ...]:
    """Every paragraph of a source, in a fixed order (empty where the package is missing)."""
    return tuple(SOURCES[source]())


@functools.lru_cache(maxsize=None)
def wordnet_words() -> tuple[str, ...]:
    """Common English nouns, verbs and adjectives (WordNet lemmas seen in its tagged corpus)."""
    words = []
    for part in ("noun", "verb", "adj"):
        path = Path(f"/usr/share/wordnet/index.{part}")
        if not path.is_file():
            continue
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(" "):
                continue
            fields = line.split()
            # index lines: lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offsets
            if len(fields) > 4 and fields[0].isalpha() and len(fields[0]) > 3:
                tagged = int(fields[4 + int(fields[3]) + 1])
                if tagged >= 5:
                    words.append(fields[0])
    return tuple(words)
