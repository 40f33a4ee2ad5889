"""Deployment files: Dockerfiles, docker-compose, Prometheus config and the Helm chart.

Docker and Helm cannot run here, so the manifests are parsed (PyYAML) and
checked; the Helm templates go through a small renderer for the subset of
the template language the chart uses (values, includes, if/range, quote).
Every server command line found in them is parsed by the real CLI parser.
`helm lint`/`helm template` run too when a helm binary is on PATH.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from cloud_server.cli import build_parser

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
CHART = DEPLOY / "helm" / "tokenrouter"


def serve_args(args: list[str]):
    """Parse a server command line with the real CLI (SystemExit = a flag the server does not know)."""
    return build_parser().parse_args(["serve", *args])


# --------------------------------------------------------------------------- a tiny Helm renderer

_EXPR = re.compile(r"{{-?\s*(.*?)\s*-?}}")


class Renderer:
    def __init__(self, values: dict, release: str = "prod") -> None:
        chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
        self.values, self.release, self.chart = values, release, chart

    def include(self, name: str) -> str:
        chart = self.chart["name"]
        if name == "tokenrouter.name":
            return chart
        if name == "tokenrouter.fullname":
            return f"{self.release}-{chart}"[:63]
        if name == "tokenrouter.secretName":
            return self.values["apiKeys"]["existingSecret"] or f"{self.release}-{chart}-keys"
        raise AssertionError(f"unknown include {name}")

    def lookup(self, path: str, dot: object) -> object:
        if path == ".":
            return dot
        if path.startswith(".Values."):
            v: object = self.values
            for part in path[len(".Values.") :].split("."):
                v = v[part]  # type: ignore[index]
            return v
        return {".Release.Name": self.release, ".Chart.Name": self.chart["name"]}[path]

    def expr(self, text: str, dot: object) -> object:
        parts = [p.strip() for p in text.split("|")]
        head = parts[0]
        m = re.fullmatch(r'include "([\w.]+)" \.', head)
        value = self.include(m.group(1)) if m else self.lookup(head, dot)
        for f in parts[1:]:
            if f == "quote":
                value = json.dumps(str(value))
            else:
                raise AssertionError(f"unsupported filter {f}")
        return value

    def render(self, text: str) -> str:
        out: list[str] = []
        self._block(text.splitlines(), 0, len(text.splitlines()), None, out)
        return "\n".join(out)

    def _block(self, lines: list[str], i: int, end: int, dot: object, out: list[str]) -> int:
        while i < end:
            line = lines[i]
            m = re.fullmatch(r"\s*{{-?\s*(if|range|end)\s*(.*?)\s*-?}}\s*", line)
            if not m:
                out.append(_EXPR.sub(lambda mm: str(self.expr(mm.group(1), dot)), line))
                i += 1
                continue
            kw, arg = m.groups()
            if kw == "end":
                return i
            close = self._match(lines, i + 1)
            if kw == "if":
                neg = arg.startswith("not ")
                cond = bool(self.expr(arg[4:] if neg else arg, dot))
                if cond != neg:
                    self._block(lines, i + 1, close, dot, out)
            else:
                for item in self.expr(arg, dot):  # type: ignore[union-attr]
                    self._block(lines, i + 1, close, item, out)
            i = close + 1
        return i

    @staticmethod
    def _match(lines: list[str], i: int) -> int:
        depth = 0
        for j in range(i, len(lines)):
            m = re.fullmatch(r"\s*{{-?\s*(if|range|end)\b.*", lines[j])
            if m and m.group(1) in ("if", "range"):
                depth += 1
            elif m and m.group(1) == "end":
                if depth == 0:
                    return j
                depth -= 1
        raise AssertionError("unbalanced template")


def render_chart(**overrides) -> dict[str, dict]:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for dotted, v in overrides.items():
        node = values
        *path, last = dotted.split("__")
        for p in path:
            node = node[p]
        node[last] = v
    r = Renderer(values)
    docs: dict[str, dict] = {}
    for t in sorted((CHART / "templates").glob("*.yaml")):
        for doc in yaml.safe_load_all(r.render(t.read_text())):
            if doc:  # the chart's optional vLLM engine as "Deployment/vllm", "Service/vllm"
                vllm = doc["metadata"]["name"].endswith("-vllm")
                docs[doc["kind"] + ("/vllm" if vllm else "")] = doc
    return docs


# --------------------------------------------------------------------------- Helm


def test_chart_metadata_and_values_parse():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2" and chart["name"] == "tokenrouter" and chart["version"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert all(d.startswith("sha256:") for d in values["apiKeys"]["digests"]), "the chart must hold key digests only"


def test_chart_renders_deployment_service_hpa_and_secret():
    docs = render_chart()
    assert set(docs) == {"Deployment", "Service", "HorizontalPodAutoscaler", "Secret"}
    dep, svc, hpa, sec = docs["Deployment"], docs["Service"], docs["HorizontalPodAutoscaler"], docs["Secret"]
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz"), ("startupProbe", "/healthz")):
        assert c[probe]["httpGet"]["path"] == path and c[probe]["httpGet"]["port"] == "ws"
    assert c["ports"][0] == {"name": "ws", "containerPort": 8765, "protocol": "TCP"}
    args = serve_args(c["args"])
    assert args.api_keys == "/etc/tokenrouter/api-keys" and args.kv_layout == "split" and args.log_format == "json"
    assert args.key_max_sessions == 8 and args.key_tokens_per_minute == 6000 and args.key_max_cloud_fraction == 0.6
    assert 0 < args.drain_timeout_s < pod["terminationGracePeriodSeconds"], "a drain must end before the pod is killed"
    keys_volume = next(v for v in pod["volumes"] if v["name"] == "api-keys")
    assert keys_volume["secret"]["secretName"] == sec["metadata"]["name"]
    assert any(m["mountPath"] == "/etc/tokenrouter" and m["readOnly"] for m in c["volumeMounts"])
    assert sec["stringData"]["api-keys"].strip().startswith("sha256:")
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    assert svc["spec"]["sessionAffinity"] == "ClientIP" and svc["spec"]["ports"][0]["targetPort"] == "ws"
    assert hpa["spec"]["scaleTargetRef"]["name"] == dep["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 16
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}


def test_chart_options_switch_parts_on_and_off():
    docs = render_chart(
        autoscaling__enabled=False,
        apiKeys__existingSecret="my-keys",
        server__remoteUrl="http://vllm:8000/v1",
        server__remoteModel="meta-llama/Llama-3.1-70B-Instruct",
    )
    assert "HorizontalPodAutoscaler" not in docs and "Secret" not in docs
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert next(v for v in pod["volumes"] if v["name"] == "api-keys")["secret"]["secretName"] == "my-keys"
    args = serve_args(pod["containers"][0]["args"])
    assert args.remote_url == "http://vllm:8000/v1" and args.remote_model == "meta-llama/Llama-3.1-70B-Instruct"
    assert args.remote_prompt_format == "ids" and args.remote_verify == "auto" and args.remote_timeout == 30


def test_chart_can_run_a_vllm_engine_with_every_flag_the_features_need():
    """vllm.enabled: a GPU Deployment and Service of vLLM with prefix caching, token ids back and
    top log-probabilities; the server uses it as its remote engine with token-id prompts."""
    docs = render_chart(vllm__enabled=True, vllm__hfTokenSecret="hf")
    assert {"Deployment/vllm", "Service/vllm", "Deployment", "Service"} <= set(docs)
    vllm = docs["Deployment/vllm"]["spec"]["template"]["spec"]["containers"][0]
    assert {"--enable-prefix-caching", "--return-tokens-as-token-ids", "--port=8000"} <= set(vllm["args"])
    assert "--max-logprobs=20" in vllm["args"] and "--tensor-parallel-size=4" in vllm["args"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"] == 4 and vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    assert vllm["env"][0]["valueFrom"]["secretKeyRef"]["name"] == "hf"
    svc = docs["Service/vllm"]
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"] == docs["Deployment/vllm"]["spec"]["selector"]["matchLabels"]
    args = serve_args(docs["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.remote_url == f"http://{svc['metadata']['name']}:8000/v1"
    assert args.remote_model == "llama-3.1-70b-instruct" and args.remote_prompt_format == "ids"
    assert "--served-model-name=llama-3.1-70b-instruct" in vllm["args"]


@pytest.mark.skipif(shutil.which("helm") is None, reason="helm is not installed here")
def test_helm_lint_and_template():
    subprocess.run(["helm", "lint", str(CHART)], check=True)
    out = subprocess.run(["helm", "template", "prod", str(CHART)], check=True, capture_output=True, text=True).stdout
    assert {d["kind"] for d in yaml.safe_load_all(out) if d} >= {
        "Deployment",
        "Service",
        "HorizontalPodAutoscaler",
        "Secret",
    }


# --------------------------------------------------------------------------- Docker


def dockerfile(name: str) -> dict[str, list[str]]:
    """Instructions of a Dockerfile (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / name).read_text())
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.setdefault(op.upper(), []).append(rest.strip())
    return out


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfiles_run_the_server_with_valid_flags_and_a_health_check(name):
    d = dockerfile(name)
    assert len(d["FROM"]) == 2, "multi-stage: build tools stay out of the runtime image"
    entry, cmd = json.loads(d["ENTRYPOINT"][-1]), json.loads(d["CMD"][-1])
    assert entry[:2] == ["tokenrouter-cloud", "serve"]
    args = serve_args(entry[2:] + cmd)
    assert args.host == "0.0.0.0" and args.port == 8765
    assert d["EXPOSE"] == ["8765"] and "/healthz" in d["HEALTHCHECK"][0]
    assert any(u != "root" for u in d["USER"])
    if name.endswith("cuda"):
        assert "GGML_CUDA=on" in " ".join(d["ENV"]) and args.n_gpu_layers == -1


