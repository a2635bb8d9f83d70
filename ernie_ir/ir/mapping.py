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
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import ErnieIRError

SHARD = "shard"
"""Param annotation of a rank graph's param that holds a slice of a global tensor:
{global_shape: [...], cuts: [{axis, ranges: [[start, stop], ...]}]} (absent: the whole tensor).
Written by the split pass; read by training (gradient sums, merged checkpoints) and planning."""


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

    @model_validator(mode="after")
    def _consistent(self) -> Mapping:
        expected = Mapping.create(self.tp, self.ep, num_experts=self.num_experts,
                                  vocab_size=self.vocab_size, _validate=False)
        if (self.world_size, self.moe_tp, self.ranks) != (expected.world_size, expected.moe_tp,
                                                          expected.ranks):
            raise ValueError("world_size, moe_tp and ranks must be what tp and ep imply")
        return self

    @classmethod
    def create(cls, tp: int = 1, ep: int = 1, *, num_experts: int | None = None,
               vocab_size: int | None = None, _validate: bool = True) -> Mapping:
        """The layout for `tp` x `ep`; MappingError (one line) when it cannot be built."""
        check_degrees(tp, ep, num_experts=num_experts)
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
                  "num_experts": num_experts, "vocab_size": vocab_size, "ranks": tuple(ranks)}
        if not _validate:
            return cls.model_construct(**values)
        return cls(**values)

    @property
    def is_single(self) -> bool:
        return self.world_size == 1

    def rank(self, r: int) -> RankLayout:
        return self.ranks[r]

    def describe(self) -> str:
        parts = [f"world {self.world_size}", f"tp {self.tp}"]
        if self.ep > 1:
            parts.append(f"ep {self.ep} (moe_tp {self.moe_tp})")
        return ", ".join(parts)


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
