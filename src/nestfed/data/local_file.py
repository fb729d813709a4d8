"""A user's own data set: a local JSON lines, JSON, CSV or parquet file read through Hugging Face
``datasets`` (``Dataset.from_json`` / ``from_csv`` / ``from_parquet``; nothing is downloaded), its
text and label columns named in the config (``data.text_column``, ``data.label_column``)."""

from __future__ import annotations

from pathlib import Path

from nestfed.data.corpora import Document
from nestfed.errors import ConfigError, DataError

#: file suffix -> the ``datasets.Dataset`` reader
READERS = {".jsonl": "from_json", ".json": "from_json", ".csv": "from_csv", ".parquet": "from_parquet"}


def local_file(path: str | Path, text_column: str, label_column: str = "") -> list[Document]:
    """The rows of a local file as Documents (text, label).

    Rows whose text is empty or missing are left out.

    Args:
        path: a ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file.
        text_column: the column holding the text.
        label_column: the column holding the label; ``""`` labels every row ``"all"``.

    Returns:
        One Document per row with text, in file order.

    Raises:
        DataError: when the file is missing, of an unknown kind, unreadable or without a usable row,
            or a row has no label (the message names the file and the first such row).
        ConfigError: when a named column is absent (the message names the field and lists the file's
            columns).
    """
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(
            f"data.path: {path} is not a JSON lines, JSON, CSV or parquet file "
            f"(suffix {path.suffix or 'none'}; known: {', '.join(READERS)})"
        )
    if not path.is_file():
        raise DataError(f"data.path: {path} does not exist")
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = getattr(datasets.Dataset, reader)(str(path))
    except Exception as exc:  # the readers raise many kinds (pyarrow, json, csv)
        raise DataError(
            f"{path}: not a readable {path.suffix[1:]} file ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
    for field, col in (("data.text_column", text_column), ("data.label_column", label_column)):
        if col and col not in ds.column_names:
            raise ConfigError(f"{field}: {path} has no column '{col}' (its columns: {', '.join(ds.column_names)})")
    texts = ds[text_column]
    labels = ds[label_column] if label_column else ["all"] * len(texts)
    missing = [i for i, lab in enumerate(labels) if lab is None or (isinstance(lab, str) and not lab.strip())]
    if missing:
        raise DataError(
            f"{path}: {len(missing)} rows have no value in data.label_column '{label_column}' (first: row "
            f'{missing[0] + 1}); give every row a label, or set data.label_column = "" and '
            'partition = "iid"'
        )
    docs = [Document(str(t), str(lab)) for t, lab in zip(texts, labels) if t is not None and str(t).strip()]
    if not docs:
        raise DataError(f"{path}: no row has text in column '{text_column}'")
    return docs
