"""Which exceptions are the user's input and which are bugs: the one allow-list every command line uses.

    try: ...
    except USER_ERRORS as e:                    # bad input: one line on stderr, exit status 2
        print(f"longdoc VERB: error: {e}")
    # anything else is a bug: its traceback, exit status 3 (longdoc.cli)

A user error names the problem and the fix in its message, so the message is all the user needs; it is raised
alike in one process and inside spawned ranks (longdoc.runtime.spawn sends it back to the parent, which re-raises it),
so `--cp 2` prints the same line as a single process. A longdoc exception class says it is a user error by
deriving from `UserError` (next to its own base: `class CheckpointError(UserError, RuntimeError)`); this module
imports no other longdoc layer, so every layer can use it.
"""

from __future__ import annotations


class UserError(Exception):
    """Marker base: an exception whose message tells the user what to fix (bad input, not a bug)."""


class ModelNotFoundError(UserError, OSError):
    """A model name that is no folder, file, known name or reachable hub repo."""


class RankInputError(UserError, ValueError):
    """A user error raised inside a spawned rank whose own exception could not travel back (not picklable)."""


# The allow-list. ValueError covers RecipeError, CorpusError, CPInputError, EvalInputError and the argument checks;
# the OS errors are missing or unreadable files and folders the user named.
USER_ERRORS: tuple[type[BaseException], ...] = (
    UserError, ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
)

# Exit statuses of every `longdoc` verb (documented in `longdoc --help`).
EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_BUG = 0, 1, 2, 3
EXIT_CODES = (
    f"exit status: {EXIT_OK} success; {EXIT_FAIL} the run's own negative verdict (verify: FAIL, CP does not match "
    f"one process; train: stopped on a non-finite loss; eval guard: HARM); {EXIT_USAGE} bad input, one line on "
    f"stderr `longdoc VERB: error: MESSAGE` (the same with --cp N as without); {EXIT_BUG} an internal error (a bug: "
    f"its traceback follows, please report it)"
)
