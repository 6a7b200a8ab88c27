"""Engine start records: what the suite's cold-start count is built from."""

from __future__ import annotations

from rlfleet.fleet.shard import start_records
from rlfleet.fleet.shard.start_records import read_starts, record_start, summarize


def test_nothing_is_written_when_the_variable_is_unset(tmp_path, monkeypatch):
    monkeypatch.delenv(start_records.ENV, raising=False)
    record_start(0, 1, "vllm", 1.0, ok=True)
    assert list(tmp_path.iterdir()) == []


def test_each_start_appends_one_record_and_the_summary_counts_them_by_backend(tmp_path, monkeypatch):
    path = tmp_path / "starts.jsonl"
    monkeypatch.setenv(start_records.ENV, str(path))
    record_start(0, 1, "vllm", 12.5, ok=True)
    record_start(1, 1, "vllm", 7.5, ok=True)
    record_start(2, 1, "vllm", 3.0, ok=False)
    record_start(3, 1, "null", 0.1, ok=True)
    records = read_starts(path)
    assert [(r["slot"], r["ok"]) for r in records] == [(0, True), (1, True), (2, False), (3, True)]
    assert summarize(records) == "engine starts: 1 null, 2 vllm; 1 failed; vllm engine start time 23 s in all"


def test_a_torn_line_is_skipped_and_a_missing_file_reads_as_none(tmp_path):
    path = tmp_path / "starts.jsonl"
    assert read_starts(path) == []
    path.write_text('{"slot": 0, "ok": true, "backend": "vllm", "start_s": 1}\n{"slot": 1, "ok"', encoding="utf-8")
    assert [r["slot"] for r in read_starts(path)] == [0]


def test_an_unwritable_file_never_fails_the_start(tmp_path, monkeypatch):
    monkeypatch.setenv(start_records.ENV, str(tmp_path / "no-such-dir" / "starts.jsonl"))
    record_start(0, 1, "vllm", 1.0, ok=True)  # raises nothing


def test_each_start_is_charged_to_the_module_running_when_its_engine_began():
    windows = [(100.0, "tests/a.py"), (200.0, "tests/b.py"), (300.0, "tests/c.py")]
    records = [
        {"t": 150.0, "start_s": 10.0, "backend": "vllm", "ok": True},  # began 140: a
        {"t": 215.0, "start_s": 20.0, "backend": "vllm", "ok": True},  # began 195: still a (fixture of a's test)
        {"t": 260.0, "start_s": 20.0, "backend": "vllm", "ok": False},  # began 240: b
        {"t": 50.0, "start_s": 1.0, "backend": "null", "ok": True},  # before any test
    ]
    out = dict(start_records.by_window(records, windows))
    assert out["tests/a.py"] == "engine starts: 2 vllm; 0 failed; vllm engine start time 30 s in all"
    assert out["tests/b.py"] == "engine starts: none; 1 failed; vllm engine start time 20 s in all"
    assert "tests/c.py" not in out and "(before the first test)" in out
