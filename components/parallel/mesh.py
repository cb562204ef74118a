"""Parallel degrees and the device mesh.

world = dp_replicate × dp_shard. Expert parallelism borrows its ranks from dp_shard:
dp_shard = efsdp × ep, so every rank still reads its own data (data-parallel degree = world),
dense parameters are FSDP-sharded over (dp_replicate ×) dp_shard, and each expert's weights are
owned by one of the ep ranks and FSDP-sharded over efsdp.

Meshes: ``experts`` = ("dp_replicate", "efsdp", "ep") for expert params (their "ep" dim is a DTensor
shard, "efsdp" (and "dp_replicate") is FSDP), and ``dense`` = ("dp_replicate", "dp_shard") for
everything else (HSDP when dp_replicate > 1, else 1-D FSDP).

Across hosts (torchrun's ``LOCAL_WORLD_SIZE`` = L ranks a host, fewer than the world): where the EP group
stays inside a host (ep divides L) but the expert-FSDP group would span hosts, the experts are sharded
over the L / ep ranks of their host that hold the same experts and replicated across hosts (HSDP: the
experts mesh's "dp_replicate" grows by the factor taken from "efsdp"), so their all-gathers and
reduce-scatters stay on NVLink and only a gradient all-reduce of each host's shard crosses the network.
"""

import os

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from components.errors import UserError


@dataclass(frozen=True)
class ParallelDims:
    world: int
    dp_replicate: int
    dp_shard: int
    ep: int
    ranks_per_host: int = 0  # L from the launcher (0: one host)

    @property
    def efsdp(self) -> int:
        return self.dp_shard // self.ep

    @property
    def expert_shard_in_host(self) -> int:
        """Ranks each expert is FSDP-sharded over: efsdp, or with hosts where the expert-FSDP group would span
        them (ep dividing L), the L / ep of one host (the rest become replicas across hosts)."""
        L = self.ranks_per_host
        if 0 < L < self.world and L % self.ep == 0 and self.efsdp > L // self.ep and self.efsdp % (L // self.ep) == 0:
            return L // self.ep
        return self.efsdp

    @property
    def fsdp(self) -> bool:
        return self.world > 1


def parallel_dims(par_cfg, world: int, num_experts: int | None) -> ParallelDims:
    """Validate ``[parallelism]`` against the world size and the model; one-line errors."""
    rep, shard, ep = par_cfg.data_parallel_replicate_degree, par_cfg.data_parallel_shard_degree, par_cfg.expert_parallel_degree
    if rep < 1:
        raise UserError(f"[parallelism] data_parallel_replicate_degree = {rep} must be >= 1")
    if world % rep != 0:
        raise UserError(f"[parallelism] data_parallel_replicate_degree = {rep} does not divide the world size {world}")
    if shard == -1:
        shard = world // rep
    if shard < 1 or rep * shard != world:
        raise UserError(f"[parallelism] data_parallel_replicate_degree ({rep}) x data_parallel_shard_degree ({shard}) "
                        f"must equal the number of processes ({world}); set data_parallel_shard_degree = -1 to infer it")
    if ep < 1 or shard % ep != 0:
        raise UserError(f"[parallelism] expert_parallel_degree = {ep} must divide data_parallel_shard_degree = {shard} "
                        f"(EP borrows its ranks from it)")
    if num_experts is not None and ep > 1 and num_experts % ep != 0:
        raise UserError(f"[parallelism] expert_parallel_degree = {ep} does not divide the model's {num_experts} experts")
    if num_experts is None and ep > 1:
        raise UserError(f"[parallelism] expert_parallel_degree = {ep} but the model has no MoE layers")
    return ParallelDims(world, rep, shard, ep, ranks_per_host(world))


def ranks_per_host(world: int) -> int:
    """L: torchrun's ranks per node where it launched several nodes (``LOCAL_WORLD_SIZE`` < world), else 0."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return local if 0 < local < world and world % local == 0 else 0


@dataclass
class Meshes:
    experts: DeviceMesh  # ("dp_replicate", "efsdp", "ep")
    dense: DeviceMesh  # ("dp_replicate", "dp_shard") or ("dp_shard",)

    @property
    def ep(self) -> DeviceMesh:
        return self.experts["ep"]

    @property
    def expert_fsdp(self) -> DeviceMesh:
        """FSDP mesh of expert parameters (their ep dim is already a DTensor shard)."""
        return self.experts["dp_replicate", "efsdp"] if self.experts.size(0) > 1 else self.experts["efsdp"]


def build_mesh(dims: ParallelDims, device_type: str) -> Meshes | None:
    if dims.world == 1:
        return None
    shard = dims.expert_shard_in_host  # efsdp, or its part inside one host (the rest replicates across hosts)
    experts = init_device_mesh(device_type, (dims.dp_replicate * dims.efsdp // shard, shard, dims.ep),
                               mesh_dim_names=("dp_replicate", "efsdp", "ep"))
    if dims.dp_replicate > 1:
        dense = init_device_mesh(device_type, (dims.dp_replicate, dims.dp_shard),
                                 mesh_dim_names=("dp_replicate", "dp_shard"))
    else:
        dense = init_device_mesh(device_type, (dims.dp_shard,), mesh_dim_names=("dp_shard",))
    return Meshes(experts, dense)
