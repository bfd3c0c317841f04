"""The router's HTTP API as an outsider would probe it: the admin API needs the admin token, a
client's bad request never takes a host out of the pool, and odd input is a 4xx."""
import aiohttp

from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.serving_fixtures import store_root, verified_version
from weightcast.stack.embedded import serve_app

ADMIN = "router-admin"
ADM = {"Authorization": f"Bearer {ADMIN}"}


async def call(s, method, url, **kw):
    async with s.request(method, url, **kw) as r:
        return r.status, await r.json(content_type=None)


async def test_admin_auth_bad_requests_and_permits(tmp_path, keys):
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    router = Router(poll_interval=0.05, admin_token=ADMIN)
    runners = []
    r, ms_addr = await serve_app(server_app(ms))
    runners.append(r)
    r, raddr = await serve_app(router_app(router))
    runners.append(r)
    base = f"{raddr}/admin/models/tiny"
    try:
        async with aiohttp.ClientSession() as s:
            # a rogue server cannot be slipped in without the token
            for hdr in ({}, {"Authorization": "Bearer nope"}):
                st, body = await call(s, "PUT", f"{base}/hosts", json={"h1": "http://127.0.0.1:9"}, headers=hdr)
                assert st == 401 and "admin token" in body["error"]
                assert (await call(s, "GET", base, headers=hdr))[0] == 401
            assert router.table.models == {}
            assert (await call(s, "PUT", f"{base}/hosts", json={"h1": ms_addr}, headers=ADM))[0] == 200
            assert (await call(s, "POST", f"{base}/versions", json={"version": "v1"}, headers=ADM))[0] == 200
            assert (await call(s, "POST", f"{ms_addr}/v1/load", headers=ADM,
                               json={"model": "tiny", "model_version": "v1", "version_id": v1.parent.name}))[0] == 200
            for w in (b'{"weights": {"v1": NaN}}', b'{"weights": {"v1": Infinity}}', b'{"weights": {"v1": 1e999}}',
                      b'{"weights": {"v1": true}}'):
                st, body = await call(s, "PUT", f"{base}/weights", data=w, headers=ADM)
                assert 400 <= st < 500, (w, st, body)
            assert (await call(s, "PUT", f"{base}/weights", json={"weights": {"v1": 100}}, headers=ADM))[0] == 200
            st, body = await call(s, "GET", base, headers=ADM)
            assert body["weights"] == {"v1": 100.0} and body["ready"] == {"v1": ["h1"]}

            # bad client requests: 4xx to the client, the host stays in the pool
            for bad in ({"input_ids": [[True]]}, {"input_ids": "x"}, {"input_ids": [[1]], "model_version": ["v1"]}):
                for _ in range(4):
                    st, _ = await call(s, "POST", f"{raddr}/v1/models/tiny/infer", json=bad)
                    assert 400 <= st < 500
            assert (await call(s, "POST", f"{raddr}/v1/models/tiny/infer", data=b"[" * 50_000))[0] == 400
            st, body = await call(s, "POST", f"{raddr}/v1/models/tiny/infer", json={"input_ids": [[1, 2]]})
            assert st == 200 and body["routed_host"] == "h1"
            assert router.table.models["tiny"].ready_hosts("v1") == ["h1"]

            # load permits only for hosts registered for the model
            for host in (None, "ghost", ["h1"]):
                st, body = await call(s, "POST", f"{base}/permits/load", json={"host": host}, headers=ADM)
                assert st == 400 and "not registered" in body["error"]
            assert router.loading.get("tiny", set()) == set()
            assert (await call(s, "POST", f"{base}/permits/load", json={"host": "h1"}, headers=ADM))[0] == 200
            assert (await call(s, "DELETE", f"{base}/permits/load/h1", headers=ADM))[0] == 200
            assert router.loading["tiny"] == set()
            st, _ = await call(s, "POST", f"{base}/permits/unload", json={"host": {"x": 1}, "version": "v1"}, headers=ADM)
            assert st == 400
            async with s.get(f"{raddr}/metrics") as resp:         # metrics stay open (read-only)
                assert resp.status == 200 and "router_requests_total" in await resp.text()
    finally:
        for r in runners:
            await r.cleanup()
