"""The deployment files under infra/ against the code they run: every command line parses with the real
argument parser, every metric an alert or dashboard panel uses exists, every file is valid YAML/JSON."""
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

import peerd.__main__ as peerd_main
from peerd.metrics import PeerdMetrics
from serving import router, server
from training.config import TrainConfig
from weightcast import cli
from weightcast.publish import hosts_from_file
from workers import control_worker, host_worker, publish_worker

REPO = Path(__file__).parent.parent
INFRA = REPO / "infra"
PARSERS = {"peerd": peerd_main.build_parser, "workers.host_worker": host_worker.build_parser,
           "workers.control_worker": control_worker.build_parser, "serving.server": server.build_parser,
           "serving.router": router.build_parser, "workers.publish_worker": publish_worker.build_parser}


def yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def k8s_manifests() -> list[Path]:
    return sorted(p for p in (INFRA / "k8s").glob("*.yaml") if p.name != "kustomization.yaml")


def k8s_containers():
    for f in k8s_manifests():
        for doc in yaml_docs(f):
            spec = doc.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []):
                yield f"{f.name}:{c['name']}", c


def placeholders(args: list[str]) -> list[str]:
    """$(NODE_NAME), ${HOST_ID}, ${{ inputs.version }} → a plain value, as the runtime would expand them."""
    return [re.sub(r"\$\{\{[^}]*\}\}|\$\([A-Z_]+\)|\$\{[A-Z_]+\}", "x", a) for a in args]


