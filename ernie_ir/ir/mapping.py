"""The parallel layout: which rank holds which heads, experts and vocabulary rows.

A `Mapping` is plain data (pydantic), written into every artifact's manifest
and read by the split pass, the emitters and the runtimes: it is the one
source of truth for how a model is laid out over devices.

    world_size = max(tp, ep)
    attention, dense MLPs, shared experts, vocab: tensor-parallel over `tp` ranks
    routed experts: `ep` groups of whole experts, each cut `moe_tp = world / ep` ways

Supported layouts (everything collective spans the whole world, so no rank ever
sums a value twice): tp == world (ep divides tp: ep=1 is FastDeploy's default
TP-inside-experts, ep=tp is ERNIEKit's experts-over-the-mp-group, anything
between is EP groups with TP inside each expert), or tp == 1 with ep = world
(attention replicated, experts spread). `tp < ep` with tp > 1 would need
attention data parallelism (different tokens per group), which an SPMD
forward pass over one batch cannot express: it is refused with the layouts
that work.

Data parallelism (training only) replicates that model-parallel world `dp` times:
`processes = dp x world_size` processes, ordered as Paddle's hybrid topology (dp
outermost, model parallel innermost): process g is replica `g // world_size` and runs
rank graph `g % world_size`. Replicas share the rank graphs (an artifact stores
rank0..world_size-1 once); `sharding` (stage1 / stage2) splits the optimizer states
(and, stage 2, the gradients) over each dp group. `world_size` stays the model-parallel
world: the ranks a graph's collectives span.

Pipeline parallelism cuts every model-parallel rank graph into `pp` stages at decoder-layer
boundaries (`stages`: each stage's layers [first, stop)): `rank_graphs = pp x world_size`
graphs, graph g being stage `g // world_size` of model-parallel rank `g % world_size` (pp
outside mp, as Paddle's hybrid topology orders them); `micro_batches` is the schedule's
default split of each batch. Processes = dp x pp x world_size.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from .errors import ErnieIRError

SHARD = "shard"
"""Param annotation of a rank graph's param that holds a slice of a global tensor:
{global_shape: [...], cuts: [{axis, ranges: [[start, stop], ...]}]} (absent: the whole tensor).
Written by the split pass; read by training (gradient sums, merged checkpoints) and planning."""


PIPELINE_STAGE = "pipeline"
"""Graph metadata of a pipeline stage graph: {stage, pp, layers: [first, stop), stages,
needs_grad: the inputs whose gradient the previous stage needs, outputs_need_grad: the outputs
whose gradient this stage needs from the next, grad_edges: whether any gradient crosses each
edge, rank_varying_inputs: the inputs that differ between tensor-parallel ranks, tied: the
trainable params the first and the last stage both hold (a tied embedding; empty elsewhere)}. Written by
the pipeline cut (passes/parallel/pipeline_stages.py); read by the runtimes."""


def stage_info(metadata: dict[str, Any]) -> dict[str, Any] | None:
    """The pipeline-stage metadata of a graph's `metadata`, None for a whole graph."""
    info = metadata.get(PIPELINE_STAGE)
    return info if isinstance(info, dict) else None


Sharding = Literal["stage1", "stage2"]
SHARDING_STAGES: tuple[str, ...] = ("stage1", "stage2")
MAX_PROCESSES = 4096
"""The most processes a layout may ask for: the manifest's bound on ranks, which the launch
recipes (`--nproc_per_node`, the device list) are written for."""


def shard_of(annotations: dict[str, Any]) -> dict[str, Any] | None:
    """The `shard` annotation in a param's annotations, or None."""
    ann = annotations.get(SHARD)
    return ann if isinstance(ann, dict) else None


class MappingError(ErnieIRError):
    """A parallel layout that cannot be built: names the numbers and the degrees that work."""


class RankLayout(BaseModel):
    """What one rank holds."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    rank: int = Field(ge=0)
    tp_rank: int = Field(ge=0)
    """Position in the tensor-parallel group (attention heads, FFN columns, vocab rows)."""
    ep_rank: int = Field(ge=0)
    """Which group of whole routed experts this rank holds."""
    moe_tp_rank: int = Field(ge=0)
    """Position inside its expert group: the slice of each expert's intermediate axis."""
    experts: tuple[int, int] | None = None
    """Global indices [first, stop) of the routed experts held (None: no MoE)."""
    vocab: tuple[int, int] | None = None
    """Vocabulary rows [first, stop) of the embedding / lm_head held (None: unknown vocab)."""


