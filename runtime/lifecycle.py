"""Process lifecycle helpers for keyshift's own processes (coordinator and instances).

Hosts start these processes with `python -P -m ...`: `-P` keeps the working directory off the
front of sys.path, where a project folder (keyshift's own `operator/`, say) could shadow the
standard library before startup completes. `allow_user_code` then appends the working directory,
so users' `module:function` references resolve as they do for `keyshift run` itself.

`die_with_parent` makes a process end when the host that started it ends, even when the host is
killed with SIGKILL and cannot clean up (Linux PR_SET_PDEATHSIG, set by the child itself so the
host can spawn without a fork-time hook, which gRPC does not survive). Called first thing by the
`main` of the coordinator and of stage instances, and by `keyshift run` (whose own host, a test
harness say, may set the variable too).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PARENT_ENV = "KEYSHIFT_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """If a host set KEYSHIFT_PARENT_PID, die with it (no-op elsewhere, e.g. in a pod)."""
    expected = os.environ.get(PARENT_ENV)
    if not expected:
        return
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    # The parent may have died before prctl took effect.
    if os.getppid() != int(expected):
        os._exit(1)


def allow_user_code() -> None:
    """Make modules in the working directory importable, after the standard library."""
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)
