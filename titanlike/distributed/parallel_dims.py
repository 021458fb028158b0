"""Parallelism degrees -> one named DeviceMesh and its flattened sub-meshes.

Mesh axes, outermost first: pp, dp_replicate, dp_shard, cp, tp. Only axes with degree > 1 exist in the
mesh (a size-1 axis buys nothing and costs a process group each). Flattened views:

  "dp"          dp_replicate x dp_shard   data loading: which slice of the global batch this rank reads
  "dp_shard_cp" dp_shard x cp             FSDP shards parameters over this (CP ranks hold the same params)
  "dp_cp"       dp_replicate x dp_shard x cp   token-count / loss all-reduce

Use `dims.get_mesh(name)` rather than `world_mesh[name]`: the flattened meshes are bookkept here
(slicing a flattened name out of the root mesh is deprecated from torch 2.11 on), and a name whose
axes are all trivial returns None instead of raising.

Expert parallelism (ep) does not multiply the world size: it borrows its ranks from dp_shard. With ep > 1 the
dp_shard axis is built as two, "efsdp" (dp_shard / ep, outer) x "ep" (inner: neighbouring ranks, whose links are the
fastest, exchange tokens), and "dp_shard" becomes their flattened view, so every flattened mesh above keeps its
meaning. Routed experts are sharded over "ep" and FSDP-sharded over "edp" = dp_replicate x efsdp x cp (the ranks
holding the same experts); everything else as without EP. edp's axes need not be neighbours (ep lies between efsdp
and cp): torch 2.13 flattens them into the right groups (tests/multiproc/test_dist_cp.py, eight ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titanlike.config.validate import check_degrees

# Outermost first: pp crosses the slowest links (its traffic is small), tp the fastest (NVLink).
MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
EP_AXES = ("efsdp", "ep")  # dp_shard split in two when ep > 1 (module doc)
# Flattened sub-meshes and the axes they span.
FLAT_MESHES = {
    "dp": ("dp_replicate", "dp_shard"),
    "dp_shard_cp": ("dp_shard", "cp"),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),
}


@dataclass
class ParallelDims:
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever world_size leaves after the other degrees
    cp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1
    world_size: int = 1
    world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False, compare=False)
    _meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._resolve_and_validate()

    @classmethod
    def from_config(cls, parallelism_cfg, world_size: int) -> "ParallelDims":
        """Build from the `[parallelism]` config section (titanlike.config.sections.Parallelism)."""
        c = parallelism_cfg
        return cls(
            dp_replicate=c.dp_replicate, dp_shard=c.dp_shard, cp=c.cp, tp=c.tp, pp=c.pp, ep=c.ep,
            world_size=world_size,
        )

    # ------------------------------------------------------------------------------ validation
    def _degrees(self) -> dict[str, int]:
        return {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "cp": self.cp,
                "tp": self.tp}

    def _resolve_and_validate(self) -> None:
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {self.world_size!r}")
        dp_shard, errors = check_degrees(self, self.world_size)  # the config's rules: one copy
        if errors:
            raise ValueError(errors[0])
        self.dp_shard = dp_shard

    # ------------------------------------------------------------------------------ properties
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def fsdp_enabled(self) -> bool:
        """True when parameters get sharded or replicated by FSDP2 (fully_shard) at all.

        Pure replication (dp_replicate > 1, dp_shard*cp == 1) also goes through fully_shard, over the
        replicate axis: same numerics as DDP, with ZeRO-3 memory instead of full replicas.
        """
        return self.dp_shard * self.cp > 1 or self.dp_replicate > 1

    @property
    def dp_degree(self) -> int:
        """How many distinct data streams (global batch = dp_degree * local batch)."""
        return self.dp_replicate * self.dp_shard

    @property
    def dp_cp_degree(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    # ------------------------------------------------------------------------------ meshes
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the world mesh (and the flattened views); None when world_size == 1.

        Needs the default process group (titanlike.distributed.init_distributed) or creates it itself
        (init_device_mesh does so from the torchrun environment). Calling it again builds a new mesh.
        """
        self._meshes = {}
        if self.world_size == 1:
            self.world_mesh = None
            return None
        degrees = self._degrees()
        axes = list(MESH_AXES)
        flat = dict(FLAT_MESHES)
        if self.ep > 1:  # dp_shard -> efsdp x ep, and dp_shard a flattened view of the two
            i = axes.index("dp_shard")
            axes[i:i + 1] = EP_AXES
            degrees.update(efsdp=self.dp_shard // self.ep, ep=self.ep)
            flat = {name: sum((EP_AXES if a == "dp_shard" else (a,) for a in spans), ())
                    for name, spans in flat.items()}
            # dp_shard is the two together; edp the ranks holding the same experts (their FSDP mesh)
            # (CP ranks hold the same experts and see different tokens: their replicas too)
            flat = {"dp_shard": EP_AXES, **flat, "edp": ("dp_replicate", "efsdp", "cp")}
        names = tuple(a for a in axes if degrees[a] > 1)
        mesh = init_device_mesh(device_type, tuple(degrees[a] for a in names), mesh_dim_names=names)
        for flat_name, axes in flat.items():
            present = tuple(a for a in axes if a in names)
            if len(present) == 1 and present[0] == flat_name:
                continue
            if present:  # every axis trivial -> no sub-mesh (get_mesh returns None)
                self._meshes[flat_name] = mesh[present]._flatten(flat_name)
        self.world_mesh = mesh
        return mesh

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """A 1-D (sub-)mesh by axis or flattened name; None when its degree is 1 or there is no mesh."""
        known = (*MESH_AXES, *EP_AXES, *FLAT_MESHES, "edp")
        if name not in known:
            raise KeyError(f"unknown mesh name {name!r}; known: {list(known)}")
        if self.world_mesh is None:
            return None
        if name in self._meshes:
            return self._meshes[name]
        if name in (self.world_mesh.mesh_dim_names or ()):
            return self.world_mesh[name]
        return None

    @property
    def fsdp_mesh(self) -> DeviceMesh | None:
        """Mesh for fully_shard: 2-D (dp_replicate, dp_shard[_cp]) = HSDP, 1-D = FSDP; None = no FSDP."""
        if self.world_mesh is None or not self.fsdp_enabled:
            return None
        shard = self.dp_shard * self.cp
        if self.dp_replicate > 1 and shard > 1:
            if self.cp == 1:
                return self.world_mesh[("dp_replicate", "dp_shard")]
            # Mixing a flattened name into a root slice is deprecated (warns) in torch >= 2.11 but still
            # works (HSDP with CP: tests/multiproc/test_dist_cp.py).
            return self.world_mesh[("dp_replicate", "dp_shard_cp")]
        if shard > 1:
            return self._meshes["dp_shard_cp"]
        return self.world_mesh["dp_replicate"]

    def dp_rank(self) -> int:
        """This rank's index among the dp_degree data streams (0 without data parallelism)."""
        if not self.dp_enabled:
            return 0
        dp_mesh = self.get_mesh("dp")
        if dp_mesh is None:
            raise RuntimeError("ParallelDims.dp_rank(): call build_mesh() first")
        return dp_mesh.get_local_rank()
