"""`ParallelConfig`: how an engine's replicas and their devices are laid out (vLLM's data and
tensor parallelism), checked where it is built. Host side: never imports jax. Re-exported by
`jaxserve.config`, whose `EngineArgs.parallel_config()` builds it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelConfig:
    """Data parallelism (vLLM's): `data_parallel_size` engine replicas, each on its own
    `tensor_parallel_size` devices. Internal load balancing (rank None): one server runs every
    replica (`engine/data_parallel.py`). External (`data_parallel_rank` r): this process is
    replica r alone, on the devices of local rank r mod `data_parallel_size_local` (default: all
    ranks on this host), behind a balancer of the user's. With `data_parallel_size_local` L below
    the size and no rank, the server runs ranks 0..L-1 and the others are headless hosts
    (ranks from `data_parallel_start_rank`) dialling `data_parallel_address`:`_rpc_port`
    (`engine/dp_remote.py`)."""
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        rank, local = self.data_parallel_rank, self.data_parallel_size_local
        if rank is not None and (not isinstance(rank, int) or not 0 <= rank < self.data_parallel_size):
            raise ValueError(f"data_parallel_rank must be in [0, data_parallel_size="
                             f"{self.data_parallel_size}), got {rank!r}")
        if local is not None and (not isinstance(local, int) or not 1 <= local <= self.data_parallel_size):
            raise ValueError(f"data_parallel_size_local must be in [1, data_parallel_size="
                             f"{self.data_parallel_size}], got {local!r}")
        start = self.data_parallel_start_rank
        if start is not None and (not isinstance(start, int) or not 0 <= start
                                  < self.data_parallel_size - (local or 1) + 1):
            raise ValueError(f"data_parallel_start_rank must be in [0, data_parallel_size - "
                             f"data_parallel_size_local], got {start!r}")
        port = self.data_parallel_rpc_port
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 < port < 65536):
            raise ValueError(f"data_parallel_rpc_port must be a TCP port, got {port!r}")
        if self.data_parallel_address is not None and (not isinstance(self.data_parallel_address, str)
                                                       or not self.data_parallel_address):
            raise ValueError(f"data_parallel_address must be a host name or address, got "
                             f"{self.data_parallel_address!r}")

    @property
    def local_ranks(self) -> range:
        """The ranks this host's processes run (a headless host's: from its start rank)."""
        local = self.data_parallel_size_local or self.data_parallel_size
        start = self.data_parallel_start_rank or 0
        return range(start, start + local)

    def replica_devices(self, devices: list, rank: int | None = None) -> list:
        """The devices of replica `rank` (default: this process's) among this host's
        `devices`: slice (local rank) of tensor_parallel_size devices. A host that shows only
        one replica's devices (CUDA_VISIBLE_DEVICES per rank) gives them all."""
        rank = self.data_parallel_rank if rank is None else rank
        tp = self.tensor_parallel_size
        if rank is None or self.data_parallel_size == 1 or len(devices) == tp:
            return list(devices)
        local = rank - self.local_ranks.start if rank in self.local_ranks else \
            rank % (self.data_parallel_size_local or self.data_parallel_size)
        if (local + 1) * tp > len(devices):
            raise ValueError(f"data_parallel_rank {rank} (local rank {local}) needs devices "
                             f"{local * tp}..{(local + 1) * tp - 1} (tensor_parallel_size {tp} "
                             f"each), but this host has {len(devices)}")
        return list(devices[local * tp:(local + 1) * tp])
