#!/usr/bin/env python3
"""Run deploy/docker-compose.yml with podman, where there is no Docker engine (CI, podman hosts).

The compose file stays the one definition: Debian's docker-compose resolves it (`config`: the .env
values, anchors and defaults filled in; it needs no engine), and this script starts what it says
with plain podman commands:

- one pod per project, sharing the network namespace only: the services reach each other on
  127.0.0.1, their compose names resolve there (``--add-host``), and each container keeps its own
  hostname (the service name), as under compose. The services' ``ports`` are published by the pod.
- named volumes become podman volumes ``<project>_<name>`` (or a host directory, ``--bind``);
  relative bind mounts are already absolute in the resolved file.
- services start in ``depends_on`` order and each condition is waited for: ``service_healthy``
  runs the service's own compose health check in its container (``podman exec``) until it passes,
  ``service_completed_successfully`` waits for exit status 0. ``restart``, ``stop_grace_period``,
  ``entrypoint``, ``command`` and ``environment`` are passed on as they are.
- ``build`` sections are built with ``podman build`` (Docker format, so HEALTHCHECK is kept).

Images a host cannot pull can be replaced per service (``--image redis=localhost/...``); extra
settings and mounts for the farm's own services (those with a ``build`` section) with ``--env`` and
``--mount``.

    deploy/tools/compose_podman.py --env-file deploy/.env build
    deploy/tools/compose_podman.py --env-file deploy/.env up api cpu-worker beat
    deploy/tools/compose_podman.py --env-file deploy/.env down --volumes

Podman runs rootful here; hosts where the defaults fail (this project's CI: runc instead of crun,
cgroupfs, explicit rlimits) set them in a containers.conf named by CONTAINERS_CONF (deploy/ci).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parent.parent
COMPOSE_FILE = DEPLOY / "docker-compose.yml"
DURATION = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)")
SECONDS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 1e-3, "us": 1e-6}


class StackError(RuntimeError):
    """A service did not build, start, become healthy or complete; the message says which and why."""


def duration_s(text: str | int | float | None, default: float) -> float:
    """Seconds of a compose duration such as ``1m30s`` or ``10s``."""
    if text is None:
        return default
    if isinstance(text, int | float):
        return float(text)
    parts = DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise StackError(f"not a compose duration: {text!r} (use e.g. 30s, 1m30s)")
    return sum(float(n) * SECONDS[u] for n, u in parts)


def resolve(env_file: Path, compose_file: Path = COMPOSE_FILE) -> dict:
    """The compose file as docker-compose resolves it with this .env file."""
    argv = ["docker-compose", "--file", str(compose_file), "--project-directory", str(compose_file.parent),
            "--env-file", str(env_file), "config"]
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except FileNotFoundError:
        raise StackError("docker-compose is missing: apt-get install docker-compose (it only reads the file)") from None
    if result.returncode != 0:
        raise StackError(f"docker-compose config refused {compose_file}: {result.stderr.strip()}")
    return _unescape(yaml.safe_load(result.stdout))


def _unescape(value):
    """``$$`` is compose's escape for a literal ``$``; `config` prints it escaped, compose runs it as ``$``."""
    if isinstance(value, str):
        return value.replace("$$", "$")
    if isinstance(value, list):
        return [_unescape(v) for v in value]
    if isinstance(value, dict):
        return {k: _unescape(v) for k, v in value.items()}
    return value


