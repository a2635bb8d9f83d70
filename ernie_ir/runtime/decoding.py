"""The generation loop over a decoder graph (the `kv-cache` pass), whatever runs it.

    result = decode(step, cache_layers, prompts, DecodeOptions(max_new_tokens=32))

`step(feeds) -> outputs` is one call of a decoder: feeds `input_ids`, `attention_mask`,
`position_ids`, `past_key_values.{i}.key/.value`; outputs `logits` and `present.{i}.key/.value`
(the interpreter, an onnxruntime session, the Paddle Layer, the SPMD interpreter all fit).
Prompts of unequal length are left-padded: pads get mask 0 and the positions of each row count
its real tokens only, so a row decodes as it would alone. The first call (prefill) reads the
prompts with an empty past; every later call reads one token per row and the cache the previous
call returned. Greedy picks the first largest logit; sampling applies temperature, then top-k,
then top-p (nucleus), in float64, with a seeded generator. A row ends at an EOS id, when
`stop(row, new_ids)` says so (e.g. a stop string in its text), or after max_new_tokens; the loop
ends when every row has.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ernie_ir.ir import DType, ErnieIRError, Graph

StepFn = Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]]
PAST = "past_key_values.{i}.{kind}"
PRESENT = "present.{i}.{kind}"


class DecodeError(ErnieIRError):
    """A generation request that cannot run (one line: what and how to fix it)."""


@dataclass(frozen=True)
class SamplingOptions:
    """How the next token is chosen. `greedy`: the first largest logit (the other fields unused)."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None

    def check(self) -> None:
        """DecodeError naming the option that is out of range."""
        if self.greedy:
            return
        if not (self.temperature > 0 and np.isfinite(self.temperature)):
            raise DecodeError(f"--temperature must be > 0 (got {self.temperature}); use --greedy for "
                              "deterministic decoding")
        if not 0 < self.top_p <= 1:
            raise DecodeError(f"--top-p must be in (0, 1] (got {self.top_p})")
        if self.top_k is not None and self.top_k < 1:
            raise DecodeError(f"--top-k must be >= 1 (got {self.top_k})")


@dataclass(frozen=True)
class DecodeOptions:
    max_new_tokens: int = 32
    sampling: SamplingOptions = field(default_factory=SamplingOptions)
    eos_ids: frozenset[int] = frozenset()
    """Ids that end a row (empty: none does, e.g. --ignore-eos)."""
    pad_id: int = 0
    """The id fed for pads and for rows that have ended (never attended to: mask 0)."""
    keep_logits: bool = False
    """Record each step's logits of every row (`DecodeResult.step_logits`)."""


