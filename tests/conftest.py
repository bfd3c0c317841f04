from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from lib.atomic import write_atomic
from lib.ports import ENV as PORTS_ENV, port_range, free_ports
from peerd import manifest as mf
from peerd.signing import generate_keypair, load_private_key, load_public_key
from weightcast.checkpoint_random import write_random_checkpoint
from weightcast.stack.seaweed import SeaweedS3
from weightcast.stack.temporal import TemporalDevServer


@pytest.fixture(scope="session")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("keys")
    generate_keypair(d / "k.pem", d / "k.pub")
    return {"private": load_private_key(d / "k.pem"), "public": load_public_key(d / "k.pub"),
            "pub_path": d / "k.pub", "priv_path": d / "k.pem"}


@pytest.fixture
def checkpoint(tmp_path):
    return write_random_checkpoint(tmp_path / "ckpt", 3 * 1024 * 1024 + 12345, files=3, seed=7)


@pytest.fixture
def signed(checkpoint, keys):
    m = mf.build_from_directory(checkpoint, "tiny", "v1", chunk_size=256 * 1024)
    return m, mf.sign_manifest(m, keys["private"])


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    s3 = SeaweedS3(tmp_path_factory.mktemp("s3")).start()
    yield s3
    s3.stop()


@pytest.fixture(scope="session")
def temporal_server(tmp_path_factory):
    """One Temporal dev server for the whole run (starting and stopping one takes ~1.6 s), in memory:
    it never restarts (a test that stops Temporal starts its own), and without its SQLite file it
    spends about a quarter less CPU."""
    d = tmp_path_factory.mktemp("temporal")
    server = TemporalDevServer(free_ports(1)[0], None, d / "temporal.log").launch()
    asyncio.run(server.wait_ready())
    yield server
    server.stop()


@dataclass(frozen=True)
class SharedTemporal:
    server: TemporalDevServer
    namespace: str

    def stack_args(self) -> dict:
        """EmbeddedStack's arguments that put a stack in this namespace of the shared server."""
        return {"temporal_server": self.server, "namespace": self.namespace}

    async def client(self):
        return await self.server.namespace_client(self.namespace)


@pytest.fixture
def temporal(temporal_server):
    """The run's Temporal server with a namespace of this test's own (created on first use): no workflow
    id, task queue or list of another test is seen. A test that stops Temporal starts its own instead."""
    return SharedTemporal(temporal_server, f"test-{uuid.uuid4().hex[:12]}")


@pytest.fixture(scope="session", autouse=True)
def hf_build_cache(tmp_path_factory):
    """Small Hugging Face checkpoints built once per run (serving/hf_build.py's cache, shared by the
    workers): the fixtures, the benchmarks and the demo build the same trained Llama."""
    from serving.hf_build import CACHE_ENV
    os.environ[CACHE_ENV] = str(_run_tmp(tmp_path_factory) / "hf-build-cache")


def _run_tmp(tmp_path_factory) -> Path:
    """The run's temporary directory, shared by its pytest-xdist workers (each one's is beneath it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """One small trained Hugging Face checkpoint per architecture (bf16, sharded) with its golden prompts:
    {arch: (directory, golden record)}. Built once per run (~20 CPU-seconds): the first pytest-xdist
    worker to need them builds them under the run's shared temporary directory, the others wait on its
    lock and read them. Tests only read them."""
    from serving import golden, hf_build
    root = _run_tmp(tmp_path_factory) / "hf-checkpoints"
    root.mkdir(exist_ok=True)
    records = root / "golden.json"
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not records.exists():
            goldens = {}
            for i, arch in enumerate(hf_build.ARCHITECTURES):
                goldens[arch] = golden.record(hf_build.build(arch, root / arch, seed=i))
            write_atomic(records, json.dumps(goldens))
    goldens = json.loads(records.read_text())
    return {arch: (root / arch, goldens[arch]) for arch in hf_build.ARCHITECTURES}


# the zygote of a pytest-xdist run, started by its controller for all of its workers
_RUN_ZYGOTE = "WEIGHTCAST_TEST_RANK_ZYGOTE"
_zygote_key = pytest.StashKey()


@pytest.fixture(scope="session")
def rank_zygote_socket(tmp_path_factory):
    """The run's rank zygote (training/zygote.py): torch and the training code imported once, not once
    per host worker's fork server (about 4.5 CPU-seconds each). Under pytest-xdist, the controller's
    (started with the run, shared by the workers); in one process, started on first use."""
    if os.environ.get(_RUN_ZYGOTE):
        from tests.waiting import until_sync
        until_sync(lambda: os.path.exists(os.environ[_RUN_ZYGOTE]), 120, "the run's rank zygote listening")
        yield os.environ[_RUN_ZYGOTE]
        return
    from training.zygote import Zygote
    zygote = Zygote(tmp_path_factory.mktemp("zygote") / "zygote.log").start()
    yield zygote.path
    zygote.stop()


@pytest.fixture
def rank_zygote(rank_zygote_socket, monkeypatch):
    """Host workers this test starts fork their rank fork servers from the run's zygote."""
    from training.zygote import ENV
    monkeypatch.setenv(ENV, rank_zygote_socket)
    return rank_zygote_socket


