"""Control-plane wire messages: frozen pydantic models, discriminated on `kind`.

Every message between nodes is one of these, serialized as JSON and signed with the cluster
token (cluster/control/auth.py). No pickle, and no generated token ever passes through here.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

LinkKind = Literal["rdma", "thunderbolt", "ethernet", "wifi", "loopback", "other"]


class Wire(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Interface(Wire):
    """One usable network interface of a node."""

    name: str
    address: str  # IPv4/IPv6 address on this interface
    kind: LinkKind = "other"
    rdma_device: str | None = None  # e.g. "rdma_en2" where ibv_devices lists one
    prefix: int | None = None  # the network's prefix length (netmask), e.g. 30 on a cable


class ThunderboltPort(Wire):
    """One Thunderbolt port of a Mac (cluster/node/thunderbolt.py)."""

    iface: str  # its network interface, e.g. "en3" for hardware port "Thunderbolt 3"
    uuid: str  # its domain UUID
    connected_to: str | None = None  # the domain UUID of the Mac port cabled to it
    speed_gbps: int | None = None  # a cabled port's link speed (80: TB5, 40: TB4); None: unread


class Route(Wire):
    """One IPv4 route of a node: `destination` as a network ("0.0.0.0/0": the default)."""

    destination: str
    interface: str
    gateway: str = ""


class NodeInfo(Wire):
    """What a node reports about itself when it joins."""

    node_id: str  # stable per machine (generated once, stored with the token)
    name: str  # hostname
    port: int  # the agent's control port
    version: str  # thunderpool version
    mlx_version: str
    python_version: str
    os: str  # e.g. "Linux 6.1" or "macOS 26.2"
    chip: str  # e.g. "Apple M3 Ultra" or the CPU model
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    mem_bw_Bps: float = 0.0  # quick measured memory bandwidth (one rank streaming weights)
    host_mem_bw_Bps: float = 0.0  # the same with every core streaming at once
    # What a rank pinned to one core with one BLAS thread gets (ranks sharing a machine are).
    core_mem_bw_Bps: float = 0.0
    core_flops: float = 0.0
    core_op_latency_s: float = 0.0  # op_latency_s on that core (its threads share it)
    # A decode step's fixed cost per weight matmul, measured where no calibration exists
    # (MLX's CPU backend); 0: the planner takes the calibrated value for the chip.
    op_latency_s: float = 0.0
    short_row_mem_bw_Bps: float = 0.0  # mem_bw_Bps with weight rows of 512 floats, not 4096
    # mem_bw_Bps with each product's rows split over the cores, as compiled decode steps
    # run (engine/rowsplit.py); 0: not measured, or the step does not split there.
    split_mem_bw_Bps: float = 0.0
    # Equal for agents sharing one machine's cores and memory (e.g. network namespaces): the
    # boot id, unless `node --host-id` tells apart containers with cpusets of their own.
    host_id: str = ""
    flops: float = 0.0  # quick measured fp32 matmul FLOP/s
    backends: tuple[str, ...] = ("ring",)  # MLX distributed backends usable here
    rdma: bool = False
    interfaces: tuple[Interface, ...] = ()
    rdma_devices: tuple[str, ...] = ()  # what `ibv_devices` lists, up or not
    # Those whose port `ibv_devinfo` shows PORT_ACTIVE; None: not read (every listed one counts).
    rdma_active: tuple[str, ...] | None = None
    routes: tuple[Route, ...] = ()  # IPv4 routes (cable subnets must stay clear of them)
    thunderbolt: tuple[ThunderboltPort, ...] = ()  # a Mac's ports and what they are cabled to
    # The agent's clock (ns) at start and whenever its network facts change (a cable plugged,
    # `doctor --fix` addressing it): a peer's older copy never overwrites a newer self-report.
    revision: int = 0
    # A Mac: what Metal will wire (cluster/node/metal.py), which bounds memory_available_bytes, and
    # how (`plan` shows it); 0 and "" elsewhere.
    gpu_wired_limit_bytes: int = 0
    memory_budget: str = ""


class Hello(Wire):
    """A node asks to join (or a coordinator greets a node)."""

    kind: Literal["hello"] = "hello"
    node: NodeInfo
    contact: str = ""  # host:port where its agent answers; the receiver fills in the peer IP


class Left(Wire):
    kind: Literal["left"] = "left"
    node_id: str
    reason: str = ""


class ProbeRequest(Wire):
    """Coordinator -> agent a: measure the link to node b at address:port."""

    peer: str  # node_id of b
    address: str
    port: int


class LinkMeasured(Wire):
    """Latency and bandwidth between two nodes over one pair of addresses."""

    kind: Literal["link"] = "link"
    a: str  # node_id
    b: str  # node_id
    a_address: str
    b_address: str
    rtt_s: float  # median round trip time
    bandwidth_Bps: float
    link: LinkKind


class RankSpec(Wire):
    """One rank process an agent must start."""

    instance_id: str
    rank: int
    world_size: int
    job: str  # engine.job.RankJob as JSON
    env: dict[str, str] = Field(default_factory=dict)
    # Files the agent writes before starting the rank, each path exported as the env var named
    # by its key: MLX_HOSTFILE (ring) or MLX_IBV_DEVICES (jaccl's RDMA device matrix).
    files: dict[str, str] = Field(default_factory=dict)
    # Pin to the agent's cpu-th usable core: ranks sharing a machine each get their own.
    cpu: int | None = None


class StartRanks(Wire):
    kind: Literal["start"] = "start"
    ranks: tuple[RankSpec, ...]


class StopInstance(Wire):
    kind: Literal["stop"] = "stop"
    instance_id: str
    reason: str = ""


# What the state's reducer applies (StartRanks and StopInstance go to an agent, not to it).
Message = Annotated[Hello | Left | LinkMeasured, Field(discriminator="kind")]
