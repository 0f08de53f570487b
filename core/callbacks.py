"""Deprecated: `core.callbacks` moved to `core.loop.callbacks`; this path imports it for one release."""

from core._deprecated import moved

moved(__name__, "core.loop.callbacks")
