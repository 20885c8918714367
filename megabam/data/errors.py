"""The one exception type of the data pipeline: bad input, reported as one line."""


class DataError(ValueError):
    """Input the data pipeline refuses; the message is one line that names the culprit."""
