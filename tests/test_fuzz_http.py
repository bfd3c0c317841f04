"""A standing, bounded fuzz test of everything a client can send: peerd's API (a real process), the
model server and the router (real HTTP on loopback), and the manifest parser. For any input: no 5xx,
the server stays healthy, its memory stays bounded, and the parser raises only ManifestError."""
import json

from hypothesis import given
from hypothesis import strategies as st

from peerd import manifest as mf
from serving.router import Router, make_app as router_app
from serving.server import ModelServer, make_app as server_app
from tests.fleet import TOKEN, Fleet
from tests.http_probe import SETTINGS, AppThread, request
from tests.serving_fixtures import store_root, store_version, verified_version

ADMIN = "fuzz-admin"
VID = "ab" * 32
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
                    | st.text(max_size=40),
                    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5),
                    max_leaves=25)
SEGMENT = st.sampled_from(["v1", VID, "0", "-1", "0.0", "%00", "..", "a" * 300, "tiny", "h1", "%ff", "%C3%BC"])


# JSON that Python's parser takes but nothing can use: a 5,000-digit integer (int() refuses past 4,300
# digits with a bare ValueError), a number beyond a double, a UTF-16 body with its BOM (the API is UTF-8)
UNHOLDABLE = [b'{"x": ' + b"1" * 5000 + b"}", b'{"x": 1e999}', '{"x": 1}'.encode("utf-16")]


def body_strategy():
    return st.one_of(JSON.map(lambda v: json.dumps(v).encode()), st.binary(max_size=300),
                     st.sampled_from([b"[" * 5000, b'{"a": NaN}', b"1e999", b'{"manifest": {}}', b"\xff\xfe",
                                      *UNHOLDABLE]))


