"""`weightcast dev up` / `publish` / `rollout status` / `dev down` through the real CLI: the path an
operator and a CI job take. The stack runs as its own background process, as it would for a user."""
import asyncio
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from serving.checkpoint import write_checkpoint
from tests.serving_fixtures import SMALL
from tests.test_cli_bench import _pid_of
from tests.waiting import until_sync
from weightcast.cli import main
from workflows.rollout import RolloutWorkflow


@pytest.fixture
def dev_stack(tmp_path):
    d = tmp_path / "dev"
    assert main(["dev", "up", "--dir", str(d), "--hosts", "2", "--temporal-port", "0", "--ui-port", "0"]) == 0
    state = json.loads((d / "state.json").read_text())
    yield d, state
    if (d / "state.json").exists():
        main(["dev", "down", "--dir", str(d)])


async def abort_record(temporal: str, wid: str) -> tuple[str, str]:
    from temporalio.client import Client
    hist = await (await Client.connect(temporal)).get_workflow_handle(wid).fetch_history()
    [acc] = [e.workflow_execution_update_accepted_event_attributes for e in hist.events
             if e.HasField("workflow_execution_update_accepted_event_attributes")]
    return acc.accepted_request.meta.identity, acc.accepted_request.input.args.payloads[0].data.decode()


async def phase_reached(temporal: str, wid: str, phase: str) -> None:
    from temporalio.client import Client
    from temporalio.service import RPCError
    client = await Client.connect(temporal)
    for _ in range(600):
        try:
            if (await client.get_workflow_handle(wid).query(RolloutWorkflow.status)).phase == phase:
                return
        except RPCError:
            pass                                  # not started yet
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{wid} never reached {phase}")


async def abort_when_back(temporal: str, wid: str, reason: str) -> None:
    """Abort once the server answers again (the dev stack's supervisor restarts it)."""
    from temporalio.client import Client
    for _ in range(300):
        try:
            client = await Client.connect(temporal)
            await client.get_workflow_handle(wid).execute_update(RolloutWorkflow.abort, reason)
            return
        except RuntimeError:                      # connect: not listening yet
            pass
        except Exception as e:                    # the server is up but not serving yet
            if "abort" in str(e).lower():
                raise
        await asyncio.sleep(0.2)
    raise TimeoutError("the Temporal server did not come back")


