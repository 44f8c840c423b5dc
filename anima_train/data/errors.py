"""The dataset's user-facing error: every data module raises it (or a subclass) with the files and the fix."""

from anima_train.errors import UserError
from anima_train.fixes import ref


class DatasetError(UserError, ValueError):
    """A dataset problem found while scanning. The first line says what is wrong and what to change (a node's popup
    shows that line alone, so paths and file lists go on the lines below it); the rest names the files."""


def the_dataset() -> str:
    """The dataset's folder as the front that shows the message names it (a ComfyUI node: its widget)."""
    return ref("name dataset", "the dataset folder")


def the_resolution() -> str:
    """The training tiers as the front that shows the message names them."""
    return ref("name resolution", "the resolution")
