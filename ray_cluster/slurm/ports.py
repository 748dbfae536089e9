"""Ray ports for a SLURM job, derived from the job id: two jobs on one host never pick the same port.

The range STRIDE_PORT_BASE..STRIDE_PORT_MAX (default 24000..32767: above Ray's default worker ports 10002-19999
and the Ray client's 23000-23999, below Linux's ephemeral ports 32768-60999) is cut into job slots of
`node_ports x nodes_per_host` ports; a job takes slot `job_id % slots`. Inside its slot, the job's i-th node on
a given host (usually i = 0: one SLURM node per host) takes the i-th block of `node_ports`:

    offset 0 GCS | 1 dashboard | 2 ray client server      (used on the head node only)
           3 node manager | 4 object manager | 5 metrics export | 6 dashboard agent (HTTP)
           7 dashboard agent (gRPC) | 8 runtime env agent | 9 spare | 10.. worker ports (min..max)

So jobs whose ids differ by less than `slots` never share a port, whatever nodes they land on. Where something
else already holds a port of the derived block, the launcher moves that node to the next slot whose block is
free (`PortScheme.slot_order`): the head before the plan is written, every other node when it starts (nobody
needs to know a non-head node's ports in advance).
"""

from __future__ import annotations

from dataclasses import dataclass

from stride.errors import StrideError

FIXED = ("gcs", "dashboard", "ray_client_server", "node_manager", "object_manager", "metrics_export",
         "dashboard_agent_listen", "dashboard_agent_grpc", "runtime_env_agent")
FIRST_WORKER_OFFSET = 10
MIN_WORKER_PORTS = 16


class PortError(StrideError, ValueError):
    """A port setting that cannot work; the message names the knob that fixes it."""


@dataclass(frozen=True)
class PortScheme:
    base: int = 24000           # STRIDE_PORT_BASE
    max_port: int = 32767       # STRIDE_PORT_MAX
    node_ports: int = 128       # STRIDE_NODE_PORTS: ports per Ray node (10 fixed + worker ports)
    nodes_per_host: int = 2     # STRIDE_NODES_PER_HOST: most nodes of one job that may share a host

    def __post_init__(self) -> None:
        if not 1024 <= self.base <= 65535:
            raise PortError(f"STRIDE_PORT_BASE ({self.base}) must be in 1024..65535; use e.g. STRIDE_PORT_BASE=24000")
        if not self.base < self.max_port <= 65535:
            raise PortError(f"STRIDE_PORT_MAX ({self.max_port}) must be above STRIDE_PORT_BASE ({self.base}) and at most "
                            f"65535; use e.g. STRIDE_PORT_MAX=32767")
        if self.node_ports < FIRST_WORKER_OFFSET + MIN_WORKER_PORTS:
            raise PortError(f"STRIDE_NODE_PORTS ({self.node_ports}) must be at least "
                            f"{FIRST_WORKER_OFFSET + MIN_WORKER_PORTS} ({FIRST_WORKER_OFFSET} fixed + worker ports); "
                            f"use STRIDE_NODE_PORTS=128")
        if self.nodes_per_host < 1:
            raise PortError(f"STRIDE_NODES_PER_HOST ({self.nodes_per_host}) must be at least 1")
        if self.slots < 1:
            raise PortError(f"STRIDE_PORT_BASE..STRIDE_PORT_MAX ({self.base}..{self.max_port}) is smaller than one job's "
                            f"{self.job_ports} ports (STRIDE_NODE_PORTS x STRIDE_NODES_PER_HOST); widen the range")

    @property
    def job_ports(self) -> int:
        return self.node_ports * self.nodes_per_host

    @property
    def slots(self) -> int:
        """How many jobs can share a host before two of them (ids `slots` apart) would reuse ports."""
        return (self.max_port + 1 - self.base) // self.job_ports

    def slot_of(self, job_id: int) -> int:
        return int(job_id) % self.slots

    def slot_order(self, slot: int) -> list[int]:
        """`slot` first, then the others in a fixed order: where to look when a block is taken."""
        return [(slot + k) % self.slots for k in range(self.slots)]

    def node(self, job_id: int, local_index: int) -> dict[str, int]:
        """Ports of the job's `local_index`-th node on its host: the FIXED names plus min/max_worker_port."""
        return self.node_at_slot(self.slot_of(job_id), local_index)

    def node_at_slot(self, slot: int, local_index: int) -> dict[str, int]:
        if not 0 <= local_index < self.nodes_per_host:
            raise PortError(f"{local_index + 1} of this job's nodes share one host but STRIDE_NODES_PER_HOST="
                            f"{self.nodes_per_host}; set STRIDE_NODES_PER_HOST={local_index + 1} (or more)")
        assert 0 <= slot < self.slots
        first = self.base + slot * self.job_ports + local_index * self.node_ports
        ports = {name: first + i for i, name in enumerate(FIXED)}
        ports["min_worker_port"] = first + FIRST_WORKER_OFFSET
        ports["max_worker_port"] = first + self.node_ports - 1
        return ports


def local_indices(addresses: list[str]) -> list[int]:
    """For each node (in job order), how many earlier nodes of the job share its host address."""
    seen: dict[str, int] = {}
    out = []
    for addr in addresses:
        out.append(seen.get(addr, 0))
        seen[addr] = out[-1] + 1
    return out


def expand_cpus_per_node(spec: str, num_nodes: int) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE ("2(x3),1") -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in filter(None, spec.split(",")):
        count, _, rep = part.partition("(x")
        out.extend([int(count)] * (int(rep.rstrip(")")) if rep else 1))
    if len(out) != num_nodes:
        raise PortError(f"SLURM_JOB_CPUS_PER_NODE ({spec!r}) does not list {num_nodes} nodes; set STRIDE_CPUS_PER_NODE")
    return out