def run(capsys, *argv) -> tuple[int, dict | None, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return rc, json.loads(lines[-1]) if lines else None, err


def forked_by_the_stacks_zygote(log: Path) -> list[str]:
    """The command lines of the processes forked by the zygote that logs to ``log``."""
    def read(pid: str, what: str) -> str:
        try:
            return (os.readlink if what.startswith("fd/") else lambda p: Path(p).read_text())(f"/proc/{pid}/{what}")
        except OSError:
            return ""
    pids = [p for p in os.listdir("/proc") if p.isdigit()]
    [zygote] = [p for p in pids if "training.zygote" in read(p, "cmdline") and read(p, "fd/2") == str(log)]
    return [read(p, "cmdline").strip("\0 ") for p in pids if read(p, "stat").rsplit(")", 1)[-1].split()[1:2] == [zygote]]


def test_dev_up_publish_status_down(tmp_path, capsys, dev_stack):
    d, state = dev_stack
    capsys.readouterr()
    # the hosts' rank fork servers (started with each host worker) were forked by the stack's one zygote
    until_sync(lambda: [c.split(" -m ")[-1] for c in forked_by_the_stacks_zygote(d / "stack" / "rank-zygote.log")]
               == ["training.fork_server"] * 2, 30, "both hosts' fork servers forked by the stack's zygote")
    ckpt = write_checkpoint(tmp_path / "ckpt", SMALL, seed=3, shard_bytes=64 * 1024, version="v1")
    publish = ["publish", str(ckpt), "--model", "tiny", "--version", "v1", "--dev", str(d),
               "--chunk-size", "64KiB"]

    rc, out, err = run(capsys, *publish, "--wait")
    assert rc == 0, err
    assert out["status"] == "COMPLETED" and out["hosts"] == {"ready": 2} and out["traffic"] == {"v1": 100}

    # a retried CI job: nothing uploaded again, the finished rollout is reported, never started twice
    rc, out, err = run(capsys, *publish)
    assert rc == 0, err
    assert out["upload"] == "skipped (already published)" and out["rollout"].startswith("already finished (COMPLETED)")

    # other bytes under a published version name are refused; nothing is overwritten
    other = write_checkpoint(tmp_path / "other", SMALL, seed=4, shard_bytes=64 * 1024, version="v1")
    rc, _, err = run(capsys, "publish", str(other), "--model", "tiny", "--version", "v1", "--dev", str(d),
                     "--chunk-size", "64KiB")
    assert rc == 2 and "already published" in err and "different contents" in err

    rc, st, err = run(capsys, "rollout", "status", "rollout-tiny-v1", "--temporal", state["temporal"])
    assert rc == 0 and st["phase"] == "done" and st["counts"] == {"ready": 2} and st["version_id"]

    rc, _, err = run(capsys, "rollout", "set-concurrency", "rollout-tiny-v1", "0", "--temporal", state["temporal"])
    assert rc == 2 and "already completed" in err
    rc, _, err = run(capsys, "rollout", "status", "rollout-nope-v9", "--temporal", state["temporal"])
    assert rc == 2 and "rollout 'rollout-nope-v9'" in err and "not found" in err

    # bad input is refused before anything is uploaded
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"id": "bad id!", "model_server": "http://127.0.0.1:9"}]))
    rc, _, err = run(capsys, *publish[:-2], "--version", "v2", "--hosts", str(hosts), "--router", "")
    assert rc == 2 and "nothing published" in err and "bad host ids" in err

    # the checkpoint's own label must match; an untrusted key is refused before any upload, and the
    # version name is not burned by it
    rc, _, err = run(capsys, *publish[:-2], "--version", "wrongname")
    assert rc == 2 and "is version 'v1'" in err and "nothing published" in err
    assert main(["keys", "generate", "--out", str(tmp_path / "stranger")]) == 0
    ckpt3 = write_checkpoint(tmp_path / "ckpt3", SMALL, seed=6, shard_bytes=64 * 1024, version="v3")
    v3 = ["publish", str(ckpt3), "--model", "tiny", "--version", "v3", "--dev", str(d), "--chunk-size", "64KiB"]
    rc, _, err = run(capsys, *v3, "--key", str(tmp_path / "stranger" / "manifest-signing.pem"))
    assert rc == 2 and "does not trust the signing key" in err and "refused before uploading" in err
    rc, out, err = run(capsys, *v3, "--wait")
    assert rc == 0 and out["status"] == "COMPLETED", err

    # a rollout past its failure budget pauses: --wait says why and exits 4; the operator aborts it;
    # publishing it again is refused (exit 3)
    ckpt2 = write_checkpoint(tmp_path / "ckpt2", SMALL, seed=7, shard_bytes=64 * 1024, version="v2")
    hosts.write_text(json.dumps(state["hosts"] + [{"id": "ghost", "model_server": "http://127.0.0.1:9"}]))
    v2 = ["publish", str(ckpt2), "--model", "tiny", "--version", "v2", "--dev", str(d), "--chunk-size", "64KiB",
          "--hosts", str(hosts), "--failure-budget", "0", "--unreachable-after", "2"]
    rc, out, err = run(capsys, *v2, "--wait")
    assert rc == 4 and out["status"] == "PAUSED", err
    assert "paused: PAUSED: 1 hosts failed, over the 0% budget" in err and "rollout resume rollout-tiny-v2" in err
    rc, st, _ = run(capsys, "rollout", "status", "rollout-tiny-v2", "--temporal", state["temporal"])
    assert st["paused"] and st["hosts"]["ghost"] == "unreachable"
    rc, _, err = run(capsys, "rollout", "abort", "rollout-tiny-v2", "--reason", "ghost is gone",
                     "--temporal", state["temporal"])
    assert rc == 0, err
    who, why = asyncio.run(abort_record(state["temporal"], "rollout-tiny-v2"))   # the history says who and why
    assert "weightcast cli" in who and "@" in who and "ghost is gone" in why
    for _ in range(100):
        _, st, _ = run(capsys, "rollout", "status", "rollout-tiny-v2", "--temporal", state["temporal"])
        if st["phase"] == "failed":
            break
        time.sleep(0.1)
    rc, out, err = run(capsys, *v2)
    assert rc == 3 and out["previous_outcome"] == "FAILED" and "publish a new version" in err

    # `publish --wait` rides out the Temporal server killed under it (the dev stack restarts it) and
    # exits 1 when the rollout fails (here an operator aborts it while the ghost holds up distribution)
    ckpt4 = write_checkpoint(tmp_path / "ckpt4", SMALL, seed=8, shard_bytes=64 * 1024, version="v4")
    v4 = ["publish", str(ckpt4), "--model", "tiny", "--version", "v4", "--dev", str(d), "--chunk-size", "64KiB",
          "--hosts", str(hosts), "--unreachable-after", "60", "--wait"]
    waited = {}
    waiter = threading.Thread(target=lambda: waited.update(rc=main(v4)))
    waiter.start()
    asyncio.run(phase_reached(state["temporal"], "rollout-tiny-v4", "distribute"))
    temporal = _pid_of(f"start-dev --ip 127.0.0.1 --port {state['temporal'].rsplit(':', 1)[1]}")
    assert temporal, "the dev stack's Temporal server"
    os.kill(temporal, signal.SIGKILL)
    asyncio.run(abort_when_back(state["temporal"], "rollout-tiny-v4", "on-call: drill"))
    waiter.join(180)
    assert not waiter.is_alive() and waited["rc"] == 1
    restarted = _pid_of(f"start-dev --ip 127.0.0.1 --port {state['temporal'].rsplit(':', 1)[1]}")
    assert restarted and restarted != temporal                        # it watched across the restart
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["status"] == "FAILED" and "on-call: drill" in err

    pid = state["pid"]
    rc, out, _ = run(capsys, "dev", "down", "--dir", str(d))
    assert rc == 0 and out["stopped"] == pid and not (d / "state.json").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_rollout_start_refuses_bad_input_files(tmp_path, capsys):
    f = tmp_path / "rollout.json"
    f.write_text("{not json")
    rc, _, err = run(capsys, "rollout", "start", str(f), "--temporal", "127.0.0.1:9")
    assert rc == 2 and "not a RolloutInput" in err
    f.write_text(json.dumps({"model": "m", "version": "v1", "signed_manifest": "{}", "origin": {"endpoint": "e"},
                             "hosts": [], "max_concurrent_loads": 0, "failure_budget": "high"}))
    rc, _, err = run(capsys, "rollout", "start", str(f), "--temporal", "127.0.0.1:9")
    assert rc == 2 and "hosts is empty" in err and "origin lacks bucket" in err and "max_concurrent_loads" in err
    assert "failure_budget is a fraction in [0, 1], got 'high'" in err


