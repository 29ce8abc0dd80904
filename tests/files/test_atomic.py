"""``ignite_amp.files.atomic.write_text``: a file written whole or not at all, a link followed, a stream in place."""
import os
import stat

import pytest

from ignite_amp.files.atomic import write_text


def test_a_write_that_fails_leaves_the_file_as_it_was_and_nothing_beside_it(tmp_path, file_size_limit):
    path = tmp_path / "mine.yaml"
    with file_size_limit(10), pytest.raises(OSError, match="File too large"):
        write_text(str(path), "x" * 100)
    assert os.listdir(tmp_path) == []  # no file, not an empty one
    path.write_text("before")
    os.chmod(path, 0o640)
    with file_size_limit(10), pytest.raises(OSError, match="File too large"):
        write_text(str(path), "x" * 100)
    assert os.listdir(tmp_path) == ["mine.yaml"] and path.read_text() == "before"
    write_text(str(path), "after")
    assert path.read_text() == "after" and stat.S_IMODE(os.stat(path).st_mode) == 0o640  # its own permissions kept


def test_a_new_file_gets_the_umasks_permissions_a_link_is_followed_and_a_stream_written_in_place(tmp_path):
    umask = os.umask(0o022)
    try:
        write_text(str(tmp_path / "new"), "text")
    finally:
        os.umask(umask)
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o644 and (tmp_path / "new").read_text() == "text"
    os.symlink(tmp_path / "new", tmp_path / "link")
    write_text(str(tmp_path / "link"), "through")
    assert os.path.islink(tmp_path / "link") and (tmp_path / "new").read_text() == "through"
    os.mkfifo(tmp_path / "fifo")
    reader = os.open(tmp_path / "fifo", os.O_RDONLY | os.O_NONBLOCK)
    try:
        write_text(str(tmp_path / "fifo"), "streamed")
        assert os.read(reader, 100) == b"streamed"
    finally:
        os.close(reader)
    assert sorted(os.listdir(tmp_path)) == ["fifo", "link", "new"]
