"""A node's self-report (NodeInfo): hardware, versions, MLX backends and network interfaces.

Each probe is a small parser over one command's text output, so tests feed recorded outputs from
macOS and Linux through a fake `run`. Nothing is cached and nothing is sent over the network.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from thunderpool import __version__
from thunderpool.cluster.control.messages import Interface, LinkKind, NodeInfo, ThunderboltPort
from thunderpool.cluster.node import metal
from thunderpool.cluster.node.thunderbolt import parse_thunderbolt
from thunderpool.cores import work_cores
from thunderpool.planner.cost import LONG_ROW, SHORT_ROW

Runner = Callable[[Sequence[str]], tuple[int, str]]

# jaccl (RDMA over Thunderbolt) ships with macOS 26.2.
RDMA_MIN_MACOS = (26, 2)


def subprocess_runner(argv: Sequence[str]) -> tuple[int, str]:
    """Run argv and return (returncode, stdout); a missing command is 127, a hung one 124."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=15, check=False)
    except FileNotFoundError:
        return 127, ""
    except subprocess.TimeoutExpired:
        return 124, ""
    return done.returncode, done.stdout


def _output(run: Runner, *argv: str) -> str | None:
    code, out = run(argv)
    return out if code == 0 else None


# ---- versions and hardware ------------------------------------------------------------------


def parse_macos_version(text: str | None) -> tuple[int, ...] | None:
    """`sw_vers -productVersion` ("26.2\\n") -> (26, 2); None when unreadable."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else None


def version_text(version: tuple[int, ...]) -> str:
    return ".".join(str(p) for p in version)


def parse_cpuinfo(text: str) -> str:
    """/proc/cpuinfo -> the CPU model; ARM boards without "model name" fall back to others."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    for key in ("model name", "Hardware", "Model", "cpu model"):
        if fields.get(key):
            return fields[key]
    return platform.machine() or "unknown"


