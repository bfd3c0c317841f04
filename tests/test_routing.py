"""The routing table's invariant under random interleavings (hypothesis), and its weight rules."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from serving.capacity import CapacityRules
from serving.routing import NoReadyHost, RoutingTable, UnknownVersion, WeightRefused

HOSTS = [f"h{i}" for i in range(5)]
VERSIONS = ["v1", "v2", "v3"]


class RouterMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.t = RoutingTable(seed=0)
        for h in HOSTS:
            self.t.add_host("m", h, f"http://{h}")
        for v in VERSIONS:
            self.t.add_version("m", v)
        self.truth: set[tuple[str, str]] = set()     # what the hosts would say right now
        self.routed = 0

    @rule(h=st.sampled_from(HOSTS), v=st.sampled_from(VERSIONS), ready=st.booleans())
    def readiness_changes(self, h, v, ready):
        if h in self.t.models["m"].hosts:
            (self.truth.add if ready else self.truth.discard)((h, v))
            self.t.set_ready("m", h, v, ready)

    @rule(h=st.sampled_from(HOSTS))
    def host_dies(self, h):
        self.t.remove_host("m", h)
        self.truth = {(x, v) for x, v in self.truth if x != h}

    @rule(h=st.sampled_from(HOSTS))
    def host_returns(self, h):
        self.t.add_host("m", h, f"http://{h}")

    @rule(w=st.lists(st.integers(0, 100), min_size=3, max_size=3))
    def weights_change(self, w):
        try:
            self.t.set_weights("m", dict(zip(VERSIONS, w)))
        except WeightRefused:
            pass

    @rule(pin=st.one_of(st.none(), st.sampled_from(VERSIONS)))
    def request(self, pin):
        try:
            h, _, v = self.t.route("m", pin)
        except NoReadyHost:
            return
        assert (h, v) in self.truth, "routed to a host not ready for the version"
        assert pin is None or v == pin
        assert pin is not None or self.t.models["m"].weights[v] > 0
        self.routed += 1

    @invariant()
    def table_never_claims_more_than_truth(self):
        assert self.t.models["m"].ready <= self.truth


TestRouterInvariant = RouterMachine.TestCase
TestRouterInvariant.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def table(ready):
    t = RoutingTable(seed=1)
    for h in {h for h, _ in ready} | {"spare"}:
        t.add_host("m", h, "http://x")
    for v in ("v1", "v2"):
        t.add_version("m", v)
    for h, v in ready:
        t.set_ready("m", h, v, True)
    return t


def test_weight_only_over_ready_capacity():
    t = table([(f"h{i}", "v1") for i in range(10)] + [("h0", "v2")])
    t.set_weights("m", {"v1": 99, "v2": 1})       # 1% fits on one of ten hosts
    t.set_weights("m", {"v1": 90, "v2": 10})
    with pytest.raises(WeightRefused, match="v2 would take 50.0%"):
        t.set_weights("m", {"v1": 50, "v2": 50})
    assert t.models["m"].weights == {"v1": 90.0, "v2": 10.0}   # a refused change changes nothing


def test_no_ready_host_is_a_503_never_a_wrong_host():
    t = table([("h0", "v1")])
    t.set_weights("m", {"v1": 1})
    t.set_ready("m", "h0", "v1", False)
    with pytest.raises(NoReadyHost):
        t.route("m")
    with pytest.raises(UnknownVersion):
        t.route("m", "v7")


def test_capacity_rules():
    r = CapacityRules(max_concurrent_loads=2, old_floor=3)
    assert r.may_load(1)[0] and not r.may_load(2)[0]
    assert r.may_unload(4, 50.0)[0] and not r.may_unload(3, 50.0)[0]
    assert r.may_unload(1, 0.0)[0]                 # a version without traffic can go
    with pytest.raises(ValueError):
        CapacityRules(max_concurrent_loads=0)
