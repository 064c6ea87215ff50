"""Draw the figures of the benchmarks page from ``benchmarks/results/*.json``.

Each figure reads one result file, written by the benchmark of the same name
(``nox -s bench`` runs them all), and shows its figures as they are: nothing
is measured here. A note under each figure names the run -- its date, the
machine and the versions -- as the file records it. A result file that is
missing leaves its figures out, with a message.

=========================  ===================  ==============================================
figure                     from                 shows
=========================  ===================  ==============================================
``bench-throughput.png``   ``throughput.json``  cycles/s of both classes and the raw floor
``bench-handoff.png``      ``waiting.json``     hand-off latency percentiles and floors
``bench-crash.png``        ``waiting.json``     how late the next grant came after a crash
``bench-holding.png``      ``holding.json``     commands/s to keep 1,000 permits alive
``bench-rate.png``         ``rate.json``        the rate limiter's pace and its bounds
``bench-failover.png``     ``failover.json``    permits forgotten and time without a grant
``bench-replicas.png``     ``failover.json``    what ``replicas=1`` costs in cycles/s
``bench-peers.png``        ``peers.json``       cycles/s beside the peers, over-admission
                                                and round trips, at limit 16 and limit 1
``bench-peer-handoff.png`` ``peers.json``       hand-off beside the peers that block
``bench-scaling.png``      ``scaling.json``     cycles/s with 1 to 8 processes; idle commands/s
                                                and connections of 10 to 10,000 waiters
``bench-split.png``        ``costs.json``       CPU per cycle against steps per cycle, in the
                                                client and in Redis, with the fitted lines
=========================  ===================  ==============================================

Run it from the repository's root::

    python benchmarks/plots.py                          # results/ -> docs/img/
    python benchmarks/plots.py --results DIR --out DIR
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from matplotlib.axes import Axes

ROOT: Final = Path(__file__).resolve().parent.parent
#: One colour per implementation, the same in every figure.
COLOURS: Final = {"raw": "#9e9e9e", "fair": "#3949ab", "locked": "#f4511e"}
#: The floors a measurement is compared with.
FLOOR: Final = "#bdbdbd"
#: The second series of a panel that shows two of one implementation.
PALE: Final = "#7986cb"
LABELS: Final = {"raw": "raw EVALSHA loop", "fair": "AsyncFairSemaphore", "locked": "AsyncLockedSemaphore"}
HOW: Final = {"failover": "SENTINEL FAILOVER", "kill": "SIGKILL of the master"}
#: The figures are drawn for the width the docs show them at: mkdocs-material's content column between both
#: sidebars is 688 CSS px, so a 7 in figure shows a point as 688 / (7 x 72) = 1.37 px, and SMALL text as 12.3 px,
#: the size of the page's tables. DPI makes the PNG 1,400 px wide, sharp on screens of two pixels a CSS px.
WIDTH: Final = 7.0
DPI: Final = 200
#: Bar labels, legends, annotations, the run's note; ticks and axis labels keep matplotlib's 10 pt.
SMALL: Final = 9
#: The title of a figure and of each panel.
TITLE: Final = 10.5
#: PNG metadata written by matplotlib would change with its version; none is kept.
METADATA: Final[dict[str, str | None]] = {"Software": None}
TIMES: Final = "\N{MULTIPLICATION SIGN}"
#: Libraries aiosem is compared with: neither aiosem nor a floor.
PEER: Final = "#a1887f"
#: What must not happen: holds over the limit, a target missed.
ALARM: Final = "#c62828"
#: The targets ``bench_scaling.py`` checks, which its JSON does not record: connections a waiters' process may
#: hold beyond its pool, and commands per waiter per re-check, which comes every third of the waiter timeout.
EXTRA_CONNECTIONS: Final = 2
COMMANDS_PER_WAITER: Final = 1.0
RECHECKS_PER_WAITER_TIMEOUT: Final = 3

Result = dict[str, Any]


def load(path: Path) -> Result | None:
    """The result file at ``path``, or ``None`` (with a message) if there is none."""
    if not path.exists():
        print(f"{path}: missing, its figures are left out", file=sys.stderr)
        return None
    result: Result = json.loads(path.read_text(encoding="utf-8"))
    return result


def provenance(result: Result) -> str:
    """Two lines naming the run, as the result file records it: date and versions, then the machine."""
    environment: Result = result.get("environment", result)
    server = environment["redis_server"]
    servers = ", ".join(server) if isinstance(server, list) else server
    return (
        f"{environment['date'][:10]} · Redis {servers} · redis-py {environment['redis_py']} · "
        f"hiredis {environment['hiredis']} · aiosem {environment['aiosem']}\n"
        f"{environment['implementation']} {environment['python']} · {environment['cpus']} CPUs · "
        f"{environment['platform']}"
    )


def figure(
    result: Result,
    height: float,
    columns: int = 1,
    *,
    share_x: bool = False,
    widths: Sequence[float] | None = None,
    heights: Sequence[float] | None = None,
) -> tuple[Figure, list[Axes]]:
    """A white figure of ``columns`` panels side by side, with the run named at its foot.

    ``widths`` gives the columns' relative widths; ``heights``, if given, one
    row of panels per entry and their relative heights. The panels come row
    by row.
    """
    drawn = Figure(figsize=(WIDTH, height), dpi=DPI, facecolor="white", layout="constrained")
    rows = 1 if heights is None else len(heights)
    grid = drawn.subplots(rows, columns, squeeze=False, sharex=share_x, width_ratios=widths, height_ratios=heights)
    axes = list(grid.flat)
    for ax in axes:
        ax.spines[["top", "right"]].set_visible(False)
        ax.set_axisbelow(True)
    drawn.supxlabel(provenance(result), fontsize=SMALL, color="#616161")
    return drawn, axes


def thousands(value: float, _position: float | None = None) -> str:
    return f"{value:,.0f}"


def plain(value: float, _position: float | None = None) -> str:
    """A log axis's tick as a number: ``0.1``, ``10``, ``1,000``."""
    return f"{value:,.0f}" if value >= 1 else f"{value:g}"


