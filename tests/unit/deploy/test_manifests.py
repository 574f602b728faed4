"""The Kubernetes manifests under deploy/: they render, match the Kubernetes 1.32 schemas, and run real verbs.

Every kustomization is rendered with ``kubectl kustomize`` (the tests skip when kubectl is absent), every
rendered document is validated strictly with kubernetes-validate, and every container that runs
``leafe <verb>`` must use a verb of ``services.cli.VERBS`` with flags that the real ``leafe <verb> --help``
lists; torchrun's own parser checks the learner's launch; every $(VAR) in a command is defined; NATS
credentials come from the Secret. test_manifest_invariants.py pins the rest of the deployment's design.
Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import argparse
import copy
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from services.cli import VERBS
from tests.support.manifests import (
    K8S_VERSION,
    KUSTOMIZATIONS,
    NATS_VERBS,
    OVERLAYS,
    VerbHelp,
    container_named,
    containers,
    env_names,
    env_value,
    expand_shell,
    find,
    flags_of,
    leafe_invocation,
    parse_help,
    verb_help,
    workload_names,
)

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def help_by_verb(rendered: dict[str, Docs]) -> dict[str, VerbHelp]:
    """The real `leafe <verb> --help` of every verb the manifests run (all failures reported at once)."""
    verbs = {
        inv[0] for docs in rendered.values() for c in containers(docs) if (inv := leafe_invocation(c.argv))
    }
    unknown = verbs - set(VERBS)
    assert not unknown, f"manifests run unknown leafe verbs {sorted(unknown)}; known: {sorted(VERBS)}"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_help_or_error, sorted(verbs)))
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, "\n\n".join(failures)
    return {r.verb: r for r in results if isinstance(r, VerbHelp)}


def _help_or_error(verb: str) -> VerbHelp | str:
    try:
        return verb_help(verb)
    except AssertionError as e:
        return str(e)


def test_every_kustomization_renders_the_expected_workloads(rendered: dict[str, Docs]) -> None:
    """dev runs the CPU inference server, gpu SGLang behind the router; both run NATS and the services."""
    common = {
        "nats": "StatefulSet",
        "actor": "Deployment",
        "replayer": "Deployment",
        "learner": "StatefulSet",
    }
    assert workload_names(rendered["dev"]) == common | {"inference": "Deployment"}
    assert workload_names(rendered["gpu"]) == common | {
        "sglang": "Deployment",
        "sglang-router": "Deployment",
    }
    assert workload_names(rendered["replay-job"]) == {"leafe-replay": "Job"}
    for docs in rendered.values():
        for doc in docs:
            assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "leafe", doc["metadata"]["name"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_rendered_document_matches_the_kubernetes_schema(rendered: dict[str, Docs], name: str) -> None:
    """Each rendered document validates strictly (no unknown fields) against the Kubernetes 1.32 schema."""
    errors = []
    for doc in rendered[name]:
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}")
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(e.message)
    assert not errors, "\n".join(errors)


def test_schema_validation_rejects_broken_manifests(rendered: dict[str, Docs]) -> None:
    """A wrong type (replicas as a string) and a misspelt field (strict mode) are both rejected."""
    actor = find(rendered["dev"], "Deployment", "actor")
    kubernetes_validate.validate(actor, K8S_VERSION, strict=True)
    wrong_type = copy.deepcopy(actor)
    wrong_type["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError, match="two"):
        kubernetes_validate.validate(wrong_type, K8S_VERSION, strict=True)
    misspelt = copy.deepcopy(actor)
    container = misspelt["spec"]["template"]["spec"]["containers"][0]
    container["comand"] = container.pop("command")
    with pytest.raises(kubernetes_validate.ValidationError, match="comand"):
        kubernetes_validate.validate(misspelt, K8S_VERSION, strict=True)


def test_kubernetes_validate_cli_fails_on_a_broken_file(rendered: dict[str, Docs], tmp_path: Path) -> None:
    """`kubernetes-validate -k 1.32 --strict FILE` exits 0 on a rendered file and 1 on a broken one."""
    cli = Path(sys.executable).parent / "kubernetes-validate"
    if not cli.exists():
        pytest.skip(f"kubernetes-validate CLI not found next to {sys.executable}")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump_all(rendered["replay-job"]), encoding="utf-8")
    broken = copy.deepcopy(rendered["replay-job"])
    job = next(d for d in broken if d["kind"] == "Job")
    job["spec"]["backoffLimit"] = "twice"
    bad.write_text(yaml.safe_dump_all(broken), encoding="utf-8")
    run = [str(cli), "-k", K8S_VERSION, "--strict", "--quiet"]
    assert subprocess.run([*run, str(good)], capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([*run, str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout


def test_help_parsing_finds_options_required_flags_and_exclusive_groups() -> None:
    """The --help reader sees every long option, the required ones, and a required either/or group."""
    parser = argparse.ArgumentParser(prog="leafe replay")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--from", dest="source_file", metavar="FILE")
    source.add_argument("--nats", metavar="URL")
    parser.add_argument("--run", required=True)
    parser.add_argument("--materializer", choices=["leafe", "grpo", "rft"], default="leafe")
    parser.add_argument("--engine", metavar="URL[,URL...]")
    for i in range(8):  # long enough for argparse to wrap the usage line
        parser.add_argument(f"--option-number-{i}", type=int, default=i)
    info = parse_help("replay", parser.format_help())
    assert {"--from", "--nats", "--run", "--materializer", "--engine", "--option-number-7"} <= info.options
    assert info.required == {"--run"}
    assert info.one_of == (frozenset({"--from", "--nats"}),)


def test_leafe_commands_use_existing_verbs_and_flags(
    rendered: dict[str, Docs], help_by_verb: dict[str, VerbHelp]
) -> None:
    """Each `leafe <verb>` uses a real verb, only flags its --help lists, and every flag it requires."""
    problems, used = [], set()
    for docs in rendered.values():
        for c in containers(docs):
            invocation = leafe_invocation(c.argv)
            if invocation is None:
                continue
            verb, args = invocation
            used.add(verb)
            info, flags = help_by_verb[verb], flags_of(args)
            if unknown := flags - info.options:
                problems.append(f"{c.where}: `leafe {verb}` has no option(s) {sorted(unknown)}")
            if missing := info.required - flags:
                problems.append(f"{c.where}: `leafe {verb}` is missing required {sorted(missing)}")
            for group in info.one_of:
                if not group & flags:
                    problems.append(f"{c.where}: `leafe {verb}` needs one of {sorted(group)}")
    assert not problems, "\n".join(problems)
    assert used == {"actor", "replayer", "learner", "weight-sync", "inference", "replay"}


def test_learner_runs_under_a_valid_torchrun_launch(rendered: dict[str, Docs]) -> None:
    """torchrun's own parser accepts the learner launch: c10d rendezvous on pod 0, then `leafe learner`."""
    from torch.distributed.run import get_args_parser

    for overlay in OVERLAYS:
        docs = rendered[overlay]
        learner = container_named(docs, "learner", "learner")
        assert learner.raw_argv[0] == "torchrun"
        args = get_args_parser().parse_args(learner.raw_argv[1:])
        program = [args.training_script, *args.training_script_args]
        # torchrun consumed none of the program's own arguments.
        assert args.no_python and program == learner.raw_argv[-len(program) :]
        assert leafe_invocation(expand_shell(program)[0]) == leafe_invocation(learner.argv)
        assert leafe_invocation(learner.argv)[0] == "learner"  # type: ignore[index]
        sts = find(docs, "StatefulSet", "learner")
        host, port = args.rdzv_endpoint.rsplit(":", 1)
        assert args.rdzv_backend == "c10d" and host == f"learner-0.{sts['spec']['serviceName']}"
        service = find(docs, "Service", sts["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
        assert args.nnodes == "$(LEARNER_NNODES)" and args.nproc_per_node == "$(LEARNER_NPROC_PER_NODE)"
        assert int(env_value(learner, "LEARNER_NNODES")) == sts["spec"]["replicas"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_nats_credentials_come_from_the_secret(rendered: dict[str, Docs], name: str) -> None:
    """NATS-using containers read LEAFE_NATS_URL and optional LEAFE_NATS_CREDS from the leafe-nats Secret."""
    for c in containers(rendered[name]):
        invocation = leafe_invocation(c.argv)
        if invocation is None or invocation[0] not in NATS_VERBS:
            continue
        env = {e["name"]: e for e in c.spec.get("env") or []}
        url = env["LEAFE_NATS_URL"]["valueFrom"]["secretKeyRef"]
        creds = env["LEAFE_NATS_CREDS"]["valueFrom"]["secretKeyRef"]
        assert url["name"] == creds["name"] == "leafe-nats" and creds["optional"] is True, c.where
        assert not any("nats://" in a for a in c.argv), f"{c.where}: a NATS URL is written in the command"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_variable_in_a_command_is_defined(rendered: dict[str, Docs], name: str) -> None:
    """Each $(VAR) in a command is defined for its container (Kubernetes leaves unknown ones verbatim)."""
    docs = rendered[name]
    for c in containers(docs):
        used = set(re.findall(r"\$\(([A-Za-z_]\w*)\)", " ".join(c.raw_argv)))
        for script in expand_shell(c.raw_argv)[1]:
            used |= set(re.findall(r"\$\{?([A-Za-z_]\w*)", script))
        assert used <= env_names(c, docs), f"{c.where}: undefined {sorted(used - env_names(c, docs))}"
