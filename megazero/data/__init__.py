"""Data: tokenizers, Megatron MMIDIDX indexed datasets, GPT sample indices, corpora.

The submodules are imported where they are used (``megazero.data.indexed`` and so on);
this package only defines the error every data problem is reported with.
"""

from megazero.errors import UserError


class DataError(UserError, ValueError):
    """A data problem the user can fix: the message is one line naming the value and the fix.

    Command-line tools print it as ``error: <message>`` and exit with status 2.
    """