@dataclass
class Stack:
    """One compose project run as a podman pod."""

    config: dict
    project: str = "exportfarm"
    images: dict[str, str] = field(default_factory=dict)   # service -> image to run instead
    binds: dict[str, str] = field(default_factory=dict)    # named volume -> host directory
    env: dict[str, str] = field(default_factory=dict)      # extra settings for built services
    mounts: list[str] = field(default_factory=list)        # extra --volume entries for built services
    podman: str = "podman"
    log: object = sys.stderr

    @property
    def services(self) -> dict[str, dict]:
        return self.config["services"]

    @property
    def pod(self) -> str:
        return self.project

    def container(self, service: str) -> str:
        return f"{self.project}-{service}"

    def image(self, service: str) -> str:
        return self.images.get(service) or self.services[service]["image"]

    def run(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([self.podman, *args], capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise StackError(f"podman {shlex.join(args[:3])} ... failed ({result.returncode}): "
                             f"{(result.stderr or result.stdout).strip()[-2000:]}")
        return result

    def say(self, message: str) -> None:
        print(f"[{self.project}] {message}", file=self.log, flush=True)

    # ---- build --------------------------------------------------------------------------------

    def build(self, services: Iterable[str] | None = None, build_args: dict[str, str] | None = None,
              volumes: Iterable[str] = (), timeout: float = 3600) -> dict[str, float]:
        """Build each distinct image of these services' ``build`` sections; seconds per image."""
        todo: dict[str, tuple] = {}
        for name in services or self.services:
            spec = self.services[name].get("build")
            if spec:
                todo.setdefault(self.services[name]["image"], (spec, name))
        took = {}
        for image, (spec, name) in todo.items():
            context = Path(spec["context"])
            self.say(f"building {image} (for {name})")
            took[image] = self.build_image(context, context / spec.get("dockerfile", "Dockerfile"), image,
                                           {**spec.get("args", {}), **(build_args or {})}, volumes,
                                           spec.get("target"), timeout)
        return took

    def build_image(self, context: Path, dockerfile: Path, image: str, build_args: dict[str, str],
                    volumes: Iterable[str] = (), target: str | None = None, timeout: float = 3600) -> float:
        """``podman build`` of one image; the seconds it took."""
        argv = ["build", "--format", "docker", "--network", "host", "--file", str(dockerfile), "--tag", image]
        if target:
            argv += ["--target", target]
        for key, value in build_args.items():
            argv += ["--build-arg", f"{key}={value}"]
        for volume in volumes:
            argv += ["--volume", volume]
        start = time.monotonic()
        result = self.run(*argv, str(context), timeout=timeout, check=False)
        if result.returncode != 0:
            raise StackError(f"building {image} failed:\n{(result.stdout + result.stderr)[-4000:]}")
        return round(time.monotonic() - start, 1)

    # ---- up / down ----------------------------------------------------------------------------

    def order(self, wanted: Iterable[str]) -> list[str]:
        """These services and everything they depend on, dependencies first."""
        done: list[str] = []

        def visit(name: str, path: tuple[str, ...]) -> None:
            if name in path:
                raise StackError(f"depends_on cycle: {' -> '.join((*path, name))}")
            if name not in self.services:
                raise StackError(f"no service {name!r} in the compose file (it has {', '.join(self.services)})")
            for dep in self.services[name].get("depends_on", {}):
                visit(dep, (*path, name))
            if name not in done:
                done.append(name)

        for name in wanted:
            visit(name, ())
        return done

    def volume(self, name: str) -> str:
        return self.binds.get(name) or f"{self.project}_{name}"

    def _mounts(self, service: str) -> list[str]:
        argv = []
        named = self.config.get("volumes") or {}
        for entry in self.services[service].get("volumes", []):
            source, _, rest = entry.partition(":")
            argv += ["--volume", f"{self.volume(source) if source in named else source}:{rest}"]
        return argv

    def _create_pod(self, services: list[str]) -> None:
        if self.run("pod", "exists", self.pod, check=False).returncode == 0:
            return
        argv = ["pod", "create", "--name", self.pod, "--share", "net"]
        for name in self.services:
            argv += ["--add-host", f"{name}:127.0.0.1"]
        for name in services:
            for port in self.services[name].get("ports", []):
                argv += ["--publish", port if isinstance(port, str) else
                         f"{port.get('host_ip', '')}:{port['published']}:{port['target']}"]
        self.run(*argv)
        for name in self.config.get("volumes") or {}:
            if name not in self.binds and self.run("volume", "exists", self.volume(name), check=False).returncode:
                self.run("volume", "create", self.volume(name))

    def start(self, service: str) -> None:
        spec = self.services[service]
        argv = ["run", "--detach", "--pod", self.pod, "--name", self.container(service), "--hostname", service,
                "--restart", str(spec.get("restart", "no")),
                "--stop-timeout", str(int(duration_s(spec.get("stop_grace_period"), 10)))]
        if spec.get("entrypoint") is not None:
            argv += ["--entrypoint", json.dumps(spec["entrypoint"])]
        env = {**spec.get("environment", {}), **(self.env if spec.get("build") else {})}
        for key, value in env.items():
            argv += ["--env", f"{key}={'' if value is None else value}"]
        argv += self._mounts(service)
        for mount in self.mounts if spec.get("build") else ():
            argv += ["--volume", mount]
        command = spec.get("command") or []
        argv += [self.image(service), *(shlex.split(command) if isinstance(command, str) else command)]
        self.say(f"starting {service} ({self.image(service)})")
        self.run(*argv)

    def up(self, services: Iterable[str], timeout: float = 300) -> dict[str, float]:
        """Start these services and their dependencies; seconds from the call until each was up."""
        order = self.order(services)
        self._create_pod(order)
        start, ready, met = time.monotonic(), {}, set()
        for name in order:
            for dep, condition in self.services[name].get("depends_on", {}).items():
                wanted = (dep, condition.get("condition", "service_started"))
                if wanted not in met:  # several services wait for the same one: check it once
                    self.wait(*wanted, timeout)
                    met.add(wanted)
            if self.state(name) is None:
                self.start(name)
            ready[name] = round(time.monotonic() - start, 1)
        return ready

    def wait(self, service: str, condition: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if condition == "service_completed_successfully":
            result = self.run("wait", self.container(service), timeout=timeout)
            code = int(result.stdout.strip().splitlines()[-1])
            if code != 0:
                raise StackError(f"{service} exited with status {code}:\n{self.logs(service)}")
            return
        if condition == "service_started":
            return
        if condition != "service_healthy":
            raise StackError(f"depends_on condition {condition!r} is not supported")
        while not self.healthy(service):
            if self.state(service) not in ("running", "created", "configured"):
                raise StackError(f"{service} stopped ({self.state(service)}) before it was healthy:\n{self.logs(service)}")
            if time.monotonic() > deadline:
                raise StackError(f"{service} not healthy after {timeout:.0f} s:\n{self.logs(service)}")
            time.sleep(1)
        self.say(f"{service} healthy")

    def healthy(self, service: str) -> bool:
        """Runs the service's compose health check once in its container."""
        check = self.services[service].get("healthcheck") or {}
        test = check.get("test")
        if not test or check.get("disable"):
            raise StackError(f"{service} has no health check to wait for")
        if isinstance(test, str):
            test = ["CMD-SHELL", test]
        kind, *argv = test
        if kind == "CMD-SHELL":
            argv = ["/bin/sh", "-c", " ".join(argv)]
        elif kind != "CMD":
            raise StackError(f"{service}: health check test {kind!r} is not supported")
        result = self.run("exec", self.container(service), *argv,
                          timeout=duration_s(check.get("timeout"), 30) + 5, check=False)
        return result.returncode == 0

    def state(self, service: str) -> str | None:
        result = self.run("container", "inspect", "--format", "{{.State.Status}}", self.container(service), check=False)
        return result.stdout.strip() if result.returncode == 0 else None

    def inspect(self, service: str, template: str) -> str:
        return self.run("container", "inspect", "--format", template, self.container(service)).stdout.strip()

    def logs(self, service: str, tail: int = 60) -> str:
        result = self.run("logs", "--tail", str(tail), self.container(service), check=False)
        return (result.stdout + result.stderr).strip()

    def down(self, volumes: bool = False) -> None:
        """Stop and remove the pod and its containers; with volumes, the project's volumes too."""
        if self.run("pod", "exists", self.pod, check=False).returncode == 0:
            self.run("pod", "rm", "--force", "--time", "10", self.pod, timeout=180)
        if volumes:
            for name in self.config.get("volumes") or {}:
                if name not in self.binds:
                    self.run("volume", "rm", "--force", self.volume(name), check=False)


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key:
            raise SystemExit(f"{what} takes KEY=VALUE, got {value!r}")
        out[key] = rest
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-file", type=Path, required=True, help="the .env file (see deploy/.env.example)")
    parser.add_argument("--file", type=Path, default=COMPOSE_FILE, help="compose file (default deploy/docker-compose.yml)")
    parser.add_argument("--project", default="exportfarm", help="pod, container and volume name prefix")
    parser.add_argument("--image", action="append", default=[], metavar="SERVICE=IMAGE", help="run this image for a service")
    parser.add_argument("--bind", action="append", default=[], metavar="VOLUME=DIR", help="a host directory for a named volume")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra setting for the farm's services")
    parser.add_argument("--mount", action="append", default=[], metavar="SRC:DST[:OPTS]", help="extra volume for the farm's services")
    sub = parser.add_subparsers(dest="action", required=True)
    build = sub.add_parser("build", help="build the images of the services' build sections")
    build.add_argument("--build-arg", action="append", default=[], metavar="KEY=VALUE")
    build.add_argument("--volume", action="append", default=[], help="podman build --volume")
    build.add_argument("services", nargs="*")
    up = sub.add_parser("up", help="start services (and what they depend on), waiting for each condition")
    up.add_argument("--timeout", type=float, default=300)
    up.add_argument("services", nargs="*")
    down = sub.add_parser("down", help="remove the pod and its containers")
    down.add_argument("--volumes", action="store_true", help="also remove the named volumes")
    args = parser.parse_args(argv)

    try:
        stack = Stack(resolve(args.env_file, args.file), project=args.project, images=_pairs(args.image, "--image"),
                      binds=_pairs(args.bind, "--bind"), env=_pairs(args.env, "--env"), mounts=args.mount)
        if args.action == "build":
            print(json.dumps(stack.build(args.services or None, _pairs(args.build_arg, "--build-arg"), args.volume)))
        elif args.action == "up":
            print(json.dumps(stack.up(args.services or list(stack.services), args.timeout)))
        else:
            stack.down(volumes=args.volumes)
    except StackError as exc:
        print(f"compose_podman: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
