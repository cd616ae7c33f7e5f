"""The exit codes of the ckptool command, defined once.

Errors carry theirs (``CkptError.exit_code``), the CLI exits with them, and the help text and
README list them (a test checks that every code here is listed in both).
"""

from __future__ import annotations

import signal

OK = 0
PROBLEM = 1  # a check found a problem (verify, diff, scan), or there was nothing to do
USAGE = 2  # the arguments contradict each other or name something that does not exist
INPUT = 3  # input unreadable, unsafe or refused, output refused, or the machine ran out of memory
INTERNAL = 70  # EX_SOFTWARE (sysexits.h): a bug in ckptool, not a verdict on the input
INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C: 130, as a shell reports it
TERMINATED = 128 + signal.SIGTERM  # a polite kill: 143
CLOSED_PIPE = 128 + signal.SIGPIPE  # what a shell reports for git or cat killed by a closed pipe: 141


# what the help text says of each code a command exits with on its own (signals end it with the others)
HELP = {
    OK: "ok",
    PROBLEM: "a check found a problem",
    USAGE: "usage",
    INPUT: "unreadable/unsafe input",
    INTERNAL: "internal error (a bug: report it)",
    CLOSED_PIPE: "output pipe closed early (quiet, as git)",
}


def help_text() -> str:
    """The codes as the help text lists them: ``0 ok, 1 a check found a problem, ...``."""
    return ", ".join(f"{code} {meaning}" for code, meaning in HELP.items())


def killed_by(signum: int) -> int:
    """The code a shell reports for a process ended by signal ``signum``."""
    return 128 + signum
