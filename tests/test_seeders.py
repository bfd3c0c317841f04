"""Seeders (the hosts that read the origin) are spread over the racks."""
from peerd.seeders import seeders_across_racks
from workflows.types import HostSpec


def _pairs(hosts):
    return [(h.id, h.rack) for h in hosts]


def test_seeders_take_turns_over_the_racks():
    hosts = [HostSpec(f"{r}{i}", rack=r) for r in ("r1", "r2", "r3") for i in range(10)]
    assert seeders_across_racks(_pairs(hosts), 4) == ["r10", "r20", "r30", "r11"]
    picked = seeders_across_racks(_pairs(hosts), 64)
    assert len(picked) == 30 and len(set(picked)) == 30          # never more than there are, no repeats
    uneven = [HostSpec("a0", rack="a"), *[HostSpec(f"b{i}", rack="b") for i in range(5)]]
    assert seeders_across_racks(_pairs(uneven), 4) == ["a0", "b0", "b1", "b2"]


def test_without_racks_the_first_hosts_seed_as_before():
    hosts = [HostSpec(f"h{i}") for i in range(100)]
    assert seeders_across_racks(_pairs(hosts), 64) == [f"h{i}" for i in range(64)]