def ratio(value: float) -> str:
    """A ratio to a floor, signed: two decimals, or one significant digit below 0.1 (``0.004``, not ``0.00``)."""
    return f"{value:.2f}{TIMES}" if value >= 0.1 else f"{value:.1g}{TIMES}"


def log_span(values: Sequence[float], room: float) -> tuple[float, float]:
    """Log-axis limits: from the decade below the least value, with ``room`` (a share of the span) after the most.

    Zeros have no place on a log axis (the in-process row makes no round trips): they are left out.
    """
    low = 10 ** math.floor(math.log10(min(value for value in values if value > 0)))
    high = max(values)
    return low, high * (high / low) ** room


def throughput(result: Result) -> Figure:
    """Cycles per second of each implementation, contended and not, with each one's ratio to the raw floor."""
    drawn, (ax,) = figure(result, 4.2)
    scenarios = result["scenarios"]
    # One group per (coroutines, limit) of the semaphores, each beside the raw loop with as many coroutines.
    groups = list(dict.fromkeys((r["coroutines"], r["limit"]) for r in scenarios if r["kind"] != "raw"))
    kinds = ("raw", "fair", "locked")
    bar = 0.26
    for offset, kind in enumerate(kinds):
        rows = [
            next(
                r
                for r in scenarios
                if r["kind"] == kind and r["coroutines"] == n and (kind == "raw" or r["limit"] == limit)
            )
            for n, limit in groups
        ]
        positions = [group + (offset - 1) * bar for group in range(len(groups))]
        bars = ax.bar(positions, [r["cycles_per_second"] for r in rows], bar, color=COLOURS[kind], label=LABELS[kind])
        labels = [f"{r['cycles_per_second']:,.0f}\n{r['ratio_to_raw']:.2f} {TIMES}" for r in rows]
        ax.bar_label(bars, labels, fontsize=SMALL)
    ax.set_xticks(range(len(groups)), [f"{n} coroutine{'s' * (n > 1)}, limit {limit}" for n, limit in groups])
    ax.set_ylabel("acquire + release cycles per second")
    ax.yaxis.set_major_formatter(FuncFormatter(thousands))
    ax.margins(y=0.2)
    ax.grid(axis="y", color="#eeeeee")
    ax.legend(frameon=False, loc="upper right")
    ax.set_title("Throughput, and its ratio to a raw loop of 2 EVALSHA per cycle in the same run", fontsize=TITLE)
    return drawn


