"""The one error of a sandbox that cannot run on this machine, raised by every part of it that finds
out (no bubblewrap, a kernel that refuses its namespaces or seccomp, no standard library to copy):
code is never run without the sandbox."""
from __future__ import annotations

from dare_core.errors import UserError

INSTALL_HINT = "run `make sandbox`, which installs bubblewrap (apt-get install bubblewrap)"


class SandboxUnavailable(UserError):
    """The OS-level sandbox cannot run here; code is never run without it."""
