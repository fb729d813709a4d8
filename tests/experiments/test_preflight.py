"""nestfed.experiments.preflight's check of what a Flower QUERY round found."""

import pytest

from nestfed.errors import ConfigError, NestfedError
from nestfed.experiments.preflight import flower_clients
from nestfed.federation.messages import ClientInfo
from tests.tiny_federation import tiny_config


def test_the_nodes_found_need_min_clients_and_ranks_in_1_to_r_max():
    cfg = tiny_config()  # ranks 2, 4, 8: r_max = 8
    ok = [ClientInfo(0, 2, 6), ClientInfo(1, 8, 6)]
    assert flower_clients(cfg, ok, 2, 2, 3, "") is None
    with pytest.raises(NestfedError, match="^only 2 nodes answered the query; min-clients is 3$"):
        flower_clients(cfg, ok, 3, 2, 3, "")
    for rank in (0, 9):
        with pytest.raises(ConfigError) as info:
            flower_clients(cfg, ok + [ClientInfo(2, rank, 6)], 2, 3, 3, "")
        assert str(info.value) == f"node of client 2: rank {rank} is not an integer in [1, r_max = 8]"
