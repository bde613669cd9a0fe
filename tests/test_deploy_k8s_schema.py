"""deploy/k8s/ against Kubernetes' own API schemas, offline (no API server runs here).

The validator is ``kubernetes-validate`` (PyPI; the ``deploy`` extra, which
``make test`` installs): it bundles, per Kubernetes minor version, JSON
schemas generated from that release's OpenAPI document, and checks a
manifest with ``jsonschema`` without any network or cluster. Chosen over
the ``kubernetes`` Python client's models because those accept any type
and ignore unknown fields (a typo would need a hand-written walk over
``attribute_map``), while a JSON schema checks field names, types and
required fields in one pass. It is kept up: one release per Kubernetes
minor release (1.37.0 bundles 1.25 to 1.37).

How it is used here, and why not its command line:

- ``strict=True`` (``--strict``): without it an unknown field, such as a
  misspelled ``imagePullPolicyy``, passes;
- an unknown kind or apiVersion raises ``SchemaNotFoundError``, which the
  command line only prints as a WARN and exits 0: here it fails;
- every bundled minor version from 1.25 up is checked, and the version it
  validated against must be the one asked for (it picks the newest schema
  not newer than the one asked, by comparing strings).

What a schema cannot say (the API server's own validation, not in the
OpenAPI document): the values allowed in enumerations such as
``restartPolicy``, name formats, and rules across fields. The ones these
manifests depend on are checked by hand at the end of this file, and the
Service-to-pod wiring in tests/test_deploy_files.py.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable

import pytest
import yaml
from packaging.version import Version

from .swarm import ROOT

try:
    import kubernetes_validate
    from kubernetes_validate.utils import SchemaNotFoundError, all_versions
except ImportError:  # the `deploy` extra is not installed
    kubernetes_validate = None

needs_validator = pytest.mark.skipif(
    kubernetes_validate is None, reason="kubernetes-validate is not installed (pip install -e '.[deploy]')")

OLDEST = Version("1.25")  # the oldest schema kubernetes-validate 1.37.0 bundles


def manifests() -> list[dict[str, Any]]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def versions() -> list[str]:
    if kubernetes_validate is None:
        return ["none"]
    return [f"{v.major}.{v.minor}" for v in sorted({Version(s) for s in all_versions()}) if v >= OLDEST]


def validate(doc: dict[str, Any], version: str) -> None:
    """Raise where the schema of ``version`` rejects ``doc``; an unknown kind or apiVersion is a rejection."""
    try:
        checked = kubernetes_validate.validate(doc, version, strict=True)
    except SchemaNotFoundError as e:
        raise AssertionError(e.message) from None
    assert checked == version, f"asked for the {version} schema, got {checked}'s"


def name(doc: dict[str, Any]) -> str:
    return f"{doc['kind']}/{doc['metadata']['name']}"


@needs_validator
@pytest.mark.parametrize("version", versions())
def test_every_manifest_is_valid_against_the_kubernetes_api_schema(version: str) -> None:
    docs = manifests()
    assert len(docs) == 3
    errors = []
    for doc in docs:
        try:
            validate(doc, version)
        except (kubernetes_validate.ValidationError, AssertionError) as e:
            errors.append(f"{name(doc)}: {'.'.join(map(str, getattr(e, 'path', [])))}: {getattr(e, 'message', e)}")
    assert not errors, "\n".join(errors)


def _pod(doc: dict[str, Any]) -> dict[str, Any]:
    return doc["spec"]["template"]["spec"]


def _rename(d: dict[str, Any], old: str, new: str) -> None:
    d[new] = d.pop(old)


# Each: (kind, what is broken, how, the path the validator must name, a word its message must hold).
MUTATIONS: list[tuple[str, str, Callable[[dict[str, Any]], None], str, str]] = [
    ("Deployment", "a misspelled container field",
     lambda d: _rename(_pod(d)["containers"][0], "imagePullPolicy", "imagePullPolicyy"),
     "spec.template.spec.containers.0", "imagePullPolicyy"),
    ("Deployment", "a misspelled top-level field", lambda d: _rename(d, "metadata", "metdata"), "", "metdata"),
    ("Job", "a misspelled Job field", lambda d: _rename(d["spec"], "completionMode", "completionmode"),
     "spec", "completionmode"),
    ("Deployment", "replicas as a string", lambda d: d["spec"].__setitem__("replicas", "1"),
     "spec.replicas", "integer"),
    ("Deployment", "args as one string", lambda d: _pod(d)["containers"][0].__setitem__("args", "coordinator"),
     "spec.template.spec.containers.0.args", "array"),
    ("Deployment", "a port as a string",
     lambda d: _pod(d)["containers"][0]["ports"][0].__setitem__("containerPort", "29400"),
     "spec.template.spec.containers.0.ports.0.containerPort", "integer"),
    ("Deployment", "no selector", lambda d: d["spec"].pop("selector"), "spec", "selector"),
    ("Job", "a container without a name", lambda d: _pod(d)["containers"][0].pop("name"),
     "spec.template.spec.containers.0", "name"),
    ("Service", "a port without its number", lambda d: d["spec"]["ports"][0].pop("port"), "spec.ports.0", "port"),
]


@needs_validator
@pytest.mark.parametrize("kind,what,mutate,path,word", MUTATIONS, ids=[m[1] for m in MUTATIONS])
def test_a_broken_manifest_fails_validation(kind: str, what: str, mutate: Callable[[dict[str, Any]], None],
                                            path: str, word: str) -> None:
    (doc,) = [d for d in manifests() if d["kind"] == kind]
    latest = versions()[-1]
    validate(doc, latest)  # the manifest as it is passes ...
    broken = copy.deepcopy(doc)
    mutate(broken)
    with pytest.raises(kubernetes_validate.ValidationError) as e:  # ... and with the one change, fails there
        validate(broken, latest)
    assert ".".join(map(str, e.value.path)) == path and word in e.value.message, (e.value.path, e.value.message)


@needs_validator
def test_an_unknown_kind_or_api_version_fails_rather_than_warns() -> None:
    doc = [d for d in manifests() if d["kind"] == "Job"][0]
    for field, value in (("kind", "Jobs"), ("apiVersion", "batch/v2")):
        broken = {**doc, field: value}
        with pytest.raises(AssertionError, match="Couldn't find schema"):
            validate(broken, versions()[-1])


# ---------------------------------------------------------------- what the schema cannot check

DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")  # Deployment, Job, Service and container names


def test_the_values_the_schema_leaves_to_the_api_server() -> None:
    """Enumerations and name formats, as the API reference states them (the OpenAPI schema has them as free strings)."""
    for doc in manifests():
        assert DNS_1123_LABEL.fullmatch(doc["metadata"]["name"]) and len(doc["metadata"]["name"]) <= 63, name(doc)
        if doc["kind"] == "Service":
            assert all(DNS_1123_LABEL.fullmatch(p["name"]) for p in doc["spec"]["ports"])
            continue
        pod = _pod(doc)
        for c in pod["containers"]:
            assert DNS_1123_LABEL.fullmatch(c["name"]), name(doc)
            assert c.get("imagePullPolicy", "IfNotPresent") in {"Always", "Never", "IfNotPresent"}, name(doc)
            assert all(len(p["name"]) <= 15 and DNS_1123_LABEL.fullmatch(p["name"]) for p in c.get("ports", []))
        if doc["kind"] == "Job":
            assert pod["restartPolicy"] in {"OnFailure", "Never"}  # a Job's pods may not restart Always
            assert doc["spec"]["completionMode"] in {"NonIndexed", "Indexed"}
        else:
            assert pod.get("restartPolicy", "Always") == "Always"  # a Deployment's pods must
