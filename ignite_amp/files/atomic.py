"""A text file written whole or not at all: a temporary name in the same folder, then ``os.replace``.

A write that fails half way (a full disk, a quota, ``ulimit -f``, Ctrl-C) leaves the file as it was, or no file,
so the same command can be run again: no empty ``mine.yaml`` that a retry refuses to replace and ``train`` reads as
a config of defaults, no schema cut to invalid JSON. A symbolic link is followed (its target is replaced, the link
kept); what is not a regular file (a terminal, a pipe, ``/dev/null``) is written in place, as a stream.
"""
import os
import secrets
import stat

__all__ = ["write_text"]


def write_text(path: str, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a new file gets the permissions ``open`` would give it (the
    umask's), a replaced one keeps its own. Raises the OSError of a failed write, with nothing left behind."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:  # a new file (or a link to one)
        mode = None
    if mode is not None and not stat.S_ISREG(mode):  # a device or a pipe (/dev/stderr): nothing can replace it
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return
    folder, name = os.path.split(os.path.realpath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to open(path, "w")
    try:
        with open(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())  # a full disk some file systems report only here
        if mode is not None:
            os.chmod(temporary, stat.S_IMODE(mode))
        os.replace(temporary, os.path.join(folder, name))
    except BaseException:
        try:
            os.remove(temporary)
        except OSError:
            pass
        raise
