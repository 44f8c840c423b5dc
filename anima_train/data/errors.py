"""The dataset's user-facing error: every data module raises it (or a subclass) with the files and the fix."""

from anima_train.errors import UserError


class DatasetError(UserError, ValueError):
    """A dataset problem found while scanning; the message names the files/settings and the fix."""
