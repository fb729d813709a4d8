"""nestfed.testing.supernode_heartbeat: flower-supernode with the kill tests' shorter heartbeat."""

import pytest

pytest.importorskip("flwr")

import flwr.supercore.heartbeat as sender  # noqa: E402
import flwr.supernode.cli as supernode_cli  # noqa: E402
import flwr.supernode.fleet_http_connection as connection  # noqa: E402

from nestfed.testing import supernode_heartbeat  # noqa: E402


@pytest.mark.parametrize("argv", [[], ["ten", "--insecure"], ["-5"]])
def test_a_missing_or_non_integer_interval_is_one_usage_line(argv):
    with pytest.raises(SystemExit, match=r"^usage: python -m nestfed.testing.supernode_heartbeat SECONDS"):
        supernode_heartbeat.main(argv)


def test_the_interval_reaches_both_modules_that_read_it_and_the_rest_reaches_flower(monkeypatch):
    seen = {}

    def fake_supernode():
        seen["argv"] = list(supernode_heartbeat.sys.argv)
        seen["intervals"] = (connection.HEARTBEAT_DEFAULT_INTERVAL, sender.HEARTBEAT_DEFAULT_INTERVAL)

    monkeypatch.setattr(supernode_cli, "flower_supernode", fake_supernode)
    monkeypatch.setattr(connection, "HEARTBEAT_DEFAULT_INTERVAL", connection.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(sender, "HEARTBEAT_DEFAULT_INTERVAL", sender.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(supernode_heartbeat.sys, "argv", ["x"])
    assert connection.HEARTBEAT_DEFAULT_INTERVAL == 30  # Flower 1.42's fixed interval
    assert supernode_heartbeat.main(["10", "--superlink", "127.0.0.1:9092", "--insecure"]) == 0
    assert seen == {"argv": ["flower-supernode", "--superlink", "127.0.0.1:9092", "--insecure"], "intervals": (10, 10)}
