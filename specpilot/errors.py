"""Errors a user can cause. The CLI prints them as one clear line instead of a traceback."""


class SpecPilotError(Exception):
    """Base class: bad input, a missing model, a corrupt file. Never a bug in SpecPilot."""


class ModelNotFoundError(SpecPilotError):
    """A model name, folder or hub id that cannot be resolved."""


class ModelFormatError(SpecPilotError):
    """A model file that is truncated, corrupt or of an unsupported architecture."""


class ConfigError(SpecPilotError):
    """An invalid configuration value (e.g. max_new_tokens <= 0, an empty prompt)."""


class DatasetError(SpecPilotError):
    """A benchmark or prompt file that cannot be found or parsed."""