def test_unreachable_services_give_clear_errors(tmp_path, capsys):
    rc, _, err = run(capsys, "rollout", "status", "rollout-x-v1", "--temporal", "127.0.0.1:9")
    assert rc == 2 and "cannot reach Temporal at 127.0.0.1:9" in err
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"x" * 1000)
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"id": "h0"}]))
    rc, _, err = run(capsys, "publish", str(ckpt), "--model", "m", "--version", "v1", "--key",
                     str(tmp_path / "manifest-signing.pem"), "--endpoint", "http://127.0.0.1:9", "--bucket", "b",
                     "--hosts", str(hosts), "--temporal", "127.0.0.1:9")
    assert rc == 2 and "cannot reach Temporal" in err         # checked before anything is uploaded


def test_unreachable_object_storage_is_a_clear_publish_error(tmp_path):
    import asyncio

    from peerd.origin import OriginSpec
    from weightcast.publish import PublishError, PublishRequest, upload
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "w.bin").write_bytes(b"x" * 1000)
    assert main(["keys", "generate", "--out", str(tmp_path)]) == 0
    req = PublishRequest(ckpt, "m", "v1", tmp_path / "manifest-signing.pem",
                         OriginSpec("http://127.0.0.1:9", "b", "m/v1"), access_key="k", secret_key="s")
    with pytest.raises(PublishError, match=r"object storage at http://127.0.0.1:9 \(s3://b/m/v1\).*check --endpoint"):
        asyncio.run(upload(req))
