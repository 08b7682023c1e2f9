"""`make e2e`'s orchestration (dev/e2e.py run_chains): the chains run in order after the
real extraction, and a chain that fails stops the ones not started yet, so a broken step
is reported at once rather than after every other chain has spent its (GPU) time."""

from __future__ import annotations

import argparse

import pytest

from eagle3_extract.dev import e2e


def _args(**kw) -> argparse.Namespace:
    base = dict(no_control=True, fp8=False, curve=[480, 2000], jobs=1)
    return argparse.Namespace(**{**base, **kw})


def test_a_failed_chain_stops_the_chains_not_started(monkeypatch, tmp_path):
    ran: list[str] = []
    monkeypatch.setattr(e2e, "extract", lambda out, args, kind, layers, lane: ran.append(f"x-{kind}"))

    def measure(out, args, kind, served, lane):
        ran.append(f"m-{kind}")
        if kind == "real":
            raise SystemExit("e2e: acceptance exited 2")
        return {"kind": kind}

    monkeypatch.setattr(e2e, "train_and_measure", measure)
    with pytest.raises(SystemExit, match="acceptance exited 2"):
        e2e.run_chains(tmp_path, _args())
    assert ran == ["x-real", "m-real"]  # neither curve chain started


def test_the_chains_run_in_order_and_all_report(monkeypatch, tmp_path):
    ran: list[str] = []
    monkeypatch.setattr(e2e, "extract", lambda out, args, kind, layers, lane: ran.append(f"x-{kind}"))
    monkeypatch.setattr(e2e, "train_and_measure",
                        lambda out, args, kind, served, lane: ran.append(f"m-{kind}") or {"k": kind})
    reports = e2e.run_chains(tmp_path, _args())
    assert list(reports) == ["real", "curve-480", "curve-2000"]
    assert ran == ["x-real", "m-real", "x-curve-480", "m-curve-480", "x-curve-2000", "m-curve-2000"]
