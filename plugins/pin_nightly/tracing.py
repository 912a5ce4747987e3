"""OpenTelemetry spans of the range tasks: one span per range, a child span per batch.

The spans go to the tracer provider that Airflow sets up when tracing is on (``[traces]
otel_on``, exporter and endpoint from the standard ``OTEL_*`` environment). They nest under
Airflow's own span of the task (``worker.<task_id>[<map_index>]``), itself a child of the run's
``dag_run`` span, so one trace shows a night from the run down to each batch. With tracing off
the tracer is OpenTelemetry's no-op one: no attribute is computed and nothing is sent.

Attributes (``pin.*``): on the range span the job, the run id (the spec's ``jobRunId`` /
``correlationId``), the sweep, its scope, the range and the card kind; on each batch span the
rows read, the rows updated (the spec's ``updated_count``), rows written, rows skipped because
locked, item errors and the cursor after the batch. An exception leaving a span is recorded on
it and sets its status to error.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace

_tracer = trace.get_tracer("pin_nightly")


@contextmanager
def span(name: str, attributes: Callable[..., dict[str, Any]], *args: Any) -> Iterator[trace.Span]:
    """A span current for the block; ``attributes(*args)`` is only called when it records."""
    with _tracer.start_as_current_span(name) as s:
        set_result(s, attributes, *args)
        yield s


def set_result(s: trace.Span, attributes: Callable[..., dict[str, Any]], *args: Any) -> None:
    """Set ``attributes(*args)`` on the span when it records (known at the end of its work)."""
    if s.is_recording():
        s.set_attributes({k: v for k, v in attributes(*args).items() if v is not None})
