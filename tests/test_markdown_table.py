"""nestfed.io.markdown: the one Markdown table writer, its bytes checked by hand."""

from nestfed.io.markdown import BLANK, markdown_row, markdown_table


def test_a_row_writes_each_cell_as_str_between_bars():
    assert markdown_row(["a", 1, 2.5]) == "| a | 1 | 2.5 |"
    assert markdown_row(["x", ""]) == "| x |  |"  # an empty string keeps both spaces
    assert markdown_row(["x", BLANK]) == "| x | |"  # one space
    assert markdown_row([None, True]) == "| None | True |"  # str() of any other value
    assert markdown_row([]) == "|"


def test_a_table_is_head_rule_rows():
    assert markdown_table(["method", "ppl"], [["a", "1.00"], ("b", 2)]) == [
        "| method | ppl |",
        "|---|---|",
        "| a | 1.00 |",
        "| b | 2 |",
    ]
    assert markdown_table(("h",)) == ["| h |", "|---|"]
