"""The compressed comparison's rows and table (nestfed.experiments.compressed_comparison): one row
per method and per FedSLM elicitation variant, bytes summed both ways per client and round."""

from nestfed.experiments.compressed_comparison import markdown, rows_of


def summary(mean, initial, server, ratio, down, up, **extra):
    return {
        "mean_ppl": mean,
        "initial_mean_ppl": initial,
        "server_mean_ppl": server,
        "client_memory": {"mean_ratio_to_full": ratio},
        "bytes_down_per_client_round": down,
        "bytes_up_per_client_round": up,
        "wall_time_s": 12.0,
        **extra,
    }


def test_rows_and_table_of_a_compressed_comparison():
    summaries = {
        "fedslm": summary(
            40.0,
            50.0,
            None,
            0.5,
            1024,
            2048,
            weak_mean_ppl=45.0,
            elicitation={"svd": {"mean_ppl": 38.5}, "none": {"mean_ppl": 39.25}},
        ),
        "fedmkt": summary(42.0, 50.0, 41.0, 0.5, 512, 512),
    }
    rows = rows_of(summaries, backbone_ppl=52.0)
    assert [r["method"] for r in rows] == ["fedslm (svd)", "fedslm (none)", "fedmkt"]
    assert [r["server_mean_ppl"] for r in rows] == [38.5, 39.25, 41.0]
    assert rows[0]["kb_per_client_round"] == 3.0 and rows[2]["kb_per_client_round"] == 1.0
    assert "weak_mean_ppl" not in rows[2]
    lines = markdown(rows).splitlines()
    assert lines[2] == "| backbone (no training) | 52.00 | 52.00 | 52.00 | - | 1.000 | - | - |"
    assert lines[3] == "| fedslm (svd) | 50.00 | 40.00 | 38.50 | 45.00 | 0.500 | 3.0 | 12 |"
    assert lines[5] == "| fedmkt | 50.00 | 42.00 | 41.00 | - | 0.500 | 1.0 | 12 |"
