"""Reading a file that holds a secret (the admin token, the L2 sealing secret).

Such a file must be a regular file, owned by the server's effective uid, that no group or other
user can access: anything else is refused with a reason a one-line start error can carry, never
read (a secret others can read is no secret; one others can write lets them choose it).
"""
from __future__ import annotations

import os
import stat

__all__ = ["PrivateFileError", "read_private_file"]


class PrivateFileError(ValueError):
    """Why a secret file was refused (the message names no path; callers add theirs)."""


def read_private_file(path: str, limit: int = 4096) -> bytes:
    """The first ``limit`` bytes of ``path``, surrounding whitespace stripped.

    Raises ``PrivateFileError`` when it cannot be opened (a symlink is not followed), is not a
    regular file, belongs to another uid, or has any group/other permission bit."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as e:
        raise PrivateFileError(f"cannot open it: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PrivateFileError("not a regular file")
        if st.st_uid != os.geteuid():
            raise PrivateFileError(f"owned by uid {st.st_uid}, not by this user")
        if st.st_mode & 0o077:
            raise PrivateFileError(
                f"mode {stat.S_IMODE(st.st_mode):04o}; it must be mode 600, with no group or other "
                f"access (chmod 600 it)"
            )
        return os.read(fd, limit).strip()
    finally:
        os.close(fd)
