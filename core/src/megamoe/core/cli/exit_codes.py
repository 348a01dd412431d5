"""The ``megamoe`` command's exit codes, shared by the parser and the commands."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAIL = 1  # an error, or a forward beyond tolerance
EXIT_USAGE = 2  # an option the command cannot use (argparse's code too)
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143  # SIGTERM, after the command removed what it had half written
EXIT_PIPE_CLOSED = 141  # SIGPIPE's code: whoever read the output stopped reading
