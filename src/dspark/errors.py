"""Errors a user can cause. The CLI prints their message without a traceback."""


class DSparkError(Exception):
    """A problem the user can fix (bad path, bad config, incompatible models)."""


class ModelLoadError(DSparkError):
    """A model folder is missing, corrupt or of an unsupported kind."""


class IncompatibleModelsError(DSparkError):
    """Drafter and target do not fit together (vocabulary, hidden size, layers)."""


class PromptError(DSparkError):
    """A prompt is empty or does not fit into the model's context."""


class BadFileError(DSparkError, ValueError):
    """A file the user gave (STS, SPS table, tokenized data, training state, config) is missing or malformed.

    The message names the file and what is wrong with it, on one line."""
