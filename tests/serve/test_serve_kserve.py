"""deploy/kserve: the ServingRuntime and InferenceService validate against KServe's published CRD
schemas (tests/serve/kserve_crds, strict: a field the schema does not know is an error, as
`kubectl apply --validate=strict` says), fit each other (format, runtime, protocol v2), and the
runtime's container command really serves: `sartor serve` with the manifest's arguments over a
model repository listens on 0.0.0.0 and answers the probes' paths."""
from __future__ import annotations

import copy
import gzip
import json
import re
import urllib.request
from pathlib import Path

import pytest
from release_helpers import sartor_process, stop, wait_for_line
from serve_helpers import add_model

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kserve"
CRDS = Path(__file__).resolve().parent / "kserve_crds"


def manifest(name: str) -> dict:
    (document,) = [d for d in yaml.safe_load_all((MANIFESTS / name).read_text()) if d]
    return document


def crd(plural: str) -> dict:
    return json.loads(gzip.decompress((CRDS / f"{plural}.schema.json.gz").read_bytes()))


def strict(schema):
    """The schema with unknown fields refused wherever it lists properties and keeps no others."""
    schema = copy.deepcopy(schema)

    def visit(node):
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)
    visit(schema)
    return schema


def errors(document: dict, plural: str) -> list[str]:
    schemas = crd(plural)
    group, version = document["apiVersion"].split("/")
    assert group == schemas["group"] and document["kind"] == schemas["kind"]
    validator = jsonschema.Draft7Validator(strict(schemas["versions"][version]))
    return sorted(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document))


@pytest.mark.parametrize("name,plural", [("servingruntime.yaml", "servingruntimes"),
                                         ("inferenceservice.yaml", "inferenceservices")])
def test_the_manifests_validate_against_kserves_crd_schemas(name, plural):
    document = manifest(name)
    assert errors(document, plural) == []
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", document["metadata"]["name"])  # a DNS-1035 label


def test_the_strict_check_catches_a_misspelt_field_and_a_wrong_type():
    document = manifest("servingruntime.yaml")
    document["spec"]["containers"][0]["readinesProbe"] = document["spec"]["containers"][0].pop("readinessProbe")
    document["spec"]["multiModel"] = "no"
    found = errors(document, "servingruntimes")
    assert any("readinesProbe" in e for e in found) and any(e.startswith("spec.multiModel") for e in found)


def test_the_service_names_the_runtime_and_both_speak_v2():
    runtime, service = manifest("servingruntime.yaml"), manifest("inferenceservice.yaml")
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] and model["protocolVersion"] == "v2"
    assert model["modelFormat"] in [{"name": f["name"], "version": f["version"]}
                                    for f in runtime["spec"]["supportedModelFormats"]]
    assert "v2" in runtime["spec"]["protocolVersions"]


def test_the_runtimes_command_serves_on_all_addresses_and_answers_its_probes(tiny_plan, tmp_path):
    (container,) = manifest("servingruntime.yaml")["spec"]["containers"]
    args = list(container["args"])
    port = container["ports"][0]["containerPort"]
    assert args[args.index("--host") + 1] == "0.0.0.0" and args[args.index("--http-port") + 1] == str(port)
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == port
    repository = tmp_path / "mnt-models"  # what the storage initializer leaves at /mnt/models
    add_model(repository, "tiny", tiny_plan)
    args[args.index("/mnt/models")] = str(repository)
    args[args.index("--http-port") + 1] = "0"  # any free port: this machine is shared
    args[args.index("--metrics-port") + 1] = "-1"
    process = sartor_process("serve", *args)
    try:
        match = wait_for_line(process.stdout, r"serving on HTTP 0\.0\.0\.0:(\d+)", process)
        served = int(match.group(1))
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            url = f"http://127.0.0.1:{served}{container[probe]['httpGet']['path']}"
            with urllib.request.urlopen(url, timeout=30) as response:
                assert response.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{served}/v2/models/tiny", timeout=30) as response:
            assert json.loads(response.read())["name"] == "tiny"
    finally:
        stop(process)
