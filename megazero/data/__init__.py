"""Data: tokenizers, Megatron MMIDIDX indexed datasets, GPT sample indices, corpora.

The submodules are imported where they are used (``megazero.data.indexed`` and so on);
this package only defines the error every data problem is reported with, and the one reader
of the small JSON files beside data (sidecars, tokenizer configs).
"""

import json
import os
from typing import Any, Optional

from megazero.errors import UserError


class DataError(UserError, ValueError):
    """A data problem the user can fix: the message is one line naming the value and the fix.

    Command-line tools print it as ``error: <message>`` and exit with status 2.
    """


def read_json(path: str, unreadable: str) -> Optional[Any]:
    """The JSON value in PATH, None when there is no such file; a file that cannot be read or
    parsed is a DataError naming it, with `unreadable` as the fix."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is unreadable ({e}); {unreadable}") from None
