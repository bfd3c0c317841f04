"""Many models, one fleet: two models with the same version label rolled out alternately on the same
hosts, through the real workflow, host workers, peerd, model servers and router. A rollout touches
only its own model's versions (loaded and stored), and the router answers for both models after
every rollout."""
import asyncio

import aiohttp

from peerd.client import PeerdClient
from tests.rollout_fixtures import Stack
from weightcast.rollouts import start_rollout
from workflows.rollout import RolloutWorkflow

HOSTS = ["a", "b"]


async def answers(s: Stack, model: str) -> set[str]:
    """Ask the router for ``model`` a few times; the versions that answered (every answer must be 200
    and from that model)."""
    seen = set()
    async with aiohttp.ClientSession() as http:
        for _ in range(6):
            async with http.post(f"{s.router_addr}/v1/models/{model}/infer", json={"input_ids": [[1, 2, 3]]}) as r:
                body = await r.json()
                assert r.status == 200, (model, r.status, body)
                assert body["model"] == model and r.headers["X-Model"] == model
                seen.add(body["model_version"])
    return seen


async def stored(s: Stack, host: str) -> set[tuple[str, str]]:
    async with PeerdClient(s.stack.peerd[host].addr, s.stack.token) as c:
        return {(v["model"], v["version"]) for v in (await c.status())["stored"]}


async def roll_out(s: Stack, fields: dict, previous: str = "") -> dict:
    inp = s.input(**fields, previous_version=previous, traffic_steps=[50, 100] if previous else [100])
    handle = await start_rollout(s.client, inp)
    try:
        return await asyncio.wait_for(handle.result(), 120)
    except asyncio.TimeoutError:
        raise AssertionError(f"{handle.id} did not finish: {await handle.query(RolloutWorkflow.status)}") from None


async def test_two_models_with_the_same_labels_rolled_out_alternately_both_keep_answering(tmp_path, seaweed, keys,
                                                                                           temporal):
    s = await Stack().start(tmp_path, seaweed, keys, HOSTS, temporal=temporal)
    try:
        m1, m2 = await s.publish("m", "v1", seed=11), await s.publish("m", "v2", seed=12)
        d1, d2, d3 = [await s.publish("d", f"v{i}", seed=20 + i) for i in (1, 2, 3)]
        table = s.stack.router.table

        assert (await roll_out(s, m1))["ready"] == HOSTS
        assert await answers(s, "m") == {"v1"}

        assert (await roll_out(s, d1))["ready"] == HOSTS           # the same label, another model
        assert await answers(s, "m") == {"v1"} and await answers(s, "d") == {"v1"}

        for d, prev in ((d2, "v1"), (d3, "v2")):
            result = await roll_out(s, d, previous=prev)
            assert result["ready"] == HOSTS and result["traffic"] == {d["version"]: 100}
            assert await answers(s, "d") == {d["version"]}
            assert await answers(s, "m") == {"v1"}                 # m untouched by d's rollouts
            assert table.models["m"].ready_hosts("v1") == HOSTS
            assert all(("m", "v1") in s.servers[h].versions for h in HOSTS)

        result = await roll_out(s, m2, previous="v1")
        assert result["ready"] == HOSTS
        assert await answers(s, "m") == {"v2"} and await answers(s, "d") == {"v3"}
        assert table.models["d"].ready_hosts("v3") == HOSTS
        for h in HOSTS:
            assert set(s.servers[h].versions) == {("m", "v1"), ("m", "v2"), ("d", "v2"), ("d", "v3")}
            # each model keeps its new and previous versions on disk; d's v1 went with d's v3 rollout
            assert await stored(s, h) == {("m", "v1"), ("m", "v2"), ("d", "v2"), ("d", "v3")}
    finally:
        await s.stop()
