"""The Kubernetes manifests under deploy/: they render, match the Kubernetes 1.32 schemas, and run
real verbs.

Every kustomization, and every overlay with every combination of optional components stacked on it,
is rendered with ``kubectl kustomize`` (the tests skip when kubectl is absent); every rendered
document is validated strictly with kubernetes-validate, except the CRD kinds it has no schema for
(PodMonitor, ScaledObject: test_components.py checks those). Every container that runs ``leafe
<verb>`` must use a verb of ``leafe.services.cli.VERBS`` with flags that the real ``leafe <verb>
--help`` lists (verbs and flags being added now are listed in ``PENDING_CODE``); torchrun's own
parser checks the learner's launch; every $(VAR) in a command is defined; each NATS client uses its
role's user and a password file. test_manifest_invariants.py, test_network_policies.py,
test_security.py, test_nats_permissions.py and test_components.py pin the rest of the deployment's
design. Run: ``.venv/bin/python -m pytest tests/unit/deploy -q``.
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from leafe.services.cli import VERBS
from tests.support.clihelp import VerbHelp, command_of, parse_help, verb_help
from tests.support.manifests import (
    K8S_VERSION,
    KUSTOMIZATIONS,
    NATS_ROLES,
    NATS_VERBS,
    OVERLAYS,
    PENDING_CODE,
    SCHEMALESS_KINDS,
    Stacks,
    config_map_value,
    container_named,
    containers,
    env_names,
    env_value,
    expand_shell,
    find,
    flags_of,
    leafe_invocation,
    mounted_secret_file,
    workload_names,
)

Docs = list[dict[str, Any]]


@pytest.fixture(scope="module")
def help_by_verb(rendered: dict[str, Docs]) -> dict[str, VerbHelp]:
    """The real `leafe <verb> --help` of every verb the manifests run (all failures reported at
    once)."""
    commands = {
        command_of(*inv)[0]
        for docs in rendered.values()
        for c in containers(docs)
        if (inv := leafe_invocation(c.argv))
    }
    pending = {verb for verb, flags in PENDING_CODE.items() if flags is None and verb not in VERBS}
    commands = {command for command in commands if command.split()[0] not in pending}
    unknown = {command.split()[0] for command in commands} - set(VERBS)
    assert not unknown, (
        f"manifests run unknown leafe verbs {sorted(unknown)}; known: {sorted(VERBS)}"
    )
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(_help_or_error, sorted(commands)))
    failures = [r for r in results if isinstance(r, str)]
    assert not failures, "\n\n".join(failures)
    return {r.verb: r for r in results if isinstance(r, VerbHelp)}


def _help_or_error(verb: str) -> VerbHelp | str:
    try:
        return verb_help(verb)
    except AssertionError as e:
        return str(e)


def test_every_kustomization_renders_the_expected_workloads(
    rendered: dict[str, Docs], stacks: Stacks
) -> None:
    """dev runs the CPU inference server, gpu SGLang behind the router; both run NATS, the services
    and the streams Job; each replay kustomization runs the replay Job alone; components add no
    workload."""
    common = {
        "nats": "StatefulSet",
        "actor": "StatefulSet",  # for its stable pod names: each pod's actor id and NATS user
        "replayer": "Deployment",
        "learner": "StatefulSet",
        "leafe-streams": "Job",
    }
    assert workload_names(rendered["dev"]) == common | {"inference": "Deployment"}
    assert workload_names(rendered["gpu"]) == common | {
        "sglang": "Deployment",
        "sglang-router": "Deployment",
    }
    assert (
        workload_names(rendered["dev-replay"])
        == workload_names(rendered["gpu-replay"])
        == {"leafe-replay": "Job"}
    )
    for (overlay, combo), docs in stacks.items():
        assert workload_names(docs) == workload_names(rendered[overlay]), combo
    for docs in [*rendered.values(), *stacks.values()]:
        for doc in docs:
            assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "leafe", doc[
                "metadata"
            ]["name"]


def _schema_errors(doc: dict[str, Any]) -> list[str]:
    try:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    except kubernetes_validate.ValidationError as e:
        path = ".".join(str(p) for p in e.path)
        return [f"{doc['kind']}/{doc['metadata']['name']}: {path}: {e.message}"]
    except kubernetes_validate.SchemaNotFoundError as e:
        return [e.message]
    return []


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_rendered_document_matches_the_kubernetes_schema(
    rendered: dict[str, Docs], name: str
) -> None:
    """Each rendered document validates strictly (no unknown fields) against the Kubernetes 1.32
    schema."""
    errors = [error for doc in rendered[name] for error in _schema_errors(doc)]
    assert not errors, "\n".join(errors)


def test_every_component_combination_renders_documents_that_match_the_schema(
    stacks: Stacks,
) -> None:
    """Every overlay with every combination of optional components renders; each distinct document
    of all those renders validates strictly, except the CRD kinds without a bundled schema
    (PodMonitor, ScaledObject), which only the combinations with their components contain."""
    seen: dict[str, dict[str, Any]] = {}
    crd_sources: dict[tuple[str, str], set[str]] = {}
    for (_, combo), docs in stacks.items():
        for doc in docs:
            kind = (doc["apiVersion"], doc["kind"])
            if kind in SCHEMALESS_KINDS:
                crd_sources.setdefault(kind, set()).update(combo)
            else:
                seen.setdefault(json.dumps(doc, sort_keys=True), doc)
    errors = [error for doc in seen.values() for error in _schema_errors(doc)]
    assert not errors, "\n".join(errors)
    assert crd_sources == {
        ("monitoring.coreos.com/v1", "PodMonitor"): crd_sources[
            ("monitoring.coreos.com/v1", "PodMonitor")
        ],
        ("keda.sh/v1alpha1", "ScaledObject"): crd_sources[("keda.sh/v1alpha1", "ScaledObject")],
    }
    for (_, combo), docs in stacks.items():
        kinds = {(d["apiVersion"], d["kind"]) for d in docs}
        assert (("monitoring.coreos.com/v1", "PodMonitor") in kinds) == ("monitoring" in combo)
        assert (("keda.sh/v1alpha1", "ScaledObject") in kinds) == ("keda-actors" in combo)


def test_schema_validation_rejects_broken_manifests(rendered: dict[str, Docs]) -> None:
    """A wrong type (replicas as a string) and a misspelt field (strict mode) are both rejected."""
    actor = find(rendered["dev"], "StatefulSet", "actor")
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


def test_kubernetes_validate_cli_fails_on_a_broken_file(
    rendered: dict[str, Docs], tmp_path: Path
) -> None:
    """`kubernetes-validate -k 1.32 --strict FILE` exits 0 on a rendered file and 1 on a broken
    one."""
    cli = Path(sys.executable).parent / "kubernetes-validate"
    if not cli.exists():
        pytest.skip(f"kubernetes-validate CLI not found next to {sys.executable}")
    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump_all(rendered["dev-replay"]), encoding="utf-8")
    broken = copy.deepcopy(rendered["dev-replay"])
    job = next(d for d in broken if d["kind"] == "Job")
    job["spec"]["backoffLimit"] = "twice"
    bad.write_text(yaml.safe_dump_all(broken), encoding="utf-8")
    run = [str(cli), "-k", K8S_VERSION, "--strict", "--quiet"]
    assert subprocess.run([*run, str(good)], capture_output=True, timeout=60).returncode == 0
    result = subprocess.run([*run, str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stdout


def test_help_parsing_finds_options_required_flags_and_exclusive_groups() -> None:
    """The --help reader sees every long option, the required ones, and a required either/or
    group."""
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
    assert {
        "--from",
        "--nats",
        "--run",
        "--materializer",
        "--engine",
        "--option-number-7",
    } <= info.options
    assert info.required == {"--run"}
    assert info.one_of == (frozenset({"--from", "--nats"}),)


def test_leafe_commands_use_existing_verbs_and_flags(
    rendered: dict[str, Docs], help_by_verb: dict[str, VerbHelp]
) -> None:
    """Each `leafe <verb>` uses a real verb, only flags its --help lists, and every flag it requires
    (verbs and flags still in PENDING_CODE are accepted while the services do not have them yet)."""
    problems, used = [], set()
    for docs in rendered.values():
        for c in containers(docs):
            invocation = leafe_invocation(c.argv)
            if invocation is None:
                continue
            verb, args = invocation
            used.add(verb)
            command, args = command_of(verb, args)
            if command not in help_by_verb:  # a pending verb: nothing to check it against yet
                continue
            info, flags = help_by_verb[command], flags_of(args)
            flags -= PENDING_CODE.get(verb) or frozenset()
            if unknown := flags - info.options:
                problems.append(f"{c.where}: `leafe {verb}` has no option(s) {sorted(unknown)}")
            if missing := info.required - flags:
                problems.append(f"{c.where}: `leafe {verb}` is missing required {sorted(missing)}")
            for group in info.one_of:
                if not group & flags:
                    problems.append(f"{c.where}: `leafe {verb}` needs one of {sorted(group)}")
    assert not problems, "\n".join(problems)
    assert used == {
        "actor",
        "replayer",
        "learner",
        "weight-sync",
        "inference",
        "replay",
        "streams",
        "tasks",
    }


def test_pending_code_is_still_pending(help_by_verb: dict[str, VerbHelp]) -> None:
    """Every PENDING_CODE entry names a verb or flag the services do not have yet; once one lands,
    this fails so the entry is removed from tests/support/manifests.py and the --help check covers
    it again."""
    landed = []
    for verb, flags in PENDING_CODE.items():
        if flags is None:
            if verb in VERBS:
                landed.append(f"verb {verb!r}")
        elif verb in help_by_verb and (done := flags & help_by_verb[verb].options):
            landed.append(f"`leafe {verb}` {sorted(done)}")
    assert not landed, f"implemented now, remove from PENDING_CODE: {', '.join(landed)}"


def test_learner_runs_under_a_valid_torchrun_launch(rendered: dict[str, Docs]) -> None:
    """torchrun's own parser accepts the learner launch: c10d rendezvous on pod 0, then `leafe
    learner`."""
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
        assert (
            service["spec"]["clusterIP"] == "None"
            and service["spec"]["publishNotReadyAddresses"] is True
        )
        assert int(port) in {p["port"] for p in service["spec"]["ports"]}
        assert (
            args.nnodes == "$(LEARNER_NNODES)"
            and args.nproc_per_node == "$(LEARNER_NPROC_PER_NODE)"
        )
        assert int(env_value(learner, "LEARNER_NNODES")) == sts["spec"]["replicas"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_nats_clients_use_their_role_nkey_seed_from_a_mounted_file(
    rendered: dict[str, Docs], name: str
) -> None:
    """Each NATS-using container gets LEAFE_NATS_URL (no credentials) from ConfigMap leafe-nats and
    LEAFE_NATS_NKEY naming its role's seed file ``<role>.nk`` (the name gives the role's inbox
    prefix), mounted from Secret leafe-nats-<role>, key seed; no user name or password. An actor
    pod's seed is its own (``actor.$(POD_NAME).nk``, the pod name its actor id): see the next
    test."""
    docs, checked = rendered[name], 0
    for c in containers(docs):
        invocation = leafe_invocation(c.argv)
        if invocation is None or invocation[0] not in NATS_VERBS:
            continue
        role = NATS_ROLES[invocation[0]]
        url = config_map_value(docs, "leafe-nats", "LEAFE_NATS_URL")
        assert re.fullmatch(r"(nats|tls)://nats:4222", url), url
        assert {
            "configMapRef": {"name": find(docs, "ConfigMap", "leafe-nats")["metadata"]["name"]}
        } in (c.spec["envFrom"]), c.where
        seed_file = env_value(c, "LEAFE_NATS_NKEY")
        if role == "actor":
            assert seed_file == "/var/run/secrets/leafe/nats/actor.$(POD_NAME).nk", c.where
            assert c.argv[c.argv.index("--actor-id") + 1] == "$(POD_NAME)", c.where
            assert mounted_secret_file(c, seed_file) is None, (
                c.where
            )  # an emptyDir its init container fills
        else:
            assert seed_file == f"/var/run/secrets/leafe/nats/{role}.nk", c.where
            assert mounted_secret_file(c, seed_file) == (f"leafe-nats-{role}", "seed"), c.where
        assert not {"LEAFE_NATS_USER", "LEAFE_NATS_PASSWORD_FILE"} & {
            e["name"] for e in c.spec["env"]
        }, c.where
        assert not any("nats://" in a or "tls://" in a for a in c.argv), (
            f"{c.where}: a NATS URL in the command"
        )
        checked += 1
    assert checked >= 1


@pytest.mark.parametrize("name", OVERLAYS)
def test_each_actor_pod_holds_only_its_own_nats_seed(rendered: dict[str, Docs], name: str) -> None:
    """The actor StatefulSet's pods are actor-<i>, each a NATS user of its own: the init container
    copies key ``$(POD_NAME)`` of Secret leafe-nats-actors (mounted in it alone) into a memory
    volume as ``actor.$(POD_NAME).nk``, the file the actor container reads; the actor container
    mounts no Secret of NATS seeds, so the model-written code it runs can reach no other actor's
    identity."""
    docs = rendered[name]
    actor = find(docs, "StatefulSet", "actor")
    pod = actor["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    [init] = pod["initContainers"]
    assert init["command"] == [
        "cp",
        "/var/run/secrets/leafe/nats-actors/$(POD_NAME)",
        "/var/run/secrets/leafe/nats/actor.$(POD_NAME).nk",
    ]
    assert init["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    init_mounts = {m["mountPath"]: m["name"] for m in init["volumeMounts"]}
    assert (
        volumes[init_mounts["/var/run/secrets/leafe/nats-actors"]]["secret"]["secretName"]
        == "leafe-nats-actors"
    )
    own = init_mounts["/var/run/secrets/leafe/nats"]
    assert volumes[own]["emptyDir"]["medium"] == "Memory"
    [main] = pod["containers"]
    mounts = {m["name"]: m["mountPath"] for m in main["volumeMounts"]}
    assert mounts[own] == "/var/run/secrets/leafe/nats"
    seeds = {
        n
        for n, v in volumes.items()
        if v.get("secret", {}).get("secretName", "").startswith("leafe-nats-")
    }
    assert seeds == {init_mounts["/var/run/secrets/leafe/nats-actors"]} and not seeds & set(mounts)
    assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in main[
        "env"
    ]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_variable_in_a_command_is_defined(rendered: dict[str, Docs], name: str) -> None:
    """Each $(VAR) in a command is defined for its container (Kubernetes leaves unknown ones
    verbatim), and so is each $VAR of a shell script there, but for the script's own variables and
    HOSTNAME (the pod name)."""
    docs = rendered[name]
    for c in containers(docs):
        used = set(re.findall(r"\$\(([A-Za-z_]\w*)\)", " ".join(c.raw_argv)))
        for script in expand_shell(c.raw_argv)[1]:
            own = set(re.findall(r"(?:^|[\s;])([A-Za-z_]\w*)=", script))  # assigned in the script
            runtime = {"HOSTNAME"}  # the pod name, set by the container runtime
            used |= set(re.findall(r"\$\{?([A-Za-z_]\w*)", script)) - own - runtime
        assert used <= env_names(c, docs), (
            f"{c.where}: undefined {sorted(used - env_names(c, docs))}"
        )
