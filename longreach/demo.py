"""``make demo`` (``longreach demo``): STRING's effect where it is real and can be measured in minutes on a CPU.

The STRING paper's claim (An et al. 2025, section 3): a model retrieves poorly over the distances it rarely trained
on -- the longest of its window -- and STRING helps by reading those pairs at shorter, well trained positions. The
demo measures exactly that on the probing experiment's final window-256 model (:mod:`longreach.probe`,
docs/probing.md), shipped in the package: a 2-layer Llama trained on this CPU on documents of median 32 tokens, so
that its longest distances are rarely trained, as a 128K model's are. RoPE and STRING answer the same cases, 100 per
distance by default, and the paired difference over the last third of the window comes with its interval.

Not the default model (SmolLM2-135M): on it STRING's effect inside the window is a few points, which takes hours of
CPU to separate from noise (docs/results.md); nor STRING's 4-needle test, which needs 50 cases per length (up to a
minute each at 8K) to say anything, where the earlier demo ran 2 and could not. Every finished cell is kept in
``OUT/demo.json``: a rerun goes on where it stopped.
"""

from __future__ import annotations

import json
from pathlib import Path

MODEL = Path(__file__).parent / "probe" / "data" / "natural_256"  # a run folder: its final checkpoint, step_1200/
METHODS = ("rope", "string")
CASES = 100
RESULTS = "demo.json"

READING = """\
How to read it. Each row is a distance d: a query asks for a record d tokens back, among 4 records in a window
of filler; a case passes when the model's next token is that record's value (chance: 1 in 8). Both methods
answer the same cases; [low, high] is the 95% Wilson interval of the pass rate. This model saw short distances
in almost every training document and the longest ones in almost none, so RoPE's pass rate sags towards d =
{longest}. STRING keeps every distance below S = {shift} as it is and reads a farther pair at d - S + W, a
position trained far more often; below S the asked pair is read at the same position by both (only tokens
farther back move), so the rows stay close there. The last line pairs the methods case by case over the
window's last third, the rarely trained distances: an interval above 0 is an effect this many cases can tell
from noise."""

DEFAULT_MODEL_NOTE = """\
On the default model (SmolLM2-135M-Instruct, L = 8,192) STRING's effect inside the window is a few points,
which takes hours of CPU and 50-130 cases per cell to tell from noise: docs/results.md ("The study") has those
measurements."""


def run(out: Path, cases: int = CASES, progress: bool = True) -> dict:
    """Measure RoPE and STRING by distance on the probe model into ``out`` (resumable); returns the summary."""
    from tqdm.auto import tqdm

    from .eval import on_model
    from .integrations.transformers import remove
    from .methods import create
    from .methods.spec import MethodSpec
    from .probe import measure, train

    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS
    done = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    if done.get("cases") != cases:
        done = {"cases": cases, "tables": {}}
    checkpoint = train.checkpoints(MODEL)[-1]
    model, state = train.load(checkpoint)
    window = state["corpus"]["window"]
    grid = measure.distances(window)
    cells = [(method, d) for method in METHODS for d in grid if str(d) not in done["tables"].get(method, {})]
    bar = tqdm(
        total=len(METHODS) * len(grid),
        initial=len(METHODS) * len(grid) - len(cells),
        unit="distance",
        desc="rope and string by distance",
        disable=not progress,
    )
    for method in METHODS:
        missing = [d for m, d in cells if m == method]
        if not missing:
            continue
        on_model.apply(model, MethodSpec.parse(method), window)
        for distance in missing:
            row = measure.by_distance(model, window, [distance], cases)[distance]
            done["tables"].setdefault(method, {})[str(distance)] = row
            path.write_text(json.dumps(done), encoding="utf-8")  # every distance kept: Ctrl-C loses nothing
            bar.update(1)
        remove(model)
    bar.close()
    tables = {m: {int(d): row for d, row in done["tables"][m].items()} for m in METHODS}
    band = [d for d in grid if d >= 2 * window / 3]
    difference, (low, high), n = measure.paired_difference(tables["string"], tables["rope"], band)
    string = create("string", training_window=window)
    return {
        "model": str(checkpoint),
        "window": window,
        "shift": string.shift,
        "local_window": string.local_window,
        "cases": cases,
        "grid": grid,
        "tables": tables,
        "band": band,
        "last_third": {"difference": difference, "low": low, "high": high, "n": n},
    }


def report(summary: dict) -> str:
    """The plain-text table, the paired difference and how to read them."""

    def rate(row):
        return f"{row['accuracy']:5.1f} [{row['low']:3.0f}, {row['high']:3.0f}]"

    lines = [
        f"RoPE and STRING (S = {summary['shift']}, W = {summary['local_window']}) on the probing experiment's model "
        f"(window L = {summary['window']} tokens), {summary['cases']} cases per distance:",
        "",
        f"{'distance':>9}  {'rope':<17}  {'string':<17}",
    ]
    for d in summary["grid"]:
        mark = "  <- beyond S" if d >= summary["shift"] else ""
        lines.append(
            f"{d:>9}  {rate(summary['tables']['rope'][d]):<17}  {rate(summary['tables']['string'][d]):<17}{mark}"
        )
    last = summary["last_third"]
    lines += [
        "",
        f"string minus rope over the last third (d >= {summary['band'][0]}), the same {last['n']} cases: "
        f"{last['difference']:+.1f} points [{last['low']:+.1f}, {last['high']:+.1f}] (95% paired bootstrap)",
        "",
        READING.format(longest=summary["grid"][-1], shift=summary["shift"]),
        "",
        DEFAULT_MODEL_NOTE,
    ]
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> Path:
    """Pass rate by distance for both methods with their 95% intervals (:func:`longreach.plots.lines`), S and the last
    third marked, STRING minus RoPE over the last third in the title."""
    from .plots import lines

    tables, grid, last = summary["tables"], summary["grid"], summary["last_third"]
    series = {m: (grid, [tables[m][d]["accuracy"] for d in grid]) for m in METHODS}
    bands = {m: [(tables[m][d]["low"], tables[m][d]["high"]) for d in grid] for m in METHODS}
    title = (
        f"probe model, window L = {summary['window']}, {summary['cases']} cases per point\nstring minus rope over "
        f"the last third: {last['difference']:+.1f} points [{last['low']:+.1f}, {last['high']:+.1f}], "
        f"n = {last['n']} paired"
    )
    return lines(
        series,
        title,
        path,
        ylabel="pass rate (%)",
        xlabel="distance from the query to its record (tokens)",
        marks={"S, STRING's shift": summary["shift"], "the last third from": summary["band"][0]},
        bands=bands,
        tokens=None,
    )


def main(out: Path, cases: int = CASES) -> str:
    """``longreach demo``: measure, write ``demo.json``, ``demo.png`` and ``demo.txt`` into ``out``; returns the
    report."""
    print(
        f"measuring RoPE and STRING on the probing experiment's window-256 model ({cases} cases per distance and "
        "method; about 15 seconds on 2 CPU cores at 100, once the CPU kernel is built)",
        flush=True,
    )
    summary = run(out, cases)
    text = report(summary)
    (out / "demo.txt").write_text(text + "\n", encoding="utf-8")
    plot(summary, out / "demo.png")
    return text