class Mapping(BaseModel):
    """A layout over `world_size` ranks: tensor parallel `tp`, expert parallel `ep`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    world_size: int = Field(ge=1)
    tp: int = Field(ge=1)
    ep: int = Field(ge=1)
    moe_tp: int = Field(ge=1)
    """TP degree inside each routed expert: world_size / ep."""
    num_experts: int | None = None
    vocab_size: int | None = None
    ranks: tuple[RankLayout, ...]
    dp: int = Field(1, ge=1)
    """Data-parallel replicas of the model-parallel world (training): processes = dp x world_size."""
    sharding: Sharding | None = None
    """ZeRO sharding over each dp group: stage1 (optimizer states), stage2 (+ gradients)."""
    pp: int = Field(1, ge=1)
    """Pipeline stages: each model-parallel rank graph cut into pp stage graphs."""
    stages: tuple[tuple[int, int], ...] | None = None
    """Decoder layers [first, stop) of each stage (pp > 1)."""
    micro_batches: int = Field(1, ge=1)
    """Micro-batches a pipelined batch is split into by default (pp > 1)."""
    sp: bool = False
    """Sequence parallelism: the residual stream, norms and row biases on token shards over the
    tensor-parallel ranks (tp > 1)."""

    @model_validator(mode="after")
    def _consistent(self) -> Mapping:
        expected = Mapping.create(self.tp, self.ep, num_experts=self.num_experts,
                                  vocab_size=self.vocab_size, _validate=False)
        if (self.world_size, self.moe_tp, self.ranks) != (expected.world_size, expected.moe_tp,
                                                          expected.ranks):
            raise ValueError("world_size, moe_tp and ranks must be what tp and ep imply")
        if self.sharding is not None and self.dp == 1:
            raise ValueError("sharding needs data parallelism (dp > 1)")
        if (self.pp > 1) != (self.stages is not None) or (self.stages is not None and (
                len(self.stages) != self.pp or any(a >= b for a, b in self.stages)
                or any(self.stages[i][1] != self.stages[i + 1][0] for i in range(self.pp - 1)))):
            raise ValueError("stages must be pp contiguous, non-empty layer ranges")
        if self.micro_batches > 1 and self.pp == 1:
            raise ValueError("micro_batches needs pipeline parallelism (pp > 1)")
        if self.sp and self.tp < 2:
            raise ValueError("sp needs tensor parallelism (tp > 1)")
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """dp and sharding only where set: a model-parallel layout (and every rank graph's
        metadata, which never records dp) dumps as it did before data parallelism."""
        data = handler(self)
        if self.dp == 1:
            data.pop("dp", None)
        if self.sharding is None:
            data.pop("sharding", None)
        if self.pp == 1:
            for key in ("pp", "stages", "micro_batches"):
                data.pop(key, None)
        if not self.sp:
            data.pop("sp", None)
        return data

    @classmethod
    def create(cls, tp: int = 1, ep: int = 1, *, num_experts: int | None = None,
               vocab_size: int | None = None, dp: int = 1, sharding: Sharding | None = None,
               sp: bool = False, _validate: bool = True) -> Mapping:
        """The layout for `tp` x `ep` (times `dp` replicas; `sp`: sequence parallel); MappingError
        (one line) when it cannot be built."""
        check_degrees(tp, ep, num_experts=num_experts)
        check_sequence_parallel(tp, sp)
        world = max(tp, ep)
        moe_tp = world // ep
        ranks = []
        for r in range(world):
            ep_rank = r // moe_tp
            experts = None
            if num_experts is not None:
                per = num_experts // ep
                experts = (ep_rank * per, (ep_rank + 1) * per)
            vocab = None
            if vocab_size is not None:
                if tp > 1 and vocab_size % tp == 0:
                    per_v = vocab_size // tp
                    vocab = ((r % tp) * per_v, (r % tp + 1) * per_v)
                else:
                    vocab = (0, vocab_size)
            ranks.append(RankLayout(rank=r, tp_rank=r % tp, ep_rank=ep_rank,
                                    moe_tp_rank=r % moe_tp, experts=experts, vocab=vocab))
        values = {"world_size": world, "tp": tp, "ep": ep, "moe_tp": moe_tp,
                  "num_experts": num_experts, "vocab_size": vocab_size, "ranks": tuple(ranks),
                  "dp": dp, "sharding": sharding, "sp": sp}
        if not _validate:
            return cls.model_construct(**values)
        check_data_parallel(dp, sharding, world)
        return cls(**values)

    def with_data_parallel(self, dp: int = 1, sharding: Sharding | None = None) -> Mapping:
        """This model-parallel layout replicated `dp` times (MappingError, one line, when it
        cannot be)."""
        check_data_parallel(dp, sharding, self.world_size * self.pp)
        return self.model_copy(update={"dp": dp, "sharding": sharding})

    def with_pipeline(self, stages: tuple[tuple[int, int], ...], micro_batches: int = 1) -> Mapping:
        """This layout with every rank graph cut into len(stages) pipeline stages."""
        return Mapping.model_validate({**self.model_dump(), "pp": len(stages),
                                       "stages": tuple(stages), "micro_batches": micro_batches})

    @property
    def is_single(self) -> bool:
        """One rank graph (dp replicas may still run it on several processes)."""
        return self.world_size == 1

    @property
    def rank_graphs(self) -> int:
        """Rank graphs the artifact stores: pp x world_size (graph g: stage g // world_size)."""
        return self.pp * self.world_size

    @property
    def processes(self) -> int:
        """Processes (devices) a launch starts: dp x pp x world_size."""
        return self.dp * self.rank_graphs

    def process(self, g: int) -> tuple[int, int]:
        """(dp index, rank graph) of process `g`: dp outermost, as Paddle's hybrid topology
        orders them; the process runs rank graph `g % rank_graphs`."""
        return g // self.rank_graphs, g % self.rank_graphs

    def stage_of(self, graph: int) -> tuple[int, int]:
        """(pipeline stage, model-parallel rank) of rank graph `graph`."""
        return divmod(graph, self.world_size)

    def rank(self, r: int) -> RankLayout:
        return self.ranks[r]

    def process_groups(self) -> list[GroupRanks]:
        """The process groups a run of this layout creates, in creation order (every process
        creates every group): pipeline stages (`pipeline_group_ranks`) or data-parallel replicas
        (`data_parallel_group_ranks`) around the model-parallel groups; one model-parallel
        group over the world otherwise (none for one rank)."""
        if self.pp > 1:
            return pipeline_group_ranks(self.pp, self.world_size)
        if self.dp > 1:
            return data_parallel_group_ranks(self.dp, self.world_size)
        return [(("mp", 0), list(range(self.world_size)))] if self.world_size > 1 else []

    def describe(self) -> str:
        parts = [f"world {self.world_size}", f"tp {self.tp}{' (sp)' if self.sp else ''}"]
        if self.ep > 1:
            parts.append(f"ep {self.ep} (moe_tp {self.moe_tp})")
        if self.pp > 1:
            cuts = ", ".join(f"{a}-{b - 1}" for a, b in self.stages or ())
            parts.append(f"pp {self.pp} (layers {cuts}; {self.micro_batches} micro-batches)")
        if self.dp > 1:
            parts.append(f"dp {self.dp}{f' (sharding {self.sharding})' if self.sharding else ''}: "
                         f"{self.processes} processes")
        elif self.pp > 1:
            parts.append(f"{self.processes} processes")
        return ", ".join(parts)


GroupKey = tuple[str | int, ...]
"""A group's name in a listing: its kind, then the indices that tell it from the others of its kind
(("dp", m): the dp group of model-parallel rank m)."""

GroupRanks = tuple[GroupKey, list[int]]
"""(key, the global ranks of its processes) of one group."""


def data_parallel_group_ranks(dp: int, world: int) -> list[GroupRanks]:
    """The groups of `dp` replicas of `world` model-parallel ranks (process g: replica g // world,
    rank graph g % world): ("mp", d) the ranks of replica d (world > 1 only; otherwise a rank's
    model-parallel group is itself), ("dp", m) the replicas of model-parallel rank m."""
    wanted: list[GroupRanks] = []
    if world > 1:
        wanted += [(("mp", d), list(range(d * world, (d + 1) * world))) for d in range(dp)]
    wanted += [(("dp", m), [m + d * world for d in range(dp)]) for m in range(world)]
    return wanted


def pipeline_group_ranks(stages: int, world: int) -> list[GroupRanks]:
    """The groups of `stages` pipeline stages of `world` model-parallel ranks (process g: stage
    g // world, rank g % world): ("mp", s) the ranks of stage s (world > 1 only), ("edge", s, q)
    the 2-rank group of rank q's edge from stage s to s + 1 (Paddle's gloo p2p tags count per
    group, so each edge gets its own), ("ring", q) rank q's stages and ("ends", q) its first and
    last stage (a tied embedding's gradient sum) (more than 2 stages only: with 2 the edge is
    both)."""
    wanted: list[GroupRanks] = []
    if world > 1:
        wanted += [(("mp", s), list(range(s * world, (s + 1) * world))) for s in range(stages)]
    wanted += [(("edge", s, q), [s * world + q, (s + 1) * world + q])
               for s in range(stages - 1) for q in range(world)]
    if stages > 2:
        wanted += [(("ring", q), [s * world + q for s in range(stages)]) for q in range(world)]
        wanted += [(("ends", q), [q, (stages - 1) * world + q]) for q in range(world)]
    return wanted


def layout_name(dp: int, sharding: str | None, world: int) -> str:
    """A data-parallel layout in words: "dp 2 x mp 2, sharding stage1" (as messages name it)."""
    return f"dp {dp} x mp {world}, {f'sharding {sharding}' if sharding else 'no sharding'}"


def check_data_parallel(dp: int, sharding: str | None, world: int = 1) -> None:
    """Refuse (MappingError, one line) a data-parallel layout that cannot run: dp < 1, an
    unknown sharding stage, sharding without dp > 1, more processes than MAX_PROCESSES."""
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise MappingError(f"--dp {dp}: the data-parallel degree must be an integer >= 1")
    if sharding is not None and sharding not in SHARDING_STAGES:
        raise MappingError(f"--sharding {sharding}: unknown stage; use stage1 (optimizer states split over "
                           "the dp group) or stage2 (also the gradients)")
    if sharding is not None and dp == 1:
        raise MappingError(f"--sharding {sharding} splits the optimizer states over data-parallel replicas, "
                           "and there is one: add --dp N (N > 1) or drop --sharding")
    if dp > 1 and dp * world > MAX_PROCESSES:  # dp 1: the model-parallel checks judge the world
        raise MappingError(f"--dp {dp} x {world} model-parallel rank(s) = {dp * world} processes, more than "
                           f"the {MAX_PROCESSES} a launch recipe starts: lower --dp")


def check_sequence_parallel(tp: int, sp: bool) -> None:
    """Refuse (MappingError, one line) sequence parallelism without tensor parallelism: the one
    home of the rule that `--sp` needs `--tp 2` or more."""
    if sp and tp < 2:
        raise MappingError(f"--sp (sequence parallelism) shards the tokens over the tensor-parallel ranks: "
                           f"it needs --tp 2 or more, got --tp {tp}")


def check_degrees(tp: int, ep: int, *, num_experts: int | None = None) -> None:
    """Refuse layouts this toolchain cannot build, naming the ones that work."""
    if tp < 1 or ep < 1:
        raise MappingError(f"--tp {tp} --ep {ep}: degrees must be >= 1")
    world = max(tp, ep)
    if ep > 1 and num_experts is None:
        raise MappingError(f"--ep {ep}: this model has no routed experts; use --ep 1 (and --tp for "
                           "tensor parallelism)")
    if tp not in (1, world) or world % ep:
        def experts_fit(e: int) -> bool:
            return e == 1 or (num_experts is not None and num_experts % e == 0)

        layouts = [(world, d) for d in range(1, world + 1) if world % d == 0] + [(1, world)]
        works = [f"--tp {t} --ep {e}" for t, e in dict.fromkeys(layouts) if experts_fit(e)]
        raise MappingError(
            f"--tp {tp} --ep {ep}: unsupported layout (world {world}): tensor parallelism must span "
            f"every rank (tp = world, ep dividing it) or be off (tp 1); use one of {', '.join(works)}")
    if num_experts is not None and ep > 1 and num_experts % ep:
        ok = [d for d in range(1, num_experts + 1) if num_experts % d == 0 and d <= 64]
        raise MappingError(f"--ep {ep}: {num_experts} routed experts do not divide into {ep} groups "
                           f"of whole experts; use --ep in {ok}")
