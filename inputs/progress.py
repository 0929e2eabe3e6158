"""Progress lines for long jobs that log instead of drawing a bar (a batch job's log, a Ray driver): how far, how
long so far, and about how long is left at this run's rate (work an earlier run finished is not counted in it)."""
from __future__ import annotations


def clock(seconds: float) -> str:
    """h:mm:ss."""
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d}"


def progress_line(done: int, total: int, fresh: int, elapsed: float, unit: str) -> str:
    """"k of n <unit>, h:mm:ss elapsed, about h:mm:ss left": done of total, `fresh` of them done by this run in
    `elapsed` seconds (the rate the estimate uses; none yet: no estimate)."""
    line = f"{done} of {total} {unit}, {clock(elapsed)} elapsed"
    if fresh > 0 and done < total:
        line += f", about {clock((total - done) * elapsed / fresh)} left"
    return line
