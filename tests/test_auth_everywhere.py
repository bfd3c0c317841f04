"""Every /v1/ and /admin/ route of every server, read from the servers' own route tables, answers a
missing or wrong token with a 401, except the routes docs/trust.md lists as open (inference and
read-only views on a model server, which sits behind the router). A new route must be placed in one
list or the other, and a route whose check is removed fails here."""
from unittest.mock import MagicMock

from peerd.server import make_app as peerd_app
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.fleet import Fleet
from tests.serving_fixtures import store_root
from tests.http_probe import AppThread, request

VID = "ab" * 32
FILL = {"vid": VID, "index": "0", "model": "tiny", "host": "h1"}
# docs/trust.md: the model server's inference and read-only routes take no token (the router in front
# of it checks clients' API keys); everything else under /v1/ and /admin/ needs one
OPEN_ON_MODEL_SERVER = {("POST", "/v1/infer"), ("POST", "/v1/generate"), ("POST", "/v1/completions"),
                        ("POST", "/v1/chat/completions"), ("GET", "/v1/versions")}


def guarded_routes(app) -> list[tuple[str, str]]:
    """(method, path with its variables filled) of every /v1/ and /admin/ route; HEAD is GET's twin."""
    out = set()
    for r in app.router.routes():
        info = r.resource.get_info() if r.resource is not None else {}
        path = info.get("path") or info.get("formatter", "")
        if r.method != "HEAD" and path.startswith(("/v1/", "/admin/")):
            out.add((r.method, path.format(**FILL)))
    return sorted(out)


def status(addr: str, method: str, path: str, auth: str | None) -> int:
    headers = {"Authorization": auth} if auth else {}
    # a websocket route checks its token at the upgrade
    headers.update({"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                    "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="} if path.endswith("/have") else {})
    return request(addr, method, path, b"{}" if method in ("POST", "PUT") else None, headers)[0]


def refusals(addr: str, routes) -> dict:
    """Each route's answers without a token and with a wrong one."""
    return {(m, p): (status(addr, m, p, None), status(addr, m, p, "Bearer wrong")) for m, p in routes}


def test_every_peerd_route_needs_the_cluster_token(tmp_path, seaweed, keys):
    routes = guarded_routes(peerd_app(MagicMock()))        # the table only: the requests go to a real peerd
    assert ("DELETE", f"/v1/versions/{VID}") in routes and ("POST", "/v1/gossip") in routes and len(routes) >= 10
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["a"]).start()
    try:
        got = refusals(fleet.procs["a"].addr, routes)
    finally:
        fleet.stop()
    assert {r: s for r, s in got.items() if s != (401, 401)} == {}, got


def test_every_model_server_and_router_route_needs_its_token_but_the_open_ones(tmp_path):
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token="adm")
    router = Router(poll_interval=60, admin_token="adm", api_keys=frozenset({"client-key"}))
    ms_routes, r_routes = guarded_routes(server_app(ms)), guarded_routes(router_app(router))
    assert OPEN_ON_MODEL_SERVER <= set(ms_routes)
    apps = AppThread(server_app(ms), router_app(router))
    try:
        ms_got = refusals(apps.addrs[0], [r for r in ms_routes if r not in OPEN_ON_MODEL_SERVER])
        open_got = refusals(apps.addrs[0], sorted(OPEN_ON_MODEL_SERVER))
        r_got = refusals(apps.addrs[1], r_routes)
    finally:
        apps.stop()
    assert set(ms_got) == {("POST", "/v1/prepare"), ("POST", "/v1/load"), ("POST", "/v1/unload")}
    assert {r: s for r, s in ms_got.items() if s != (401, 401)} == {}, ms_got
    assert all(401 not in s for s in open_got.values()), open_got
    # the router: the admin API (admin token) and the clients' API (their keys), every route
    assert {p.split("/")[1] for _, p in r_routes} == {"admin", "v1"} and len(r_routes) >= 12
    assert {r: s for r, s in r_got.items() if s != (401, 401)} == {}, r_got
