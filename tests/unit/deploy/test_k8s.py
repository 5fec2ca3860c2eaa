"""The Kubernetes manifests in docker/k8s/: schema-valid for a pinned Kubernetes release, and
wired the way sparkforge reads its environment.

Core kinds are checked with kubernetes-validate (strict: unknown fields fail). The JobSet CRD is
not in its schemas, so it is checked twice: its own fields against a JSON schema written from
the JobSet API reference (jobset-v1alpha2.schema.json), and each replicated Job template as a
batch/v1 Job with kubernetes-validate.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from cache_helpers import build_cache

from sparkforge.app.cli import main
from sparkforge.producer.units import resolve_share

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "docker" / "k8s"
KUBERNETES_VERSION = "1.33.0"
"""The release the manifests target: backoffLimitPerIndex and podFailurePolicy are GA in it."""
JOBSET_SCHEMA = Path(__file__).with_name("jobset-v1alpha2.schema.json")
# The ConfigMap docker/README.md creates: kubectl create configmap sparkforge-config
#   --from-file=producer.yaml=producer/examples/qwen3-8b.yaml
#   --from-file=train.yaml=trainer/examples/qwen3_8b.yaml
CONFIG_FILES = {"/etc/sparkforge/producer.yaml": ROOT / "producer" / "examples" / "qwen3-8b.yaml",
                "/etc/sparkforge/train.yaml": ROOT / "trainer" / "examples" / "qwen3_8b.yaml"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    """(file name, document) for every YAML document under docker/k8s/."""
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        docs += [(path.name, d) for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def document(kind: str, name: str) -> dict[str, Any]:
    """The one manifest of ``kind`` named ``name``."""
    found = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, (kind, name)
    return found[0]


def container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The single container of a pod spec."""
    (only,) = pod_spec["containers"]
    return only


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    """Container env as name -> value (or valueFrom)."""
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c.get("env", [])}


