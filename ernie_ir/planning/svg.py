"""`plan_svg`: a memory plan drawn as one stacked bar per rank (SVG text, no plotting library)."""

from __future__ import annotations

import math
from xml.sax.saxutils import escape

from .plan import CATEGORIES, MemoryPlan
from .units import format_bytes

COLORS = {
    "weights": "#4c72b0", "lora": "#8172b3", "gradients": "#dd8452", "optimizer_moments": "#c44e52",
    "master_weights": "#937860", "activations": "#55a868", "kv_cache": "#64b5cd", "reserve": "#8c8c8c",
}


def _ticks(top: float) -> list[float]:
    """Round axis values (1, 2 or 5 x 10^k of the largest binary unit that fits) from 0 to `top`."""
    unit = next(u for u in (1024 ** 4, 1024 ** 3, 1024 ** 2, 1024, 1) if top >= u or u == 1)
    raw = top / unit / 5
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw) * unit
    return [i * step for i in range(int(top // step) + 1)]


def plan_svg(plan: MemoryPlan, *, width: int = 760, height: int = 420) -> str:
    """Per-rank device memory stacked by category (bottom to top in CATEGORIES order), with the
    device memory as a dashed line and a legend of the categories that occur."""
    left, right, top, bottom = 80, 190, 40, 50
    plot_w, plot_h = width - left - right, height - top - bottom
    ranks = plan.per_rank
    scale_max = max([plan.device_memory_bytes, *(r.total_bytes for r in ranks)]) * 1.05
    bar_w = plot_w / max(len(ranks), 1)

    def y(v: float) -> float:
        return top + plot_h - v / scale_max * plot_h

    verdict = "fits" if plan.fits else "does not fit"
    dp = f", dp {plan.dp}" + (f" ({plan.sharding})" if plan.sharding != "none" else "") if plan.dp > 1 else ""
    title = (f"{plan.model} on {plan.target}, {plan.mode}: tp {plan.tp}, ep {plan.ep}{dp}, {plan.devices} "
             f"device(s), {verdict} in {format_bytes(plan.device_memory_bytes)}")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="13">{escape(title)}</text>']
    for v in _ticks(scale_max):
        out.append(f'<line x1="{left - 4}" y1="{y(v):.1f}" x2="{left + plot_w}" y2="{y(v):.1f}" '
                   'stroke="#e5e5e5"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">'
                   f'{escape(format_bytes(v))}</text>')
    used: list[str] = []
    for i, r in enumerate(ranks):
        x = left + i * bar_w + bar_w * 0.15
        base = 0
        for cat in CATEGORIES:
            b = r.by_category.get(cat, 0)
            if b <= 0:
                continue
            if cat not in used:
                used.append(cat)
            out.append(f'<rect x="{x:.1f}" y="{y(base + b):.1f}" width="{bar_w * 0.7:.1f}" '
                       f'height="{y(base) - y(base + b):.1f}" fill="{COLORS[cat]}">'
                       f'<title>rank {r.rank} {cat}: {escape(format_bytes(b))}</title></rect>')
            base += b
        if len(ranks) <= 32:
            out.append(f'<text x="{x + bar_w * 0.35:.1f}" y="{top + plot_h + 16}" text-anchor="middle">'
                       f'{r.rank}</text>')
    out.append(f'<text x="{left + plot_w / 2:.1f}" y="{height - 12}" text-anchor="middle">rank</text>')
    dm = y(plan.device_memory_bytes)
    out.append(f'<line x1="{left}" y1="{dm:.1f}" x2="{left + plot_w}" y2="{dm:.1f}" stroke="black" '
               'stroke-dasharray="6,4"/>')
    out.append(f'<text x="{left + plot_w}" y="{dm - 4:.1f}" text-anchor="end">device memory '
               f'{escape(format_bytes(plan.device_memory_bytes))}</text>')
    if plan.engine_settings is not None:  # the serving engine's share: what the bars are held to
        usable, share = plan.engine_settings.usable_bytes, plan.engine_settings.gpu_memory_utilization
        um = y(usable)
        out.append(f'<line x1="{left}" y1="{um:.1f}" x2="{left + plot_w}" y2="{um:.1f}" stroke="black" '
                   'stroke-dasharray="2,3"/>')
        out.append(f'<text x="{left + plot_w}" y="{um + 12:.1f}" text-anchor="end">fastdeploy usable '
                   f'{escape(format_bytes(usable))} (x{share:g})</text>')
    for j, cat in enumerate(reversed(used)):
        ly = top + 10 + j * 18
        out.append(f'<rect x="{left + plot_w + 20}" y="{ly - 9}" width="12" height="12" '
                   f'fill="{COLORS[cat]}"/>')
        out.append(f'<text x="{left + plot_w + 38}" y="{ly + 1}">{cat}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
