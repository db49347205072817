"""``exportfarm``: exporter commands plus the farm's (serve, worker, tokens, db)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from exporter import cli as exporter_cli


def _cmd_serve(args) -> int:
    import uvicorn

    from services.api.app import create_app
    from services.settings import get_settings

    settings = get_settings()
    if "public_base_url" not in settings.model_fields_set:
        # Links the API hands out (local-store downloads) point at where it actually listens.
        settings = settings.model_copy(update={"public_base_url": f"http://{args.host}:{args.port}"})
    worker = None
    if settings.redis_url is None and not args.no_worker:
        # Embedded mode: the file-based queue needs a local worker; run one beside the API.
        worker = subprocess.Popen([sys.executable, "-m", "services.cli", "worker", "--queues", "cpu,gpu"])
    try:
        uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level="info")
    finally:
        if worker is not None:
            worker.terminate()
            worker.wait(timeout=30)
    return 0


def _cmd_worker(args) -> int:
    from services.catalog.database import upgrade_schema
    from services.settings import get_settings
    from workers.app import make_celery

    settings = get_settings()
    upgrade_schema(settings.catalog_url)
    if args.name:
        os.environ["EXPORTFARM_WORKER_NAME"] = args.name
    app = make_celery(settings)
    argv = ["worker", "-Q", args.queues or settings.worker_queues, "--concurrency", "1", "--loglevel", args.loglevel,
            "--without-gossip", "--without-mingle", "--without-heartbeat"]
    if args.name:
        argv += ["-n", f"{args.name}@%h"]
    app.worker_main(argv)
    return 0


def _cmd_beat(args) -> int:
    from services.catalog.database import upgrade_schema
    from services.settings import get_settings
    from workers.app import make_celery

    settings = get_settings()
    upgrade_schema(settings.catalog_url)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    make_celery(settings).start(["beat", "--loglevel", args.loglevel])
    return 0


def _cmd_token(args) -> int:
    from services.auth import create_token
    from services.catalog.database import session_scope, upgrade_schema
    from services.settings import get_settings

    settings = get_settings()
    upgrade_schema(settings.catalog_url)
    with session_scope(settings.catalog_url) as session:
        token = create_token(session, args.name, args.scope)
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
    p.add_argument("--queues", default=None, help="comma-separated: cpu, gpu (default WORKER_QUEUES)")
    p.add_argument("--name", default=None, help="worker name (default: the hostname)")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=_cmd_worker)
    p = sub.add_parser("beat", help="run the scheduler: re-export what an ONNX Runtime upgrade made stale")
    p.add_argument("--loglevel", default="INFO")
    p.set_defaults(func=_cmd_beat)
    p = sub.add_parser("token", help="create an API bearer token (printed once; stored hashed)")
    p.add_argument("--name", required=True)
    p.add_argument("--scope", choices=["read", "admin"], default="read")
    p.set_defaults(func=_cmd_token)
    p = sub.add_parser("db-upgrade", help="migrate the catalog schema to the newest revision")
    p.set_defaults(func=_cmd_db_upgrade)
    return parser


def main(argv: list[str] | None = None) -> int:
    return exporter_cli.run(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
