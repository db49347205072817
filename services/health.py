"""The health checks a farm container runs on itself: the images' HEALTHCHECK, docker-compose.yml's
health checks and the Helm chart's probes all call this one module.

    python -m services.health worker   # this host's Celery node answers a ping over the broker
    python -m services.health beat     # the broker beat sends to answers from here
    python -m services.health api      # the API answers /healthz (--ready: /readyz)

A worker names itself celery@<hostname> (``exportfarm worker`` without ``--name``) and its main
process answers control messages even while its pool child runs an export, so a hung or
disconnected consumer fails the check while a busy one passes. A broker this probe cannot reach
is not the worker's fault: the check passes (saying so on stderr), since restarting every worker
during a Redis outage would only kill their running exports; Celery reconnects by itself once the
broker is back, and a worker that then still does not answer fails the check. A broker that answers
but refuses the credentials (a rotated password) fails it: a restart reads the new secret. Each check imports only the client
it needs (celery, kombu, urllib), never the export code, so a probe stays cheap next to a running
job. Exit status 0 when healthy, 1 when not, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys


def _broker_url() -> str:
    url = os.environ.get("REDIS_URL")
    if not url:
        raise SystemExit("health: REDIS_URL is not set (the broker the farm uses)")
    return url


def worker(timeout_s: float) -> str | None:
    """None when celery@<this hostname> answers a ping within timeout_s, or when the broker itself
    cannot be reached (not a reason to restart this worker); else why not."""
    from celery import Celery

    error = _broker_error(min(timeout_s, 5.0))
    if error is not None and _refused_credentials(error):
        return f"the broker refused this worker's credentials: {error}"  # a restart picks up new ones
    if error is not None:
        print(f"health: broker unreachable ({type(error).__name__}: {error}); not restarting this worker for "
              "it (its running export goes on; Celery reconnects when the broker is back)", file=sys.stderr)
        return None
    app = Celery(broker=_broker_url())
    app.conf.broker_connection_timeout = 5
    node = f"celery@{socket.gethostname()}"
    try:
        replies = app.control.ping(destination=[node], timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - the broker answered a moment ago: this is the ping failing
        return f"ping through the broker failed: {type(exc).__name__}: {exc}"
    return None if replies else f"{node} did not answer a ping within {timeout_s:g} s"


def _broker_error(timeout_s: float) -> Exception | None:
    """Why the broker does not accept a connection from here, or None when it does."""
    from kombu import Connection

    try:
        with Connection(_broker_url(), connect_timeout=timeout_s) as conn:
            conn.ensure_connection(max_retries=1, timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - whatever it is, the caller says what it means
        return exc
    return None


def _refused_credentials(error: BaseException | None) -> bool:
    """The broker answered, and refused the password (a rotated secret): not an outage."""
    while error is not None:
        if type(error).__name__ in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError"):
            return True
        error = error.__cause__ or error.__context__
    return False


def beat(timeout_s: float) -> str | None:
    """None when the broker accepts a connection from here."""
    error = _broker_error(timeout_s)
    return None if error is None else f"broker unreachable: {type(error).__name__}: {error}"


def api(timeout_s: float, ready: bool, port: int) -> str | None:
    """None when the API on this host answers /healthz (or /readyz) with 200."""
    import urllib.error
    import urllib.request

    path = "/readyz" if ready else "/healthz"
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as response:
            return None if response.status == 200 else f"{path} answered {response.status}"
    except urllib.error.HTTPError as err:
        return f"{path} answered {err.code}"
    except OSError as exc:
        return f"{path} unreachable: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("process", choices=["worker", "beat", "api"])
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for an answer")
    parser.add_argument("--ready", action="store_true", help="api: readiness (/readyz) instead of liveness")
    parser.add_argument("--port", type=int, default=8000, help="api: the port it listens on")
    args = parser.parse_args(argv)
    if args.process == "worker":
        problem = worker(args.timeout)
    elif args.process == "beat":
        problem = beat(args.timeout)
    else:
        problem = api(args.timeout, args.ready, args.port)
    if problem:
        print(f"health: {args.process}: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
