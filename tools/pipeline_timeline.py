"""Draw one pipeline step as an SVG timeline: a row per stage, forward / backward / send / recv
spans, idle time left blank.

    python tools/pipeline_timeline.py TIMELINE.json OUT.svg [--title "1F1B, pp=2, m=8"]

TIMELINE.json holds ``{"stages": [[[label, start_s, end_s], ...], ...]}`` -- one list of spans per
stage, as recorded by ``megalite.core.pipeline_parallel.timeline.Timeline`` (``tools/bench/
bench_pipeline.py --timeline-dir`` writes them). Start times are aligned per stage to the step
start.
"""

from __future__ import annotations

import json
import sys
from html import escape

from megalite.errors import ArgumentParser, UserError, path_problem, run_main

COLOURS = {
    "forward": "#4c78a8",
    "backward": "#f58518",
    "send": "#54a24b",
    "recv": "#b279a2",
    "send+recv": "#72b7b2",  # a paired exchange; includes waiting for the neighbour
}
ROW, GAP, LEFT, WIDTH = 28, 8, 70, 1000


def _colour(label: str) -> str:
    return COLOURS.get(label, COLOURS.get(label.split()[0], "#9d9d9d"))


def render_svg(stages: list[list[tuple[str, float, float]]], title: str = "") -> str:
    """SVG text for per-stage spans (seconds)."""
    t0 = min(s for spans in stages for _, s, _ in spans)
    t1 = max(e for spans in stages for _, _, e in spans)
    scale = WIDTH / max(t1 - t0, 1e-9)
    height = 40 + len(stages) * (ROW + GAP) + 40
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{LEFT + WIDTH + 20}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<text x="{LEFT}" y="20" font-size="14">{escape(title)} ({(t1 - t0) * 1e3:.1f} ms)</text>',
    ]
    for i, spans in enumerate(stages):
        y = 32 + i * (ROW + GAP)
        out.append(f'<text x="4" y="{y + ROW * 0.65}">stage {i}</text>')
        out.append(
            f'<rect x="{LEFT}" y="{y}" width="{WIDTH}" height="{ROW}" fill="#f2f2f2"/>'
        )  # idle background
        for label, s, e in spans:
            x, w = LEFT + (s - t0) * scale, max((e - s) * scale, 0.5)
            out.append(
                f'<rect x="{x:.2f}" y="{y}" width="{w:.2f}" height="{ROW}" '
                f'fill="{_colour(label)}"><title>{escape(label)} '
                f"{(e - s) * 1e3:.2f} ms</title></rect>"
            )
    y = 32 + len(stages) * (ROW + GAP) + 10
    for j, (name, colour) in enumerate([*COLOURS.items(), ("idle", "#f2f2f2")]):
        x = LEFT + j * 110
        out.append(f'<rect x="{x}" y="{y}" width="14" height="14" fill="{colour}" stroke="#999"/>')
        out.append(f'<text x="{x + 18}" y="{y + 12}">{name}</text>')
    out.append("</svg>")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """The command line; a user error prints one ``error:`` line: status 1 (2: bad usage)."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("timeline")
    parser.add_argument("out")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    try:
        with open(args.timeline) as f:
            stages = json.load(f)["stages"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(
            f"{args.timeline}: not a readable timeline JSON with a 'stages' list ({e!r:.120})"
        ) from None
    svg = render_svg(stages, args.title)
    try:
        with open(args.out, "w") as f:
            f.write(svg)
    except OSError as e:
        raise UserError(f"{args.out}: cannot write ({path_problem(e)})") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
