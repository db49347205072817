"""``make run``: the farm end to end on embedded defaults, as a new user would drive it.

Builds a small random-weight checkpoint, starts ``exportfarm serve`` (embedded: SQLite catalog, file
queue, local store, a supervised worker; no external server), submits an export over the REST API,
shows its stage and progress until it finishes, prints the artifact links (each file's size and
sha256, checked by downloading it through its link) and the catalog entry, then stops the farm
with SIGTERM and waits for it. Exits non-zero, with the farm's log tail, when anything fails.

    python -m services.demo [--work .work] [--port 0] [--arch qwen2] [--dtype fp32] [--ep cpu]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Api:
    def __init__(self, base: str, token: str):
        self.base, self.token = base, token

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.base + path, data=data, method=method,
                                         headers={"Authorization": f"Bearer {self.token}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as err:
            return err.code, _json(err.read())


def _json(body: bytes) -> dict:
    try:
        return json.loads(body or b"{}")
    except ValueError:
        return {"detail": body.decode(errors="replace")[:300]}


def _fail(message: str, log: Path | None) -> int:
    print(f"demo: {message}", file=sys.stderr)
    if log is not None and log.is_file():
        print("--- the farm's log (last 40 lines) ---", file=sys.stderr)
        print("\n".join(log.read_text(errors="replace").splitlines()[-40:]), file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path(".work"))
    parser.add_argument("--port", type=int, default=0, help="API port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--arch", default="qwen2")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--ep", default="cpu")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)

    from exporter.tiny_checkpoint import make_tiny_checkpoint

    model = f"demo-{args.arch}"
    work = args.work.absolute()
    models, data, log = work / "models", work / "farm", work / "farm.log"
    models.mkdir(parents=True, exist_ok=True)
    if not (models / model / "config.json").is_file():
        print(f"demo: building a small random-weight {args.arch} checkpoint in {models / model}")
        make_tiny_checkpoint(args.arch, models / model)
    port = args.port or _free_port()
    token = secrets.token_urlsafe(32)
    env = {**os.environ, "DATA_DIR": str(data), "MODELS_DIR": str(models), "ADMIN_TOKEN": token,
           "DATABASE_URL": "", "REDIS_URL": "", "S3_ENDPOINT_URL": "", "HF_HUB_OFFLINE": "1",
           "BENCH_CONTEXTS": "[64, 128]", "PUBLIC_BASE_URL": f"http://127.0.0.1:{port}"}
    print(f"demo: starting the embedded farm on http://127.0.0.1:{port} (data in {data}, log in {log})")
    with log.open("ab") as out:
        serve = subprocess.Popen([sys.executable, "-m", "services.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
                                 env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    api = Api(f"http://127.0.0.1:{port}", token)
    try:
        deadline = time.monotonic() + 120
        while True:
            if serve.poll() is not None:
                return _fail(f"serve exited with {serve.returncode} before answering", log)
            try:
                if api.call("GET", "/healthz")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                return _fail("serve did not answer /healthz within 120 s", log)
            time.sleep(0.3)
        body = {"model": model, "dtype": args.dtype, "ep": args.ep}
        status, export = api.call("POST", "/exports", body)
        if status not in (200, 202):
            return _fail(f"POST /exports answered {status}: {export.get('detail')}", log)
        print(f"demo: POST /exports {json.dumps(body)} -> {status}, export {export['id']} ({export['variant']})"
              + (" — an identical export exists, so it is returned" if status == 200 else ""))
        last, deadline = None, time.monotonic() + args.timeout
        while export["status"] in ("queued", "running"):
            shown = (export["status"], export["stage"], export["percent"])
            if shown != last:
                print(f"demo:   {export['status']:<8} stage {export['stage'] or '-':<9} {export['percent']:>3}%")
                last = shown
            if time.monotonic() > deadline:
                return _fail(f"export {export['id']} still {export['status']} after {args.timeout:.0f} s", log)
            time.sleep(0.5)
            status, latest = api.call("GET", f"/exports/{export['id']}")
            if status == 200:
                export = latest
            elif status not in (429, 503):  # busy or briefly unavailable: ask again
                return _fail(f"GET /exports/{export['id']} answered {status}: {latest.get('detail')}", log)
        print(f"demo: export {export['id']} is {export['status']}" + (f": {export['error']}" if export["error"] else ""))
        if export["status"] != "ready":
            return _fail("the export did not end ready", log)
        status, artifacts = api.call("GET", f"/exports/{export['id']}/artifacts")
        if status != 200:
            return _fail(f"GET /exports/{export['id']}/artifacts answered {status}: {artifacts.get('detail')}", log)
        print(f"demo: artifacts (signed links, valid {artifacts['expires_in_s']} s; each downloaded and its sha256 checked):")
        for name, entry in sorted(artifacts["files"].items()):
            with urllib.request.urlopen(entry["url"], timeout=60) as response:
                digest = hashlib.sha256(response.read()).hexdigest()
            ok = "ok" if not entry["sha256"] or digest == entry["sha256"] else f"MISMATCH (got {digest[:16]})"
            print(f"  {name:<20} {entry['size']:>12} bytes  sha256 {entry['sha256'][:16]}  {ok}  {entry['url']}")
            if ok != "ok":
                return _fail(f"{name} does not match its sha256", log)
        status, entry = api.call("GET", f"/catalog/models/{model}")
        print(f"demo: catalog entry GET /catalog/models/{model} -> {status}")
        print(json.dumps(entry, indent=2, default=str))
        print(f"demo: to browse this catalog: DATA_DIR={data} MODELS_DIR={models} ADMIN_TOKEN=<24+ characters> "
              "exportfarm serve, then open http://127.0.0.1:8000/ui and sign in with that token")
        return 0
    finally:
        if serve.poll() is None:
            print("demo: stopping the farm (SIGTERM)")
            serve.send_signal(signal.SIGTERM)  # serve stops its worker, hands back any job, then exits
            try:
                serve.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(serve.pid, signal.SIGKILL)
                serve.wait()
            print("demo: farm stopped" + (" cleanly" if serve.returncode in (0, -signal.SIGTERM) else
                                          f" (exit {serve.returncode})"))
            if serve.returncode not in (0, -signal.SIGTERM):
                print(f"demo: serve exited with {serve.returncode}; see {log}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
