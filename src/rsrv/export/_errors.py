"""The one error every exporter raises."""


class ExportError(ValueError):
    """The model cannot be exported as a servable bundle; nothing was written."""