def handoff(result: Result) -> Figure:
    """Release in one process to acquire returning in another: percentiles against the floors of the same server."""
    drawn, axes = figure(result, 4.0, columns=len(result["handoff"]), share_x=True)
    for ax, row in zip(axes, result["handoff"], strict=True):
        names = ["EVALSHA p50", "EVALSHA p50 after 2 ms idle", "PUBLISH to an idle listener, p50"]
        values = [row["evalsha_p50_ms"], row["idle_evalsha_p50_ms"], row["publish_p50_ms"]]
        colours = [FLOOR] * 3
        for percentile in ("p50", "p90", "p99", "max"):
            names.append(f"hand-off {percentile}")
            values.append(row[f"{percentile}_ms"])
            colours.append(COLOURS[row["kind"]])
        bars = ax.barh(names, values, color=colours)
        ax.bar_label(bars, [f"{value:.2f} ms" for value in values], fontsize=SMALL, padding=2)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        ax.set_xlabel("milliseconds")
        ax.grid(axis="x", color="#eeeeee")
        ax.set_title(f"{LABELS[row['kind']]}\n{row['repetitions']} hand-offs", fontsize=TITLE)
    for ax in axes[1:]:
        ax.tick_params(labelleft=False)
    drawn.suptitle("Hand-off latency; grey: floors measured on the same server in the same run", fontsize=TITLE)
    return drawn


def crash(result: Result) -> Figure:
    """How long after the lease (or the waiter timeout) of a killed process the next waiter was granted."""
    drawn, (ax,) = figure(result, 3.2)
    rows = result["crash"]
    for index, row in enumerate(rows):
        excess = [(delay - row["bound_s"]) * 1000 for delay in row["delays_s"]]
        ax.scatter(excess, [index] * len(excess), color=COLOURS[row["kind"]], s=36, alpha=0.8, zorder=3)
    ax.set_yticks(range(len(rows)), [f"{LABELS[row['kind']]}:\n{row['case']}" for row in rows])
    ax.invert_yaxis()
    ax.set_xlim(left=0)
    bounds = " and ".join(sorted({f"{row['bound_s']:g} s" for row in rows}))
    ax.set_xlabel(f"ms after the lease or the waiter timeout ({bounds}) ran out")
    ax.grid(axis="x", color="#eeeeee")
    ax.set_title("Crash reclaim: when the next waiter got the permit\n(each dot one SIGKILL)", fontsize=TITLE)
    return drawn


def holding(result: Result) -> Figure:
    """Commands per second the server ran to keep 1,000 permits alive, by aiosem's refresher and by a task each."""
    drawn, (ax,) = figure(result, 3.0)
    rows = result["results"]
    names = [f"{LABELS[row['kind']]}: {row['method']}" for row in rows]
    values = [row["commands_per_s"] for row in rows]
    colours = [COLOURS[row["kind"]] if row["method"] == "refresher" else FLOOR for row in rows]
    bars = ax.barh(names, values, color=colours)
    ax.bar_label(bars, [f"{value:,.1f}" for value in values], fontsize=SMALL, padding=2)
    ax.set_xscale("log")
    ax.invert_yaxis()
    ax.margins(x=0.3)
    ax.set_xlabel("commands per second run by the server\n(log scale; those inside scripts included)")
    ax.grid(axis="x", color="#eeeeee")
    permits = rows[0]["permits"]
    ax.set_title(f"Keeping {permits:,} held permits alive\ngrey: a task per permit calling the recipe", fontsize=TITLE)
    return drawn


