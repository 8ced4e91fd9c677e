"""`gemmrl llm` end to end on a GPU against the local fake OpenAI-compatible server: an honest
kernel is built, verified, timed against measured baselines and rewarded; cheats that pass the
static check are caught by verification on the GPU; a host-side cheat is refused before any
build; garbage is a parse error; every turn is a stored trajectory and exported."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from test_llm import FAKE_KEY, HONEST, THREAD_CHEAT, FakeServer, completion, fenced, inlined

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_llm_command_builds_verifies_times_and_rewards(tmp_path, monkeypatch):
    from gemmrl.cli import main
    from gemmrl.store.db import Store

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    partial = inlined("cheats/partial_write.cu")
    downgrade = inlined("cheats/precision_downgrade.cu")
    srv = FakeServer([
        completion([fenced(HONEST), fenced(partial), fenced(THREAD_CHEAT), "no code, sorry"]),
        completion([fenced(downgrade), fenced(HONEST)]),
    ])
    monkeypatch.setenv("GEMMRL_LLM_BASE_URL", srv.url)
    monkeypatch.setenv("GEMMRL_LLM_MODEL", "fake-model")
    monkeypatch.setenv("GEMMRL_LLM_API_KEY", FAKE_KEY)
    db, export = tmp_path / "store.db", tmp_path / "traj.jsonl"
    try:
        r = CliRunner().invoke(main, ["llm", "--shapes", "256x384x512", "--layout", "NN", "--turns", "2",
                                      "--samples", "4", "--db", str(db), "--export", str(export)])
    finally:
        srv.close()
    print(r.output)
    assert r.exit_code == 0, r.output
    assert len(srv.requests) == 2
    store = Store(db)
    rows = store.trajectories(torch.cuda.get_device_name())
    st = [(x["turn"], x["sample"], x["status"]) for x in rows]
    assert st[:4] == [(0, 0, "ok"), (0, 1, "rejected"), (0, 2, "refused"), (0, 3, "parse_error")]
    assert st[4][2] == "rejected" and st[5][2] == "ok"
    ok = rows[0]
    assert ok["time_us"] > 0 and ok["reward"] > 0  # a real time against measured baselines
    assert rows[1]["reward"] == 0 and rows[4]["reward"] == 0
    # the second turn's prompt tells the model what went wrong in the first
    turn1 = srv.requests[1]["body"]["messages"][1]["content"]
    assert "rejected" in turn1 and "refused" in turn1 and "parse_error" in turn1
    from gemmrl.llm.ncu import ncu_path

    if ncu_path():  # the best kernel's Nsight Compute metrics go into the next prompt
        assert "Nsight Compute metrics of the best kernel" in turn1 and "DRAM throughput" in turn1
    lines = [json.loads(x) for x in export.read_text().splitlines()]
    assert len(lines) == len(rows) == 6
    store.close()
    for text in (export.read_text(), db.read_bytes().decode("latin-1"), r.output):
        assert FAKE_KEY not in text


def test_ncu_metrics_of_a_real_kernel(tmp_path):
    from gemmrl.build.nvcc import build_shared
    from gemmrl.llm import ncu

    if ncu.ncu_path() is None:
        pytest.skip("no ncu on this machine")
    r = build_shared(HONEST, name="honest_nn", cache_dir=tmp_path)
    assert r.ok, r.log
    got = ncu.profile(r.path, 256, 384, 512)
    print("\nncu:", got)
    assert got, "ncu gave no metrics"
    assert got["gpu__time_duration.sum"] > 0
    assert 0 < got["dram__throughput.avg.pct_of_peak_sustained_elapsed"] <= 100
    assert 0 < got["sm__warps_active.avg.pct_of_peak_sustained_active"] <= 100
