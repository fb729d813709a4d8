"""The shared rules of nestfed.config.schema every layer uses: clients per round and the rank range."""

import numpy as np
import pytest

from nestfed.config import ConfigError, check_rank, clients_per_round, sampled_per_round
from tests.tiny_federation import tiny_config


@pytest.mark.parametrize(
    ("fraction", "population", "expected"),
    [
        (0.1, 10, 1),  # 1.0
        (0.3, 10, 3),
        (0.25, 10, 2),  # 2.5 rounds to the even 2
        (0.35, 10, 4),  # 3.5 rounds to the even 4
        (0.01, 10, 1),  # 0.1 rounds to 0; at least one client
        (0.0, 10, 1),
        (1.0, 7, 7),
        (0.5, 1, 1),  # 0.5 rounds to 0; at least one client
    ],
)
def test_clients_per_round_is_max_1_round_fraction_times_k(fraction, population, expected):
    assert clients_per_round(fraction, population) == expected


def test_sampled_per_round_is_clients_per_round_of_the_config():
    cfg = tiny_config("data.num_clients=10", "lora.ranks=[4]", "federation.fraction=0.25")
    assert sampled_per_round(cfg) == 2


@pytest.mark.parametrize("rank", [1, 4, 8, np.int64(5)])
def test_a_rank_in_1_to_r_max_passes(rank):
    assert check_rank(rank, 8) is None


@pytest.mark.parametrize("rank", [0, -1, 9, 4.0, "4", True, None])
def test_a_rank_outside_1_to_r_max_or_not_an_integer_is_refused(rank):
    with pytest.raises(ValueError) as info:
        check_rank(rank, 8)
    assert str(info.value) == f"rank {rank!r} is not an integer in [1, r_max = 8]"


def test_the_rank_error_names_where_and_takes_the_callers_class():
    with pytest.raises(ConfigError) as info:
        check_rank(9, 8, "node config", ConfigError)
    assert str(info.value) == "node config: rank 9 is not an integer in [1, r_max = 8]"
