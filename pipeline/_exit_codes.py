"""How a worker process ends: its exit codes, which its launcher reads to decide whether to
start it again; and the one every stagewire command shares for arguments it cannot use."""

from __future__ import annotations

__all__ = (
    "EXIT_CONFIG",
    "EXIT_INTERRUPTED",
    "EXIT_MASTER_LOST",
    "EXIT_REPLACED",
    "EXIT_SETUP_FAILED",
)

#: A command given a config, input or arguments it cannot work with (a usage error).
EXIT_CONFIG = 2
#: The stage's setup raised.
EXIT_SETUP_FAILED = 3
#: No master answered for twice the heartbeat timeout, or the master stopped counting it.
EXIT_MASTER_LOST = 4
#: The master gave its slot to a newer worker and told this one to stop: the slot has a
#: holder, so a launcher does not start it again (where a worker ending with 0 outside a
#: close is a crash, and is restarted).
EXIT_REPLACED = 5
#: A worker started by hand and stopped by Ctrl-C.
EXIT_INTERRUPTED = 130