# What makes a test an integration test: it starts real processes (servers, daemons, ranks, engines)
# or network namespaces. `make test-fast` runs the rest; `make test` runs everything.
_REAL = ("EmbeddedStack", "Stack()", "Fleet(", "subprocess", "Topology(", "launch(", "weightcast.cli import main",
         "TemporalDevServer", "SeaweedS3", "mp.start_processes", "serve_app(", "ModuleProc", "Daemon(PeerdConfig")
_REAL_FIXTURES = {"seaweed", "hf_checkpoints", "temporal"}
_sources: dict[str, str] = {}


# `make test` runs pytest-xdist workers, a file at a time each (--dist loadfile), the longest files
# first (by their wall time in a two-worker run), so that no worker is left with one at the end
_LONGEST = ["test_training_workflow.py", "test_vllm_engine.py", "test_cli_bench.py", "test_rollout_network.py",
            "test_rollout_controls.py", "test_rollout_shape.py", "test_publish_dev.py", "test_training.py",
            "test_full_size_rollout.py", "test_training_llama.py", "test_rollout_faults.py", "test_sim.py",
            "test_training_swarm.py", "test_peerd_swarm.py", "test_netns.py", "test_rollout_analysis.py",
            "test_train_to_rollout.py"]


def pytest_configure(config):
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker and getattr(config.option, "numprocesses", None) and not config.option.collectonly:
        # the controller: one rank zygote for every worker, importing while the workers start
        from training.zygote import Zygote
        config.stash[_zygote_key] = Zygote().start(wait=False)
        os.environ[_RUN_ZYGOTE] = config.stash[_zygote_key].path
    if worker and workers and PORTS_ENV not in os.environ:
        # each worker's stacks pick their ports from a range of their own (lib/ports.py)
        ports, i, n = port_range(), int(worker.removeprefix("gw")), int(workers)
        share = len(ports) // n
        os.environ[PORTS_ENV] = f"{ports.start + i * share}-{ports.start + (i + 1) * share - 1}"
    if worker and workers and "OMP_NUM_THREADS" not in os.environ:
        # each worker's torch (in process, and in the servers and engines it starts) gets its share of the
        # cores: workers with a full-width OpenMP pool each oversubscribe them, and the pools' spinning
        # cost about 12 % of the suite's CPU-seconds. Training ranks set their own count (training/rank.py).
        threads = max(1, (os.cpu_count() or 1) // int(workers))
        os.environ["OMP_NUM_THREADS"] = str(threads)
        if "torch" in sys.modules:
            sys.modules["torch"].set_num_threads(threads)
    if worker and "OMP_WAIT_POLICY" not in os.environ:
        # OpenMP threads that wait for work sleep instead of spinning: with the workers' processes beside
        # one another, spinning threads (numba's parallel loops above all) burnt up to twice the CPU-seconds
        # of the work itself (tests/test_sim_kernels.py: 33 CPU-s against 15 beside two busy loops)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def pytest_unconfigure(config):
    zygote = config.stash.get(_zygote_key, None)
    if zygote is not None:
        zygote.stop()


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if path not in _sources:
            with open(path) as f:
                _sources[path] = f.read()
        if set(item.fixturenames) & _REAL_FIXTURES or any(w in _sources[path] for w in _REAL):
            item.add_marker(pytest.mark.integration)
    rank = {name: i for i, name in enumerate(_LONGEST)}
    items.sort(key=lambda item: rank.get(Path(str(item.fspath)).name, len(rank)))     # stable: file order kept