def rate(result: Result) -> Figure:
    """The rate limiter's pace in each run, against what GCRA allows."""
    drawn, (counts, gaps) = figure(result, 3.6, columns=2)
    rows = result["results"]
    first = rows[0]
    # "fakeredis (TCP)" on one line runs into its neighbour's tick label.
    servers = [row["server"].replace(" (", "\n(") for row in rows]
    bar = 0.35
    # What is counted, the bound it is drawn against, and how the legend says both.
    counted = (
        ("grants", "ideal", f"grants\n(line: rate {TIMES} duration + burst)"),
        ("max_in_window", "allowed_in_window", f"most grants in any {first['per']:g} s window\n(line: rate + burst)"),
    )
    for offset, (key, bound, label) in enumerate(counted):
        positions = [index + (offset - 0.5) * bar for index in range(len(rows))]
        colour = COLOURS["fair"] if offset == 0 else PALE
        bars = counts.bar(positions, [row[key] for row in rows], bar, color=colour, label=label)
        counts.bar_label(bars, [f"{row[key]:g}" for row in rows], fontsize=SMALL, label_type="center", color="white")
        for position, row in zip(positions, rows, strict=True):
            counts.hlines(row[bound], position - bar / 2, position + bar / 2, color="black", linewidth=1.5)
    counts.set_xticks(range(len(rows)), servers)
    counts.margins(y=0.25)
    counts.legend(frameon=False, fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    counts.set_title("Grants, each against its bound", fontsize=TITLE)
    for offset, (key, label) in enumerate((("gap_p50_ms", "median gap"), ("gap_min_ms", "shortest gap"))):
        positions = [index + (offset - 0.5) * bar for index in range(len(rows))]
        colour = COLOURS["fair"] if offset == 0 else PALE
        bars = gaps.bar(positions, [row[key] for row in rows], bar, color=colour, label=label)
        gaps.bar_label(bars, [f"{row[key]:.1f}" for row in rows], fontsize=SMALL, padding=2)
    interval = rows[0]["interval_ms"]
    gaps.axhline(interval, color="black", linewidth=1, linestyle="--", label=f"interval ({interval:g} ms)")
    gaps.set_xticks(range(len(rows)), servers)
    gaps.set_ylabel("ms between two grants")
    gaps.margins(y=0.25)
    gaps.legend(frameon=False, fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.18))
    gaps.set_title("Time between grants", fontsize=TITLE)
    drawn.suptitle(
        f"Rate limiter: {first['processes']} processes {TIMES} {first['coroutines']} coroutines, "
        f"rate {first['rate']:g} per {first['per']:g} s, burst {first['burst']}, {first['duration_s']:g} s",
        fontsize=TITLE,
    )
    return drawn


