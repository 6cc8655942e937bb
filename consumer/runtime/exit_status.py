"""What a `tracejudge` command's exit status means: one meaning per status, the same for every command.

    0    done: the input was evaluated (or the service stopped cleanly) and every gate passed
    1    a quality gate failed: `eval --fail-under`, `calibrate --min-kappa`, `dataset merge-labels` with
         conflicting labels (the outputs are written: the run itself succeeded, its verdict is what failed)
    2    usage, configuration or unreadable input: a bad option or configuration key, an input that
         cannot be opened, an input file of which no line could be read as a record (gzip not named
         .gz, UTF-16, CSV, pretty-printed JSON, ...), an output path that is one of the inputs.
         Reported before any output is written; a previous output file is left as it was
    3    an output could not be written: disk full, permission denied, a missing directory, a closed
         pipe (`tracejudge eval ... | head -1`). One line on stderr, no traceback, except for a closed
         pipe, which ends the command silently as it ends `cat` (the reader has gone; nobody is
         listening). The output file that was being written is left as it was before the run
    4    a service could not start or stopped on an error: the long-running commands (`run`, `sink`,
         `sessions`, `agreement`, `backfill`, `demo`) when Kafka is unreachable, the metrics port is
         taken or a write-back failed (one line in the log says which)
    130  interrupted (Ctrl-C); the outputs are left as they were before the run
"""

from __future__ import annotations

from typing import Final

OK: Final = 0
GATE_FAILED: Final = 1
USAGE: Final = 2
OUTPUT_ERROR: Final = 3
SERVICE_FAILED: Final = 4
INTERRUPTED: Final = 130
