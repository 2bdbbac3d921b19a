"""The one exception type a user sees: a bad config, mesh, data path or checkpoint."""


class ConfigError(ValueError):
    """Raised before compilation; the message is one line naming the field and what would be valid."""
