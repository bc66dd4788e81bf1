"""Know before you download: each drafter configuration's speed on this machine at every accepted length, measured
with real llama-server on stand-ins of the repos (their configs and tokenizers, random weights of the right shapes
and types), and where each breaks even with the target alone."""

from .curve import Curve, crossing
from .run import ForecastOptions, ForecastReport, Standins, configurations, forecast, make_standins

__all__ = ["Curve", "ForecastOptions", "ForecastReport", "Standins", "configurations", "crossing", "forecast",
           "make_standins"]
