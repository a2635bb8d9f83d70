"""Per-token quality statistics and their summaries (llama.cpp's `perplexity --kl-divergence`).

For a token t scored after its context, with p the model's next-token distribution there and
p_ref the reference's (both softmax of the logits, computed in float64):
    nll        = -log p(t)
    KL         = sum_v p_ref(v) (log p_ref(v) - log p(v))          KL(reference || model)
    same top   = argmax p == argmax p_ref
    delta-p    = p(t) - p_ref(t)
Summaries pool every scored token of the corpus: mean_nll, perplexity = exp(mean_nll) with a 95%
interval exp(mean_nll +- 1.96 * standard error); KL mean (with its 1.96 standard errors),
median, 99th and 99.9th percentiles (numpy's linear interpolation), maximum; top-1 agreement;
RMS of delta-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log softmax over the last axis, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


@dataclass
class TokenStats:
    """Per scored token (appended window by window)."""

    nll: list[np.ndarray] = field(default_factory=list)
    nll_reference: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)
    delta_p: list[np.ndarray] = field(default_factory=list)

    def add(self, other: TokenStats) -> None:
        for name in ("nll", "nll_reference", "kl", "same_top", "delta_p"):
            getattr(self, name).extend(getattr(other, name))

    def array(self, name: str) -> np.ndarray:
        parts = getattr(self, name)
        return np.concatenate(parts) if parts else np.zeros(0)


def token_stats(logits: np.ndarray, targets: np.ndarray, reference: np.ndarray | None = None) -> TokenStats:
    """Statistics of the tokens `targets` [N] predicted by `logits` [N, V] (and the reference's
    logits [N, V] for the same positions)."""
    lp = log_softmax(logits)
    rows = np.arange(len(targets))
    stats = TokenStats(nll=[-lp[rows, targets]])
    if reference is not None:
        if reference.shape != logits.shape:
            raise ValueError(f"reference logits {reference.shape} do not match {logits.shape}")
        lr = log_softmax(reference)
        stats.nll_reference.append(-lr[rows, targets])
        stats.kl.append(np.maximum((np.exp(lr) * (lr - lp)).sum(axis=-1), 0.0))
        stats.same_top.append(np.argmax(lp, axis=-1) == np.argmax(lr, axis=-1))
        stats.delta_p.append(np.exp(lp[rows, targets]) - np.exp(lr[rows, targets]))
    return stats


def _ppl(nll: np.ndarray) -> tuple[float, float, float]:
    mean = float(nll.mean())
    sem = float(nll.std(ddof=1) / np.sqrt(nll.size)) if nll.size > 1 else 0.0
    return float(np.exp(mean)), float(np.exp(mean - 1.96 * sem)), float(np.exp(mean + 1.96 * sem))


def summarize(stats: TokenStats) -> dict[str, float | int | list[float]]:
    """The corpus-level figures (see the module docstring); KL figures only with a reference."""
    nll = stats.array("nll")
    ppl, lo, hi = _ppl(nll)
    out: dict[str, float | int | list[float]] = {
        "tokens_scored": int(nll.size), "mean_nll": float(nll.mean()), "perplexity": ppl,
        "perplexity_ci95": [lo, hi]}
    if stats.kl:
        ref = stats.array("nll_reference")
        kl = stats.array("kl")
        dp = stats.array("delta_p")
        rppl, rlo, rhi = _ppl(ref)
        kl_sem = float(kl.std(ddof=1) / np.sqrt(kl.size)) if kl.size > 1 else 0.0
        out.update({
            "perplexity_reference": rppl, "perplexity_reference_ci95": [rlo, rhi],
            "mean_nll_reference": float(ref.mean()),
            "kl_mean": float(kl.mean()), "kl_mean_ci95": [float(kl.mean() - 1.96 * kl_sem),
                                                          float(kl.mean() + 1.96 * kl_sem)],
            "kl_median": float(np.median(kl)), "kl_p99": float(np.percentile(kl, 99)),
            "kl_p999": float(np.percentile(kl, 99.9)), "kl_max": float(kl.max()),
            "top1_agreement": float(stats.array("same_top").mean()),
            "rms_delta_p": float(np.sqrt(np.mean(dp ** 2))),
        })
    return out