def test_compose_stack_and_prometheus_config():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    cloud = compose["services"]["cloud"]
    assert cloud["build"]["dockerfile"] == "deploy/Dockerfile.cpu"
    args = serve_args(cloud["command"])
    assert args.audit_dir and args.kv_layout == "split"
    assert "/healthz" in " ".join(cloud["healthcheck"]["test"])
    remote = serve_args(compose["services"]["cloud-remote"]["command"])
    assert remote.remote_url == "http://vllm:8000/v1" and remote.remote_prompt_format == "ids"
    assert remote.remote_verify == "prompt-logprobs" and remote.remote_timeout == 30
    vllm = compose["services"]["vllm"]
    assert vllm["profiles"] == ["gpu"] == compose["services"]["cloud-remote"]["profiles"]
    cmd = vllm["command"]
    assert {"--enable-prefix-caching", "--return-tokens-as-token-ids", "--max-logprobs"} <= set(cmd)
    assert int(cmd[cmd.index("--max-logprobs") + 1]) >= 8  # the server asks for its 8 most likely tokens
    assert remote.remote_model == cmd[cmd.index("--served-model-name") + 1]
    assert compose["services"]["cloud-remote"]["depends_on"]["vllm"]["condition"] == "service_healthy"
    assert "/health" in " ".join(vllm["healthcheck"]["test"])
    prom = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = prom["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"] == ["cloud:8765"]
