"""Device tiers (``population.precisions``): a memory budget chooses the most precise backbone that
holds the smallest rank choice, then the largest rank at that precision, against hand-computed
footprints; the settings at fault are refused in one line naming the key."""

import pytest

from nestfed import methods
from nestfed.config.capabilities import Capability, asked_by
from nestfed.config.population import PopulationConfig, assign_tiers, choose_tier
from nestfed.errors import ConfigError

MIB = 2**20

#: footprints by hand (MiB) of a backbone whose weights are 100 MiB in float32, 40 in int8, 25 in
#: nf4, with 10 MiB of saved activations and 2 MiB per rank step: bytes(r) = W + 10 + 2 r
SIZES = {q: {r: (w + 10 + 2 * r) * MIB for r in (2, 4, 8)} for q, w in (("none", 100), ("int8", 40), ("nf4", 25))}


@pytest.mark.parametrize(
    ("mib", "tier"),
    [
        (200, ("none", 8)),  # 126 MiB: float32 at the largest rank
        (118, ("none", 4)),  # none r8 needs 126, r4 118: float32 at rank 4 (precision before rank)
        (113, ("int8", 8)),  # none r2 needs 114: int8, at its largest rank (66)
        (66, ("int8", 8)),  # int8 r8 needs 66
        (65, ("int8", 4)),
        (54, ("int8", 2)),  # int8 r2 needs 54
        (53, ("nf4", 8)),  # nf4 r8 needs 51: nf4 at its largest rank rather than int8 at none
        (39, ("nf4", 2)),  # nf4 r2 needs 39
        (38, None),  # holds nothing
    ],
)
def test_a_budget_takes_the_most_precise_backbone_then_its_largest_rank(mib, tier):
    assert choose_tier(mib, [2, 4, 8], SIZES) == tier


def test_precision_wins_over_rank():
    # 120 MiB holds float32 at rank 4 (118) or int8 at rank 8 (66): the float32 backbone wins
    assert choose_tier(120, [2, 4, 8], SIZES) == ("none", 4)
    # only the precisions configured are tried
    assert choose_tier(60, [2, 4, 8], {q: SIZES[q] for q in ("none", "nf4")}) == ("nf4", 8)


def test_tiers_are_drawn_per_client_from_the_budgets():
    p = PopulationConfig(memory_mib=((60, 0.5), (120, 0.5)), rank_choices=(2, 4, 8), precisions=("nf4", "none"))
    assert p.tiers("none") == ["none", "nf4"]  # the most precise first, whatever the order given
    footprints = {q: (lambda r, q=q: SIZES[q][r]) for q in ("none", "nf4")}
    ranks, budgets, precisions = assign_tiers(p, (8,), 0, 6, 0, footprints, "none")
    assert sorted(budgets) == [60, 60, 60, 120, 120, 120]
    for r, b, q in zip(ranks, budgets, precisions):
        assert (q, r) == {60: ("nf4", 8), 120: ("none", 4)}[b]
    with pytest.raises(ValueError) as err:  # one line naming the client, its budget, the precisions
        assign_tiers(PopulationConfig(memory_mib=((30, 1.0),), rank_choices=(2,), precisions=("none", "nf4")),
                     (8,), 0, 2, 0, footprints, "none")  # fmt: skip
    assert str(err.value) == (
        "population.memory_mib: client 0's budget of 30 MiB holds no rank of [2] at any precision of "
        "['none', 'nf4'] (rank 2 at nf4 needs 39 MiB; nestfed.nn.footprint)"
    )


def test_without_precisions_every_client_holds_the_models_own():
    p = PopulationConfig(memory_mib=((120, 1.0),), rank_choices=(2, 4))
    ranks, _, precisions = assign_tiers(p, (8,), 0, 3, 0, lambda r: SIZES["nf4"][r], "nf4")
    assert precisions == ["nf4"] * 3 and ranks == [4] * 3
    ranks, budgets, precisions = assign_tiers(PopulationConfig(), (2, 4, 8), 0, 3, 0, None, "none")
    assert (ranks, budgets, precisions) == ([2, 4, 8], None, ["none"] * 3)


BUDGETS = ["population.memory_mib={100=1.0}", "population.rank_choices=[2,4]"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (['population.precisions=["none","fp8"]'], r"population.precisions: unknown \['fp8'\]"),
        (['population.precisions=["none","nf4","nf4"]'], "population.precisions: a precision is listed twice"),
        (['population.precisions=["nf4"]'], r"population.precisions: \['nf4'\] leaves out model.quantization = 'none'"),
    ],
)
def test_bad_precisions_are_refused_in_one_line(extra, message):
    with pytest.raises(ConfigError, match=message) as err:
        methods.load_config(None, BUDGETS + extra)
    assert "\n" not in str(err.value)


def test_precisions_need_memory_budgets():
    with pytest.raises(ConfigError, match="population.precisions: only population.memory_mib chooses from it"):
        methods.load_config(None, ['population.precisions=["none","nf4"]'])


def test_a_quantised_tier_asks_for_the_quantised_backbone_capability():
    pytest.importorskip("bitsandbytes")
    cfg = methods.load_config(None, BUDGETS + ['population.precisions=["none","nf4"]', "strategy.name=zeropad"])
    assert asked_by(cfg)[Capability.QUANTIZED_BACKBONE] == "population.precisions"
    assert Capability.QUANTIZED_BACKBONE not in asked_by(methods.load_config(None, BUDGETS))
    with pytest.raises(ConfigError) as err:  # FedSLM's clients are SVDs of the dense weights
        methods.load_config(
            "configs/fedslm_bbc_news.toml",
            ["lora.ranks=[16]", *BUDGETS, 'population.precisions=["none","nf4"]'],
        )
    assert "population.precisions: fedslm cannot train over a quantised backbone: " in str(err.value)
    assert "\n" not in str(err.value)