def test_every_infra_file_parses():
    files = [p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml", ".json")]
    assert len(files) >= 8
    for p in files:
        assert (json.loads(p.read_text()) if p.suffix == ".json" else yaml_docs(p)), p


@pytest.mark.parametrize("name,container", list(k8s_containers()), ids=lambda v: v if isinstance(v, str) else "")
def test_k8s_commands_parse_with_the_real_flags(name, container):
    cmd = container["command"]
    assert cmd[:2] == ["python", "-m"] and cmd[2] in PARSERS, f"{name}: unknown program {cmd}"
    PARSERS[cmd[2]]().parse_args(placeholders(container.get("args", [])))   # SystemExit on a bad flag


def test_systemd_units_parse_with_the_real_flags():
    units = sorted((INFRA / "systemd").glob("*.service"))
    assert len(units) == 3
    for u in units:
        line = next(ln for ln in u.read_text().splitlines() if ln.startswith("ExecStart="))
        argv = shlex.split(line.removeprefix("ExecStart="))
        assert argv[1] == "-m" and argv[2] in PARSERS, u.name
        PARSERS[argv[2]]().parse_args(placeholders(argv[3:]))


def test_ci_example_publish_command_parses():
    wf = yaml.safe_load((INFRA / "ci" / "publish-after-training.yml").read_text())
    runs = [s["run"] for job in wf["jobs"].values() for s in job["steps"] if "weightcast publish" in s.get("run", "")]
    assert len(runs) == 1
    argv = shlex.split(placeholders([runs[0]])[0])
    a = cli.build_parser().parse_args(argv[1:])
    assert a.fn is cli.rollout.cmd_publish and a.wait and a.hosts == Path("infra/fleet/hosts.json")
    assert len(hosts_from_file(INFRA / "fleet" / "hosts.json")) == 3


def test_ci_example_trains_with_a_config_and_command_that_parse():
    wf = yaml.safe_load((INFRA / "ci" / "publish-after-training.yml").read_text())
    runs = [s["run"] for job in wf["jobs"].values() for s in job["steps"] if "weightcast train start" in s.get("run", "")]
    assert len(runs) == 1
    argv = shlex.split(placeholders([runs[0]])[0])
    a = cli.build_parser().parse_args(argv[1:])
    assert a.fn is cli.train.cmd_train and a.sub == "start" and a.wait and a.export
    cfg = TrainConfig.load(REPO / a.config, a.set)        # the config file is real and valid
    assert cfg.world_size < len(a.hosts.split(","))       # a spare to migrate to


def test_ci_example_chain_parses_and_checks_its_rollout():
    """The one-job chain: a publish worker and `train start --roll-out`, both through the real parsers,
    and the rollout it would start passes the same checks `train start` makes before connecting."""
    from weightcast.training_runs import check_training
    from workflows.training_types import TrainingInput
    wf = yaml.safe_load((INFRA / "ci" / "train-and-roll-out.yml").read_text())
    runs = [shlex.split(placeholders([s["run"]])[0]) for job in wf["jobs"].values() for s in job["steps"]
            if "run" in s]
    worker = next(r for r in runs if "workers.publish_worker" in r)
    i = worker.index("workers.publish_worker")
    assert publish_worker.build_parser().parse_args([a for a in worker[i + 1:] if a not in (">", "2>&1", "&")
                                                     and not a.endswith(".log")]).key == Path("signing.pem")
    train = next(r for r in runs if "train" in r and "start" in r)
    a = cli.build_parser().parse_args(train[1:])
    assert a.fn is cli.train.cmd_train and a.wait and a.roll_out == Path("infra/fleet/hosts.json")
    cfg = TrainConfig.load(REPO / a.config, a.set)
    a.endpoint = "https://s3.example.internal"                  # $AWS_ENDPOINT_URL in the job
    inp = TrainingInput(run=a.run, config=cfg.to_dict(), hosts=a.hosts.split(","), checkpoint_dir=str(a.checkpoint_dir),
                        export_dir=str(a.export), rollout=cli.train.training_rollout(a), min_world_size=a.min_world_size,
                        checkpoint_archive=cli.train.archive_spec(a))
    check_training(inp)                                         # raises on anything it would refuse
    assert inp.rollout.model == "llm" and inp.checkpoint_archive["bucket"] == "weights"


def exported_metric_names() -> set[str]:
    regs: list[CollectorRegistry] = [PeerdMetrics().registry, router.Router().registry, server.ModelServer("x").registry]
    names = set()
    for r in regs:
        for fam in r.collect():
            names.add(fam.name)
            names.update(s.name for s in fam.samples)
            names.add(fam.name + "_total")
    return names


def test_alerts_and_dashboard_use_metrics_that_exist():
    exprs = [r["expr"] for g in yaml.safe_load((INFRA / "prometheus" / "alerts.yaml").read_text())["groups"]
             for r in g["rules"]]
    dash = json.loads((INFRA / "grafana" / "weightcast-dashboard.json").read_text())
    exprs += [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b(?:peerd|model_server|router)_[a-z_]+", e)}
    assert len(used) >= 8
    assert used <= exported_metric_names(), f"unknown metrics: {sorted(used - exported_metric_names())}"


def test_state_changing_apis_get_their_tokens_from_secrets():
    """The model server, router and both workers read the admin token from a Secret, never a literal."""
    needs_admin = {"serving.server", "serving.router", "workers.host_worker", "workers.control_worker"}
    seen = set()
    for name, c in k8s_containers():
        if c["command"][2] not in needs_admin:
            continue
        env = {e["name"]: e for e in c.get("env", [])}
        ref = env.get("WEIGHTCAST_ADMIN_TOKEN", {}).get("valueFrom", {}).get("secretKeyRef")
        assert ref and ref["key"] == "admin-token", f"{name}: WEIGHTCAST_ADMIN_TOKEN must come from a secret"
        seen.add(c["command"][2])
    assert seen == needs_admin


@pytest.mark.parametrize("path", k8s_manifests(), ids=lambda p: p.name)
def test_kubernetes_manifests_validate_against_the_kubernetes_schemas(path):
    """Strict: a misspelled or misplaced field is an error, as `kubectl apply --validate=strict` has it."""
    import kubernetes_validate
    docs = yaml_docs(path)
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_schema_check_catches_a_misplaced_field():
    import kubernetes_validate
    doc = yaml_docs(INFRA / "k8s" / "host-daemonset.yaml")[0]
    doc["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"      # a typo kubectl would drop
    with pytest.raises(kubernetes_validate.ValidationError, match="imagePullPolcy"):
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_the_image_is_a_parameter_set_in_one_place():
    """Every container names the placeholder `weightcast`; kustomization.yaml maps it to the image a user
    built, and lists every manifest."""
    images = {name: c["image"] for name, c in k8s_containers()}
    assert len(images) >= 5 and set(images.values()) == {"weightcast"}, images
    kust = yaml.safe_load((INFRA / "k8s" / "kustomization.yaml").read_text())
    assert sorted(kust["resources"]) == sorted(p.name for p in k8s_manifests())
    assert [i["name"] for i in kust["images"]] == ["weightcast"] and kust["images"][0]["newName"]
