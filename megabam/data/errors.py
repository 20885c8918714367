"""The one exception type of the data pipeline: bad input, reported as one line."""

from megabam.errors import UserError


class DataError(UserError):
    """Input the data pipeline refuses; the message is one line that names the culprit."""