def failover(result: Result) -> Figure:
    """Per row of failovers: permits granted and forgotten, and the longest time without a grant."""
    drawn, (permits, outage) = figure(result, 6.4, columns=2, widths=(1.3, 1))
    rows = result["forgotten"]
    names = [f"{row['kind']}, replicas={row['replicas']}\n{HOW[row['how']]}" for row in rows]
    kept = [row["granted"] - row["forgotten"] for row in rows]
    permits.barh(names, kept, color=[COLOURS[row["kind"]] for row in rows], label="still held on the new master")
    lost = permits.barh(names, [row["forgotten"] for row in rows], left=kept, color="black", label="forgotten")
    permits.bar_label(lost, [f"{row['forgotten']:,} of {row['granted']:,}" for row in rows], fontsize=SMALL, padding=2)
    permits.invert_yaxis()
    permits.margins(x=0.45)
    permits.xaxis.set_major_formatter(FuncFormatter(thousands))
    permits.set_xlabel(f"permits granted in {rows[0]['rounds']} failovers")
    permits.legend(frameon=False, fontsize=SMALL, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    permits.set_title("Permits granted,\nand forgotten by the new master", fontsize=TITLE)
    medians = [row["outage_median_s"] for row in rows]
    maxima = [row["outage_max_s"] for row in rows]
    longest = outage.barh(names, maxima, color=FLOOR, label="max")
    outage.barh(names, medians, color=[COLOURS[row["kind"]] for row in rows], label="median")
    outage.bar_label(
        longest, [f"{m:.2f} / {x:.2f}" for m, x in zip(medians, maxima, strict=True)], fontsize=SMALL, padding=2
    )
    outage.invert_yaxis()
    outage.tick_params(labelleft=False)
    outage.margins(x=0.3)
    outage.set_xlabel("seconds: median / max\nover the rounds")
    outage.set_title("Longest time\nwithout a grant", fontsize=TITLE)
    return drawn


def replicas(result: Result) -> Figure:
    """Cycles per second with ``replicas=0`` and ``1``, on the same master and replica in the same run."""
    # One panel above the other: side by side, the class names under the bars run into each other.
    drawn, axes = figure(result, 5.6, heights=(1, 1))
    rows = result["cost"]
    kinds = list(dict.fromkeys(row["kind"] for row in rows))
    panels: Sequence[tuple[str, str]] = (
        ("one_coroutine_cycles_per_s", "1 coroutine"),
        ("many_coroutines_cycles_per_s", "64 coroutines, limit 16"),
    )
    bar = 0.38
    for ax, (key, title) in zip(axes, panels, strict=True):
        for offset, count in enumerate((0, 1)):
            chosen = [next(r for r in rows if r["kind"] == kind and r["replicas"] == count) for kind in kinds]
            positions = [index + (offset - 0.5) * bar for index in range(len(kinds))]
            colours = [COLOURS[kind] for kind in kinds]
            bars = ax.bar(positions, [r[key] for r in chosen], bar, color=colours, alpha=1.0 if count else 0.45)
            ax.bar_label(bars, [f"replicas={count}\n{r[key]:,.0f}" for r in chosen], fontsize=SMALL)
        ax.set_xticks(range(len(kinds)), [LABELS[kind] for kind in kinds])
        ax.yaxis.set_major_formatter(FuncFormatter(thousands))
        ax.margins(y=0.25)
        ax.grid(axis="y", color="#eeeeee")
        ax.set_title(title, fontsize=TITLE)
        ax.set_ylabel("acquire + release\ncycles per second")
    drawn.suptitle(
        "What replicas=1 costs: pale, replicas=0; solid, replicas=1\n(master and replica on loopback)", fontsize=TITLE
    )
    return drawn


def peers(result: Result) -> Figure:
    """Cycles per second of aiosem and its peers at each limit: ratio to the raw loop, over-admission, round trips."""
    limits: list[int] = result["limits"]
    scenarios = [[row for row in result["rows"] if row["limit"] == limit] for limit in limits]
    # A row of panels per limit, as tall as its bars (and its title): every bar as thick as the others.
    drawn, axes = figure(result, 8.0, columns=2, widths=(3, 1), heights=[len(rows) + 2 for rows in scenarios])
    speeds, trips = axes[0::2], axes[1::2]
    colours = {"raw": COLOURS["raw"], "aiosem-fair": COLOURS["fair"], "aiosem-locked": COLOURS["locked"]}
    every = [row for rows in scenarios for row in rows]
    # A peer that made next to nothing (the book's livelocked mutex) would stretch the axis by decades.
    speed_limits = log_span([row["cycles_per_second"] for row in every if row["cycles_per_second"] >= 1], 0.3)
    trip_limits = log_span([row["round_trips_per_cycle"] for row in every], 0.45)
    for speed, trip, limit, rows in zip(speeds, trips, limits, scenarios, strict=True):
        trip.sharey(speed)
        elsewhere = {row["peer"] for other in scenarios if other is not rows for row in other}
        positions = range(len(rows))
        fill = [colours.get(row["peer"], PEER) for row in rows]
        over = [row["over_limit"] or 0 for row in rows]
        bars = speed.barh(
            positions,
            [row["cycles_per_second"] for row in rows],
            color=fill,
            edgecolor=[ALARM if count else "none" for count in over],
            linewidth=2,
        )
        labels = speed.bar_label(
            bars, [f"{row['cycles_per_second']:,.0f}/s · {ratio(row['ratio_to_raw'])}" for row in rows], fontsize=SMALL,
            padding=3,
        )  # fmt: skip
        for label, count in zip(labels, over, strict=True):
            if count:
                speed.annotate(
                    f"over limit: {count:,}", xy=(1, 0.5), xycoords=label, xytext=(6, 0), textcoords="offset points",
                    va="center", fontsize=SMALL, fontweight="bold", color=ALARM,
                )  # fmt: skip
        speed.set_yticks(positions, [row["label"] for row in rows], fontsize=SMALL)
        speed.invert_yaxis()
        speed.set_xscale("log")
        speed.set_xlim(*speed_limits)
        speed.xaxis.set_major_formatter(FuncFormatter(plain))
        speed.grid(axis="x", color="#eeeeee")
        mutex = ": a mutex" if limit == 1 else ""
        alone = "\nthe locks run at this limit only" if any(row["peer"] not in elsewhere for row in rows) else ""
        speed.set_title(f"limit {limit}{mutex}{alone}", fontsize=TITLE, loc="left")
        trip_bars = trip.barh(positions, [row["round_trips_per_cycle"] for row in rows], color=fill)
        trip.bar_label(trip_bars, [f"{row['round_trips_per_cycle']:,.3g}" for row in rows], fontsize=SMALL, padding=2)
        trip.set_xscale("log")
        trip.set_xlim(*trip_limits)
        trip.xaxis.set_major_formatter(FuncFormatter(plain))
        trip.tick_params(labelleft=False, labelsize=SMALL)
        trip.grid(axis="x", color="#eeeeee")
        trip.set_title("round trips\nper cycle", fontsize=SMALL)
    speeds[-1].set_xlabel("acquire + release cycles per second (log scale)")
    trips[-1].set_xlabel("socket writes (log)", fontsize=SMALL)
    drawn.suptitle(
        f"aiosem beside its peers: {result['coroutines']} coroutines on one client,\n"
        "acquire, one event-loop pass, release; beside each bar: cycles/s\n"
        "and its ratio to the raw loop on the same server; red: holds begun\nwith the limit already in use",
        fontsize=TITLE,
    )
    return drawn


def peer_handoff(result: Result) -> Figure:
    """Release in one process to acquire returning in another, at limit 1: aiosem beside the peers that block."""
    rows = result["handoffs"]
    drawn, (ax,) = figure(result, 4.0, columns=1)
    colours = {"aiosem-fair": COLOURS["fair"], "aiosem-locked": COLOURS["locked"]}
    colours |= {row["peer"]: FLOOR for row in rows if row["peer"].startswith("floor-")}
    positions = range(len(rows))
    for offset, (percentile, alpha) in enumerate((("p50", 1.0), ("p99", 0.45))):
        bars = ax.barh(
            [position + offset * 0.4 for position in positions],
            [row[f"{percentile}_ms"] for row in rows],
            height=0.4,
            color=[colours.get(row["peer"], PEER) for row in rows],
            alpha=alpha,
        )
        texts = [f"{percentile} {row[f'{percentile}_ms']:.2f} ms" for row in rows]
        ax.bar_label(bars, texts, fontsize=SMALL, padding=2)
    ax.set_yticks([position + 0.2 for position in positions], [row["label"] for row in rows], fontsize=SMALL)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.margins(x=0.25)
    ax.xaxis.set_major_formatter(FuncFormatter(plain))
    ax.set_xlabel("milliseconds (log scale)")
    ax.grid(axis="x", color="#eeeeee")
    drawn.suptitle(
        "Hand-off at limit 1: release called in one process to acquire returning in another\n"
        f"{rows[0]['repetitions']} hand-offs each; solid p50, pale p99; grey: floors",
        fontsize=TITLE,
    )
    return drawn


def first_row(drawn: Figure, panel: Axes, beside: Axes) -> None:
    """Stretch ``panel`` over the whole first row of ``drawn``'s grid, in place of the panel ``beside`` it."""
    grid = panel.get_gridspec()
    assert grid is not None  # noqa: S101 -- figure() lays its panels on a grid
    panel.set_subplotspec(grid[0, :])
    drawn.delaxes(beside)


def label_points(axes: Axes, rows: Sequence[Result], key: str, met: str, form: str) -> None:
    """Write each row's ``key`` above its point, in red and bold where its target (``met``) was missed."""
    for row in rows:
        missed = not row[met]
        axes.annotate(
            form.format(row[key]), xy=(row["waiters"], row[key]), xytext=(0, 6), textcoords="offset points",
            ha="center", fontsize=SMALL, color=ALARM if missed else "black", fontweight="bold" if missed else "normal",
        )  # fmt: skip


def scaling(result: Result) -> Figure:
    """Cycles per second with more processes; what waiters in one process cost Redis while idle, and connections."""
    drawn, (cycles, beside, commands, connections) = figure(result, 6.2, columns=2, heights=(1, 1))
    # The processes' panel takes the whole first row: three panels side by side have no room for their labels.
    first_row(drawn, cycles, beside)
    rows = result["processes"]
    positions = range(len(rows))
    bars = cycles.bar(positions, [row["cycles_per_second"] for row in rows], 0.6, color=COLOURS["fair"])
    labels = cycles.bar_label(
        bars,
        [f"{row['cycles_per_second']:,.0f}/s\nover limit: {row['over_limit']}" for row in rows],
        fontsize=SMALL,
        padding=2,
    )
    for label, row in zip(labels, rows, strict=True):
        if row["over_limit"]:
            label.set(color=ALARM, fontweight="bold")
    cycles.set_xticks(positions, [str(row["processes"]) for row in rows])
    each = rows[0]["coroutines"] // rows[0]["processes"]
    cycles.set_xlabel(f"processes on limit {rows[0]['limit']}, {each} coroutines each")
    cycles.set_ylabel("acquire + release cycles per second")
    cycles.yaxis.set_major_formatter(FuncFormatter(thousands))
    cycles.margins(x=0.08, y=0.2)
    cycles.grid(axis="y", color="#eeeeee")
    cycles.set_title("More processes, one semaphore", fontsize=TITLE)

    waiting = result["waiters"]
    counts = [row["waiters"] for row in waiting]
    recheck = waiting[0]["waiter_timeout_s"] / RECHECKS_PER_WAITER_TIMEOUT
    target = [
        row["waiters"] * COMMANDS_PER_WAITER * RECHECKS_PER_WAITER_TIMEOUT / row["waiter_timeout_s"] for row in waiting
    ]
    commands.plot(
        counts, target, color="black", linestyle="--", linewidth=1, label="target: 1 per waiter\nper re-check"
    )
    commands.plot(
        counts, [row["commands_per_s"] for row in waiting], color=COLOURS["fair"], marker="o", label="measured"
    )
    label_points(commands, waiting, "commands_per_s", "commands_target_met", "{:,.0f}")
    commands.set_yscale("log")
    commands.yaxis.set_major_formatter(FuncFormatter(plain))
    commands.yaxis.set_minor_formatter(NullFormatter())
    commands.set_ylabel("commands/s while idle (log)")
    commands.legend(frameon=False, fontsize=SMALL, loc="upper left")
    commands.set_title(f"Idle cost, a re-check every {recheck:.3g} s", fontsize=TITLE)

    pool = waiting[0]["pool_size"]
    bound = pool + EXTRA_CONNECTIONS
    connections.axhline(
        bound, color="black", linestyle="--", linewidth=1, label=f"target: pool ({pool}) + {EXTRA_CONNECTIONS}"
    )
    held = [row["connections"] for row in waiting]
    connections.plot(counts, held, color=COLOURS["fair"], marker="o", label="held")
    label_points(connections, waiting, "connections", "connections_target_met", "{}")
    connections.set_ylim(0, max([bound, *held]) * 1.3)
    connections.set_ylabel("connections to Redis")
    connections.legend(frameon=False, fontsize=SMALL, loc="upper left")
    connections.set_title("Connections held", fontsize=TITLE)
    for ax in (commands, connections):
        ax.set_xscale("log")
        ax.set_xticks(counts)
        ax.xaxis.set_major_formatter(FuncFormatter(thousands))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("waiters in one process")
        ax.margins(x=0.15)
        ax.grid(color="#eeeeee")
    drawn.suptitle(
        "AsyncFairSemaphore: processes on one semaphore, and waiters in one\nprocess on one permit held elsewhere; "
        "red: holds over the limit, or a target missed",
        fontsize=TITLE,
    )
    return drawn


def split(result: Result) -> Figure:
    """CPU per cycle against scripts per cycle at limits 8 to 64, with the fitted line, in both processes."""
    drawn, axes = figure(result, 3.4, columns=2, share_x=True)
    points = result["split"]["points"]
    steps = [point["scripts_per_cycle"] for point in points]
    for ax, side, title in zip(axes, ("client", "server"), ("the client", "Redis"), strict=True):
        per_step = result["split"][f"{side}_us_per_step"]
        beside = result["split"][f"{side}_us_per_cycle_beside_steps"]
        cpu = [point[f"{side}_cpu_us"] for point in points]
        ax.scatter(steps, cpu, color=COLOURS["fair"], s=36, zorder=3)
        for point, x, y in zip(points, steps, cpu, strict=True):
            limit = point["scenario"].rsplit(" ", 1)[-1]
            ax.annotate(f"limit {limit}", (x, y), xytext=(4, 4), textcoords="offset points", fontsize=SMALL)
        span = [0.0, max(steps) * 1.1]
        ax.plot(span, [beside + per_step * x for x in span], color=PALE, zorder=2)
        ax.annotate(
            f"{per_step:.0f} µs a step\n{beside:.0f} µs a cycle beside its steps",
            (0, beside),
            xytext=(6, -28),
            textcoords="offset points",
            fontsize=SMALL,
        )
        ax.set_xlim(0, max(steps) * 1.25)  # room for the last point's label
        ax.set_ylim(bottom=0)
        ax.set_xlabel("scripts per cycle")
        ax.set_ylabel("CPU per cycle, µs")
        ax.grid(color="#eeeeee")
        ax.set_title(f"in {title}", fontsize=TITLE)
    drawn.suptitle(
        "AsyncFairSemaphore, four coroutines per permit: a cycle's CPU, split\n"
        "into what each step costs (the slope) and what its calls cost beside the steps",
        fontsize=TITLE,
    )
    return drawn


#: Each figure: its file, the result it reads, how it is drawn.
FIGURES: Final[tuple[tuple[str, str, Callable[[Result], Figure]], ...]] = (
    ("bench-throughput.png", "throughput.json", throughput),
    ("bench-handoff.png", "waiting.json", handoff),
    ("bench-crash.png", "waiting.json", crash),
    ("bench-holding.png", "holding.json", holding),
    ("bench-rate.png", "rate.json", rate),
    ("bench-failover.png", "failover.json", failover),
    ("bench-replicas.png", "failover.json", replicas),
    ("bench-peers.png", "peers.json", peers),
    ("bench-peer-handoff.png", "peers.json", peer_handoff),
    ("bench-scaling.png", "scaling.json", scaling),
    ("bench-split.png", "costs.json", split),
)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="where the JSONs are")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img", help="where to write the PNGs")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Result | None] = {}
    for image, source, draw in FIGURES:
        if source not in results:
            results[source] = load(args.results / source)
        result = results[source]
        if result is None:
            continue
        path = args.out / image
        draw(result).savefig(path, metadata=METADATA)
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
