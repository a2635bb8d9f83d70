"""Text every machine has: the docstrings of a fixed list of Python standard-library modules.

`stdlib_documents()` returns one document per docstring (a module's, and its public classes',
functions' and methods'), in a fixed order (module list order, then qualified names sorted), with
duplicates dropped; `split_documents(docs, every)` puts each document whose name hashes to 0 mod
`every` into the held-out part, so which side a docstring falls on does not depend on the others.
The text depends on the Python version (docstrings change between releases): `corpus_digest`
names it, for cache keys. Nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import warnings
from collections.abc import Iterator, Sequence

# modules importable on every CPython 3.11+ build, without side effects on import
MODULES = (
    "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath", "codecs",
    "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "filecmp", "fnmatch", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser",
    "http.client", "http.server", "imaplib", "importlib", "inspect", "io", "ipaddress", "itertools",
    "json", "logging", "lzma", "mailbox", "math", "mimetypes", "multiprocessing", "numbers",
    "operator", "optparse", "os", "pathlib", "pickle", "pkgutil", "platform", "plistlib", "poplib",
    "pprint", "queue", "random", "re", "sched", "secrets", "selectors", "shelve", "shlex", "shutil",
    "smtplib", "socket", "socketserver", "sqlite3", "ssl", "statistics", "string", "struct",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
    "types", "typing", "unittest", "urllib.parse", "urllib.request", "uuid", "warnings", "wave",
    "weakref", "xml.dom.minidom", "xml.etree.ElementTree", "zipfile", "zlib",
)
MIN_CHARS = 80
"""Docstrings shorter than this (one-liners like "Return self.") are left out."""


def _members(module: object, prefix: str) -> Iterator[tuple[str, object]]:
    for name, value in sorted(vars(module).items()):
        if name.startswith("_"):
            continue
        # only what the module defines, not what it imports
        if getattr(value, "__module__", None) != getattr(module, "__name__", None):
            continue
        if inspect.isclass(value):
            yield f"{prefix}.{name}", value
            for attr, member in sorted(vars(value).items()):
                routine = inspect.isfunction(member) or inspect.ismethoddescriptor(member)
                if routine and not attr.startswith("_"):
                    yield f"{prefix}.{name}.{attr}", member
        elif inspect.isfunction(value) or inspect.isbuiltin(value):
            yield f"{prefix}.{name}", value


def stdlib_documents(modules: Sequence[str] = MODULES) -> list[tuple[str, str]]:
    """(qualified name, docstring) of every public docstring of `modules` of at least MIN_CHARS
    characters, in a fixed order, each text once."""
    docs: list[tuple[str, str]] = []
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated modules and members warn on access
        for mod_name in modules:
            try:
                module = importlib.import_module(mod_name)
            except ImportError:  # a build without it (e.g. no _ssl): the others still make a corpus
                continue
            for name, obj in [(mod_name, module), *_members(module, mod_name)]:
                text = inspect.getdoc(obj)
                if not text or len(text) < MIN_CHARS or text in seen:
                    continue
                seen.add(text)
                docs.append((name, text))
    return docs


def split_documents(docs: Sequence[tuple[str, str]], every: int = 10) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): a document is held out when its name's sha256 is 0 mod
    `every`."""
    train: list[str] = []
    held: list[str] = []
    for name, text in docs:
        h = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big")
        (held if h % every == 0 else train).append(text)
    return train, held


def corpus_digest(docs: Sequence[tuple[str, str]]) -> str:
    """A short digest of the documents' names and texts (it changes with the Python version)."""
    h = hashlib.sha256()
    for name, text in docs:
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]
