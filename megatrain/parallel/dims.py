"""ParallelDims: the parallel sizes of a run, their validation, and the one DeviceMesh built from them.

The world is laid out as a 4-D mesh with named axes ``("pp", "dp", "cp", "tp")`` (outermost to
innermost, so tensor-parallel ranks are neighbours, as in Megatron). Data parallel is what is left
over: ``dp = world / (pp * cp * tp)``. Sub-meshes are handed out by axis name (``dims.mesh["tp"]``,
``dims.submesh("dp")``); code never assumes a 1-D mesh.

Expert parallelism (mixture-of-experts layers, ``ep``) folds the ``dp x cp x tp`` ranks of each pipeline
stage into ``(edp, ep)`` with ``ep`` innermost (Megatron's "parallel folding"): :meth:`expert_mesh` is a
second 3-D mesh ``("pp", "edp", "ep")`` over the same ranks; experts are split over ``ep`` and their
gradients reduced over ``edp`` (:mod:`megatrain.parallel.expert_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

    from megatrain.models.common.config import TransformerConfig

MESH_AXES = ("pp", "dp", "cp", "tp")
EXPERT_MESH_AXES = ("pp", "edp", "ep")
MOE_DISPATCHERS = ("allgather", "alltoall")


@dataclass
class ParallelDims:
    """Sizes of the pipeline (pp), data (dp), context (cp) and tensor (tp) parallel axes.

    ``dp`` of -1 (the default) means "the rest of the world". Sizes are checked on construction;
    :meth:`validate_model` checks a model shape against the tensor-parallel size.

    ``ep`` (``--expert-model-parallel-size``) splits each mixture-of-experts layer's experts over that
    many ranks of a pipeline stage; ``etp`` (``--expert-tensor-parallel-size``; None: Megatron's default,
    the tensor-parallel size) may only be 1 here: experts are never tensor-split, which gives the same
    numbers. ``moe_dispatcher`` is ``--moe-token-dispatcher-type`` (Megatron's flex arrives as alltoall: the
    same tokens moved, by PyTorch's all-to-all instead of DeepEP / HybridEP kernels).
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = -1
    sequence_parallel: bool = False
    ep: int = 1
    etp: int | None = None
    moe_dispatcher: str = "allgather"
    _mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _replica_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _expert_mesh: Any = field(default=None, init=False, repr=False, compare=False)
    _flat_meshes: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world size must be at least 1, got {self.world_size}")
        for flag, size in (("--tensor-model-parallel-size", self.tp), ("--pipeline-model-parallel-size", self.pp),
                           ("--context-parallel-size", self.cp)):
            if size < 1:
                raise ValueError(f"{flag} must be at least 1, got {size}")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size ({self.tp}) x "
                f"--pipeline-model-parallel-size ({self.pp}) x --context-parallel-size ({self.cp})")
        rest = self.world_size // model_parallel
        if self.dp == -1:
            self.dp = rest
        elif self.dp != rest:
            raise ValueError(
                f"data-parallel size {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} does not equal the "
                f"world size ({self.world_size})")
        if self.tp == 1:
            self.sequence_parallel = False
        self._check_expert_sizes()

    def _check_expert_sizes(self) -> None:
        ep, stage = self.ep, self.dp * self.cp * self.tp
        if ep < 1:
            raise ValueError(f"--expert-model-parallel-size must be at least 1, got {ep}")
        if stage % ep:
            raise ValueError(
                f"--expert-model-parallel-size ({ep}) must divide the ranks of each pipeline stage: world size "
                f"({self.world_size}) / --pipeline-model-parallel-size ({self.pp}) = {stage} (data x context x "
                f"tensor parallel)")
        if self.etp is not None:
            if self.etp < 1:
                raise ValueError(f"--expert-tensor-parallel-size must be at least 1, got {self.etp}")
            if self.etp > 1:
                raise ValueError(
                    f"--expert-tensor-parallel-size {self.etp}: splitting experts over tensor-parallel ranks is "
                    "not supported; use --expert-tensor-parallel-size 1 (each expert whole on its rank; the "
                    "numbers are the same; the tensor-parallel size itself is also accepted and runs as 1)")
        if ep > 1 and self.tp > 1 and not self.sequence_parallel:
            raise ValueError(
                f"--expert-model-parallel-size {ep} with --tensor-model-parallel-size {self.tp} needs "
                "--sequence-parallel (as in Megatron-LM: each rank routes its own part of the sequence)")
        if self.moe_dispatcher not in MOE_DISPATCHERS:
            raise ValueError(f"--moe-token-dispatcher-type must be allgather or alltoall, got "
                             f"{self.moe_dispatcher!r}")

    # ---- checks against the model --------------------------------------------------------------

    def validate_model(self, config: "TransformerConfig", *, orig_vocab_size: int | None = None,
                       make_vocab_size_divisible_by: int | None = None, seq_length: int | None = None) -> None:
        """Raise ValueError naming the flags when the model cannot be split ``tp`` ways."""
        tp = self.tp
        n, g = config.num_attention_heads, config.num_query_groups
        if n % tp:
            raise ValueError(f"--num-attention-heads ({n}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        if g is not None and g % tp:
            raise ValueError(f"--num-query-groups ({g}) must be divisible by --tensor-model-parallel-size ({tp}): "
                             f"each tensor-parallel rank holds whole query groups")
        assert config.ffn_hidden_size is not None
        if config.ffn_hidden_size % tp:
            raise ValueError(f"--ffn-hidden-size ({config.ffn_hidden_size}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        if config.vocab_size % tp:
            raise ValueError(f"the padded vocabulary ({config.vocab_size}) must be divisible by "
                             f"--tensor-model-parallel-size ({tp}); pad it with --make-vocab-size-divisible-by")
        if orig_vocab_size is not None and make_vocab_size_divisible_by is not None:
            multiple = make_vocab_size_divisible_by * tp
            if config.vocab_size % multiple or config.vocab_size < orig_vocab_size:
                raise ValueError(
                    f"vocabulary size {config.vocab_size} is not the tokenizer's {orig_vocab_size} padded to a "
                    f"multiple of --make-vocab-size-divisible-by ({make_vocab_size_divisible_by}) x "
                    f"--tensor-model-parallel-size ({tp})")
        if self.sequence_parallel and seq_length is not None and seq_length % tp:
            raise ValueError(f"--sequence-parallel needs --seq-length ({seq_length}) divisible by "
                             f"--tensor-model-parallel-size ({tp})")
        self.validate_experts(config)

    def validate_experts(self, config: "TransformerConfig") -> None:
        """Raise ValueError naming the flags when the mixture-of-experts layers cannot be split ``ep`` ways."""
        experts = getattr(config, "num_moe_experts", None)
        if experts is None:
            if self.ep > 1:
                raise ValueError(f"--expert-model-parallel-size {self.ep} needs a mixture-of-experts model "
                                 "(--num-experts)")
            return
        if experts % self.ep:
            raise ValueError(f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size "
                             f"({self.ep})")
        shared = getattr(config, "moe_shared_expert_intermediate_size", None)
        if shared is not None and shared % self.tp:
            raise ValueError(f"--moe-shared-expert-intermediate-size ({shared}) must be divisible by "
                             f"--tensor-model-parallel-size ({self.tp})")

    # ---- the mesh ------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters: data x context parallel (their gradients are reduced together)."""
        return self.dp * self.cp

    def replica_mesh(self) -> "DeviceMesh":
        """The 1-D mesh gradients are reduced over: ``dp``, or ``dp`` and ``cp`` flattened into one axis."""
        if self.cp == 1:
            return self.submesh("dp")
        if self._replica_mesh is None:
            self._replica_mesh = self.mesh["dp", "cp"]._flatten("dp_cp")
        return self._replica_mesh

    def build_mesh(self, device_type: str) -> "DeviceMesh":
        """Build (once) the 4-D DeviceMesh over all ranks; the process group must be initialised."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_AXES)
        return self._mesh

    @property
    def expert_data_parallel(self) -> int:
        """``edp``: the ranks of a pipeline stage holding the same experts (data x context x tensor / ep)."""
        return self.dp * self.cp * self.tp // self.ep

    def expert_mesh(self) -> "DeviceMesh":
        """The 3-D mesh ``("pp", "edp", "ep")`` over the same ranks as :attr:`mesh` (built once, by every
        rank): each stage's ``dp x cp x tp`` ranks in order, ``ep`` consecutive ranks an expert group."""
        if self._expert_mesh is None:
            import torch
            from torch.distributed.device_mesh import DeviceMesh

            ranks = torch.arange(self.world_size).reshape(self.pp, self.expert_data_parallel, self.ep)
            self._expert_mesh = DeviceMesh(self.mesh.device_type, ranks, mesh_dim_names=EXPERT_MESH_AXES)
            # The (edp, ep) ranks as one group: DTensor then reduces an expert gradient's norm over the
            # stage in one collective instead of two.
            self._expert_mesh["edp", "ep"]._flatten("edp_ep")
        return self._expert_mesh

    def flat_submesh(self, *axes: str) -> "DeviceMesh | None":
        """One 1-D mesh over the named world axes (flattened, built once); only axes of size > 1 count,
        None when none is left (the axes hold one rank)."""
        axes = tuple(a for a in axes if dict(zip(MESH_AXES, self.shape))[a] > 1)
        if not axes:
            return None
        if len(axes) == 1:
            return self.submesh(axes[0])
        if axes == ("dp", "cp"):
            return self.replica_mesh()
        if axes not in self._flat_meshes:
            self._flat_meshes[axes] = self.submesh(*axes)._flatten("_".join(axes))
        return self._flat_meshes[axes]

    @property
    def mesh(self) -> "DeviceMesh":
        if self._mesh is None:
            raise RuntimeError("ParallelDims.build_mesh(device_type) must be called before using the mesh")
        return self._mesh

    def submesh(self, *axes: str) -> "DeviceMesh":
        """The sub-mesh over the named axes, e.g. ``submesh("dp")`` or ``submesh("dp", "tp")``."""
        for a in axes:
            if a not in MESH_AXES:
                raise ValueError(f"unknown mesh axis {a!r}; axes are {MESH_AXES}")
        return self.mesh[axes[0]] if len(axes) == 1 else self.mesh[axes]

    def local_rank_on(self, axis: str) -> int:
        """This process's coordinate along ``axis`` (0 without a mesh)."""
        if self._mesh is None:
            return 0
        return self.mesh.get_local_rank(axis)

    @property
    def dp_rank(self) -> int:
        return self.local_rank_on("dp")

    @property
    def tp_rank(self) -> int:
        return self.local_rank_on("tp")

    @property
    def pp_rank(self) -> int:
        return self.local_rank_on("pp")

    def describe(self) -> str:
        return (f"world {self.world_size} = pp {self.pp} x dp {self.dp} x cp {self.cp} x tp {self.tp}"
                + (" (sequence parallel)" if self.sequence_parallel else "")
                + (f"; experts: ep {self.ep} x edp {self.expert_data_parallel} ({self.moe_dispatcher} dispatcher)"
                   if self.ep > 1 else ""))
