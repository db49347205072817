"""``exportfarm``: exporter commands plus the farm's (serve, worker, tokens, db)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from exporter import cli as exporter_cli
from exporter.errors import ExportError


def _cmd_serve(args) -> int:
    import uvicorn

    from services.api.app import create_app
    from services.settings import get_settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    if "public_base_url" not in settings.model_fields_set:
        # Links the API hands out (local-store downloads) point at where it actually listens.
        settings = settings.model_copy(update={"public_base_url": f"http://{args.host}:{args.port}"})
    _ready_schema(settings)
    farm = None
    if not settings.redis_url:
        # Embedded mode: the filesystem queue needs a local worker, and someone must sweep.
        from services.embedded import EmbeddedFarm

        farm = EmbeddedFarm(settings, worker=not args.no_worker)
    # The farm stops in the app's shutdown, not after uvicorn.run: uvicorn re-raises SIGTERM once
    # it has shut down, which ends the process before code after run() could stop the worker.
    app = create_app(settings, on_shutdown=(farm.stop,) if farm is not None else ())
    if farm is not None:
        farm.start()
    try:
        # The app alone decides who a client is (TRUSTED_PROXIES, services.api.guard.client_address):
        # uvicorn's own proxy headers trust X-Forwarded-For from 127.0.0.1 by default, which let any
        # local peer name itself anew per request and so never reach the failed-login limit.
        uvicorn.run(app, host=args.host, port=args.port, log_level="info", proxy_headers=False)
    finally:
        if farm is not None:
            farm.stop()
    return 0


def _cmd_worker(args) -> int:
    from exporter.versions import ort_version
    from services.queue import worker_queues
    from services.settings import get_settings
    from workers.app import make_celery

    _die_with_parent()
    settings = get_settings()
    if args.gpu is not None:
        settings = settings.model_copy(update={"gpu_device": args.gpu})
    if args.queues:  # the worker's own classes, for its placement checks as for Celery
        settings = settings.model_copy(update={"worker_queues": args.queues})
    _ready_schema(settings)
    name = args.name
    claim = None
    if settings.gpu_device is not None:
        # One worker per GPU: this process and its pool work on that device alone, and a second
        # worker bound to it on this host is refused here rather than sharing it.
        import socket

        from exporter.runtime.device import bind_cuda_device, claim_device

        bind_cuda_device(settings.gpu_device)
        claim = claim_device(settings.gpu_device)
        name = name or os.environ.get("EXPORTFARM_WORKER_NAME") or f"{socket.gethostname()}-gpu{settings.gpu_device}"
    if name:
        os.environ["EXPORTFARM_WORKER_NAME"] = name
    # Leases name the worker's main process; its pool process inherits this.
    os.environ["EXPORTFARM_WORKER_PID"] = str(os.getpid())
    try:
        from services.placement import queue_names

        queues = worker_queues(settings.worker_queues, ort_version(), queue_names(settings))
    except ValueError as err:
        raise ExportError(f"--queues: {err}") from None
    app = make_celery(settings)
    argv = ["worker", "-Q", ",".join(queues), "--concurrency", "1", "--loglevel", args.loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if name:
        argv += ["-n", f"{name}@%h"]
    try:
        app.worker_main(argv)
    finally:
        if claim is not None:
            claim.release()
    return 0


def _die_with_parent() -> None:
    """A worker started by ``serve`` (EXPORTFARM_PARENT_PID) is killed by the kernel when serve dies."""
    parent = os.environ.get("EXPORTFARM_PARENT_PID")
    if not parent:
        return
    from celery.platforms import set_pdeathsig

    set_pdeathsig("SIGKILL")
    if os.getppid() != int(parent):  # serve died before the death signal was armed
        raise SystemExit(1)


def _cmd_beat(args) -> int:
    import signal
    import threading

    from services.beat import Beat
    from services.queue import CeleryQueue
    from services.settings import get_settings

    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = get_settings()
    _ready_schema(settings)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger("exportfarm").info("beat: sweeping every %g s, checking runtimes every %g s",
                                         settings.sweep_interval_s, settings.beat_interval_s)
    Beat(settings, CeleryQueue(settings)).run(stop)
    return 0


def _ready_schema(settings) -> None:
    """Embedded mode migrates its own SQLite catalog; a deployment's is migrated by db-upgrade (its
    Helm job, compose's migrate service) and only checked here."""
    from services.catalog.database import check_schema, upgrade_schema

    if settings.embedded:
        upgrade_schema(settings.catalog_url)
    else:
        check_schema(settings.catalog_url)


def _cmd_token(args) -> int:
    from services import auth
    from services.catalog.database import session_scope
    from services.settings import get_settings

    settings = get_settings()
    _ready_schema(settings)
    with session_scope(settings.catalog_url) as session:
        if args.action == "list":
            for row in auth.list_tokens(session):
                state = "revoked" if row.revoked_at else ("expires " + row.expires_at.isoformat() if row.expires_at else "active")
                print(f"{row.id:>5}  {row.scope:<5}  {row.name:<30} {state:<32} last used {row.last_used_at or 'never'}")
            return 0
        if args.action == "revoke":
            if args.id is None:
                raise ExportError("token revoke needs --id N (see `exportfarm token list`)")
            if auth.revoke_token(session, args.id) is None:
                raise ExportError(f"no token {args.id} (see `exportfarm token list`)")
            print(f"token {args.id} revoked")
            return 0
        if not args.name:
            raise ExportError("token create needs --name (who or what will use it)")
        expires = args.expires_in_days * 86400 if args.expires_in_days is not None else None
        _row, token = auth.create_token(session, args.name, args.scope, expires_in_s=expires)
    print(token)
    return 0


def _cmd_db_upgrade(_args) -> int:
    from services.catalog.database import upgrade_schema
    from services.settings import get_settings

    upgrade_schema(get_settings().catalog_url)
    print("catalog schema is up to date")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = exporter_cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    p = sub.add_parser("serve", help="run the REST API (embedded mode also starts a local worker)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--no-worker", action="store_true", help="do not start a local worker in embedded mode")
    p.set_defaults(func=_cmd_serve)
    p = sub.add_parser("worker", help="run a Celery export worker")
    p.add_argument("--queues", default=None, help="comma-separated: cpu, gpu or QUEUE_CLASSES names (default WORKER_QUEUES)")
    p.add_argument("--name", default=None, help="worker name (default: the hostname; with a GPU bound, hostname-gpuN)")
    p.add_argument("--gpu", type=int, default=None, metavar="N",
                   help="bind this worker to GPU N (default GPU_DEVICE): one worker per GPU")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=_cmd_worker)
    p = sub.add_parser("beat", help="run the sweeper and the scheduler (re-exports after an ONNX Runtime upgrade)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=_cmd_beat)
    p = sub.add_parser("token", help="create (printed once; stored hashed), list or revoke API bearer tokens")
    p.add_argument("action", nargs="?", choices=["create", "list", "revoke"], default="create")
    p.add_argument("--name", default=None, help="create: who or what uses it")
    p.add_argument("--scope", choices=["read", "admin"], default="read")
    p.add_argument("--expires-in-days", type=float, default=None, help="create: default never")
    p.add_argument("--id", type=int, default=None, help="revoke: the token's id (token list)")
    p.set_defaults(func=_cmd_token)
    p = sub.add_parser("db-upgrade", help="migrate the catalog schema to the newest revision")
    p.set_defaults(func=_cmd_db_upgrade)
    return parser


def main(argv: list[str] | None = None) -> int:
    return exporter_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
