"""[population]: ranks drawn from shares (stratified counts by largest remainders), the inline-table
syntax and its round trip, memory budgets through a footprint, and one line naming the key at fault."""

import pytest

from nestfed import config, methods
from nestfed.config.population import PopulationConfig, assign_ranks, draw
from nestfed.errors import ConfigError

SHARES = ((2, 0.4), (4, 0.3), (8, 0.2), (16, 0.1))


def test_stratified_counts_are_the_largest_remainders_of_the_shares():
    # n = 7: exact 2.8, 2.1, 1.4, 0.7 -> floors 2, 2, 1, 0 (5); the two largest remainders (.8 at rank 2,
    # .7 at rank 16) get the other two
    ranks = draw(SHARES, 7, "stratified", seed=0, stream="population/rank")
    assert sorted(ranks) == [2, 2, 2, 4, 4, 8, 16]
    assert draw(SHARES, 7, "stratified", 0, "population/rank") == ranks  # seeded
    assert draw(SHARES, 7, "stratified", 1, "population/rank") != ranks  # another data.seed, another permutation
    hundred = draw(SHARES, 100, "stratified", 0, "population/rank")
    assert [hundred.count(r) for r in (2, 4, 8, 16)] == [40, 30, 20, 10]
    free = draw(SHARES, 100, "independent", 0, "population/rank")
    assert set(free) <= {2, 4, 8, 16} and [free.count(r) for r in (2, 4, 8, 16)] != [40, 30, 20, 10]


def test_shares_are_an_inline_table_that_round_trips_and_replace_lora_ranks(tmp_path):
    cfg = methods.load_config(None, ["data.num_clients=20", "population.rank_shares={2=0.5,16=0.5}", "lora.ranks=[8]"])
    assert cfg.population.rank_shares == ((2, 0.5), (16, 0.5))
    text = config.dumps_toml(cfg)
    assert "rank_shares = {2 = 0.5, 16 = 0.5}" in text
    (tmp_path / "c.toml").write_text(text)
    again = methods.load_config(tmp_path / "c.toml")
    assert again == cfg
    ranks = config.client_ranks(cfg)
    assert sorted(ranks) == [2] * 10 + [16] * 10 and config.r_max(cfg) == 16


@pytest.mark.parametrize(
    "override,message",
    [
        ("population.rank_shares={2=0.5,4=0.4}", "population.rank_shares: the shares sum to 0.9, not 1"),
        ("population.rank_shares={x=1.0}", "population.rank_shares.x: the key must be a positive integer"),
        ("population.rank_shares=[2,4]", "population.rank_shares: expected a table"),
        ("population.availability=0", "population.availability must be in \\(0, 1\\]"),
        ("population.dropout=1", "population.dropout must be in \\[0, 1\\)"),
        ("population.elastic=sometimes", "population.elastic: 'sometimes' is not one of none, uniform, trace"),
        ("population.elastic=trace", "population.elastic_trace: a trace file goes with"),
        ("population.rank_choices=[2,4]", "population.rank_choices: only population.memory_mib"),
    ],
)
def test_bad_population_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        methods.load_config(None, ["data.num_clients=4", "lora.ranks=[8]", override])


def test_shares_beside_a_rank_list_or_memory_budgets_are_refused():
    with pytest.raises(
        ConfigError, match="population.rank_shares draws the clients' ranks and lora.ranks lists \\[2, 4\\]; set one"
    ):
        methods.load_config(None, ["data.num_clients=2", "lora.ranks=[2,4]", "population.rank_shares={2=1.0}"])
    with pytest.raises(ConfigError, match="rank_shares and population.memory_mib both choose"):
        methods.load_config(
            None, ["population.rank_shares={2=1.0}", "population.memory_mib={100=1.0}", "population.rank_choices=[2]"]
        )


def test_memory_budgets_take_the_largest_rank_that_fits():
    p = PopulationConfig(memory_mib=((1, 0.5), (3, 0.5)), rank_choices=(1, 2, 4, 8))
    mib = 2**20
    footprint = {1: int(0.5 * mib), 2: int(0.9 * mib), 4: int(2.5 * mib), 8: int(5 * mib)}.__getitem__
    ranks, budgets = assign_ranks(p, (8,), 0, 10, seed=0, footprint=footprint)
    assert sorted(budgets) == [1] * 5 + [3] * 5
    assert all(r == (2 if b == 1 else 4) for r, b in zip(ranks, budgets))  # 1 MiB holds rank 2, 3 MiB rank 4
    with pytest.raises(ValueError, match="population.memory_mib: client \\d+'s budget of 1 MiB holds no rank"):
        assign_ranks(p, (8,), 0, 10, 0, {1: 2 * mib, 2: 3 * mib, 4: 4 * mib, 8: 5 * mib}.__getitem__)
    with pytest.raises(ValueError, match="known once the experiment is prepared"):
        assign_ranks(p, (8,), 0, 10, 0, None)


def test_elastic_ranks_are_refused_by_methods_that_need_one_rank_or_do_not_train_a_prefix():
    with pytest.raises(
        ConfigError, match="population.elastic: fedavg cannot train an elastic rank: it needs one rank for every client"
    ):
        methods.load_config(None, ["strategy.name=fedavg", "lora.ranks=[4]", "population.elastic=uniform"])
    with pytest.raises(
        ConfigError,
        match="population.elastic: fedslm cannot train an elastic rank: its clients' ranks are compression ratios",
    ):
        methods.load_config(None, ["strategy.name=fedslm", "population.elastic=uniform"])
    for name in (
        "prelort",
        "zeropad",
        "hetlora",
        "flora",
        "ffa_lora",
        "flexlora",
        "raflora",
        "fedsa_lora",
        "fedex_lora",
        "local_only",
    ):
        assert (
            methods.load_config(
                None,
                [f"strategy.name={name}", "data.num_clients=3", "lora.ranks=[2,4,8]", "population.elastic=uniform"],
            ).population.elastic
            == "uniform"
        )
