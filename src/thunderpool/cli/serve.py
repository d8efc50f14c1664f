"""`thunderpool serve`: the API and dashboard live in this process; the ranks come and go.

The gateway (API side) is up before any rank loads, so /health shows load progress, and it
stays up across a lost node while the supervisor replans and starts a new instance.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import ipaddress
import logging
import math
import secrets
import sys
import threading
import time
from pathlib import Path

from rich.console import Console

from thunderpool.errors import LaunchError, ThunderpoolError
from thunderpool.parallel.layout import Layout

MEMBERS_EVERY_S = 2.0


def check_exposure(host: str, api_key: str | None, insecure: bool) -> None:
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise ThunderpoolError(f"--host {host} is not an IP address; use e.g. 0.0.0.0") from None
    if not loopback and not api_key and not insecure:
        raise ThunderpoolError(
            f"--host {host} exposes the API beyond this machine; pass --api-key KEY or set "
            "$THUNDERPOOL_API_KEY (or --insecure to serve without one)"
        )


def serve_main(args: argparse.Namespace, console: Console) -> int:
    from thunderpool.cli.flags import resolve_backend
    from thunderpool.config import api_key_from_env
    from thunderpool.serving.models import Models

    api_key = args.api_key or api_key_from_env()
    check_exposure(args.host, api_key, args.insecure)
    known = list(getattr(args, "known_model", None) or [])
    # No --model: the embedded one, unless every model is --known-model (loaded on demand).
    loaded = list(args.model or ([] if known else [None]))
    if args.cluster and len(loaded) + len(known) > 1:
        raise ThunderpoolError(
            "--cluster serves one model per `serve` for now; run one `serve --cluster --port P` "
            "per model, or serve several models on this machine's ranks without --cluster"
        )
    # Hybrid: one MLX ring world per group (mpirun starts one world), joined by hand-offs.
    groups = getattr(args, "groups", None)
    backend = "ring" if groups else resolve_backend(args, args.nodes or 2, serving=True)
    several = len(loaded) + len(known) > 1
    prepared = [_prepare(args, m, backend, console, several) for m in loaded + known]
    names = [k.name for k, _ in prepared]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ThunderpoolError(
            f"several --model/--known-model flags name the model {', '.join(twice)}; "
            "give each model once (models are known by their directory's name)"
        )
    keep = args.keep_alive if getattr(args, "keep_alive", None) is not None else math.inf
    max_loaded = getattr(args, "max_loaded", None)
    budget = getattr(args, "max_memory_gb", None)
    max_bytes = None if budget is None else int(budget * 2**30)
    models = Models([k for k, _ in prepared], console, keep, max_loaded, max_bytes=max_bytes)
    startup = names[: len(loaded)][:max_loaded]
    url = _start_api(args, models, api_key)
    what = ", ".join(startup) or "nothing until a request names a model"
    console.print(f"API and dashboard at {url} (loading {what}); Ctrl-C stops every rank")
    from thunderpool.serving.admin import admin_token_file

    console.print(f"admin endpoints (/v1/admin/*): token in {admin_token_file(args.port)}")
    gateway, plan = prepared[0][0].gateway, prepared[0][1]
    if args.cluster:
        from thunderpool.cli.cache import health_listener

        plan.fetch_listeners.append(health_listener(gateway))  # /health while weights move
        threading.Thread(target=_watch_members, args=(gateway, plan.members), daemon=True).start()
    # What startup built (modules, tokenizer, app) lives as long as serve: out of the collector's
    # reach, a full collection no longer holds the GIL for 60-170 ms mid-stream.
    gc.collect()
    gc.freeze()
    try:
        models.serve(startup)
    finally:
        models.stop()
    return 0


def _prepare(args, model: str | None, backend: str, console: Console, several: bool):
    """One model as `serve` knows it: (Known: name, gateway, how to start an instance; the
    plan: a ClusterPlanner with --cluster). Its config and tokenizer load here, its ranks later."""
    from mlx_lm.utils import load_tokenizer

    from thunderpool.cli.flags import resolve_backend
    from thunderpool.cli.proof import admit
    from thunderpool.cluster.control.remote_model import MARKER as REMOTE
    from thunderpool.engine.loader import read_config
    from thunderpool.engine.service import EngineInfo
    from thunderpool.launch.mpi import LOCAL_BACKENDS, SERVE_RING_REASON
    from thunderpool.models.source import resolve_model
    from thunderpool.serving.gateway import Gateway
    from thunderpool.serving.models import Known
    from thunderpool.serving.view import ClusterView

    args = argparse.Namespace(**{**vars(args), "model": model})
    if args.cluster:  # config and tokenizer from a member when this machine lacks the model
        from thunderpool.cli.connect import coordinator
        from thunderpool.cluster.control.remote_model import model_here_or_remote

        model_dir = model_here_or_remote(args.model, lambda: coordinator(args))
    else:
        model_dir = resolve_model(args.model)
    config = read_config(model_dir)
    if not args.cluster:
        from thunderpool.cli.jobs import local_layout

        layout, _ = local_layout(args, model_dir, args.nodes or 2)
        admit(config, args.nodes or 2, layout, args.allow_untested, backend, console)
    tokenizer = load_tokenizer(model_dir, eos_token_ids=config.get("eos_token_id"))
    limit = config.get("max_position_embeddings") or 4096
    max_context = min(args.max_context or limit, limit)
    # A model described by a member (remote_model.py): named as the user named it.
    name = Path(args.model).name if (model_dir / REMOTE).is_file() else model_dir.name
    # model_type names the family where tools are refused, and in Ollama's /api/show.
    cluster = {"model": name, "model_type": str(config.get("model_type", ""))}
    info = EngineInfo(name, max_context, int(time.time()), cluster)
    if args.cluster:
        plan, token, _members = _cluster(args, name, max_context, console)
    else:
        token = secrets.token_urlsafe(24)
        plan = _local(args, backend, layout, model_dir, name, max_context, token)
        why = ""
        if (
            backend == "ring"
            and getattr(args, "backend", "auto") == "auto"
            and resolve_backend(args, args.nodes or 2) == "mpi"
        ):
            why = f" ({SERVE_RING_REASON})"
        who = f"{name}: " if several else ""
        console.print(f"{who}{args.nodes or 2} local ranks, {LOCAL_BACKENDS[backend]}{why}")
    gateway = Gateway(info, tokenizer, token)
    shown = _print_loaded(console, f"{name} " if several else "")
    known = Known(name, gateway, plan, shown, ClusterView(config))
    if getattr(args, "max_memory_gb", None) is not None:
        from thunderpool.cli.serve_flags import check_budget
        from thunderpool.planner.spec import model_spec

        known.weight_bytes = model_spec(model_dir).total_bytes
        check_budget(name, known.weight_bytes, args.max_memory_gb)
    return known, plan


def _local(
    args, backend: str, layout: Layout, model_dir: Path, name: str, max_context: int, token: str
):
    from thunderpool.cli.jobs import prefix_cache_bytes, rank_job
    from thunderpool.config import LINK_TOKEN_ENV
    from thunderpool.engine.job import ServeTask
    from thunderpool.launch.mpi import local_instance

    nodes = args.nodes or 2
    task = ServeTask(
        model_name=name,
        max_batch=args.max_batch,
        max_context=max_context,
        prefix_cache_bytes=prefix_cache_bytes(args),
    )
    job = rank_job(args, task, nodes, layout, str(model_dir), backend)
    # On one host a lost rank is restarted in the same layout; the token authenticates the
    # gateway to the leader and reaches the ranks through their environment only.
    return lambda first: local_instance(job, timeout=None, env={LINK_TOKEN_ENV: token})


def _cluster(args, name: str, max_context: int, console: Console):
    from thunderpool.cli.cluster import ClusterPlanner
    from thunderpool.cli.jobs import prefix_cache_bytes, rank_job
    from thunderpool.engine.job import ServeTask

    task = ServeTask(
        link_host="0.0.0.0",
        model_name=name,
        max_batch=args.max_batch,
        max_context=max_context,
        prefix_cache_bytes=prefix_cache_bytes(args),
    )

    def make_job(world: int, layout: Layout, _model_dir: str | None = None):
        # Each node resolves the model as the user named it to its own copy.
        return rank_job(args, task, world, layout, args.model or "")

    planner = ClusterPlanner(args, make_job, None, console)
    return planner, planner.coord.token, planner.members


def _watch_members(gateway, members) -> None:
    """Keep /v1/cluster's member list fresh: a node that comes back shows up, unused."""
    while True:
        try:
            gateway.set_cluster(members=members())
        except Exception:  # noqa: BLE001 - no seed answers right now; keep the last list
            pass
        time.sleep(MEMBERS_EVERY_S)


