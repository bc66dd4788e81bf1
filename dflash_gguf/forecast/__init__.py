"""Know before you download: each drafter configuration's speed on this machine at every accepted length, measured
with real llama-server on stand-ins of the repos (their configs and tokenizers, random weights of the right shapes
and types), and where each breaks even with the target alone."""

from .run import (
    ForecastOptions,
    ForecastReport,
    Standins,
    acceptance_from_record,
    configurations,
    forecast,
    make_standins,
)

__all__ = ["ForecastOptions", "ForecastReport", "Standins", "acceptance_from_record", "configurations", "forecast",
           "make_standins"]