def parse_meminfo(text: str) -> tuple[int, int]:
    """/proc/meminfo -> (MemTotal, MemAvailable) in bytes (the file counts in KiB)."""
    values = {}
    for line in text.splitlines():
        match = re.match(r"(\w+):\s+(\d+)\s*kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    if "MemTotal" not in values:
        raise ValueError("/proc/meminfo has no MemTotal line; is /proc mounted?")
    # MemAvailable exists since Linux 3.14; older kernels only report MemFree.
    return values["MemTotal"], values.get("MemAvailable", values.get("MemFree", 0))


# (limit, usage, memory.stat's reclaimable page-cache key) of cgroup v2, then v1.
CGROUP_MEMORY = (
    ("sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory.current", "inactive_file"),
    (
        "sys/fs/cgroup/memory/memory.limit_in_bytes",
        "sys/fs/cgroup/memory/memory.usage_in_bytes",
        "total_inactive_file",
    ),
)


def cgroup_memory(root: Path, total: int, available: int) -> tuple[int, int]:
    """(total, available) within this process's cgroup memory limit (a container's `--memory`),
    which /proc/meminfo does not show; unchanged without a limit below `total`."""
    for limit_file, usage_file, cache_key in CGROUP_MEMORY:
        try:
            limit = int((root / limit_file).read_text().strip())  # v2 writes "max": no limit
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= total:
            return total, available
        cache = 0
        with contextlib.suppress(OSError, ValueError):
            stat = (root / limit_file).with_name("memory.stat")
            for line in stat.read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == cache_key:
                    cache = int(value)
        return limit, max(0, min(available, limit - usage + cache))
    return total, available


def parse_memsize(text: str) -> int:
    """`sysctl hw.memsize` ("hw.memsize: 68719476736") or `sysctl -n hw.memsize` -> bytes."""
    return int(text.rsplit(":", 1)[-1].strip())


def parse_vm_stat(text: str) -> int:
    """`vm_stat` -> available bytes: free + inactive (+ speculative, which vm_stat keeps apart
    from free) pages times the page size from its header."""
    page = re.search(r"page size of (\d+) bytes", text)
    page_size = int(page.group(1)) if page else 4096
    pages = {k.strip(): int(v) for k, v in re.findall(r"^Pages ([\w ]+):\s+(\d+)\.", text, re.M)}
    return page_size * sum(pages.get(k, 0) for k in ("free", "inactive", "speculative"))


# ---- RDMA and backends ----------------------------------------------------------------------


def parse_rdma_ctl(text: str | None) -> bool:
    """`rdma_ctl status` prints "enabled" or "disabled"."""
    words = re.findall(r"[a-z]+", (text or "").lower())
    return "enabled" in words and "disabled" not in words and "not" not in words


def parse_ibv_devices(text: str | None) -> tuple[str, ...]:
    """`ibv_devices` -> the device names under its two header lines, e.g. ("rdma_en2",)."""
    devices = []
    for line in (text or "").splitlines():
        fields = line.split()
        if fields and fields[0] not in ("device", "------"):
            devices.append(fields[0])
    return tuple(devices)


def backends(
    macos: tuple[int, ...] | None, rdma_enabled: bool, has_mpirun: bool
) -> tuple[str, ...]:
    found = ["ring"]
    if macos is not None and macos >= RDMA_MIN_MACOS and rdma_enabled:
        found.append("jaccl")
    if has_mpirun:
        found.append("mpi")
    return tuple(found)


# ---- interfaces -----------------------------------------------------------------------------


def parse_hardware_ports(text: str) -> dict[str, str]:
    """`networksetup -listallhardwareports` -> {device: port}, e.g. {"en2": "Thunderbolt 1"}."""
    ports: dict[str, str] = {}
    port = None
    for line in text.splitlines():
        if line.startswith("Hardware Port:"):
            port = line.split(":", 1)[1].strip()
        elif line.startswith("Device:") and port is not None:
            ports[line.split(":", 1)[1].strip()] = port
            port = None
    return ports


def parse_ifconfig(text: str) -> dict[str, dict]:
    """macOS `ifconfig` -> {name: {"flags", "inet" (IPv4 addresses), "members", "active"}}."""
    found: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        head = re.match(r"^(\S+): flags=\w+<([^>]*)>", line)
        if head:
            current = {"flags": head.group(2).split(","), "inet": [], "members": []}
            current["active"] = True
            found[head.group(1)] = current
            continue
        if current is None:
            continue
        fields = line.split()
        if fields[:1] == ["inet"] and len(fields) > 1:
            current["inet"].append((fields[1], _netmask_prefix(fields)))
        elif fields[:1] == ["member:"] and len(fields) > 1:
            current["members"].append(fields[1])
        elif fields[:1] == ["status:"]:
            current["active"] = fields[1:2] == ["active"]
    return found


def _netmask_prefix(fields: list[str]) -> int | None:
    """ifconfig's "inet A netmask 0xfffffffc ..." -> 30."""
    if "netmask" not in fields[:-1]:
        return None
    mask = fields[fields.index("netmask") + 1]
    try:
        return bin(int(mask, 16) if mask.startswith("0x") else int(mask)).count("1")
    except ValueError:
        return None


def macos_kind(port: str | None) -> LinkKind:
    """Classify a networksetup hardware port name."""
    name = (port or "").lower()
    if "wi-fi" in name or "airport" in name:
        return "wifi"
    # "Thunderbolt Ethernet Slot 1" is an Ethernet adapter that happens to sit on Thunderbolt.
    if "ethernet" in name or "lan" in name:
        return "ethernet"
    if name.startswith("thunderbolt"):
        return "thunderbolt"
    return "other"


def macos_interfaces(
    ifconfig: str, hardware_ports: dict[str, str], rdma_devices: Sequence[str]
) -> tuple[Interface, ...]:
    found = []
    for name, info in parse_ifconfig(ifconfig).items():
        if "LOOPBACK" in info["flags"] or "UP" not in info["flags"]:
            continue
        kind = macos_kind(hardware_ports.get(name))
        rdma = f"rdma_{name}" if f"rdma_{name}" in rdma_devices else None
        if rdma is not None:
            kind = "rdma"
        for address, prefix in info["inet"]:
            found.append(
                Interface(name=name, address=address, kind=kind, rdma_device=rdma, prefix=prefix)
            )
    return tuple(found)


def linux_interfaces(ip_json: str, sys_net: Path) -> tuple[Interface, ...]:
    """`ip -j addr` -> the up, non-loopback interfaces with an IPv4 address."""
    found = []
    for link in json.loads(ip_json or "[]"):
        flags = link.get("flags", [])
        if "LOOPBACK" in flags or "UP" not in flags:
            continue
        name = link["ifname"]
        if (sys_net / name / "wireless").exists():
            kind: LinkKind = "wifi"
        elif link.get("link_type") == "ether":  # physical NICs, veth and bridges alike
            kind = "ethernet"
        else:  # tun, wireguard, infiniband...
            kind = "other"
        for addr in link.get("addr_info", []):
            if addr.get("family") == "inet":
                prefix = addr.get("prefixlen")
                found.append(Interface(name=name, address=addr["local"], kind=kind, prefix=prefix))
    return tuple(found)


# ---- quick measurements ---------------------------------------------------------------------


def _copy_size(available: int) -> int:
    # Two arrays of at most 1/16 of free memory each, so a small node is not pushed into swap.
    return max(16 * 2**20, min(128 * 2**20, available // 16))


def _best_time(step: Callable[[], object], repeats: int, budget_s: float) -> float:
    """Best wall time of `step` over up to `repeats` runs, stopping once `budget_s` is spent."""
    best, spent = math.inf, 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        elapsed = time.perf_counter() - start
        best, spent = min(best, elapsed), spent + elapsed
        if spent > budget_s:
            break
    return best


def measure_memory_bandwidth(
    nbytes: int = 128 * 2**20, repeats: int = 3, row: int = LONG_ROW
) -> float:
    """Bytes per second an MLX fp32 matrix-vector product streams, best of `repeats`, with
    weight rows of `row` floats (CPU BLASes stream short rows slower: planner/cost.py).

    Decode is a chain of such products, so this predicts decode speed better than a raw copy
    (on Linux CPUs the mlx wheel's reference BLAS reaches a fraction of the copy bandwidth).
    """
    import mlx.core as mx

    rows = nbytes // (4 * row)
    w = mx.random.normal((rows, row), dtype=mx.float32)
    x = mx.random.normal((1, row), dtype=mx.float32)
    # x @ w.T is what nn.Linear runs for one token (a different, faster kernel than w @ x).
    mx.eval(w, x, x @ w.T)  # warm-up: materialise the matrix, pick the kernel
    return w.nbytes / _best_time(lambda: mx.eval(x @ w.T), repeats, budget_s=0.5)


def measure_split_bandwidth(nbytes: int = 128 * 2**20, repeats: int = 3) -> float:
    """Bytes per second of the same product with its rows split over this process's cores,
    one CPU stream each, as the compiled decode step runs it (engine/rowsplit.py); 0 where
    that step would not split (one core, a GPU)."""
    import mlx.core as mx

    from thunderpool.engine import rowsplit

    ways = rowsplit.ways()
    if ways < 2:
        return 0.0
    rowsplit.blas_threads(one_row=True)
    w = mx.random.normal((nbytes // (4 * LONG_ROW), LONG_ROW), dtype=mx.float32)
    x = mx.random.normal((1, LONG_ROW), dtype=mx.float32)
    parts = [w[a:b] for a, b in rowsplit.bounds(w.shape[0], ways)]
    streams = rowsplit.streams(len(parts))

    def product() -> mx.array:
        ys = [mx.matmul(x, p.T, stream=s) for p, s in zip(parts, streams, strict=True)]
        return mx.concatenate(ys, axis=-1)

    mx.eval(w, x, parts, product())
    return w.nbytes / _best_time(lambda: mx.eval(product()), repeats, budget_s=0.5)


def _gemv_rate(start_at: float, seconds: float, nbytes: int = 64 * 2**20) -> float:
    """Bytes/s of single-token GEMVs from `start_at` for `seconds` (one of several processes)."""
    import mlx.core as mx

    w = mx.random.normal((nbytes // (4 * 4096), 4096), dtype=mx.float32)
    x = mx.random.normal((1, 4096), dtype=mx.float32)
    mx.eval(w, x, x @ w.T)
    while time.time() < start_at:
        time.sleep(0.005)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        mx.eval(x @ w.T)
        n += 1
    return n * w.nbytes / (time.perf_counter() - t0)


def rank_env(**extra: str) -> dict[str, str]:
    """The environment rank processes run in (the fast BLAS on Linux, launch/blas.py): the
    agent itself runs MLX's bundled BLAS, 2-3x slower on GEMV, which would mislead the planner."""
    from thunderpool.launch.blas import fast_blas_env

    return {**os.environ, **fast_blas_env(), **extra}


def measure_op_latency(layers: int = 16, steps: int = 20) -> float:
    """Seconds a decode step spends per weight matmul besides streaming weights, on MLX's CPU
    backend (0 elsewhere: the GPU families have calibrated values). A tiny llama of mlx-lm's
    own blocks, whose weights stay in cache, decodes token by token; the time of all its ops
    (norms, RoPE, attention, activations) is charged to its 7 matmuls per layer, as the cost
    model charges op_latency_s."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    if mx.default_device() != mx.cpu:
        return 0.0
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=256,
    )
    model = llama.Model(args)
    cache = make_prompt_cache(model)
    mx.eval(model.parameters(), model(mx.array([[1, 2, 3, 4]]), cache=cache))
    times = []
    for _ in range(steps):
        out = model(mx.array([[5]]), cache=cache)  # built apart: the engine builds ahead
        start = time.perf_counter()
        mx.eval(out)
        times.append(time.perf_counter() - start)
    # The median step, as decode tok/s is a median: on one pinned core, MLX's stream thread
    # and Python take turns, which costs half as much again (best 32 us, median 51, here).
    return statistics.median(times) / (7 * layers + 1)


def measure_rank_speed(
    nbytes: int, core: int | None = None
) -> tuple[float, float, float, float, float]:
    """(GEMV bytes/s, the same with short rows, matmul FLOP/s, seconds per matmul of fixed
    cost, GEMV bytes/s split over the cores) measured in a child with the ranks' environment;
    in this process if the child fails. With `core`, the child runs as a pinned rank does: on
    that core alone with one BLAS thread (zeros if it fails: the planner then keeps the
    unpinned rates)."""
    from thunderpool.launch.local import one_core_env

    code = (
        "import os, sys; from thunderpool.cluster.node import capabilities as c; "
        "core = int(sys.argv[2]); core >= 0 and os.sched_setaffinity(0, {core}); "
        "n = int(sys.argv[1]); print(c.measure_memory_bandwidth(n), "
        "c.measure_memory_bandwidth(n, row=c.SHORT_ROW), c.measure_matmul_flops(), "
        "c.measure_op_latency(), c.measure_split_bandwidth(n))"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(nbytes), str(-1 if core is None else core)],
            env=rank_env(**one_core_env(core)),
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        bw, short_bw, flops, op_latency, split_bw = (float(x) for x in done.stdout.split())
        return bw, short_bw, flops, op_latency, split_bw
    except (OSError, ValueError, subprocess.SubprocessError):
        if core is not None:
            return 0.0, 0.0, 0.0, 0.0, 0.0
        short_bw = measure_memory_bandwidth(nbytes, row=SHORT_ROW)
        return measure_memory_bandwidth(nbytes), short_bw, measure_matmul_flops(), 0.0, 0.0


def measure_host_bandwidth(procs: int, seconds: float = 0.6) -> float:
    """Aggregate GEMV bandwidth with `procs` processes streaming at once: what co-located
    ranks share (on many machines one core cannot saturate the memory bus, or all can). Each
    runs one BLAS thread, as a rank pinned to one core does."""
    from thunderpool.launch.local import one_core_env

    start = time.time() + 3.0  # time for every process to import MLX and warm up
    code = (
        "import sys; from thunderpool.cluster.node.capabilities import _gemv_rate; "
        "print(_gemv_rate(float(sys.argv[1]), float(sys.argv[2])))"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(start), str(seconds)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=rank_env(**one_core_env(0)),
        )
        for _ in range(procs)
    ]
    total = 0.0
    for p in runs:
        out, _ = p.communicate(timeout=60)
        total += float(out.strip() or 0)
    return total


def usable_cores() -> list[int]:
    """The cores this process may run on: a container's cpuset (or `taskset`) gives fewer than
    the machine has, and its ranks get only those (os.cpu_count counts the machine's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def parse_platform_uuid(text: str | None) -> str:
    """`ioreg -rd1 -c IOPlatformExpertDevice` -> the hardware's IOPlatformUUID, or ""."""
    match = re.search(r'"IOPlatformUUID"\s*=\s*"([^"]+)"', text or "")
    return match.group(1) if match else ""


def host_id(macos: bool, run: Runner, root: Path, override: str | None = None) -> str:
    """Same for every agent on one machine and different between machines: the kernel's boot
    id (Linux), the hardware's IOPlatformUUID (macOS; `kern.uuid` is the kernel *build*'s,
    equal on every Mac of one macOS build), else that boot's session UUID.
    `override` (`node --host-id`) tells apart agents that share the kernel but not their cores
    and memory (containers with their own cpusets), which the boot id cannot."""
    if override:
        return override
    if macos:
        found = parse_platform_uuid(_output(run, "ioreg", "-rd1", "-c", "IOPlatformExpertDevice"))
        return found or (_output(run, "sysctl", "-n", "kern.bootsessionuuid") or "").strip()
    try:
        return (root / "proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def measure_matmul_flops(n: int = 1024, repeats: int = 4) -> float:
    """fp32 matmul FLOP/s on MLX's default device (the GPU on a Mac), best of `repeats`."""
    import mlx.core as mx

    a = mx.random.normal((n, n), dtype=mx.float32)
    b = mx.random.normal((n, n), dtype=mx.float32)
    mx.eval(mx.matmul(a, b))  # warm-up: kernel selection and allocation
    return 2 * n**3 / _best_time(lambda: mx.eval(mx.matmul(a, b)), repeats, budget_s=0.5)


def mlx_version() -> str:
    try:
        import mlx.core as mx
    except ImportError:
        return "not installed"
    return mx.__version__


# ---- the report -----------------------------------------------------------------------------


@contextlib.contextmanager
def measuring_alone(lock: Path | None = None) -> Iterator[None]:
    """Hold this machine's measurement lock: agents sharing a machine (e.g. one per network
    namespace) that measured at once would each see a fraction of it."""
    lock = lock or Path(tempfile.gettempdir()) / "thunderpool-measure.lock"
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        yield


def node_info(
    port: int,
    node_id: str,
    measure: bool = True,
    run: Runner = subprocess_runner,
    *,
    system: str | None = None,
    root: Path = Path("/"),
    host: str | None = None,
    metal_info: Callable[[], dict | None] = metal.device_info,
) -> NodeInfo:
    """This node's NodeInfo. `system` ("Darwin"/"Linux") and `root` (where /proc and /sys are)
    exist so tests can replay another machine's recorded outputs; `host` overrides host_id."""
    system = system or platform.system()
    rdma_devices: tuple[str, ...] = ()
    thunderbolt: tuple[ThunderboltPort, ...] = ()
    gpu = None
    rdma_enabled = False
    macos = None
    if system == "Darwin":
        macos = parse_macos_version(_output(run, "sw_vers", "-productVersion"))
        os_name = f"macOS {version_text(macos)}" if macos else f"macOS {platform.mac_ver()[0]}"
        chip = (_output(run, "sysctl", "-n", "machdep.cpu.brand_string") or "").strip()
        total = parse_memsize(_output(run, "sysctl", "-n", "hw.memsize") or "0")
        available = parse_vm_stat(_output(run, "vm_stat") or "")
        # The planner's budget is what Metal will wire, less a reserve (cluster/node/metal.py).
        gpu = metal.budget(total, metal_info(), _output(run, *metal.WIRED_LIMIT))
        available = min(available, gpu.bytes) if gpu else available
        rdma_enabled = parse_rdma_ctl(_output(run, "rdma_ctl", "status"))
        rdma_devices = parse_ibv_devices(_output(run, "ibv_devices"))
        ports = parse_hardware_ports(_output(run, "networksetup", "-listallhardwareports") or "")
        interfaces = macos_interfaces(_output(run, "ifconfig") or "", ports, rdma_devices)
        thunderbolt = parse_thunderbolt(
            _output(run, "system_profiler", "SPThunderboltDataType", "-json"), ports
        )
    else:
        os_name = f"{system} {platform.release()}"
        chip = parse_cpuinfo((root / "proc/cpuinfo").read_text())
        total, available = parse_meminfo((root / "proc/meminfo").read_text())
        total, available = cgroup_memory(root, total, available)
        interfaces = linux_interfaces(
            _output(run, "ip", "-j", "addr") or "[]", root / "sys/class/net"
        )
    rdma = macos is not None and macos >= RDMA_MIN_MACOS and rdma_enabled
    mem_bw, short_bw, flops, op_latency, host_bw, core_bw, core_flops, core_op = (0.0,) * 8
    split_bw = 0.0
    if measure:
        with measuring_alone():
            rank = measure_rank_speed(_copy_size(available))
            mem_bw, short_bw, flops, op_latency, split_bw = rank
            host_bw = measure_host_bandwidth(len(usable_cores()))
            cores = usable_cores() if hasattr(os, "sched_getaffinity") else []
            if len(cores) > 1:  # ranks are pinned only where the OS lets us (Linux)
                pinned = measure_rank_speed(_copy_size(available), cores[0])
                core_bw, _, core_flops, core_op, _ = pinned
    has_mpirun = run(("mpirun", "--version"))[0] == 0
    return NodeInfo(
        node_id=node_id,
        name=socket.gethostname(),
        port=port,
        version=__version__,
        mlx_version=mlx_version(),
        python_version=platform.python_version(),
        os=os_name,
        chip=chip or platform.processor() or platform.machine(),
        # A Mac counts its performance cores: work split over efficiency cores waits on them.
        cpu_count=work_cores("darwin", run) if system == "Darwin" else len(usable_cores()),
        memory_total_bytes=total,
        memory_available_bytes=available,
        mem_bw_Bps=mem_bw,
        host_mem_bw_Bps=host_bw,
        core_mem_bw_Bps=core_bw,
        core_flops=core_flops,
        core_op_latency_s=core_op,
        op_latency_s=op_latency,
        short_row_mem_bw_Bps=short_bw,
        split_mem_bw_Bps=split_bw,
        host_id=host_id(system == "Darwin", run, root, host),
        flops=flops,
        backends=backends(macos, rdma, has_mpirun),
        rdma=rdma,
        interfaces=interfaces,
        rdma_devices=rdma_devices,
        thunderbolt=thunderbolt,
        gpu_wired_limit_bytes=gpu.wired_limit_bytes if gpu else 0,
        memory_budget=gpu.describe() if gpu else "",
    )


if __name__ == "__main__":  # a quick look: python -m thunderpool.cluster.node.capabilities
    print(node_info(0, "local").model_dump_json(indent=2))
