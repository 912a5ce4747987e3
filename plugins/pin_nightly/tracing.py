"""OpenTelemetry spans of a run: ``job_run`` (drawn by the setup task, sent by the teardown),
a ``range`` span per range task under it and a ``batch`` span per batch transaction under each
range, sent to the tracer provider Airflow sets up when tracing is on (a no-op otherwise: no
attribute is computed). Attributes and setup: docs/operations.md, "Traces".
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from datetime import datetime
from typing import Any

from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

log = logging.getLogger(__name__)
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


def new_run(attributes: dict[str, Any]) -> dict[str, Any] | None:
    """In the setup task: where the run's ``job_run`` span goes (this trace, under the current
    span, a new span id) and its attributes; None when nothing records."""
    current = trace.get_current_span()
    ctx = current.get_span_context()
    if not current.is_recording() or not ctx.is_valid:
        return None
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "parent_id": f"{ctx.span_id:016x}",
        "span_id": f"{random.getrandbits(64) or 1:016x}",
        "flags": int(ctx.trace_flags),
        "attributes": attributes,
    }


def _context(trace_id: str, span_id: str, flags: int) -> context.Context:
    parent = SpanContext(
        int(trace_id, 16), int(span_id, 16), is_remote=True, trace_flags=TraceFlags(flags)
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def in_run(run: dict[str, Any] | None):
    """A block whose new spans are children of the run's ``job_run`` span (nothing changes when
    the run has none, or it belongs to another trace: a task cleared into a new one)."""
    current = trace.get_current_span().get_span_context()
    if not run or not current.is_valid or f"{current.trace_id:032x}" != run["trace_id"]:
        return nullcontext()
    return _attached(_context(run["trace_id"], run["span_id"], run["flags"]))


@contextmanager
def _attached(ctx: context.Context) -> Iterator[None]:
    token = context.attach(ctx)
    try:
        yield
    finally:
        context.detach(token)


def _override_ids():
    try:  # the id generator of the tracer provider Airflow configures
        from airflow._shared.observability.traces import override_ids
    except ImportError:  # a worker with the Task SDK only
        from airflow.sdk._shared.observability.traces import override_ids
    return override_ids


def end_run(run: dict[str, Any] | None, started: datetime) -> None:
    """In the teardown: send the run's ``job_run`` span, from ``started`` to now."""
    if not run:
        return
    with _override_ids()(int(run["trace_id"], 16), int(run["span_id"], 16)):
        s = _tracer.start_span(
            "job_run",
            context=_context(run["trace_id"], run["parent_id"], run["flags"]),
            start_time=int(started.timestamp() * 1e9),
            attributes=run["attributes"],
        )
    if f"{s.get_span_context().span_id:016x}" != run["span_id"]:
        log.warning("the tracer provider chose its own span id: range spans are not under job_run")
    s.end()
