"""XLA's memory analyses kept on disk for the processes to come (``OPTIREMAT_CACHE_DIR``,
``client.memory_cache``): what one process compiled, the next reads instead of compiling."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import optiremat
from optiremat.client import memory_cache, schedule
from optiremat.client.peak import calibration
from optiremat.client.step import Step, _memory_options, forget_compiled_memory, lowered_memory
from tests.peak_models import small_llama


@pytest.fixture
def folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache folder, and this process's own memory of compiles forgotten on both sides,
    so that each test starts as a fresh process does."""
    monkeypatch.setenv(memory_cache.CACHE_DIR_ENV, str(tmp_path / "cache"))
    _as_a_fresh_process()
    yield tmp_path / "cache"
    _as_a_fresh_process()


def _as_a_fresh_process() -> None:
    forget_compiled_memory()
    calibration._measured.clear()


class _Compiles:
    """Counts XLA compiles in a block; each still runs."""

    def __enter__(self) -> _Compiles:
        self.count = 0
        self._original = jax.stages.Lowered.compile
        counter = self

        def compile(lowered, *args, **kwargs):
            counter.count += 1
            return counter._original(lowered, *args, **kwargs)

        jax.stages.Lowered.compile = compile  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        jax.stages.Lowered.compile = self._original  # type: ignore[method-assign]


def _lowered() -> jax.stages.Lowered:
    def loss(w, x):
        return jnp.sum(jnp.tanh(jnp.sin(x @ w) @ w))

    args = (jnp.ones((64, 64)), jnp.ones((32, 64)))
    return Step.of(0).function(loss).lower(*args)


def test_what_one_process_compiled_the_next_reads_from_the_folder(folder):
    lowered = _lowered()
    with _Compiles() as first:
        analysis = lowered_memory(lowered)
    assert first.count == 1
    [entry] = folder.glob("*.json")
    _as_a_fresh_process()
    with _Compiles() as again:
        assert lowered_memory(lowered) == analysis
    assert again.count == 0
    # The figure comes from the file: edited, it is what the next process reads.
    fields = json.loads(entry.read_text())
    entry.write_text(json.dumps({**fields, "temp_bytes": fields["temp_bytes"] + 1}))
    _as_a_fresh_process()
    assert lowered_memory(lowered).temp_bytes == analysis.temp_bytes + 1


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"temp_bytes": "12"}',
                                    '{"other": 1}', ""])
def test_a_damaged_entry_is_compiled_again_and_written_whole(folder, damage):
    lowered = _lowered()
    analysis = lowered_memory(lowered)
    [entry] = folder.glob("*.json")
    entry.write_text(damage)
    _as_a_fresh_process()
    with _Compiles() as again:
        assert lowered_memory(lowered) == analysis
    assert again.count == 1
    assert json.loads(entry.read_text())["temp_bytes"] == analysis.temp_bytes


def test_each_set_of_compile_options_has_its_own_entry(folder):
    lowered = _lowered()
    # Keeping checkpoint barriers takes options only where this process's compile would
    # merge them (client.schedule: jax 0.10's CPU backend; its probe may keep entries too).
    options = {json.dumps(_memory_options(keep), sort_keys=True) for keep in (False, True)}
    before = set(folder.glob("*.json"))
    for keep_barriers in (False, True):
        lowered_memory(lowered, keep_barriers=keep_barriers)
    assert len(set(folder.glob("*.json")) - before) == len(options)
    assert memory_cache.entry_name("f" * 64, {}) != memory_cache.entry_name("f" * 64,
                                                                            {"an option": "1"})


def test_a_folder_that_cannot_be_written_warns_once_and_compiles(tmp_path, monkeypatch):
    blocked = tmp_path / "a file, not a folder"
    blocked.write_text("")
    monkeypatch.setenv(memory_cache.CACHE_DIR_ENV, str(blocked))
    memory_cache._WARNED.discard(str(blocked))
    _as_a_fresh_process()
    lowered = _lowered()
    with pytest.warns(optiremat.CacheWarning, match=memory_cache.CACHE_DIR_ENV):
        analysis = lowered_memory(lowered)
    _as_a_fresh_process()
    with warnings.catch_warnings():
        warnings.simplefilter("error", optiremat.CacheWarning)
        assert lowered_memory(lowered) == analysis
    _as_a_fresh_process()


def test_unset_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(memory_cache.CACHE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _as_a_fresh_process()
    with _Compiles() as compiles:
        lowered_memory(_lowered())
    assert compiles.count == 1
    assert list(tmp_path.iterdir()) == []
    _as_a_fresh_process()


def test_a_plan_made_again_in_a_fresh_process_compiles_nothing(folder):
    loss, args = small_llama()
    budget = int(optiremat.measured_peak(jax.jit(jax.grad(loss)).lower(*args).compile()) * 0.6)
    with _Compiles() as first:
        plan = optiremat.optimize(loss, *args, budget=budget)
    _as_a_fresh_process()
    with _Compiles() as again:
        replanned = optiremat.optimize(loss, *args, budget=budget)
    assert first.count > 0 and again.count == 0
    assert replanned.solution.fingerprint() == plan.solution.fingerprint()
    assert replanned.peak_bytes == plan.peak_bytes


def test_the_schedule_probe_compiled_once_is_read_back(folder):
    """``barriers_kept``'s probe compiles under the process's default options: an entry of
    its own, read back by the next process."""
    with _Compiles() as first:
        temp = schedule._probe_temp_bytes(True)
    with _Compiles() as again:
        assert schedule._probe_temp_bytes(True) == temp
    assert (first.count, again.count) == (1, 0)
    assert len(list(folder.glob("*.json"))) == 1
