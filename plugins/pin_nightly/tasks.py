"""Helpers for the task callables of the DAG files."""

from __future__ import annotations

import functools
from collections.abc import Callable

from pin_nightly.db import JobConfigError


def config_errors_fail(fn: Callable) -> Callable:
    """A configuration error fails the task at once, without retries."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JobConfigError as exc:
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(str(exc)) from exc

    return wrapper