def unholdable_json_is_400(addr: str, routes, token: str, segs=("tiny", "v1")) -> None:
    """Every route that reads a JSON body answers each UNHOLDABLE body with a 400, the one entry point's
    refusal, whatever the route would go on to check."""
    for method, path in routes:
        if method in ("POST", "PUT"):
            for body in UNHOLDABLE:
                status = send(addr, method, path.removeprefix("router:").format(*segs), body,
                              {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
                assert status == 400, (addr, method, path, body[:12], status)


def send(addr: str, method: str, path: str, body: bytes, headers: dict) -> int:
    return request(addr, method, path, body if method != "GET" else None, headers)[0]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


PEERD_ROUTES = [("POST", "/v1/jobs"), ("POST", "/v1/gossip"), ("GET", "/v1/jobs/{}"), ("GET", "/v1/status"),
                ("GET", "/v1/versions/{}/bitmap"), ("GET", "/v1/versions/{}/manifest"),
                ("GET", "/v1/versions/{}/chunks/{}"), ("DELETE", "/v1/versions/{}"), ("GET", "/healthz"),
                ("DELETE", "/v1/jobs/{}"), ("DELETE", "/v1/jobs/{}?reason={}"), ("GET", "/v1/have")]
SERVING_ROUTES = [("POST", "/v1/load"), ("POST", "/v1/unload"), ("POST", "/v1/infer"), ("GET", "/v1/versions"),
                  ("GET", "/health/ready?model=tiny&model_version={}"),
                  ("POST", "/v1/models/{}/infer"), ("PUT", "/admin/models/{}/hosts"), ("PUT", "/admin/models/{}/weights"),
                  ("POST", "/admin/models/{}/versions"), ("POST", "/admin/models/{}/permits/load"),
                  ("DELETE", "/admin/models/{}/permits/load/{}"), ("POST", "/admin/models/{}/permits/unload"),
                  ("GET", "/admin/models/{}"), ("DELETE", "/admin/models/{}/hosts/{}"),
                  ("GET", "/admin/models/{}/stats?since_s={}"),
                  # text: the model server's generation and OpenAI endpoints, the router's OpenAI API
                  ("POST", "/v1/generate"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                  ("POST", "router:/v1/completions"), ("POST", "router:/v1/chat/completions"),
                  ("GET", "router:/v1/models")]


def request_strategy(routes):
    return st.tuples(st.sampled_from(routes), st.lists(SEGMENT, min_size=2, max_size=2), body_strategy(),
                     st.sampled_from(["good", "none", "bad", "latin1"]))


def auth_header(kind: str, token: str) -> dict:
    return {"good": {"Authorization": f"Bearer {token}"}, "none": {}, "bad": {"Authorization": "Bearer x"},
            "latin1": {"Authorization": "Bearer \xe9\xff"}}[kind]


def test_peerd_answers_every_client_input_with_less_than_500(tmp_path, seaweed, keys):
    fleet = Fleet(tmp_path, seaweed, keys["pub_path"], ["f"], extra={"f": ["--max-members", "200"]}).start()
    addr, pid = fleet.procs["f"].addr, fleet.procs["f"].proc.pid
    rss0 = rss_kb(pid)
    try:
        @SETTINGS
        @given(request_strategy(PEERD_ROUTES))
        def probe(req):
            (method, path), segs, body, auth = req
            status = send(addr, method, path.format(*segs), body, auth_header(auth, TOKEN))
            assert status < 500, (method, path.format(*segs), body[:80], status)
        probe()
        unholdable_json_is_400(addr, PEERD_ROUTES, TOKEN)
        assert send(addr, "GET", "/healthz", b"", {}) == 200 and fleet.procs["f"].running
        assert rss_kb(pid) - rss0 < 150 * 1024, "peerd grew by more than 150 MB under fuzzing"
    finally:
        fleet.stop()


def test_model_server_and_router_answer_every_client_input_with_less_than_500(tmp_path, keys, hf_checkpoints):
    v1 = verified_version(tmp_path, "v1", seed=1, key=keys["private"])
    src, golden = hf_checkpoints["llama"]
    llama = store_version(tmp_path, src, "llama", "v1", keys["private"], serving={"golden": golden})
    ms = ModelServer("h1", store_root=store_root(tmp_path), admin_token=ADMIN)
    router = Router(poll_interval=0.2, admin_token=ADMIN)
    apps = AppThread(server_app(ms), router_app(router))
    ms_addr, r_addr = apps.addrs
    try:
        for model, d in (("tiny", v1), ("llama", llama)):
            assert send(ms_addr, "POST", "/v1/load",
                        json.dumps({"model": model, "model_version": "v1", "version_id": d.parent.name}).encode(),
                        {"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"}) == 200

        @SETTINGS
        @given(request_strategy(SERVING_ROUTES))
        def probe(req):
            (method, path), segs, body, auth = req
            target = r_addr if path.startswith(("/admin", "/v1/models", "router:")) else ms_addr
            path = path.removeprefix("router:")
            status = send(target, method, path.format(*segs), body, auth_header(auth, ADMIN))
            # 503 is an answer, not an error, where the protocol says "not ready" / "no ready host"
            designed_503 = (path.startswith(("/health/ready", "/v1/models/")) or target == r_addr) and status == 503
            assert status < 500 or designed_503, (target, method, path.format(*segs), body[:80], status)
        probe()
        unholdable_json_is_400(ms_addr, [r for r in SERVING_ROUTES if not r[1].startswith(("/admin", "/v1/models",
                                                                                          "router:"))], ADMIN)
        unholdable_json_is_400(r_addr, [r for r in SERVING_ROUTES if r[1].startswith(("/admin", "/v1/models",
                                                                                     "router:"))], ADMIN)
        assert send(ms_addr, "GET", "/health/ready?model=tiny&model_version=v1", b"", {}) in (200, 503)
        assert send(r_addr, "GET", "/metrics", b"", {}) == 200
    finally:
        apps.stop()


@SETTINGS
@given(st.one_of(JSON, st.fixed_dictionaries({"manifest": JSON, "signature": JSON})))
def test_the_manifest_parser_raises_only_manifest_errors(doc):
    try:
        mf.load_signed(json.dumps(doc).encode(), [])
    except mf.ManifestError:
        pass
    try:
        mf.parse_body(doc)
    except mf.ManifestError:
        pass


@SETTINGS
@given(st.data())
def test_mutated_valid_manifests_raise_only_manifest_errors(data):
    digest = "cd" * 32
    body = {"schema": mf.SCHEMA, "model": "m", "version": "v1", "created_at": "t", "hash_algorithm": "sha256",
            "chunk_size": 4, "files": [{"path": "a/b", "size": 8, "digest": digest}],
            "chunks": [{"index": 0, "file": "a/b", "offset": 0, "size": 4, "digest": digest},
                       {"index": 1, "file": "a/b", "offset": 4, "size": 4, "digest": digest}]}
    where = data.draw(st.sampled_from(["top", "file", "chunk"]))
    target = body if where == "top" else body["files"][0] if where == "file" else body["chunks"][1]
    key = data.draw(st.sampled_from(sorted(target)))
    target[key] = data.draw(JSON)
    try:
        mf.parse_body(body)
    except mf.ManifestError:
        pass
