"""Checkpoint files: the header check, the SHA-256 check and retention (survivors of tools/mutation.py)."""
import hashlib

import pytest
import torch

from elasticlab.elastic.checkpoint import MAGIC, CheckpointDir, CheckpointError, load, save, verify


def test_a_file_with_the_wrong_magic_is_refused_by_its_header(tmp_path):
    good = save({"step": 1, "w": torch.ones(3)}, tmp_path / "a.pt").read_bytes()
    forged = b"X" + good[1:]                                  # same length, same newline, same checksum
    (tmp_path / "b.pt").write_bytes(forged)
    with pytest.raises(CheckpointError, match="not an elasticlab checkpoint"):
        verify(tmp_path / "b.pt")
    payload = good[len(MAGIC) + 65:]
    no_newline = MAGIC + hashlib.sha256(payload).hexdigest().encode() + b" " + payload
    (tmp_path / "c.pt").write_bytes(no_newline)
    with pytest.raises(CheckpointError, match="not an elasticlab checkpoint"):
        verify(tmp_path / "c.pt")
    assert load(tmp_path / "a.pt")["step"] == 1


def test_retention_keeps_exactly_keep_files_and_keep_one_is_allowed(tmp_path):
    with pytest.raises(ValueError, match="keep must be >= 1, got 0"):
        CheckpointDir(tmp_path / "x", keep=0)
    one = CheckpointDir(tmp_path / "one", keep=1)
    for step in (1, 2, 3):
        one.save({"step": step}, step)
    assert one.steps() == [3]
    three = CheckpointDir(tmp_path / "three")
    for step in range(1, 6):
        three.save({"step": step}, step)
    assert three.steps() == [3, 4, 5]                          # the default keeps three


def test_latest_recorded_goes_back_to_the_record_or_says_there_is_a_gap(tmp_path):
    """The newest checkpoint at or before the record's step; with none left there, the newest and gap."""
    ck = CheckpointDir(tmp_path, keep=5)
    for step in (4, 8, 12):
        ck.save({"step": step}, step)
    assert ck.latest_recorded(None) == (ck.path(12), [], False)
    assert ck.latest_recorded(11) == (ck.path(8), [], False)
    assert ck.latest_recorded(3) == (ck.path(12), [], True)
    assert ck.latest_recorded(9, exclude=[ck.path(8)]) == (ck.path(4), [], False)
