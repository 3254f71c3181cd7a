"""This machine's measurements (edgespec.costs) where the cache cannot keep
them: a read-only or full EDGESPEC_HOME costs one measurement per process,
said once in one line, never one per load."""
from __future__ import annotations

import errno
import logging
import os

import pytest

from edgespec import costs
from edgespec.backends import open_backend
from refusing_fs import refuse_writes


@pytest.mark.parametrize("disturbed", [False, True], ids=["quiet", "disturbed"])
@pytest.mark.parametrize("code", [errno.EROFS, errno.ENOSPC])
def test_a_cache_that_cannot_be_written_costs_one_measurement_per_process_said_once(
        tiny_llama_path, tmp_path, monkeypatch, caplog, code, disturbed):
    """Also where the curve looks measured on a busy machine (a loaded test
    machine): the process keeps it rather than measuring at every load."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    monkeypatch.setattr(costs, "_unsaved", {})
    monkeypatch.setattr(costs, "_said_unsaved", set())
    measured = []
    real = costs.measure_batch_costs

    def measure(b):
        measured.append(1)
        return costs.Suspect(real(b), "simulated") if disturbed else real(b)

    monkeypatch.setattr(costs, "measure_batch_costs", measure)
    refuse_writes(monkeypatch, home, code)
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend, \
            caplog.at_level(logging.INFO, logger="edgespec"):
        first = costs.batch_costs(backend)
        assert costs.batch_costs(backend) == first and costs.batch_costs(backend) == first
        costs.bandwidth(1)   # another file of the same cache: said for it too, once
        costs.bandwidth(1)
    assert len(measured) == 1
    said = [r.getMessage() for r in caplog.records if "busy machine" not in r.getMessage()]
    assert len(said) == 2 and all("cannot save" in line for line in said), said
    assert str(home / costs.COST_FILE) in said[0] and os.strerror(code) in said[0]
    assert str(home / costs.BANDWIDTH_FILE) in said[1]
    assert not home.exists()


def test_a_file_the_disk_has_no_room_for_is_said_once(tiny_llama_path, tmp_path, monkeypatch, caplog):
    """The folder takes a new file, but not the bytes of the table."""
    home = tmp_path / "home"
    monkeypatch.setenv("EDGESPEC_HOME", str(home))
    monkeypatch.setattr(costs, "_unsaved", {})
    monkeypatch.setattr(costs, "_said_unsaved", set())

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    monkeypatch.setattr(costs, "write_atomic", full)
    with open_backend("native", tiny_llama_path, n_ctx=256, threads=1) as backend, \
            caplog.at_level(logging.INFO, logger="edgespec"):
        first = costs.batch_costs(backend)
        assert costs.batch_costs(backend) == first
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2 and "measuring" in said[0] and "cannot save" in said[1], said
    assert os.strerror(errno.ENOSPC) in said[1]

