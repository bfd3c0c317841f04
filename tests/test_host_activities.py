"""The host's load activity against a real model server and router (in-process HTTP on loopback):
successive rollouts retire versions older than the two a rollout keeps, never one that still carries
traffic on too few hosts."""
import contextlib

from temporalio.testing import ActivityEnvironment

from activities.host import HostActivities
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.serving_fixtures import store_root, verified_version
from weightcast.stack.embedded import serve_app
from workflows.types import LoadInput


@contextlib.asynccontextmanager
async def host(tmp_path, max_versions: int = 2):
    """A model server (host h1) and a router on loopback: (model server, its address, router, its address)."""
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token="adm", max_versions=max_versions)
    router = Router(poll_interval=0.1, admin_token="adm")
    (r1, ms_addr), (r2, router_addr) = await serve_app(server_app(ms)), await serve_app(router_app(router))
    try:
        yield ms, ms_addr, router, router_addr
    finally:
        for r in (r1, r2):
            await r.cleanup()


async def test_successive_rollouts_retire_old_versions(tmp_path, keys):
    async with host(tmp_path) as (ms, ms_addr, router, router_addr):
        dirs = {v: verified_version(tmp_path, v, seed=i, key=keys["private"]) for i, v in enumerate(["v1", "v2", "v3"])}

        async def load(v: str, previous: str, with_router: bool = False) -> dict:
            d = dirs[v]
            acts = HostActivities("h1", "http://127.0.0.1:9", "", d.parent.parent.parent, ms_addr, admin_token="adm")
            inp = LoadInput(v, d.parent.name, keep=[v, previous] if previous else [v],
                            router=router_addr if with_router else "", model="tiny")
            return await ActivityEnvironment().run(acts.load_version, inp)

        assert (await load("v1", ""))["retired"] == []
        assert (await load("v2", "v1"))["retired"] == []
        assert sorted(ms.versions) == [("tiny", "v1"), ("tiny", "v2")]
        # v3 replaces v2: v1 is retired first, or the server (two versions at most) would refuse v3
        out = await load("v3", "v2")
        assert out["retired"] == ["v1"] and out["state"] == "ready"
        assert sorted(ms.versions) == [("tiny", "v2"), ("tiny", "v3")]

        # with a router: a version still carrying traffic on its last host is not retired
        router.table.add_host("tiny", "h1", ms_addr)
        router.table.add_version("tiny", "v2")
        await router.poll_once()
        router.table.set_weights("tiny", {"v2": 100})
        ms.unload(("tiny", "v3"))
        out = await load("v1", "", with_router=True)   # keep=[v1] only: v2 would be retired, but serves traffic
        assert out["retired"] == [] and sorted(ms.versions) == [("tiny", "v1"), ("tiny", "v2")]


async def test_a_rollout_retires_only_its_own_models_versions(tmp_path, keys):
    """Two models on one host, the same label in both: rolling model "tiny" forward never unloads model
    "other", even where "other" carries no traffic the router knows of under "tiny"."""
    async with host(tmp_path, max_versions=4) as (ms, ms_addr, router, router_addr):
        dirs = {(m, v): verified_version(tmp_path, v, seed=i, key=keys["private"], model=m)
                for i, (m, v) in enumerate([("other", "v1"), ("tiny", "v1"), ("tiny", "v2"), ("tiny", "v3")])}

        async def load(model: str, v: str, keep: list[str]) -> dict:
            d = dirs[(model, v)]
            acts = HostActivities("h1", "http://127.0.0.1:9", "", d.parent.parent.parent, ms_addr, admin_token="adm")
            return await ActivityEnvironment().run(acts.load_version, LoadInput(v, d.parent.name, keep=keep,
                                                                               router=router_addr, model=model))

        assert (await load("other", "v1", ["v1"]))["retired"] == []
        router.table.add_host("other", "h1", ms_addr)
        router.table.add_version("other", "v1")
        await router.poll_once()
        router.table.set_weights("other", {"v1": 100})
        router.table.add_host("tiny", "h1", ms_addr)
        assert (await load("tiny", "v1", ["v1"]))["retired"] == []
        assert (await load("tiny", "v2", ["v2", "v1"]))["retired"] == []
        out = await load("tiny", "v3", ["v3", "v2"])
        assert out["retired"] == ["v1"]                                   # tiny's v1, not other's
        assert sorted(ms.versions) == [("other", "v1"), ("tiny", "v2"), ("tiny", "v3")]
        await router.poll_once()
        assert router.table.models["other"].ready_hosts("v1") == ["h1"]   # other still answers
