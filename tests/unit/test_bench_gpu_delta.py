"""scripts/bench_gpu_delta.py, the prepared GPU script of sharded and delta refits, in its CPU check mode: its
writes land where ``refit.sharded_wire.from_full`` says, both patch applies leave the new weights, and a
broken apply is caught (the check can fail)."""

from __future__ import annotations

import json
import sys

import torch

from tests.scripts import load


def bench():
    return load("bench_gpu_delta")


def run(module, monkeypatch, capsys, *extra) -> tuple[int, dict]:
    monkeypatch.setattr(sys, "argv", ["bench_gpu_delta.py", "--device", "cpu", "--model", "tiny", "--copy-mib", "4",
                                      "--repeats", "1", *extra])
    rc = module.main()
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_the_cpu_check_measures_and_proves_every_write(monkeypatch, capsys):
    rc, out = run(bench(), monkeypatch, capsys)
    assert rc == 0 and out["equal"] and out["unpack_equal"] and out["apply_equal"]
    assert out["unpack_bytes"] < out["model_bytes"] / 4  # worker 0 of TP 8 holds about an eighth
    assert 0.05 < out["delta_bytes_vs_full"] < 0.15  # 3% of the elements, 6 bytes each against 2
    for key in ("d2d_GBps", "unpack_vs_d2d", "diff_vs_d2d", "apply_inplace_vs_d2d", "apply_nan_masked_vs_d2d"):
        assert out[key] > 0, key


def test_an_apply_that_misses_a_patch_is_caught(monkeypatch, capsys):
    module = bench()

    def drops_the_first(target, indices, values):  # every patch but its first element
        target.view(-1).index_copy_(0, indices[1:].to(torch.int64), values[1:])

    monkeypatch.setattr(module.delta, "apply_flat", drops_the_first)
    rc, out = run(module, monkeypatch, capsys)
    assert rc == 1 and not out["apply_equal"] and not out["equal"]