def _print_loaded(console: Console, model: str = ""):
    """Per-rank lines on the terminal: what each rank runs on, then what it loaded (the
    dashboard draws the progress bar)."""
    from thunderpool.engine.blas import REFERENCE
    from thunderpool.launch.blas import INSTALL

    def show(ev) -> None:
        e = ev.event
        if e["kind"] == "runtime":
            backend = f"{e['backend']} backend" if e.get("backend") else "no collectives"
            where = f" ({e['blas_path']})" if e.get("blas_path") else ""
            console.print(f"[dim]{model}rank {ev.rank}: BLAS {e.get('blas')}{where}, {backend}[/]")
            if e.get("blas") == REFERENCE:
                console.print(
                    f"[yellow]rank {ev.rank} runs the mlx wheel's reference BLAS, ~30x slower "
                    f"at prefill; on Debian/Ubuntu: {INSTALL}[/]"
                )
        if e["kind"] == "loaded":
            console.print(
                f"[dim]{model}rank {ev.rank}: layers {e['layers'][0]}-{e['layers'][1] - 1}, "
                f"{e['param_bytes'] / 2**20:,.1f} MiB of weights in {e['seconds']:.1f} s[/]"
            )

    return show


def _log_requests() -> None:
    """The access log (api/observe.py) to stderr, one line per request."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    access = logging.getLogger("thunderpool.access")
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False


def _start_api(args, models, api_key: str | None) -> str:
    import uvicorn

    from thunderpool.api.dashboard import mount_dashboard
    from thunderpool.api.routes import create_app
    from thunderpool.serving.admin import mount_admin, write_admin_token

    _log_requests()
    app = create_app(
        models,
        api_key=api_key,
        log_prompts=args.log_prompts,
        cors_origins=args.cors_origin,
        bind_host=args.host,
        allowed_hosts=args.allowed_host,
        max_concurrent_per_key=args.max_concurrent_per_key,
    )
    token, path = write_admin_token(args.port)
    atexit.register(path.unlink, missing_ok=True)
    mount_admin(app, models.replanner(), token, api_key, models)
    mount_dashboard(app)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    )
    thread = threading.Thread(target=server.run, name="api", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise LaunchError(
                f"cannot listen on {args.host}:{args.port} (in use or not an address of this "
                "host); pass another --port or --host"
            )
        time.sleep(0.02)
    return f"http://{args.host}:{args.port}"
