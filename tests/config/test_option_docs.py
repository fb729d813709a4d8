"""``nestfed methods NAME``'s reading of an options dataclass: each field's default and the
meaning its docstring gives it."""

from dataclasses import dataclass, field

from nestfed.config.option_docs import OptionDoc, option_docs


@dataclass(frozen=True)
class Options:
    """mode: ``fast`` or ``exact`` (see :func:`~nestfed.ops.delta_rule.chunk_delta_rule`); steps: local
    steps per round; a, b: described together; ranks: the ranks. Raises ValueError for a bad mode."""

    mode: str = "fast"
    steps: int = 3
    a: float = 0.5
    b: bool = True
    ranks: tuple[int, ...] = field(default_factory=lambda: (2, 4))
    undocumented: int = 0


def test_each_field_gets_its_default_and_its_own_meaning():
    assert option_docs(Options) == [
        OptionDoc("mode", '"fast"', "`fast` or `exact` (see chunk_delta_rule)"),
        OptionDoc("steps", "3", "local steps per round"),
        OptionDoc("a", "0.5", "described together"),
        OptionDoc("b", "true", "described together"),
        OptionDoc("ranks", "[2, 4]", "the ranks."),
        OptionDoc("undocumented", "0", ""),
    ]


@dataclass(frozen=True)
class GoogleOptions:
    """Options of ``[demo]``: the prose before the section is no field's meaning.

    Attributes:
        mode: ``fast`` or ``exact`` (see :func:`~nestfed.ops.delta_rule.chunk_delta_rule`); its
            description runs over two lines.
        steps: local steps per round.

    Raises:
        ValueError: for a bad mode.
    """

    mode: str = "fast"
    steps: int = 3
    undocumented: int = 0


def test_a_google_attributes_section_gives_each_field_its_item_and_no_raises():
    assert option_docs(GoogleOptions) == [
        OptionDoc("mode", '"fast"', "`fast` or `exact` (see chunk_delta_rule); its description runs over two lines."),
        OptionDoc("steps", "3", "local steps per round."),
        OptionDoc("undocumented", "0", ""),
    ]


@dataclass(frozen=True)
class ProseAndSections:
    """Options whose meanings come from the Attributes section alone.

    Prose before it names a field (mode: not its meaning) and is ignored.

    Attributes:
        mode: ``fast`` or ``exact`` (see :func:`~nestfed.ops.delta_rule.delta_rule`).
        steps: local steps
            per round.
        a, b: described together.
        ranks: the ranks.

    Raises:
        ValueError: for a bad mode (steps: not a meaning either).
    """

    mode: str = "fast"
    steps: int = 3
    a: float = 0.5
    b: bool = True
    ranks: tuple[int, ...] = field(default_factory=lambda: (2, 4))
    undocumented: int = 0


def test_prose_before_the_attributes_section_and_sections_after_it_give_no_meaning():
    assert option_docs(ProseAndSections) == [
        OptionDoc("mode", '"fast"', "`fast` or `exact` (see delta_rule)."),
        OptionDoc("steps", "3", "local steps per round."),
        OptionDoc("a", "0.5", "described together."),
        OptionDoc("b", "true", "described together."),
        OptionDoc("ranks", "[2, 4]", "the ranks."),
        OptionDoc("undocumented", "0", ""),
    ]
