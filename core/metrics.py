"""Deprecated: `core.metrics` moved to `core.logging.sinks`; this path imports it for one release."""

from core._deprecated import moved

moved(__name__, "core.logging.sinks")
