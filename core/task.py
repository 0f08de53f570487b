"""Deprecated: `core.task` moved to `core.loop.task`; this path imports it for one release."""

from core._deprecated import moved

moved(__name__, "core.loop.task")
