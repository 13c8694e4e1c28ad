"""The interface gloo binds to: the one holding the task's Spark address (the lab's allreduce test
shows the group failing across hosts without it)."""
from __future__ import annotations

import socket

import pytest

from sparkdl._internal.spark.rendezvous import gloo_interface, interface_of, torch_environment


def test_the_interface_holding_an_address_is_found_by_address_and_by_name():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("localhost") == "lo"
    assert interface_of("203.0.113.254") is None          # an address on no interface of this machine
    assert interface_of("no-such-host.invalid") is None


def test_a_task_address_on_no_interface_leaves_gloo_to_its_default(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    on_this_host = [{"host": "127.0.0.1", "port": 5000}, {"host": "127.0.0.1", "port": 0}]
    assert torch_environment(1, on_this_host)["GLOO_SOCKET_IFNAME"] == "lo"
    elsewhere = [{"host": "203.0.113.254", "port": 5000}, {"host": "203.0.113.254", "port": 0}]
    assert "GLOO_SOCKET_IFNAME" not in torch_environment(1, elsewhere)


@pytest.mark.parametrize("chosen", ["eth7", "lo"])
def test_an_interface_the_user_chose_is_kept(monkeypatch, chosen):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", chosen)
    assert gloo_interface("127.0.0.1") == {}
    assert gloo_interface(socket.gethostname()) == {}


def test_a_loopback_task_address_among_several_hosts_leaves_gloo_to_its_default(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_interface("127.0.0.1", ["127.0.0.1", "127.0.0.1"]) == {"GLOO_SOCKET_IFNAME": "lo"}
    assert gloo_interface("127.0.0.1", ["127.0.0.1", "10.200.77.3"]) == {}


def test_ranks_on_two_hosts_are_numbered_within_each_host_and_the_hosts_by_their_first_rank():
    """As torchrun's agents number them: ranks 0 and 2 on one host, 1 and 3 on the other."""
    gathered = [{"host": host, "port": 29500 + rank} for rank, host in enumerate(["10.0.0.2", "10.0.0.3"] * 2)]
    variables = [torch_environment(rank, gathered) for rank in range(4)]
    assert [v["LOCAL_RANK"] for v in variables] == ["0", "0", "1", "1"]
    assert [v["GROUP_RANK"] for v in variables] == ["0", "1", "0", "1"]
    assert {(v["LOCAL_WORLD_SIZE"], v["GROUP_WORLD_SIZE"], v["WORLD_SIZE"]) for v in variables} == {("2", "2", "4")}
    assert [v["RANK"] for v in variables] == ["0", "1", "2", "3"]
    assert {(v["MASTER_ADDR"], v["MASTER_PORT"]) for v in variables} == {("10.0.0.2", "29500")}