def sparkforge_config(args: list[str]) -> dict[str, Any]:
    """``sparkforge <args> --print_config`` with the ConfigMap paths mapped to the repo files."""
    argv = [str(CONFIG_FILES.get(a, a)) for a in args]
    out = subprocess.run([sys.executable, "-P", "-m", "sparkforge.app.cli", *argv,
                          "--print_config"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    config: dict[str, Any] = yaml.safe_load(out.stdout)
    return config


def image_tag(component: str) -> str:
    """The image name the manifests should use: sparkforge-<component>:<project version>."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    return f"sparkforge-{component}:{version}"


@pytest.mark.parametrize(("name", "doc"), [d for d in documents() if d[1]["kind"] != "JobSet"],
                         ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_core_manifest_is_valid(name: str, doc: dict[str, Any]) -> None:
    """Every core-kind manifest passes kubernetes-validate (strict) for the pinned release."""
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_catches_a_misspelt_field() -> None:
    """The strict check fails on a field the Job API does not have (the check can fail)."""
    job = json.loads(json.dumps(document("Job", "sparkforge-produce")))
    job["spec"]["backoffLimitPerIdx"] = job["spec"].pop("backoffLimitPerIndex")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)


def test_jobset_fields_and_job_templates_are_valid() -> None:
    """The JobSet matches its JSON schema and each replicated Job template is a valid Job."""
    jobset = document("JobSet", "sparkforge-train")
    jsonschema.validate(jobset, json.loads(JOBSET_SCHEMA.read_text()))
    for rj in jobset["spec"]["replicatedJobs"]:
        job = {"apiVersion": "batch/v1", "kind": "Job",
               "metadata": {"name": f"{jobset['metadata']['name']}-{rj['name']}-0"},
               **rj["template"]}
        kubernetes_validate.validate(job, KUBERNETES_VERSION, strict=True)
    broken = json.loads(json.dumps(jobset))
    broken["spec"]["failurePolicy"]["rules"][0]["action"] = "Restart"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, json.loads(JOBSET_SCHEMA.read_text()))


def test_producer_indexed_job() -> None:
    """Indexed, one worker share per index (SPARKFORGE_NUM_WORKERS = completions), per-index
    retries, preemption retried for free, restartPolicy Never, a GPU, S3 secret, emptyDir
    scratch."""
    job = document("Job", "sparkforge-produce")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    c = container(pod)
    env = env_of(c)
    assert spec["completionMode"] == "Indexed"
    assert int(env["SPARKFORGE_NUM_WORKERS"]) == spec["completions"]
    last = resolve_share(None, None, {"JOB_COMPLETION_INDEX": str(spec["completions"] - 1),
                                      "SPARKFORGE_NUM_WORKERS": env["SPARKFORGE_NUM_WORKERS"]})
    assert (last.worker_index, last.num_workers) == (spec["completions"] - 1, spec["completions"])
    assert spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    preempted = [{"type": "DisruptionTarget", "status": "True"}]
    assert {"action": "Ignore", "onPodConditions": preempted} in rules
    assert pod["restartPolicy"] == "Never"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"secretRef": {"name": "sparkforge-s3"}} in c["envFrom"]
    scratch = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
    assert scratch & {m["name"] for m in c["volumeMounts"]} >= {"scratch", "dshm"}
    assert c["image"] == image_tag("producer")
    resolved = sparkforge_config(c["args"])
    assert resolved["engine"]["model"] == "Qwen/Qwen3-8B"


def test_finalize_and_validate_jobs_name_the_producer_output(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """finalize and validate point at the cache the producer config writes, need no GPU, and
    their flags work: validate, run on a small cache in place of the bucket, judges it against
    the training config (exit 1: the test cache does not fit Qwen3-8B), not a usage error (2)."""
    output = yaml.safe_load(CONFIG_FILES["/etc/sparkforge/producer.yaml"].read_text())["output"]
    finalize = container(document("Job", "sparkforge-finalize")["spec"]["template"]["spec"])
    assert sparkforge_config(finalize["args"])["output"] == output
    validate = container(document("Job", "sparkforge-validate")["spec"]["template"]["spec"])
    assert validate["args"][:2] == ["validate", output]
    assert "nvidia.com/gpu" not in json.dumps(finalize) + json.dumps(validate)

    cache = str(build_cache(tmp_path / "cache"))
    argv = [cache if a == output else str(CONFIG_FILES.get(a, a)) for a in validate["args"]]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "(deep)" in out
    assert "model.hidden_size=4096" in out


@pytest.mark.slow
def test_trainer_jobset_runs_lightning_multi_node() -> None:
    """Node rank from the completion index, MASTER_ADDR = node 0's JobSet hostname,
    num_nodes = completions, devices = GPUs per pod, resume from last in a fixed mounted folder."""
    jobset = document("JobSet", "sparkforge-train")
    (rj,) = jobset["spec"]["replicatedJobs"]
    job, pod = rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    c = container(pod)
    env = env_of(c)
    subdomain = jobset["spec"]["network"]["subdomain"]
    assert env["MASTER_ADDR"] == f"{jobset['metadata']['name']}-{rj['name']}-0-0.{subdomain}"
    assert env["NODE_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert job["completionMode"] == "Indexed"
    (rule,) = job["podFailurePolicy"]["rules"]
    assert rule["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert rule["action"] == "FailJob"
    assert jobset["spec"]["failurePolicy"]["rules"][0] == {
        "name": "restart-on-preemption", "action": "RestartJobSetAndIgnoreMaxRestarts",
        "onJobFailureReasons": ["PodFailurePolicy"]}
    assert c["image"] == image_tag("trainer")
    resolved = sparkforge_config(c["args"])
    assert resolved["trainer"]["num_nodes"] == job["completions"] == job["parallelism"]
    assert int(resolved["trainer"]["devices"]) == int(c["resources"]["limits"]["nvidia.com/gpu"])
    assert resolved["ckpt_path"] == "last"
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    assert any(resolved["checkpoint"]["dirpath"].startswith(m + "/") for m in mounts)
    output = yaml.safe_load(CONFIG_FILES["/etc/sparkforge/producer.yaml"].read_text())["output"]
    assert resolved["data"]["uri"] == output


def test_secret_example_holds_the_variables_s3fs_reads() -> None:
    """The example Secret's keys are the AWS variables botocore (under s3fs) reads."""
    secret = document("Secret", "sparkforge-s3")
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(secret["stringData"])
