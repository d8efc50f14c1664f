"""What `thunderpool doctor` asks this machine, each probe small enough to fake in tests: the BLAS a
rank would load, a port to bind or reach, MLX and its jaccl backend, Metal's working set."""

from __future__ import annotations

import socket


def probe_blas() -> dict[str, str]:
    from thunderpool.launch.blas import fast_blas_env

    return fast_blas_env()


def try_bind(port: int) -> OSError | None:
    """Listen on all interfaces at `port` for an instant; the error if that is refused."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Like the real servers, so a recently closed connection (TIME_WAIT) does not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
            s.listen(1)
        except OSError as e:
            return e
    return None


def try_connect(host: str, port: int, timeout: float) -> OSError | None:
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        return e
    return None


def probe_mlx() -> tuple[str | None, bool, str]:
    """(MLX version or None, whether the ring backend is available, import error text)."""
    try:
        import mlx.core as mx
    except Exception as e:  # a broken wheel raises more than ImportError
        return None, False, f"{type(e).__name__}: {e}"
    return mx.__version__, bool(mx.distributed.is_available("ring")), ""


def probe_jaccl() -> bool | None:
    """Whether the installed MLX can run jaccl; None where it cannot be asked for one backend."""
    try:
        import mlx.core as mx
    except Exception:
        return False
    try:
        return bool(mx.distributed.is_available(backend="jaccl"))
    except TypeError:  # an MLX older than per-backend availability
        return None


def probe_working_set() -> int | None:
    """Metal's recommended working set (the GPU wired limit's default), None off Metal."""
    from thunderpool.cluster.node import metal

    info = metal.device_info()
    return int(info.get("max_recommended_working_set_size") or 0) or None if info else None
