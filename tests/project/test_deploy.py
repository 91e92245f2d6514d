"""The deployment files: Dockerfile, config/compose.yaml, config/kubernetes/.

No container engine runs here, so each file is checked by what can be checked without
one: Kubernetes manifests against the API's own schemas (kubernetes-validate, strict:
unknown fields are errors), compose.yaml against the Compose Specification schema (as
vendored by check-jsonschema), the Dockerfile through a real parser (dockerfile-parse).
Then what ties them together — every referenced config file loads with load_settings,
names and ports agree — and the image's own CMD and HEALTHCHECK run here, outside a
container, against the image's configuration.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from check_jsonschema.builtin_schemas import get_builtin_schema
from dockerfile_parse import DockerfileParser

from idemproxy.proxy.config import ConfigError, load_settings

pytestmark = pytest.mark.slow  # deployment checks: schemas, wheel build, the image command as a subprocess

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "config"
KUBE = CONFIG / "kubernetes"
# The oldest and the newest Kubernetes the manifests are meant for.
KUBERNETES_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
BIN = Path(sys.executable).parent


# -- Dockerfile -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dockerfile() -> DockerfileParser:
    parser = DockerfileParser(path=str(REPO / "Dockerfile"))
    return parser


def instructions(parser: DockerfileParser, name: str) -> list[str]:
    return [i["value"] for i in parser.structure if i["instruction"] == name]


def exec_form(value: str) -> list[str]:
    """The argv of an exec-form (JSON array) CMD or HEALTHCHECK CMD."""
    argv = json.loads(value)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def dockerfile_env(parser: DockerfileParser) -> dict[str, str]:
    return dict(parser.envs)


def test_dockerfile_base_user_port_and_install(dockerfile):
    assert dockerfile.baseimage == "python:3.11-slim"
    users = instructions(dockerfile, "USER")
    assert users, "the image must not run as root"
    uid = users[-1].split(":")[0]
    assert uid not in ("root", "0") and uid.isdigit(), "a numeric non-root uid (for runAsNonRoot)"
    assert instructions(dockerfile, "EXPOSE") == ["8787"]
    installs = [run for run in instructions(dockerfile, "RUN") if "pip install" in run]
    assert len(installs) == 1 and "--no-cache-dir" in installs[0]
    extras = re.search(r'"\.\[([a-z,]+)\]"', installs[0]).group(1).split(",")
    assert extras == ["postgres", "redis", "fast"]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras) <= set(declared)


def test_dockerfile_serves_by_default_and_health_checks_with_idemproxy_check(dockerfile):
    assert exec_form(instructions(dockerfile, "CMD")[-1]) == ["idemproxy", "serve", "--host", "0.0.0.0"]
    health = instructions(dockerfile, "HEALTHCHECK")
    assert len(health) == 1
    options, _, command = health[0].partition("CMD")
    assert exec_form(command.strip())[:2] == ["idemproxy", "check"]
    assert "--interval" in options and "--timeout" in options


def test_dockerfile_copies_what_the_build_needs_and_dockerignore_keeps_it(dockerfile):
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    copied = []
    for copy_args in instructions(dockerfile, "COPY"):
        *sources, _ = copy_args.split()
        copied += sources
    for source in copied:
        assert (REPO / source).exists(), f"COPY {source}: no such file"
        assert not dockerignored(Path(source), ignored), f"COPY {source} is excluded by .dockerignore"
    # The package build needs every package folder and the embedded default config.
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    for folder in setuptools["package-dir"].values():
        assert folder in copied, f"{folder}/ is not copied into the build"
    default = (REPO / "proxy" / "default.toml").resolve().relative_to(REPO)
    assert default.parts[0] in copied
    for heavy in ("tests", ".git", "bench", "clients"):
        assert heavy in ignored


def dockerignored(relative: Path, patterns: list[str]) -> bool:
    """Whether .dockerignore leaves ``relative`` out of the build context (the patterns
    this repository uses: names, globs, and ``**/`` for any depth)."""
    parts = relative.parts
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch("/".join(parts[i:j]), pattern[3:])
                   for i in range(len(parts)) for j in range(i + 1, len(parts) + 1)):
                return True
        elif any(fnmatch.fnmatch("/".join(parts[:j]), pattern) for j in range(1, len(parts) + 1)):
            return True
    return False


def test_package_builds_from_exactly_what_the_dockerfile_copies(dockerfile, tmp_path):
    """Lay out /build as the image does (COPY sources, minus .dockerignore), build the
    wheel there, and check it carries the embedded default config."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    build = tmp_path / "build"
    build.mkdir()
    for copy_args in instructions(dockerfile, "COPY"):
        *sources, dest = copy_args.split()
        if not dest.startswith("./"):
            continue  # copied after the install, into the final image
        for source in sources:
            for path in [REPO / source, *sorted((REPO / source).rglob("*"))]:
                relative = path.relative_to(REPO)
                if dockerignored(relative, patterns):
                    continue
                target = build / relative
                if path.is_symlink():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.symlink_to(os.readlink(path))
                elif path.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(path.read_bytes())
    assert not list(build.rglob("__pycache__")) and not list(build.rglob("*.egg-info"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "--wheel-dir", str(tmp_path / "dist"), str(build)], check=True,
                   cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("idemproxy-*.whl"))
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "idemproxy/proxy/default.toml" in names
    assert "idemproxy/supervisor/loop.py" in names and "idemproxy/proxy/store/sqlite/__init__.py" in names
    assert "idemproxy/proxy/runs/service.py" in names  # once missing from the package list
    for asset in ("templates/run.html", "static/console.css", "static/console.js"):  # the console, whole
        assert f"idemproxy/proxy/console/{asset}" in names, asset