@dataclass
class DecodeResult:
    prompts: list[list[int]]
    new_tokens: list[list[int]]
    finish_reasons: list[str]
    """Per row: "eos", "stop" or "length"."""
    prefill_ms: float
    decode_ms: list[float]
    """Wall time of each decode step after the prefill."""
    step_logits: list[np.ndarray] = field(default_factory=list)
    """With keep_logits: per step, float32 [B, V], the logits each row's next token was chosen from."""

    @property
    def sequences(self) -> list[list[int]]:
        """Prompt + new tokens, per row."""
        return [p + n for p, n in zip(self.prompts, self.new_tokens, strict=True)]

    @property
    def decode_ms_per_token(self) -> float:
        """Mean wall time of a decode step (one token per row); 0.0 when there was none."""
        return float(np.mean(self.decode_ms)) if self.decode_ms else 0.0


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None) -> list[list[int]]:
    """The prompts as lists of ints; DecodeError for an empty batch or prompt, or an id outside
    [0, vocab_size)."""
    rows = [[int(t) for t in p] for p in prompts]
    if not rows:
        raise DecodeError("no prompt given: give at least one")
    for r, row in enumerate(rows):
        if not row:
            raise DecodeError(f"prompt {r} is empty: give at least one token")
        bad = [t for t in row if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if bad:
            raise DecodeError(f"prompt {r}: token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return rows


def choose(logits: np.ndarray, sampling: SamplingOptions, rng: np.random.Generator) -> np.ndarray:
    """The next token of each row from its logits [B, V]."""
    if sampling.greedy:
        return np.argmax(logits, axis=-1)
    z = logits.astype(np.float64) / sampling.temperature
    out = np.empty(z.shape[0], np.int64)
    for b, row in enumerate(z):
        order = np.argsort(-row, kind="stable")
        if sampling.top_k is not None:
            order = order[: sampling.top_k]
        p = np.exp(row[order] - row[order[0]])
        p /= p.sum()
        if sampling.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(p), sampling.top_p) + 1)  # the smallest set reaching top_p
            order, p = order[:keep], p[:keep] / p[:keep].sum()
        out[b] = order[rng.choice(len(order), p=p)]
    return out


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, attention_mask, position_ids) [B, S] of prompts left-padded to the longest."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int64)
    mask = np.zeros((len(prompts), width), np.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = p
        mask[r, width - len(p):] = 1
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return ids, mask, positions


def cache_dtype_of(graph: Graph) -> type:
    """The numpy dtype of a decoder graph's empty first past: uint8 for a C8 (int8) cache, float32
    otherwise (a float cache of any width is fed as float32)."""
    past = [v for v in graph.inputs if v.name == PAST.format(i=0, kind="key")]
    return np.uint8 if past and past[0].type.dtype == DType.U8 else np.float32


def empty_cache(cache_layers: Sequence[tuple[int, int]], batch: int,
                dtype: np.dtype | type = np.float32) -> dict[str, np.ndarray]:
    """Zero-length past keys and values [batch, kv_heads, 0, head_dim] for every attention."""
    return {PAST.format(i=i, kind=kind): np.zeros((batch, kv, 0, d), dtype)
            for i, (kv, d) in enumerate(cache_layers) for kind in ("key", "value")}


def decode(step: StepFn, cache_layers: Sequence[tuple[int, int]], prompts: Sequence[Sequence[int]],
           options: DecodeOptions, *, cache_dtype: np.dtype | type = np.float32,
           stop: Callable[[int, list[int]], bool] | None = None,
           on_tokens: Callable[[int, np.ndarray, list[bool]], None] | None = None) -> DecodeResult:
    """Generate up to `options.max_new_tokens` tokens after each prompt (see the module docstring).

    `on_tokens(step_index, tokens [B], live)` is called as each step's tokens are chosen
    (`live[b]`: row b was still generating, so its token counts); `stop(row, new_ids)` may end
    a row after its latest token."""
    if options.max_new_tokens < 1:
        raise DecodeError(f"--max-new-tokens must be >= 1 (got {options.max_new_tokens})")
    options.sampling.check()
    rows = [list(p) for p in prompts]
    batch = len(rows)
    rng = np.random.default_rng(options.sampling.seed)
    ids, mask, positions = left_pad(rows, options.pad_id)
    feeds: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions,
                                    **empty_cache(cache_layers, batch, cache_dtype)}
    new: list[list[int]] = [[] for _ in rows]
    reasons = ["length"] * batch
    live = [True] * batch
    logits_kept: list[np.ndarray] = []
    times: list[float] = []
    next_pos = positions[:, -1] + 1
    for s in range(options.max_new_tokens):
        t0 = time.perf_counter()
        out = step(feeds)
        logits = np.asarray(out["logits"])[:, -1, :]
        times.append((time.perf_counter() - t0) * 1e3)
        if options.keep_logits:
            logits_kept.append(np.array(logits, np.float32))
        tokens = choose(logits, options.sampling, rng)
        was_live = list(live)
        for b in range(batch):
            if not live[b]:
                continue
            t = int(tokens[b])
            new[b].append(t)
            if t in options.eos_ids:
                live[b], reasons[b] = False, "eos"
            elif stop is not None and stop(b, new[b]):
                live[b], reasons[b] = False, "stop"
        if on_tokens is not None:
            on_tokens(s, tokens, was_live)
        if not any(live) or s + 1 == options.max_new_tokens:
            break
        fed = np.where(live, tokens, options.pad_id).astype(np.int64)
        feeds = {"input_ids": fed[:, None],
                 "attention_mask": np.concatenate([feeds["attention_mask"],
                                                   np.asarray(live, np.int64)[:, None]], axis=1),
                 "position_ids": next_pos[:, None].astype(np.int64)}
        next_pos = next_pos + np.asarray(live, np.int64)
        for i in range(len(cache_layers)):
            for kind in ("key", "value"):
                feeds[PAST.format(i=i, kind=kind)] = np.asarray(out[PRESENT.format(i=i, kind=kind)])
    return DecodeResult(prompts=rows, new_tokens=new, finish_reasons=reasons, prefill_ms=times[0],
                        decode_ms=times[1:], step_logits=logits_kept)
