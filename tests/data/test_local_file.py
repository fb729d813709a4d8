"""A user's own JSON lines / CSV / parquet file as the data set, partitioned by flwr-datasets'
partitioners; a missing column or an empty partition is one line and exit 2."""

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nestfed.config import DataConfig
from nestfed.data.clients import load_partitions
from nestfed.data.local_file import local_file
from nestfed.errors import ConfigError, DataError

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
TOPICS = ("cooking", "sailing", "chess", "opera")


def rows(n_per_topic=12):
    return [
        {"body": f"{t} note {i}: " + " ".join([t] * (20 + i)), "topic": t, "id": k}
        for k, (t, i) in enumerate((t, i) for i in range(n_per_topic) for t in TOPICS)
    ]


@pytest.fixture(params=["jsonl", "csv", "parquet"])
def data_file(request, tmp_path):
    path = tmp_path / f"notes.{request.param}"
    data = rows()
    if request.param == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in data))
    elif request.param == "csv":
        path.write_text("body,topic,id\n" + "".join(f'"{r["body"]}",{r["topic"]},{r["id"]}\n' for r in data))
    else:
        pq.write_table(pa.Table.from_pylist(data), path)
    return path


def test_every_format_reads_the_same_documents(data_file):
    docs = local_file(data_file, "body", "topic")
    assert [(d.text, d.label) for d in docs] == [(r["body"], r["topic"]) for r in rows()]


@pytest.mark.parametrize(
    "partition, extra, labels_per_client",
    [
        ("label", {}, [1, 1, 1, 1]),
        ("pathological", {"classes_per_client": 2}, [2, 2, 2, 2]),
        ("iid", {}, None),
        ("dirichlet", {"dirichlet_alpha": 0.5}, None),
    ],
)
def test_partitions_of_a_local_file_are_disjoint_covering_and_skewed_as_configured(
    data_file, partition, extra, labels_per_client
):
    d = DataConfig(
        source="file",
        path=str(data_file),
        text_column="body",
        label_column="topic",
        partition=partition,
        num_clients=4,
        **extra,
    )
    records, labels, parts = load_partitions(d)
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat))  # disjoint
    if partition in ("iid", "dirichlet", "label"):
        assert sorted(flat) == list(range(len(records)))  # covering (4 clients, 4 topics)
    if labels_per_client is not None:
        assert [len({labels[i] for i in p}) for p in parts] == labels_per_client
    if partition == "label":
        assert [labels[p[0]] for p in parts] == sorted(TOPICS)  # one natural id each, in sorted order
    if partition == "iid":
        assert sorted(len(p) for p in parts) == [12, 12, 12, 12]


def test_missing_columns_and_files_are_named(tmp_path, data_file):
    with pytest.raises(
        ConfigError,
        match=r"data.label_column: .*notes\.\w+ has no column 'label' \(its columns: "
        r"body, topic, id\)",
    ):
        local_file(data_file, "body", "label")
    with pytest.raises(ConfigError, match=r"data.text_column: .* has no column 'text'"):
        local_file(data_file, "text", "topic")
    with pytest.raises(DataError, match=r"data.path: .*missing.csv does not exist"):
        local_file(tmp_path / "missing.csv", "body")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(DataError, match=r"not a JSON lines, JSON, CSV or parquet file"):
        local_file(tmp_path / "notes.txt", "body")
    nolabel = tmp_path / "nolabel.jsonl"
    nolabel.write_text('{"body": "a", "topic": "x"}\n{"body": "b", "topic": null}\n')
    with pytest.raises(
        DataError,
        match=r"nolabel.jsonl: 1 rows have no value in data.label_column 'topic' "
        r"\(first: row 2\)",
    ):
        local_file(nolabel, "body", "topic")
    (tmp_path / "broken.jsonl").write_text('{"body": "a"}\n{not json\n')
    with pytest.raises(DataError, match=r"broken.jsonl: not a readable jsonl file"):
        local_file(tmp_path / "broken.jsonl", "body")


@pytest.mark.slow
def test_cli_trains_on_a_local_file_and_bad_input_is_one_line(tmp_path, cli, caplog):
    path = tmp_path / "notes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows()))
    base = [
        "run",
        TINY,
        "--set",
        f"output.dir={tmp_path / 'runs'}",
        "--set",
        "data.source=file",
        "--set",
        f"data.path={path}",
        "--set",
        "data.text_column=body",
        "--set",
        "data.label_column=topic",
        "--set",
        "data.num_clients=4",
        "--set",
        "lora.ranks=[2,4,4,8]",
        "--set",
        "data.block_size=32",
    ]
    r = cli(*base, "--set", "data.label_column=topik", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: data.label_column: {path} has no column 'topik' (its columns: body, topic, id)"
    ]
    # 5 clients, one label each (label i mod 4): clients 0 and 4 share 'chess' (first in order of
    # appearance and by name), whose one row goes to one of them; the other's partition is empty
    one_each = tmp_path / "one.jsonl"
    topics = ["chess"] + ["cooking", "opera", "sailing"] * 3
    one_each.write_text("".join(json.dumps({"body": "x " * 40, "topic": t}) + "\n" for t in topics))
    r = cli(
        *base,
        "--set",
        f"data.path={one_each}",
        "--set",
        "data.partition=pathological",
        "--set",
        "data.classes_per_client=1",
        "--set",
        "data.num_clients=5",
        "--set",
        "lora.ranks=[2,2,2,2,2]",
        cwd=tmp_path,
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr  # flwr-datasets refuses it
    assert "error: data.partition: Label: chess is needed to be assigned to more partitions (2)" in r.stderr
    r = cli(
        *base,
        "--set",
        f"data.path={one_each}",
        "--set",
        "data.num_clients=5",
        "--set",
        "lora.ranks=[2,2,2,2,2]",
        "--set",
        'data.client_labels=[["chess"],["chess"],["cooking"],["opera"],["sailing"]]',
        cwd=tmp_path,
    )
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: client 1: empty partition (data.partition = label gave it no records); change the partition's "
        "settings or data.num_clients"
    ], r.stderr
    assert not (tmp_path / "runs").exists()
    r = cli(
        *base,
        "--set",
        "federation.rounds=1",
        "--set",
        "data.num_clients=3",
        "--set",
        "lora.ranks=[2,4,8]",
        "--set",
        f"output.dir={tmp_path / 'three'}",
        cwd=tmp_path,
    )  # fewer clients than labels: said
    assert r.returncode == 0, r.stderr[-2000:]
    assert "data.partition: label gives the 3 clients the first 3 of 4 labels; sailing go unused" in caplog.text
    r = cli(*base, "--set", "federation.rounds=1", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    summary = json.loads(next((tmp_path / "runs").iterdir()).joinpath("summary.json").read_text())
    assert summary["client_labels"] == {str(i): t for i, t in enumerate(sorted(TOPICS))}
    assert Counter(summary["client_labels"].values()) == Counter(TOPICS)