def test_image_config_is_where_idemproxy_config_points_and_loads(dockerfile):
    env = dockerfile_env(dockerfile)
    target = env["IDEMPROXY_CONFIG"]
    sources = [c.split() for c in instructions(dockerfile, "COPY") if c.split()[-1] == target]
    assert len(sources) == 1, f"nothing is copied to {target}"
    settings = load_settings(REPO / sources[0][0], env={})
    assert settings.server.port == 8787 and settings.store.url.startswith("sqlite:////var/lib/idemproxy/")


def test_image_cmd_serves_and_healthcheck_passes_outside_a_container(dockerfile, tmp_path):
    """Run the image's CMD and HEALTHCHECK here with the image's ENV and config file;
    only the store path and the address are redirected into the test's folder."""
    env = dockerfile_env(dockerfile)
    config_source = next(c.split()[0] for c in instructions(dockerfile, "COPY")
                         if c.split()[-1] == env["IDEMPROXY_CONFIG"])
    port = _free_port()
    run_env = {**os.environ, **env, "IDEMPROXY_CONFIG": str(REPO / config_source),
               "IDEMPROXY_STORE_URL": f"sqlite:///{tmp_path}/image.db",
               "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
    cmd = exec_form(instructions(dockerfile, "CMD")[-1]) + ["--host", "127.0.0.1", "--port", str(port)]
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(cmd, env=run_env, cwd=tmp_path, stdout=log, stderr=log)
    try:
        _wait_ready(f"http://127.0.0.1:{port}", server, tmp_path / "serve.log")
        health = instructions(dockerfile, "HEALTHCHECK")[0].partition("CMD")[2]
        check = subprocess.run(exec_form(health.strip()), env=run_env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=30)
        assert check.returncode == 0, check.stderr
        assert "ok" in check.stdout
        # ... and it fails when the store is gone, which is what a health check is for.
        broken = {**run_env, "IDEMPROXY_STORE_URL": "postgresql://idemproxy@127.0.0.1:1/none",
                  "IDEMPROXY_STORE_TIMEOUT": "0.3"}
        failed = subprocess.run(exec_form(health.strip()), env=broken, cwd=tmp_path,
                                capture_output=True, text=True, timeout=30)
        assert failed.returncode == 1 and "NOT reachable" in failed.stderr
    finally:
        server.terminate()
        server.wait(20)
        log.close()


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert server.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                assert httpx.get(url + "/healthz", timeout=1).status_code == 200
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"not ready: {log.read_text()[-3000:]}")


# -- compose --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((CONFIG / "compose.yaml").read_text())


# The secrets compose.yaml requires (``${VAR:?message}``), as an operator sets them
SECRETS = {"IDEMPROXY_ADMIN_TOKEN": "k7Qm2vXw9pLr4tYz8nBc3dFg",
           "IDEMPROXY_TENANTS_SECRET": "tenant-hmac-0123456789",
           "IDEMPROXY_HOOKS_AGENT_SECRET": "hook-signing-0123456789"}


class Unset(Exception):
    """A variable compose.yaml requires (``${VAR:?message}``) is not set: compose stops."""


def interpolate(value: str, variables: dict[str, str] | None = None) -> str:
    """Compose's ``${VAR}``, ``${VAR:-default}`` and ``${VAR:?message}`` with ``variables``."""
    variables = variables or {}

    def one(m: re.Match) -> str:
        name, kind, rest = m.group(1), m.group(2) or "", m.group(3) or ""
        if variables.get(name):
            return variables[name]
        if kind.endswith("?"):
            raise Unset(f"{name}: {rest}")
        return rest
    return re.sub(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}", one, value)


