"""The GIL switch interval an open store sets (tierstore/_switch.py): set once, restored once, not forced."""

from __future__ import annotations

import gc
import sys
import threading

import pytest

import tierstore as ts
from tierstore import _switch
from tierstore.store import _OPEN_STORES


@pytest.fixture
def fresh_interval():
    """No store open, the interpreter's default interval; the caller's interval back afterwards."""
    gc.collect()
    for st in list(_OPEN_STORES):  # stores other tests left open would hold the interval
        st.close()
    assert _switch.STORES.users == 0
    before = sys.getswitchinterval()
    sys.setswitchinterval(_switch.PYTHON_DEFAULT)
    yield
    sys.setswitchinterval(before)


def _open(path):
    return ts.TierStore(path, [ts.TableSpec("t", 100, 4)])


def test_open_stores_hold_a_1ms_interval_and_the_last_close_restores_the_default(tmp_path, fresh_interval):
    a = _open(tmp_path / "a")
    assert sys.getswitchinterval() == pytest.approx(_switch.STORE_DEFAULT)
    b = _open(tmp_path / "b")
    a.close()
    assert sys.getswitchinterval() == pytest.approx(_switch.STORE_DEFAULT)  # b still runs
    a.close()  # a second close releases nothing more
    assert _switch.STORES.users == 1
    b.close()
    assert sys.getswitchinterval() == _switch.PYTHON_DEFAULT
    assert _switch.STORES.users == 0


def test_an_interval_the_user_chose_is_kept_while_open_and_after_close(tmp_path, fresh_interval):
    sys.setswitchinterval(0.002)
    with _open(tmp_path / "a"):
        assert sys.getswitchinterval() == pytest.approx(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_an_interval_changed_while_a_store_is_open_survives_its_close(tmp_path, fresh_interval):
    with _open(tmp_path / "a"):
        sys.setswitchinterval(0.003)
    assert sys.getswitchinterval() == pytest.approx(0.003)


@pytest.mark.parametrize("text, expected", [("keep", _switch.PYTHON_DEFAULT), ("0.0005", 0.0005)])
def test_the_environment_variable_sets_or_keeps_the_interval(tmp_path, fresh_interval, monkeypatch,
                                                             text, expected):
    monkeypatch.setenv(_switch.ENV, text)
    with _open(tmp_path / "a"):
        assert sys.getswitchinterval() == pytest.approx(expected)
    assert sys.getswitchinterval() == _switch.PYTHON_DEFAULT


@pytest.mark.parametrize("text", ["fast", "0", "-1", "2", "nan"])
def test_a_bad_environment_variable_fails_the_open_before_any_file_is_made(tmp_path, fresh_interval,
                                                                          monkeypatch, text):
    monkeypatch.setenv(_switch.ENV, text)
    with pytest.raises(ts.ConfigError, match=_switch.ENV):
        _open(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    assert _switch.STORES.users == 0
    assert sys.getswitchinterval() == _switch.PYTHON_DEFAULT


def test_a_store_that_fails_to_open_holds_no_interval(tmp_path, fresh_interval):
    with _open(tmp_path / "a"):
        with pytest.raises(ts.StoreLockedError):  # a second writer on the same store
            _open(tmp_path / "a")
        assert _switch.STORES.users == 1
    assert _switch.STORES.users == 0
    assert sys.getswitchinterval() == _switch.PYTHON_DEFAULT


def test_a_store_abandoned_without_close_stops_counting(tmp_path, fresh_interval):
    a = _open(tmp_path / "a")
    a.log.stop_merger()  # left as a kill leaves it (tests/test_writeback.py's `_kill`)
    a.writeback.close()
    a.backend.close()
    a.closed = True
    assert _switch.STORES.users == 0
    with _open(tmp_path / "b"):
        assert sys.getswitchinterval() == pytest.approx(_switch.STORE_DEFAULT)
    assert sys.getswitchinterval() == _switch.PYTHON_DEFAULT


def test_release_from_a_finalizer_during_a_walk_does_not_deadlock():
    """A store's __del__ run by the garbage collector while this thread walks the holders closes
    the store and calls release here: it must return, not wait on the lock the walk holds."""
    counter = _switch.SwitchInterval()

    class Holder:
        closed = False

    dropped = Holder()

    class Collecting:  # its `closed` runs the finalizer of another holder, as GC may
        @property
        def closed(self) -> bool:
            dropped.closed = True
            counter.release(dropped)
            return False

    walker = Collecting()
    counter.acquire(dropped, None)
    counter.acquire(walker, None)
    done = threading.Event()

    def walk() -> None:
        counter.acquire(Holder(), None)
        done.set()

    t = threading.Thread(target=walk, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "acquire deadlocked on a release from its own walk"
    assert counter.users == 1  # the walker: the closed holder is dropped, the temporary one collected
    assert walker.closed is False
