"""A progress bar for a job being waited on: on a terminal only, silent otherwise.

The bar fills as the proven bound closes on the incumbent (the best plan's
recompute FLOPs so far): full means optimal. It draws on stderr with rich,
and only when stderr is a terminal, so logs and pipes stay clean.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Protocol


class _JobView(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def status(self) -> str: ...

    @property
    def incumbent_flops(self) -> int | None: ...

    @property
    def bound_flops(self) -> int | None: ...


def is_terminal(stream: IO[str]) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def describe(job: _JobView) -> str:
    """One line: incumbent, bound and gap, as far as the solver has reported them."""
    incumbent, bound = job.incumbent_flops, job.bound_flops
    if incumbent is None:
        return "no plan yet"
    text = f"incumbent {incumbent:.4g} FLOPs"
    if bound is not None:
        gap = 0.0 if incumbent == 0 else (incumbent - bound) / incumbent
        text += f", bound {bound:.4g} (gap {gap:.1%})"
    return text


@contextmanager
def job_progress(show: bool | None = None, stream: IO[str] | None = None
                 ) -> Iterator[Callable[[_JobView], None]]:
    """Yields ``update(job)``; draws a bar when ``show`` (default: ``stream`` is a terminal)."""
    stream = stream or sys.stderr
    if not (is_terminal(stream) if show is None else show):
        yield lambda job: None
        return
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               TextColumn("{task.fields[detail]}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(file=stream, force_terminal=True),
                  refresh_per_second=8) as bar:
        task = bar.add_task("optiremat job", total=1.0, detail="submitted")

        def update(job: _JobView) -> None:
            incumbent, bound = job.incumbent_flops, job.bound_flops
            closed = 0.0
            if incumbent is not None and bound is not None:
                closed = 1.0 if incumbent == 0 else bound / incumbent
            bar.update(task, completed=closed, detail=describe(job),
                       description=f"optiremat job {job.id[:12]} {job.status}")

        yield update