def services_in(compose: dict, profile: str) -> set[str]:
    return {name for name, svc in compose["services"].items()
            if not svc.get("profiles") or profile in svc["profiles"]}


def test_compose_file_is_valid_against_the_compose_specification(compose):
    validator = jsonschema.Draft202012Validator(get_builtin_schema("vendor.compose-spec"))
    assert [e.message for e in validator.iter_errors(compose)] == []
    broken = copy.deepcopy(compose)
    broken["services"]["proxy"]["helthcheck"] = broken["services"]["proxy"].pop("healthcheck")
    assert list(validator.iter_errors(broken)), "the schema must catch a misspelt key"


def test_compose_profiles_are_the_sidecar_and_gateway_setups(compose):
    services = compose["services"]
    assert services_in(compose, "sidecar") == {"postgres", "proxy", "agent"}
    assert services_in(compose, "gateway") == {"postgres", "idemproxy", "supervisor"}
    # sidecar: the agent shares the proxy's network namespace and reaches it on localhost
    agent = services["agent"]
    assert agent["network_mode"] == "service:proxy"
    assert interpolate(agent["environment"]["IDEM_PROXY_URL"]) == "http://127.0.0.1:8787"
    assert agent["depends_on"]["proxy"]["condition"] == "service_healthy"
    # gateway: two replicas that only proxy, one supervisor on the same store
    gateway, supervisor = services["idemproxy"], services["supervisor"]
    assert gateway["deploy"]["replicas"] == 2
    assert gateway["command"] == ["idemproxy", "serve", "--host", "0.0.0.0", "--no-supervisor"]
    assert supervisor["command"] == ["idemproxy", "supervise"]
    for name in ("proxy", "idemproxy", "supervisor"):
        svc = services[name]
        assert svc["build"]["context"] == ".." and (CONFIG / ".." / svc["build"]["dockerfile"]).exists()
        assert svc["healthcheck"]["test"][1:3] == ["idemproxy", "check"]
        assert svc["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "pg_isready" in services["postgres"]["healthcheck"]["test"][1]


@pytest.mark.parametrize("service", ["proxy", "idemproxy", "supervisor"])
def test_compose_config_files_load_with_the_service_environment(compose, service):
    svc = compose["services"][service]
    mounts = [v.split(":") for v in svc["volumes"] if v.split(":")[1] == "/etc/idemproxy/config.toml"]
    assert len(mounts) == 1
    env = {k: interpolate(str(v), SECRETS) for k, v in svc["environment"].items()}
    settings = load_settings(CONFIG / mounts[0][0], env=env)
    store = settings.store.url
    assert store.startswith("postgresql://idemproxy:") and "@postgres:5432/" in store
    assert settings.admin.token and settings.tenants.secret
    if service == "proxy":
        assert settings.server.host == "127.0.0.1"  # private to the agent beside it
        assert not settings.supervisor.enabled
    else:
        hook = settings.hooks[settings.runs.hook]
        assert hook.url and hook.secret, "gateway restart hooks are signed"
        # the address restarted agents are told is the gateway service's
        assert settings.proxy_url == "http://idemproxy:8787" and "idemproxy" in compose["services"]


def test_compose_ships_no_secret_and_publishes_on_loopback(compose):
    """No admin token, tenant secret or hook secret has a default: compose stops until each
    is set, and a short one stops the proxy (`check` exits 2)."""
    for name in ("proxy", "idemproxy", "supervisor"):
        for variable, value in compose["services"][name]["environment"].items():
            if variable in SECRETS:
                with pytest.raises(Unset, match=variable):
                    interpolate(str(value))
    assert "change-me" not in (CONFIG / "compose.yaml").read_text()
    assert [interpolate(p) for p in compose["services"]["idemproxy"]["ports"]] == ["127.0.0.1:8787-8788:8787"]
    svc = compose["services"]["idemproxy"]
    short = {**SECRETS, "IDEMPROXY_ADMIN_TOKEN": "short"}
    env = {k: interpolate(str(v), short) for k, v in svc["environment"].items()}
    with pytest.raises(ConfigError, match="admin.token is 5 characters"):
        load_settings(CONFIG / "gateway.toml", env=env)


# -- Kubernetes -----------------------------------------------------------------------------

def manifests() -> dict[str, list[dict]]:
    return {path.name: [d for d in yaml.safe_load_all(path.read_text()) if d]
            for path in sorted(KUBE.glob("*.yaml")) if path.name != "kustomization.yaml"}


def resources(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for docs in manifests().values() for d in docs if d["kind"] == kind}


def kustomization() -> dict:
    return yaml.safe_load((KUBE / "kustomization.yaml").read_text())


def generated_secret() -> dict[str, str]:
    """The Secret kustomize makes from secrets.env, with the keys kustomization.yaml's
    comment tells an operator to write, each given a value as an operator would."""
    keys = re.findall(r"^#\s+([a-z][a-z-]*)=", (KUBE / "kustomization.yaml").read_text(), re.M)
    return {key: ("postgresql://idemproxy:db-pw-0123@postgres:5432/idemproxy" if key == "store-url"
                  else f"{key}-0123456789abcdef") for key in keys}


def test_the_secret_is_generated_from_a_file_never_in_the_repository():
    (generator,) = kustomization()["secretGenerator"]
    assert generator["name"] == "idemproxy-secrets" and generator["envs"] == ["secrets.env"]
    assert generator["options"]["disableNameSuffixHash"] is True  # the deployments name it so
    ignored = subprocess.run(["git", "check-ignore", "-q", str(KUBE / "secrets.env")], cwd=REPO)
    assert ignored.returncode == 0, "config/kubernetes/secrets.env must be git-ignored"
    assert set(generated_secret()) == {"store-url", "admin-token", "tenant-secret", "hook-secret"}
    for path in KUBE.glob("*.yaml"):
        assert "change-me" not in path.read_text(), path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_against_the_kubernetes_schema(version):
    checked = 0
    for name, docs in manifests().items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']}: {exc.message}")
            checked += 1
    assert checked >= 5


def test_the_schema_check_catches_a_misspelt_probe():
    deployment = copy.deepcopy(resources("Deployment")["idemproxy"])
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((KUBE / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert set(kustomization["resources"]) == set(manifests())


def test_gateway_deployment_probes_service_and_security(dockerfile):
    deployment = resources("Deployment")["idemproxy"]
    spec = deployment["spec"]
    assert spec["replicas"] >= 2
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    (container,) = pod["containers"]
    assert container["command"] == ["idemproxy", "serve", "--host", "0.0.0.0", "--no-supervisor"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8787}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    # the same uid as the image's USER, and never root
    uid = int(instructions(dockerfile, "USER")[-1].split(":")[0])
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == uid
    assert container["securityContext"]["allowPrivilegeEscalation"] is False

    service = resources("Service")["idemproxy"]
    assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in ports and port["port"] == 8787
    pdb = resources("PodDisruptionBudget")["idemproxy"]
    assert pdb["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]


def test_supervisor_deployment_runs_idemproxy_supervise():
    deployment = resources("Deployment")["idemproxy-supervisor"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["idemproxy", "supervise"]
    gateway = resources("Deployment")["idemproxy"]["spec"]["selector"]["matchLabels"]
    own = deployment["spec"]["template"]["metadata"]["labels"]
    assert not gateway.items() <= own.items(), "the gateway Service must not route to the supervisor"


@pytest.mark.parametrize("deployment", ["idemproxy", "idemproxy-supervisor"])
def test_deployments_load_their_configmap_and_secret(deployment, tmp_path):
    pod = resources("Deployment")[deployment]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    secret = generated_secret()
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "idemproxy-secrets" and ref["key"] in secret, var
            env[var["name"]] = secret[ref["key"]]
    volumes = {v["name"]: v for v in pod["volumes"]}
    (mount,) = container["volumeMounts"]
    configmap = resources("ConfigMap")[volumes[mount["name"]]["configMap"]["name"]]
    assert env["IDEMPROXY_CONFIG"] == f"{mount['mountPath']}/config.toml"
    text = configmap["data"]["config.toml"]
    assert text == (CONFIG / "gateway.toml").read_text(), "ConfigMap and config/gateway.toml differ"
    path = tmp_path / "config.toml"
    path.write_text(text)
    settings = load_settings(path, env=env)
    assert settings.store.url == secret["store-url"]
    assert settings.hooks[settings.runs.hook].secret == secret["hook-secret"]
    assert settings.proxy_url == f"http://{resources('Service')['idemproxy']['metadata']['name']}:8787"
    if deployment == "idemproxy":
        assert str(settings.admin.token) == secret["admin-token"]
        assert str(settings.tenants.secret) == secret["tenant-secret"]
        grace = pod["terminationGracePeriodSeconds"]
        assert grace > settings.server.shutdown_timeout, "calls in flight need time to be recorded"
