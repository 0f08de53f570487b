"""Deprecated: `core.trainer` moved to `core.loop.trainer`; this path imports it for one release."""

from core._deprecated import moved

moved(__name__, "core.loop.trainer")
