import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gemmrl.cli import _modes, main
from gemmrl.core.problem import Problem
from gemmrl.store.db import Store


def test_shapes_lists_the_subset():
    r = CliRunner().invoke(main, ["shapes", "--shapes", "subset:5"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 5 and all("x" in ln.split()[0] for ln in lines)


def test_bad_shape_is_a_clear_usage_error():
    r = CliRunner().invoke(main, ["shapes", "--shapes", "64x0x64"])
    assert r.exit_code == 2 and "N must be positive" in r.output


def test_bad_mode_is_refused():
    with pytest.raises(Exception, match="unknown mode 'fast'"):
        _modes(("kernel,fast",))
    assert _modes(("all",)) == ("kernel", "offline", "server")
    assert _modes(("server", "kernel,server")) == ("server", "kernel")


def test_bench_refuses_a_machine_without_gpu(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64"])
    assert r.exit_code == 2
    assert "no CUDA GPU" in r.output


def test_bench_checks_arguments_before_the_gpu():
    r = CliRunner().invoke(main, ["bench", "--shapes", "grid", "--mode", "fastest"])
    assert r.exit_code == 2 and "unknown mode" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--mode", "server", "--quick", "--host-max-s", "20"])
    assert r.exit_code == 2 and "--quick" in r.output and "precision target" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--quick", "--host-ci", "0.01"])
    assert r.exit_code == 2 and "--quick" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--quick", "--kernel-ci", "0.01"])
    assert r.exit_code == 2 and "--quick" in r.output and "--kernel-ci" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--kernel-max-s", "0"])
    assert r.exit_code == 2 and "--kernel-max-s" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--mode", "offline", "--server-gaps", "round"])
    assert r.exit_code == 2 and "--server-gaps" in r.output and "server" in r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--mode", "server", "--server-gaps", "pairs"])
    assert r.exit_code == 2 and "pairs" in r.output


def _fill(store):
    run = store.start_run("gemmrl bench", "NVIDIA H100 80GB HBM3", {"commit": "c0ffee", "date": "2026-11-21"}, {})
    for p, t in ((Problem(64, 64, 64), 4.0), (Problem(4096, 4096, 4096), 200.0)):
        res = {name: {"median_us": t * f, "mean_us": t * f, "min_us": t * f, "p10_us": t * f,
                      "p90_us": t * f, "std_us": 0.0, "n": 20, "status": "ok", "details": {}}
               for name, f in (("torch.matmul", 1.0), ("torch.matmul@repeat", 1.01), ("cuBLAS-nn", 0.9),
                               ("cuBLAS-tn", 0.95), ("cuBLASLt-auto-tuning-nn", 0.8),
                               ("cuBLASLt-auto-tuning-tn", 0.85))}
        store.record_session(run, "s", "NVIDIA H100 80GB HBM3", p, "kernel", "kernel:v1", res)
    store.record_peaks(run, "NVIDIA H100 80GB HBM3", 700.0, 3000.0)
    store.finish_run(run)


def test_a_unique_part_of_a_device_name_names_it(tmp_path):
    db = tmp_path / "s.sqlite"
    st = Store(db)
    _fill(st)
    run = st.start_run("gemmrl bench", "NVIDIA H200", {}, {})
    st.record_session(run, "t", "NVIDIA H200", Problem(64, 64, 64), "kernel", "kernel:v1", {
        "torch.matmul": {"median_us": 3.0, "n": 20, "status": "ok", "details": {}}})
    st.close()
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--device", "h100"])
    assert r.exit_code == 0, r.output
    assert (out / "h100").is_dir() and not (out / "h200").exists()
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--device", "NVIDIA H"])
    assert r.exit_code != 0 and "names 2 devices" in r.output
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out)])
    assert r.exit_code != 0 and "name one with --device" in r.output
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--device", "A100"])
    assert r.exit_code != 0 and "A100" in r.output


def test_report_writes_cuda_l2_layout_from_the_store(tmp_path):
    db = tmp_path / "s.sqlite"
    _fill(Store(db))
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output
    out = tmp_path / "res" / "h100"
    csv = (out / "torch_matmul_h100_F32F16F16F32_speedup_kernel.csv").read_text().splitlines()
    assert csv[0] == ("mnk,torch.matmul,cuBLAS-tn,cuBLAS-nn,cuBLAS-max,cuBLASLt-auto-tuning-tn,"
                      "cuBLASLt-auto-tuning-nn,cuBLASLt-auto-tuning-max,best-baseline")
    row = dict(zip(csv[0].split(","), csv[1].split(",")))
    assert row["mnk"] == "64_64_64" and row["cuBLAS-max"] == "0.900"
    summary = json.loads((out / "torch_matmul_h100_F32F16F16F32_summary.json").read_text())
    assert summary["provenance"]["commit"] == "c0ffee"
    assert summary["provenance"]["runs"][0]["command"] == "gemmrl bench"
    assert (out / "torch_matmul_h100_F32F16F16F32_speedup_vs_flops.png").read_bytes()[:4] == b"\x89PNG"


def test_report_notes_a_mode_whose_shapes_mix_measuring_protocols(tmp_path):
    db = tmp_path / "s.sqlite"
    st = Store(db)
    _fill(st)  # both shapes kernel:v1
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(tmp_path / "res")])
    assert r.exit_code == 0 and "mixes measuring protocols" not in r.output
    run = st.start_run("gemmrl bench", "NVIDIA H100 80GB HBM3", {}, {})
    st.record_session(run, "v3", "NVIDIA H100 80GB HBM3", Problem(64, 64, 64), "kernel", "kernel:v3:ci=0.005", {
        n: {"median_us": 4.0, "n": 20, "status": "ok", "details": {}} for n in ("torch.matmul", "cuBLAS-nn")})
    st.close()
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(tmp_path / "res")])
    assert r.exit_code == 0, r.output
    assert ("note: kernel mode mixes measuring protocols (1 shape kernel:v3:ci=0.005, 1 shape kernel:v1)"
            in r.output)
    summary = json.loads((tmp_path / "res" / "h100" / "torch_matmul_h100_F32F16F16F32_summary.json").read_text())
    assert summary["protocols"] == {"kernel": {"kernel:v1": 1, "kernel:v3:ci=0.005": 1}}


def _tuned_summary(db, out) -> dict:
    """gemmrl report --subject gemmrl-tuned on `db` into `out`: the H100 fp32 summary it writes."""
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--subject", "gemmrl-tuned"])
    assert r.exit_code == 0, r.output
    return json.loads((out / "h100" / "gemmrl-tuned_h100_F32F16F16F32_summary.json").read_text())


def test_tuned_report_names_runs_whose_ratios_read_apart(tmp_path):
    """gemmrl report --subject gemmrl-tuned: a run whose split-K kernels read 10% better over the
    baseline than the same kernels' other sessions is named in the summary (report.bias.scan),
    with how many report rows still come from it; the runs beside it, measured against the
    median of the others, are not."""
    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H100 80GB HBM3"
    sr = "sm90_coop_128x128x64_c1x1_splitk8sr_s0_rh_sw1_nn_f16_f32"
    shapes = [Problem(64 * (i + 1), 1024, 8192) for i in range(9)]
    for run_no, lt_us in ((1, 9.0), (2, 9.0), (3, 9.0), (4, 9.9), (5, 9.0)):
        run = st.start_run("gemmrl bench", dev, {}, {})
        # run 5 times the first shape again only: 8 report rows stay run 4's
        for p in (shapes if run_no < 5 else shapes[:1]):
            st.record_session(run, f"s{run_no}", dev, p, "kernel", "kernel:v3", {
                "gemmrl-tuned": {"median_us": 10.0, "n": 5, "status": "ok", "details": {}},
                "cuBLASLt-auto-tuning-nn": {"median_us": lt_us, "n": 5, "status": "ok", "details": {}},
                "cuBLASLt-auto-tuning-tn": {"median_us": lt_us + 0.5, "n": 5, "status": "ok", "details": {}}})
            st.record_verification(run, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": {"name": sr}}})
        st.finish_run(run)
    st.close()
    summary = _tuned_summary(db, tmp_path / "res")
    assert summary["provenance"]["run_bias"] == [
        {"run": 4, "class": "splitk-sr", "pairs": 9, "median": 1.1, "report_rows": 8}]


def test_tuned_report_counts_the_rows_resting_on_slow_library_runs(tmp_path):
    """gemmrl report --subject gemmrl-tuned: the rows whose latest kernel-mode session is in a run
    whose small-shape library sessions ran slow (report.bias.slow_rows: 5% or more of 10 or more)
    are counted by kernel class in the summary, with the runs, for `gemmrl targets` to name."""
    db = tmp_path / "s.sqlite"
    st = Store(db)
    dev = "NVIDIA H100 80GB HBM3"
    ws = "sm90_ws_64x16x128_c1x2_tile_s0_rh_sw1_tn_f16_f32"
    shapes = [Problem(64, 1024 * (i + 1), 1024) for i in range(5)]
    # run 2 reads the libraries 14% slow; shapes 0-2 end on run 2, shapes 3-4 on run 3
    for run_no, factor, tuned in ((1, 1.0, range(5)), (2, 1.14, range(3)), (3, 1.0, range(3, 5))):
        run = st.start_run("gemmrl bench", dev, {"cublas": "13.1"}, {})
        for i, p in enumerate(shapes):
            res = {"torch.matmul": {"median_us": 7.0 * factor, "n": 5, "status": "ok", "details": {}},
                   "cuBLAS-tn": {"median_us": 7.4 * factor, "n": 5, "status": "ok", "details": {}}}
            if i in tuned:
                res.update({"gemmrl-tuned": {"median_us": 7.0, "n": 5, "status": "ok", "details": {}},
                            "cuBLASLt-auto-tuning-nn": {"median_us": 7.2 * factor, "n": 5, "status": "ok", "details": {}},
                            "cuBLASLt-auto-tuning-tn": {"median_us": 7.3 * factor, "n": 5, "status": "ok", "details": {}}})
                st.record_verification(run, dev, p, "gemmrl-tuned", True, "", {"impl": {"chosen": {"name": ws}}})
            st.record_session(run, f"s{run_no}{i}", dev, p, "kernel", "kernel:v3", res)
        st.finish_run(run)
    st.close()
    summary = _tuned_summary(db, tmp_path / "res")
    assert summary["provenance"]["slow_library_rows"] == {"share": 0.05, "runs": "2", "rows": {"cutlass": 3}}


def test_report_versus_writes_the_head_to_head_and_refuses_an_unknown_impl(tmp_path):
    db = tmp_path / "s.sqlite"
    _fill(Store(db))
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--subject",
                                  "cuBLAS-nn", "--versus", "cuBLAS-tn"])
    assert r.exit_code == 0, r.output
    csv = (out / "h100" / "cuBLAS-nn_h100_F32F16F16F32_vs_cuBLAS-tn.csv").read_text().splitlines()
    assert csv[0] == "mnk,kernel"
    assert csv[1] == "64_64_64,1.056"  # 0.95 / 0.9
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--versus", "cuda-l2"])
    assert r.exit_code == 1 and "no ok measurement of 'cuda-l2'" in r.output and "nothing written" in r.output
    # refused before writing: the torch.matmul report of that call was not written
    assert not list((out / "h100").glob("torch.matmul_*"))


def test_cuda_l2_tiles_are_read_as_their_harness_reads_them_and_pad_the_shape():
    """Their launchers write `auto BM = Int<128>{};`. A word boundary before the name found no
    tile in any of their files (the spaces are taken out first, as their harness does), so a
    kernel whose tiles do not divide the shape ran unpadded and wrote out of bounds: 7 of 32 A100
    fp16-accumulator kernels on the H200 (2026-11-27), each one of a shape needing padding."""
    from gemmrl.baselines.cuda_l2 import padding, tile_sizes

    launcher = """template <typename T, int BM, int BN, int BK, int kStage>
__global__ void cuda_l2_a100_fp16_kernel(T *Aptr, T *Bptr, T *Dptr, int m, int n, int k) {}
void launch(T *a, T *b, T *c, int M, int N, int K) {
  auto BM = Int<128>{};
  auto BN = Int<192>{};
  auto BK = Int<64>{};
  auto KStage = Int<Stages>{};
  using SmemLayoutAtom = decltype(composition(Swizzle<3, 3, 3>{}, make_layout(make_shape(Int<8>{}, Int<BK>{}))));
}"""
    assert tile_sizes(launcher) == (128, 192, 64)
    assert padding(Problem(256, 8192, 64), tile_sizes(launcher)) == (0, 64, 0)  # 8192 = 42 * 192 + 128
    assert padding(Problem(256, 7680, 64), tile_sizes(launcher)) == (0, 0, 0)
    assert tile_sizes(launcher.replace("auto BK = Int<64>{};", "")) is None  # all three or none
    assert tile_sizes("using BM = Int<64>;\nconstexpr auto BN = Int < 32 >{};\nauto BK=Int<16>{};") == (64, 32, 16)


def test_a_cuda_l2_report_says_which_gpu_their_kernels_were_written_for(tmp_path):
    """Their fp16-accumulator kernels exist only for the A100: a report of them on a Hopper GPU
    counts, per GPU named by each kernel's entry point (or, in older records, by the kernels the
    profiler saw), the kernels that passed: the latest verification of each shape."""
    from gemmrl.baselines.cuda_l2 import written_for

    assert written_for({"impl": {"name": "cuda-l2", "entry": "cuda_l2_a100_fp16"}}) == "a100"
    assert written_for({"trace": {"kernels": ["_Z24cuda_l2_h100_fp32_kernelI6__half"]}}) == "h100"
    assert written_for({"trace": {"kernels": ["hgemm_128x64_opt(__half const*)"]}}) is None
    assert written_for({}) is None
    db = tmp_path / "s.sqlite"
    st = Store(db)
    _fill(st)
    dev = "NVIDIA H100 80GB HBM3"
    run = st.start_run("gemmrl bench", dev, {}, {})
    a100 = {"impl": {"name": "cuda-l2", "entry": "cuda_l2_a100_fp32", "padded": False}}
    for p, t in ((Problem(64, 64, 64), 5.0), (Problem(4096, 4096, 4096), 260.0)):
        st.record_verification(run, dev, p, "cuda-l2", True, "",
                               {"impl": {**a100["impl"], "padded": p.M == 64}})
        st.record_session(run, "l2", dev, p, "kernel", "kernel:v1", {
            n: {"median_us": f, "n": 20, "status": "ok", "details": {}}
            for n, f in (("cuda-l2", t), ("torch.matmul", t * 0.9))})
    # a later verification of one shape failed: that kernel is not counted
    st.record_verification(run, dev, Problem(4096, 4096, 4096), "cuda-l2", False, "wrote outside C", a100)
    st.close()
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--subject", "cuda-l2",
                                  "--versus", "torch.matmul"])
    assert r.exit_code == 0, r.output
    for name in ("cuda-l2_h100_F32F16F16F32_summary.json", "cuda-l2_h100_F32F16F16F32_vs_torch_matmul_summary.json"):
        prov = json.loads((out / "h100" / name).read_text())["provenance"]
        assert prov["cuda_l2_written_for"] == {"a100": 1} and prov["cuda_l2_padded"] == ["64x64x64"]


def test_report_since_run_keeps_one_sessions_shapes(tmp_path):
    """--since-run N: only shapes whose subject was timed from run N on, with that session's
    implementations; an older session's shapes and an implementation timed only before N stay out."""
    db = tmp_path / "s.sqlite"
    st = Store(db)
    _fill(st)  # run 1: both shapes
    run = st.start_run("gemmrl bench", "NVIDIA H100 80GB HBM3", {"commit": "d00d"}, {})
    st.record_session(run, "new", "NVIDIA H100 80GB HBM3", Problem(64, 64, 64), "kernel", "kernel:v3", {
        n: {"median_us": t, "n": 20, "status": "ok", "details": {}}
        for n, t in (("torch.matmul", 5.0), ("cuBLAS-nn", 4.0))})
    st.finish_run(run)
    st.close()
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--since-run", str(run)])
    assert r.exit_code == 0, r.output
    csv = (out / "h100" / "torch_matmul_h100_F32F16F16F32_speedup_kernel.csv").read_text().splitlines()
    assert csv == ["mnk,torch.matmul,cuBLAS-nn,cuBLAS-max,best-baseline", "64_64_64,1.000,0.800,0.800,0.800"]
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out)])  # without: both shapes
    csv = (out / "h100" / "torch_matmul_h100_F32F16F16F32_speedup_kernel.csv").read_text().splitlines()
    assert len(csv) == 3 and "cuBLAS-tn" in csv[0]
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--since-run", str(run + 1)])
    assert r.exit_code == 1 and f"--since-run {run + 1}: no ok measurement" in r.output


def test_report_errors(tmp_path):
    r = CliRunner().invoke(main, ["report", "--db", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output
    db = tmp_path / "s.sqlite"
    _fill(Store(db))
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--device", "H200"])
    assert r.exit_code == 1 and "no measurements for 'H200'" in r.output


def test_llm_needs_an_endpoint_then_a_gpu(monkeypatch):
    for name in ("GEMMRL_LLM_BASE_URL", "GEMMRL_LLM_MODEL", "GEMMRL_LLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    r = CliRunner().invoke(main, ["llm", "--shapes", "64x64x64"])
    assert r.exit_code == 1 and "GEMMRL_LLM_BASE_URL" in r.output
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("GEMMRL_LLM_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("GEMMRL_LLM_MODEL", "tiny")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["llm", "--shapes", "64x64x64"])
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_tune_checks_layouts_and_refuses_without_gpu(monkeypatch):
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--layouts", "NT"])
    assert r.exit_code == 2 and "layouts are NN and/or TN" in r.output
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--family", "triton"])
    assert r.exit_code == 2 and "unknown kernel family 'triton'" in r.output
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--match", "splitk(sr"])
    assert r.exit_code == 2 and "not a regular expression" in r.output
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64"])
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_build_compiles_ahead_without_a_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    args = ["build", "--shapes", "64x64x64", "--family", "raw", "--layouts", "TN", "--top", "2"]
    r = CliRunner().invoke(main, args + ["--dry-run"])
    assert r.exit_code == 0, r.output
    assert "2 distinct kernels for 1 shapes; 0 already built, 2 to compile" in r.output
    names = [ln for ln in r.output.splitlines() if ln.startswith("raw_tn_")]
    assert len(names) == 2
    r = CliRunner().invoke(main, args + ["--jobs", "1"])
    assert r.exit_code == 0, r.output
    assert "[2/2] ok" in r.output
    r = CliRunner().invoke(main, args + ["--dry-run", "--entries", str(tmp_path / "entries.txt")])
    assert "2 already built, 0 to compile" in r.output
    entries = (tmp_path / "entries.txt").read_text().split()
    # the two builds' cache directories, relative to $GEMMRL_CACHE, each holding the library
    assert len(entries) == 2 and all(e.startswith("builds/raw_tn_") for e in entries)
    assert all((tmp_path / e / "kernel.so").exists() for e in entries)
    more = tmp_path / "entries-top3.txt"
    r = CliRunner().invoke(main, args[:-1] + ["3", "--dry-run", "--entries", str(more)])
    assert "2 already built, 1 to compile" in r.output
    listed = more.read_text().split()  # planned but not built yet is listed too
    assert len(listed) == 3 and set(entries) < set(listed) and not (tmp_path / (set(listed) - set(entries)).pop()).exists()
    bad = CliRunner().invoke(main, ["build", "--shapes", "64x64x64", "--family", "nope"])
    assert bad.exit_code == 2 and "unknown kernel family 'nope'" in bad.output
    bad = CliRunner().invoke(main, ["build", "--shapes", "64x64x64", "--layouts", "NT"])
    assert bad.exit_code == 2 and "layouts are NN and/or TN" in bad.output


def test_build_match_plans_the_pool_kernels_a_matching_search_would_find_built(tmp_path, monkeypatch):
    """build --match REGEX: per shape, family and layout, the search pool's kernels whose names
    match, the cost model's fastest --top first: what `tune --match REGEX --built-only` proposes."""
    from gemmrl.core.problem import Problem
    from gemmrl.search.policy import candidate_pool
    from gemmrl.space import cutlass_sm90

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path))
    big = Problem(16384, 4096, 2048)
    base = ["build", "--shapes", "16384x4096x2048", "--layouts", "NN", "--dry-run"]
    r = CliRunner().invoke(main, base + ["--match", "_128x160x", "--top", "3", "--entries", str(tmp_path / "e.txt")])
    assert r.exit_code == 0, r.output
    assert "3 distinct kernels for 1 shapes (kernels matching '_128x160x'); 0 already built, 3 to compile" in r.output
    names = [ln for ln in r.output.splitlines() if ln.startswith("sm90_")]
    pool = [s for _, s in candidate_pool(big, ("NN",), ("cutlass_sm90",)) if "_128x160x" in s.name]
    want = sorted(pool, key=lambda s: (cutlass_sm90.estimate_us(s, big), s.name))[:3]
    # two schedules x three clusters x both swaps x swizzles 1 and 2
    assert names == [s.name for s in want] and len(pool) == 24
    assert len((tmp_path / "e.txt").read_text().split()) == 3
    # a regex over both families: each family's own matches (raw's 'swap' kernels, CUTLASS's '_xab' ones)
    r = CliRunner().invoke(main, base + ["--match", "swap|_xab", "--top", "2", "--family", "raw",
                                         "--family", "cutlass_sm90", "--shapes", "8192x128x4096"])
    assert r.exit_code == 0, r.output
    listed = [ln for ln in r.output.splitlines() if ln.startswith(("sm90_", "raw_"))]
    assert len(listed) == 4 and all("swap" in n or n.endswith("_xab") for n in listed)
    assert {n.split("_")[0] for n in listed} == {"raw", "sm90"}
    bad = CliRunner().invoke(main, base + ["--match", "no-such-kernel"])
    assert bad.exit_code == 1 and "matches 'no-such-kernel'" in bad.output
    bad = CliRunner().invoke(main, base + ["--match", "(128"])
    assert bad.exit_code == 2 and "not a regular expression" in bad.output
    bad = CliRunner().invoke(main, base + ["--match", "x", "--tuned-in", str(tmp_path / "s.sqlite")])
    assert bad.exit_code == 2 and "choose one" in bad.output


def test_build_pack_compiles_each_kernel_source_of_a_pack_once(tmp_path, monkeypatch):
    """build --pack: a deployment's cache made ahead of time, named and flagged as the runtime
    builds it, so that the pack then loads its kernels from the cache without compiling."""
    import shutil

    pytest.importorskip("torch")
    from gemmrl.build.nvcc import is_built
    from gemmrl.runtime.dispatch import Dispatcher
    from gemmrl.runtime.pack import load_pack
    from gemmrl.space import registry

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    src = Path(__file__).parent.parent / "packs" / "h200-fp16-F32F16F16F32"
    m = json.loads((src / "manifest.json").read_text())
    raw = [e for e in m["entries"] if e["family"] == "raw"]
    two = [raw[0], next(e for e in raw if e["source_sha256"] != raw[0]["source_sha256"])]  # raw: seconds to build
    pack = tmp_path / "pack"
    (pack / "kernels").mkdir(parents=True)
    for e in two:
        shutil.copy(src / e["file"], pack / e["file"])
    m["entries"], m["lt_algos"], m["library"] = two, [], []
    (pack / "manifest.json").write_text(json.dumps(m))
    loaded = load_pack(pack)
    shas = {e.source_sha256 for e in loaded.entries}
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--dry-run", "--entries", str(tmp_path / "e.txt")])
    assert r.exit_code == 0, r.output
    assert f"{len(shas)} distinct kernels for the {len(two)} entries of {pack}; 0 already built, {len(shas)} to compile" in r.output
    assert len((tmp_path / "e.txt").read_text().split()) == len(shas)
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--jobs", "2"])
    assert r.exit_code == 0 and f"[{len(shas)}/{len(shas)}] ok" in r.output, r.output
    d = Dispatcher(loaded)
    for e in loaded.entries:  # what the runtime would build is in the cache
        assert is_built(loaded.source(e), name=e.spec_name, arch=d.arch, **registry.get(e.family).build_kwargs())
    assert d.build_all(workers=1) == {}  # found in the cache: nothing compiled, nothing failed
    assert all(d.built_path(e) for e in loaded.entries)
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--dry-run"])
    assert f"{len(shas)} already built, 0 to compile" in r.output
    # --shapes: only the kernels serving those shapes (what a settle's bench of them loads)
    one = loaded.entries[0].problem
    mine = [e for e in loaded.entries if e.problem.shape == one.shape]
    assert len(mine) < len(loaded.entries), "the test pack's two entries serve two shapes"
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--shapes", f"{one.M}x{one.N}x{one.K}", "--dry-run",
                                  "--entries", str(tmp_path / "e1.txt")])
    assert r.exit_code == 0 and f"for the {len(mine)} entries of {pack} serving 1 shapes" in r.output, r.output
    assert len((tmp_path / "e1.txt").read_text().split()) == len({e.source_sha256 for e in mine})
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--shapes", "3x5x7", "--dry-run"])
    assert r.exit_code == 0 and "the 0 entries" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--pack", str(pack), "--race", "3"])
    assert r.exit_code == 2 and "--race does not apply" in r.output
    r = CliRunner().invoke(main, ["build", "--pack", str(tmp_path)])
    assert r.exit_code == 1 and "not a pack" in r.output


def test_tune_times_only_the_shapes_it_touched_or_never_timed(tmp_path):
    from types import SimpleNamespace

    from gemmrl.cli import shapes_to_time

    store = Store(tmp_path / "t.sqlite")
    dev, proto = "NVIDIA H200", "kernel:v1"
    a, b, c, d = Problem(64, 64, 64), Problem(128, 128, 128), Problem(256, 256, 256), Problem(512, 512, 512)
    run = store.start_run("gemmrl tune", dev, {}, {})
    for p in (b, c):  # winners from an earlier run
        store.put_tuning(dev, p, "gemmrl-tuned", b"{}", "", 1.0)
    st = {"median_us": 1.0, "mean_us": 1.0, "min_us": 1.0, "p10_us": 1.0, "p90_us": 1.0, "std_us": 0.0,
          "n": 5, "status": "ok", "details": {}}
    store.record_session(run, "s", dev, b, "kernel", proto, {"gemmrl-tuned": st})  # b was timed, c was not
    trials = [SimpleNamespace(problem=a)]  # this run tried candidates on a only
    assert shapes_to_time([a, b, c, d], trials, store, dev, proto) == [a, c]
    assert shapes_to_time([a, b, c, d], [], store, "NVIDIA H100", proto) == []  # winners are per GPU
    # e's winner was verified and timed; then a run cut after its search stored another choice:
    # a rerun (no new trials on e) times e again, and leaves f (choice as verified) alone
    e, f = Problem(1024, 1024, 1024), Problem(2048, 2048, 2048)
    timed = {"family": "raw", "spec": {"block_m": 64}}
    for p in (e, f):
        store.put_tuning(dev, p, "gemmrl-tuned", json.dumps(timed).encode(), "", 1.0)
        store.record_verification(run, dev, p, "gemmrl-tuned", True, "ok", {"impl": {"chosen": timed}})
        store.record_session(run, f"s{p.M}", dev, p, "kernel", proto, {"gemmrl-tuned": st})
    assert shapes_to_time([e, f], [], store, dev, proto) == []
    store.put_tuning(dev, e, "gemmrl-tuned", json.dumps({"family": "raw", "spec": {"block_m": 32}}).encode(), "", 0.9)
    assert shapes_to_time([a, b, c, d, e, f], trials, store, dev, proto) == [a, c, e]
    store.record_verification(run, dev, e, "gemmrl-tuned", False, "wrong", {})  # the newest check failed
    assert shapes_to_time([e, f], [], store, dev, proto) == [e]
    # a winner timed under either protocol a tune knows (its final timing's v3, or v1 before) is timed
    v3 = "kernel:v3:ci=0.005"
    assert shapes_to_time([c], [], store, dev, (proto, v3)) == [c]
    store.record_session(run, "s3", dev, c, "kernel", v3, {"gemmrl-tuned": st})
    assert shapes_to_time([b, c], [], store, dev, (proto, v3)) == []
    assert shapes_to_time([b, c], [], store, dev, v3) == [b]  # b was timed under v1 only
    assert shapes_to_time([b, c], [], store, dev, proto) == [c]


def test_build_leaves_out_shapes_searched_enough_and_keeps_the_first_n(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "t.sqlite"
    store = Store(db)
    for i in range(8):  # 64^3 has had its 8 candidates; 128^3 only 2
        store.record_trial(None, "NVIDIA H200", Problem(64, 64, 64), f"c{i}", "ok", 1.0, 1.0, {})
    for i in range(2):
        store.record_trial(None, "NVIDIA H200", Problem(128, 128, 128), f"c{i}", "ok", 1.0, 1.0, {})
    store.close()
    args = ["build", "--family", "raw", "--top", "1", "--layouts", "NN", "--dry-run",
            "--shapes", "64x64x64,128x128x128,256x256x256"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0 and "for 3 shapes" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--pending-in", str(db)])
    assert r.exit_code == 0 and "shapes: 128x128x128, 256x256x256\n" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--pending-in", str(db), "--candidates", "24"])  # a re-tune
    assert "shapes: 64x64x64, 128x128x128, 256x256x256\n" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--pending-in", str(db), "--max-shapes", "1"])
    assert r.exit_code == 0 and "shapes: 128x128x128\n" in r.output and "for 1 shapes" in r.output, r.output
    r = CliRunner().invoke(main, args + ["--pending-in", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output


def test_shapes_below_a_speedup_lists_where_to_search_again(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("mnk,torch.matmul,cuBLASLt-auto-tuning-max\n64_64_64,1.2,1.10\n128_128_4096,0.9,0.52\n"
                   "256_256_256,1.0,\n512_512_512,0.8,0.85\n")
    r = CliRunner().invoke(main, ["shapes", "--shapes", str(csv), "--below", "0.9", "--plain"])
    assert r.exit_code == 0 and r.output == "128x128x4096\n512x512x512\n", r.output  # worst first
    out = tmp_path / "worst.txt"
    out.write_text(r.output)
    r = CliRunner().invoke(main, ["shapes", "--shapes", str(out), "--plain"])  # a shape file again
    assert r.output == "128x128x4096\n512x512x512\n"
    r = CliRunner().invoke(main, ["shapes", "--shapes", str(csv), "--below", "1", "--column", "cuBLAS-max"])
    assert r.exit_code == 2 and "no column 'cuBLAS-max'" in r.output


def test_build_transfer_from_compiles_the_fp16_twins_of_the_fp32_winners(tmp_path, monkeypatch):
    """build --tuned-in DB --transfer-from GPU:fp32 --acc fp16: what tune --transfer-from GPU:fp32
    proposes first, the fp32 winners as fp16-accumulator kernels (dry run: no nvcc)."""
    import json
    from dataclasses import replace

    from gemmrl.space import cutlass_sm90, raw

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "t.sqlite"
    store = Store(db)
    cut = next(s for s in cutlass_sm90.heuristic_specs(Problem(256, 1024, 512), "TN") if s.scheduler == "persistent")
    sr = cutlass_sm90.CutlassSpec(64, 64, 64, 1, 1, "pingpong", "splitk", 16, 0, "heuristic", 1, "TN", "fp16",
                                  "fp32", "separate")
    rw = raw.heuristic_specs(Problem(64, 1024, 4096), "TN")[0]
    for p, fam, spec in ((Problem(256, 1024, 512), "cutlass_sm90", cut), (Problem(128, 128, 16384), "cutlass_sm90", sr),
                         (Problem(64, 1024, 4096), "raw", rw)):
        store.put_tuning("NVIDIA H200", p, "gemmrl-tuned",
                         json.dumps({"family": fam, "spec": dict(spec.__dict__)}).encode(), spec.name, 1.0)
    store.close()
    base = ["build", "--tuned-in", str(db), "--dry-run", "--acc", "fp16",
            "--shapes", "256x1024x512,128x128x16384,64x1024x4096,512x512x512"]
    r = CliRunner().invoke(main, base + ["--transfer-from", "h200:fp32"])
    assert r.exit_code == 0, r.output
    assert "3 distinct kernels for the first 4 of NVIDIA H200's fp32 suggestions on 3 of 4 shapes as " \
           "fp16-accumulator twins" in r.output
    for spec in (cut, sr, rw):
        twin = replace(spec, acc="fp16")
        assert twin.name in r.output and spec.name not in r.output
    r = CliRunner().invoke(main, base + ["--transfer-from", "h200:fp32", "--family", "raw"])
    assert r.exit_code == 0 and "1 distinct kernels" in r.output, r.output
    # the fp16 tuning on the H200 is empty: nothing to suggest
    r = CliRunner().invoke(main, base + ["--transfer-from", "h200"])
    assert r.exit_code == 1 and "suggests nothing for these 4 shapes" in r.output, r.output
    r = CliRunner().invoke(main, base + ["--transfer-from", "a100:fp32"])
    assert r.exit_code == 1 and "no gemmrl-tuned winners on 'a100'" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--transfer-from", "h200:fp32"])
    assert r.exit_code == 2 and "goes with --tuned-in" in r.output
    r = CliRunner().invoke(main, base + ["--transfer-from", "h200:fp32", "--race", "2"])
    assert r.exit_code == 2 and "--race does not apply" in r.output
    # two sources: the H100's fp16 winner of 128x128x16384 beside the H200 fp32 winners' twins
    other = replace(sr, splits=32, acc="fp16")
    store = Store(db)
    store.put_tuning("NVIDIA H100 80GB HBM3", Problem(128, 128, 16384, "fp16", "fp16"), "gemmrl-tuned",
                     json.dumps({"family": "cutlass_sm90", "spec": dict(other.__dict__)}).encode(), other.name, 1.0)
    store.close()
    r = CliRunner().invoke(main, base + ["--transfer-from", "h200:fp32", "--transfer-from", "h100", "--top", "2"])
    assert r.exit_code == 0, r.output
    assert ("4 distinct kernels for the first 2 of NVIDIA H200's fp32 and NVIDIA H100 80GB HBM3's suggestions on 3 "
            "of 4 shapes as fp16-accumulator twins") in r.output
    assert other.name in r.output and replace(sr, acc="fp16").name in r.output


def test_build_tuned_in_compiles_the_stored_winners_once_each(tmp_path, monkeypatch):
    import json

    from gemmrl.space import cutlass_sm90, raw

    monkeypatch.setenv("GEMMRL_CACHE", str(tmp_path / "cache"))
    db = tmp_path / "t.sqlite"
    store = Store(db)
    cut = next(s for s in cutlass_sm90.heuristic_specs(Problem(256, 1024, 512), "TN") if s.scheduler == "persistent")
    rw = raw.heuristic_specs(Problem(64, 1024, 4096), "TN")[0]

    def win(dev, p, fam, spec):
        store.put_tuning(dev, p, "gemmrl-tuned", json.dumps({"family": fam, "spec": dict(spec.__dict__)}).encode(),
                         spec.name, 1.0)

    # the generic CUTLASS spec wins two shapes on two GPUs: one build; the raw one is per shape
    win("NVIDIA H200", Problem(256, 1024, 512), "cutlass_sm90", cut)
    win("NVIDIA H100 80GB HBM3", Problem(512, 1024, 512), "cutlass_sm90", cut)
    win("NVIDIA H200", Problem(64, 1024, 4096), "raw", rw)
    store.put_tuning("NVIDIA H200", Problem(64, 64, 64), "gemmrl-tuned", b"not json", "", 1.0)  # left out
    store.put_tuning("NVIDIA H200", Problem(64, 64, 64), "cuBLASLt-auto-tuning-tn", b"{}", "", 1.0)  # not ours
    store.put_tuning("NVIDIA H200", Problem(128, 64, 64), "gemmrl-tuned",  # a family this version lacks
                     json.dumps({"family": "gone", "spec": {}}).encode(), "", 1.0)
    store.close()
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "2 distinct kernels for the winners of 4 tuned (shape, precision) pairs; 0 already built, 2 to compile" \
        in r.output
    assert cut.name in r.output and rw.name in r.output
    assert "skipped: 128x64x64 (fp32): gone: unknown kernel family 'gone'" in r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--family", "raw"])
    assert r.exit_code == 0 and "1 distinct kernels" in r.output and cut.name not in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--device", "NVIDIA H100 80GB HBM3"])
    assert "1 distinct kernels for the winners of 1 tuned" in r.output and rw.name not in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--device", "h100"])  # part of it
    assert "1 distinct kernels for the winners of 1 tuned" in r.output and rw.name not in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--device", "NVIDIA"])
    assert r.exit_code == 1 and "names 2 GPUs" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--device", "NVIDIA A100"])
    assert r.exit_code == 1 and "holds no gemmrl-tuned winners on 'NVIDIA A100'" in r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 1 and "no store at" in r.output
    r = CliRunner().invoke(main, ["build", "--device", "NVIDIA H200"])
    assert r.exit_code == 2 and "--device goes with --tuned-in" in r.output
    r = CliRunner().invoke(main, ["build", "--variants", "raster"])
    assert r.exit_code == 2 and "--variants goes with --tuned-in" in r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--variants", "tiles"])
    assert r.exit_code == 2 and "fields are raster, swizzle, stages" in r.output
    # around the CUTLASS winner: 2 raster orders, 3 swizzle sizes (the raw winner has none)
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--variants", "raster,swizzle"])
    assert r.exit_code == 0 and "7 distinct kernels" in r.output and "raster, swizzle variants" in r.output, r.output
    assert "_rm_sw1_" in r.output and "_rn_sw1_" in r.output and "_rh_sw8_" in r.output
    # --shapes keeps those shapes' winners alone (any GPU): 512x1024x512's is the CUTLASS one
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--shapes", "512x1024x512,64x1024x4096"])
    assert r.exit_code == 0 and "2 distinct kernels for the winners of 2 tuned" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--shapes", "512x1024x512"])
    assert "1 distinct kernels for the winners of 1 tuned" in r.output and cut.name in r.output, r.output
    # in --shapes' order, whatever the store's (a list written smallest first compiles its head first)
    for order in (["512x1024x512", "64x1024x4096"], ["64x1024x4096", "512x1024x512"]):
        r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--shapes", ",".join(order)])
        listed = [line for line in r.output.splitlines() if line in (cut.name, rw.name)]
        assert listed == ([cut.name, rw.name] if order[0] == "512x1024x512" else [rw.name, cut.name]), r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--dry-run", "--acc-only", "fp16"])
    assert r.exit_code == 1 and "holds no gemmrl-tuned winners with a fp16 accumulator" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--max-shapes", "3"])
    assert r.exit_code == 2 and "do not apply" in r.output
    # and for real: the raw winner compiles (a minute or less), then counts as built
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--family", "raw", "--jobs", "1"])
    assert r.exit_code == 0 and "[1/1] ok" in r.output, r.output
    r = CliRunner().invoke(main, ["build", "--tuned-in", str(db), "--family", "raw", "--dry-run"])
    assert "1 already built, 0 to compile" in r.output


def _fake_gpu_for_tune(monkeypatch):
    """tune's GPU parts replaced for the CLI tests: a visible 'Fake GPU', its provenance, a
    baseline of 1 us for every shape and no evaluator (run_tune and run_isolated are the tests')."""
    import gemmrl.bench.env as env
    import gemmrl.search.run as srun
    import gemmrl.search.tune as stune

    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(env, "provenance", lambda *a, **k: {"device": "Fake GPU"})
    monkeypatch.setattr(stune, "best_baseline_from_store", lambda *a, **k: (lambda p: 1.0))
    monkeypatch.setattr(srun, "isolated_evaluator", lambda *a, **k: (None, lambda: None))


def _record_run_tune(monkeypatch, p):
    """run_tune replaced: each call's keyword arguments appended to the list returned, and a result
    of one trial on `p` (reward 1.2)."""
    from types import SimpleNamespace

    import gemmrl.search.run as srun
    from gemmrl.search.tune import TuneResult

    seen = []

    def fake_run_tune(problems, store, device, evaluate, **kw):
        seen.append(kw)
        trial = SimpleNamespace(problem=p, reward=1.2)
        return TuneResult(problems=list(problems), trials=[trial], history=[], best={p: trial}, curve=[],
                          device_s=0.0)
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)
    return seen


def test_tune_builds_the_next_shapes_batches_ahead_on_this_machines_cores(tmp_path, monkeypatch):
    """tune --build-ahead: by default as many kernels as this machine has cores, built side by side
    across shapes (run_tune's `ahead`); 0 turns it off; with --ray (the cluster builds) it is refused."""
    import gemmrl.search.run as srun
    from gemmrl.bench import runner
    from gemmrl.build.pool import default_jobs

    _fake_gpu_for_tune(monkeypatch)
    seen = _record_run_tune(monkeypatch, Problem(64, 64, 64))
    monkeypatch.setattr(runner, "run_isolated", lambda *a, **k: {"stopped": False})
    monkeypatch.setattr(srun, "rejected_winners", lambda *a: {})
    args = ["tune", "--shapes", "64x64x64", "--db", str(tmp_path / "s.sqlite"), "--no-report", "--search-only"]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert seen[-1]["ahead_kernels"] == default_jobs() and callable(seen[-1]["ahead"])
    r = CliRunner().invoke(main, args + ["--build-ahead", "0"])
    assert r.exit_code == 0 and seen[-1]["ahead_kernels"] == 0 and seen[-1]["ahead"] is None, r.output
    r = CliRunner().invoke(main, args + ["--build-ahead", "5"])
    assert r.exit_code == 0 and seen[-1]["ahead_kernels"] == 5, r.output
    n = len(seen)
    r = CliRunner().invoke(main, args + ["--build-ahead", "5", "--ray", "auto"])
    assert r.exit_code == 2 and "--build-ahead compiles on this machine" in r.output and len(seen) == n


def test_tune_stopped_in_its_baselines_or_final_timing_ends_partial_and_goes_no_further(tmp_path, monkeypatch):
    """A SIGTERM (a device call's timeout) during tune's final timing: the runner returns with
    counts['stopped']; the run must be recorded 'partial', not 'done', and no runner-up round may
    start on the strength of winners that were never timed. One during the baselines: no search
    starts. The GPU parts are replaced."""
    import gemmrl.search.run as srun
    from gemmrl.bench import runner

    _fake_gpu_for_tune(monkeypatch)
    p = Problem(64, 64, 64)
    seen_kw = _record_run_tune(monkeypatch, p)
    calls, promoted, cfgs = [], [], []
    for cut in (True, False):
        def fake_isolated(probs, specs, store, cfg, **kw):
            calls.append(specs)
            cfgs.append((cfg.protocol("kernel"), cfg.retime))
            stopped = cut and "baselines" in specs and len(specs) == 2  # the final timing
            return {"stopped": stopped}
        monkeypatch.setattr(runner, "run_isolated", fake_isolated)
        monkeypatch.setattr(srun, "rejected_winners", lambda store, device, final, run_id: {p: "wrong"})
        monkeypatch.setattr(srun, "promote_runner_up", lambda *a: promoted.append(a) or None)
        db = tmp_path / f"cut{cut}.sqlite"
        r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--db", str(db), "--no-report"])
        assert r.exit_code == 0, r.output
        store = Store(db)
        status = store.runs()[-1]["status"]
        store.close()
        assert "the final timing of 1 shapes took 0 s\n" in r.output, r.output  # no --finish-s: nothing kept
        if cut:
            assert status == "partial" and "final timing was stopped" in r.output and not promoted
        else:
            assert status == "done" and len(promoted) == 1  # the rejected winner had its runner-up round
    assert [len(c) for c in calls] == [1, 2, 1, 2]  # baselines, then baselines + winners, per run
    assert calls[1] == ("baselines", "race:1")  # a new winner races the incumbent (if any) first
    # the search's yardstick in the quick v1 protocol; the final timing in
    # bench's (v3, paired), measured again
    v3 = ("kernel:v3:ci=0.005", True)
    assert cfgs == [("kernel:v1", False), v3, ("kernel:v1", False), v3]
    assert seen_kw[-1]["more"] is None
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--db", str(tmp_path / "more.sqlite"),
                                  "--no-report", "--more", "3"])
    assert r.exit_code == 0 and seen_kw[-1]["more"] == 3, r.output
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--more", "0"])
    assert r.exit_code == 2 and "--more" in r.output
    # stopped while measuring the baselines: the runner left SIGTERM ignored for its clean exit, so
    # no search may start (nothing could stop it), and the run is partial
    n_tunes = len(seen_kw)
    monkeypatch.setattr(runner, "run_isolated", lambda probs, specs, store, cfg, **kw: calls.append(specs)
                        or {"stopped": True})
    db = tmp_path / "cut-baselines.sqlite"
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--db", str(db), "--no-report"])
    assert r.exit_code == 0 and "stopped while measuring the baselines" in r.output, r.output
    store = Store(db)
    assert store.runs()[-1]["status"] == "partial"
    store.close()
    assert len(seen_kw) == n_tunes and calls[-1] == ("baselines",) and calls[-2] != ("baselines",)


def test_tune_wall_gives_the_baselines_half_and_searches_the_shapes_that_have_them(tmp_path, monkeypatch):
    """--wall-s bounds the baselines' measurement too: they get half of it (H100, 2026-11-27: the
    baselines of 200 shapes took a whole call and nothing was searched). The shapes measured by
    then are searched until the whole wall, the others are left to a rerun (the run is partial);
    without --wall-s the baselines have no deadline. The GPU parts are replaced."""
    import time
    from types import SimpleNamespace

    import gemmrl.search.run as srun
    from gemmrl.bench import runner
    from gemmrl.search.tune import TuneResult

    _fake_gpu_for_tune(monkeypatch)
    monkeypatch.setattr(srun, "rejected_winners", lambda *a: {})
    searched, timed, deadlines = [], [], []

    def fake_run_tune(problems, store, device, evaluate, **kw):
        searched.append([q.shape for q in problems])
        deadlines.append(kw["deadline"])
        trials = [SimpleNamespace(problem=q, reward=1.2) for q in problems]
        return TuneResult(problems=list(problems), trials=trials, history=[], best={t.problem: t for t in trials},
                          curve=[], device_s=0.0)
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)

    def fake_isolated(probs, specs, store, cfg, **kw):
        if specs == ("baselines",):
            deadlines.append(cfg.deadline)
            if cfg.deadline is not None:  # the wall's half ran out after the first shape
                return {"stopped": True, "deadline_after": 1}
            return {"stopped": False}
        timed.append([q.shape for q in probs])
        return {"stopped": False}
    monkeypatch.setattr(runner, "run_isolated", fake_isolated)
    shapes = "64x64x64,128x128x128"
    db = tmp_path / "wall.sqlite"
    t0 = time.monotonic()
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(db), "--no-report", "--wall-s", "100"])
    assert r.exit_code == 0, r.output
    assert "baselines measured for 1 of 2 shapes" in r.output
    assert searched == [["64x64x64"]] and timed == [["64x64x64"]]
    base_deadline, search_deadline = deadlines
    assert t0 + 50 <= base_deadline <= time.monotonic() + 50  # half the wall, from the start
    assert abs(search_deadline - base_deadline - 50) < 1e-6  # the whole wall, from the same start
    store = Store(db)
    assert store.runs()[-1]["status"] == "partial"  # one shape left to a rerun
    store.close()
    # without --wall-s: no deadline on the baselines, every shape searched, the run done
    searched.clear(), timed.clear(), deadlines.clear()
    db = tmp_path / "nowall.sqlite"
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(db), "--no-report"])
    assert r.exit_code == 0, r.output
    assert deadlines == [None, None] and searched == [["64x64x64", "128x128x128"]]
    assert "this run searched" not in r.output  # both shapes reached
    store = Store(db)
    assert store.runs()[-1]["status"] == "done"
    store.close()
    # the search's deadline before the second shape (run 608: the 12 s wall went on the start and the
    # baselines, and 1 of 73 shapes was searched): the run says so, not only "tuned 2 shapes"
    def first_only(problems, store, device, evaluate, **kw):
        old = SimpleNamespace(problem=problems[1], reward=1.1)  # an earlier run's winner
        new = SimpleNamespace(problem=problems[0], reward=1.2)
        return TuneResult(problems=list(problems), trials=[new], history=[old], best={problems[0]: new,
                          problems[1]: old}, curve=[], device_s=0.0, stopped="wall-clock deadline")
    monkeypatch.setattr(srun, "run_tune", first_only)
    monkeypatch.setattr(runner, "run_isolated", lambda probs, specs, store, cfg, **kw: {"stopped": False})
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(tmp_path / "late.sqlite"), "--no-report",
                                  "--wall-s", "12"])
    assert r.exit_code == 0, r.output
    assert "tuned 2 shapes with 1 new candidates" in r.output and "stopped: wall-clock deadline" in r.output
    assert "this run searched 1 of its 2 shapes (the wall-clock deadline came 12 s after the start" in r.output


def test_tune_finish_keeps_time_for_the_final_timing(tmp_path, monkeypatch):
    """--finish-s bounds the whole run: the baselines get half of it, and the search gets the
    deadline with a reserve for the final timing of the shapes it reaches (8 s a shape with
    --race 1, more with a longer race); it says so when it stops there. Not with --wall-s, and not
    with --search-only (no final timing to keep time for). The GPU parts are replaced."""
    import time
    from types import SimpleNamespace

    import gemmrl.search.run as srun
    from gemmrl.bench import runner
    from gemmrl.core.problem import Problem
    from gemmrl.search.tune import TuneResult, final_reserve_s

    _fake_gpu_for_tune(monkeypatch)
    monkeypatch.setattr(srun, "rejected_winners", lambda *a: {})
    got = []

    def fake_run_tune(problems, store, device, evaluate, **kw):
        got.append(kw)
        first = SimpleNamespace(problem=problems[0], reward=1.2)
        return TuneResult(problems=list(problems), trials=[first], history=[], best={problems[0]: first},
                          curve=[], device_s=0.0, stopped="wall-clock deadline")
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)
    base = []

    def fake_isolated(probs, specs, store, cfg, **kw):
        if specs == ("baselines",):
            base.append(cfg.deadline)
        return {"stopped": False}
    monkeypatch.setattr(runner, "run_isolated", fake_isolated)
    shapes = "64x64x64,128x128x128"
    # the fake GPU's baselines run 1 us (_fake_gpu_for_tune): each shape's reserve counts it
    for race, per in ((1, final_reserve_s(1, kernel_us=[1.0])), (3, final_reserve_s(1, race=3, kernel_us=[1.0]))):
        got.clear(), base.clear()
        t0 = time.monotonic()
        r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(tmp_path / f"f{race}.sqlite"),
                                      "--no-report", "--finish-s", "100", "--race", str(race)])
        assert r.exit_code == 0, r.output
        kw = got[0]
        assert t0 + 50 <= base[0] <= time.monotonic() + 50 and abs(kw["deadline"] - base[0] - 50) < 1e-6
        one, two = Problem(64, 64, 64), Problem(128, 128, 128)
        assert kw["reserve"](frozenset()) == 0.0  # a fresh store: no winner waits for its timing
        both = final_reserve_s(2, race=race, kernel_us=[1.0, 1.0])
        assert kw["reserve"](frozenset([one])) == per and kw["reserve"](frozenset([one, two])) == both
        assert (f"this run searched 1 of its 2 shapes (--finish-s 100: it stopped with about {per:.0f} s left"
                in r.output), r.output
        assert f"the final timing of 1 shapes took 0 s (--finish-s kept {per:.0f} s for it)" in r.output, r.output
    # a stored winner never timed in the final protocol is timed whatever the search reaches: kept for
    from gemmrl.search.run import TUNED
    from gemmrl.store.db import Store

    db = tmp_path / "waiting.sqlite"
    store = Store(db)
    store.put_tuning("Fake GPU", two, TUNED, b'{"family": "raw", "spec": {}}', "an earlier search's", 3.0)
    store.close()
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(db), "--no-report", "--finish-s", "100"])
    assert r.exit_code == 0, r.output
    per = final_reserve_s(1, kernel_us=[1.0])
    assert got[-1]["reserve"](frozenset()) == per
    assert got[-1]["reserve"](frozenset([one, two])) == final_reserve_s(2, kernel_us=[1.0, 1.0])
    assert "warning: --finish-s" not in r.output
    # a window shorter than what the waiting winner's timing needs: said before the search
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(db), "--no-report", "--finish-s", "5"])
    assert r.exit_code == 0 and f"the winners waiting for their final timing alone need about {per:.0f} s" in r.output
    # the CUTLASS kernels the shapes' races would compile, each once across the shapes, side by side
    import os

    import gemmrl.search.race as srace

    seen = []
    monkeypatch.setattr(srace, "unbuilt_contenders", lambda store, device, problems, k, built_only:
                        seen.append((k, built_only)) or {one: frozenset({"a"}), two: frozenset({"a", "b"})})
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(tmp_path / "u.sqlite"), "--no-report",
                                  "--finish-s", "1000", "--race", "2", "--built-only"])
    assert r.exit_code == 0 and seen == [(2, True)], r.output
    cores = os.cpu_count() or 1
    assert got[-1]["reserve"](frozenset([one])) == final_reserve_s(1, race=2, unbuilt=1, cores=cores, kernel_us=[1.0])
    assert got[-1]["reserve"](frozenset([one, two])) == final_reserve_s(2, race=2, unbuilt=2, cores=cores,
                                                                        kernel_us=[1.0, 1.0])
    # a shape whose best baseline runs for milliseconds keeps more (its rounds beside the baselines are long)
    import gemmrl.search.tune as stune

    monkeypatch.setattr(stune, "best_baseline_from_store",
                        lambda *a, **k: (lambda p: 4000.0 if p == two else 1.0))
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(tmp_path / "long.sqlite"), "--no-report",
                                  "--finish-s", "1000"])
    assert r.exit_code == 0, r.output
    assert got[-1]["reserve"](frozenset([two])) - got[-1]["reserve"](frozenset([one])) == pytest.approx(16.0 - 0.005)
    r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--db", str(tmp_path / "w.sqlite"), "--no-report",
                                  "--wall-s", "100"])
    assert r.exit_code == 0 and got[-1]["reserve"] is None  # --wall-s: the search runs to its deadline
    for extra in (["--wall-s", "50"], ["--search-only"]):
        r = CliRunner().invoke(main, ["tune", "--shapes", shapes, "--finish-s", "100", *extra])
        assert r.exit_code == 2 and "--finish-s" in r.output, r.output


def test_tune_seeds_from_the_stored_cublaslt_choices_after_the_baselines(tmp_path, monkeypatch):
    """tune --seed-from-lt reads the autotuned baseline's stored choices once the baselines are
    measured (they store them) and gives run_tune their kernels as a prior; it says how many."""
    import gemmrl.search.run as srun
    from gemmrl.bench import runner
    from gemmrl.runtime.pack import LT_IMPL
    from gemmrl.search.tune import TuneResult

    _fake_gpu_for_tune(monkeypatch)
    db = tmp_path / "lt.sqlite"
    p = Problem(16384, 4096, 4096)
    info = "algo=66 tile=29 stages=35 splitk=1 reduction=0 swizzle=0 custom=1 inner=0 cluster=3"

    def fake_isolated(probs, specs, store, cfg, **kw):
        if specs == ("baselines",):  # the autotuned baseline stores its pick as it runs
            store.put_tuning("Fake GPU", p, LT_IMPL.format("tn"), b"\x01" * 64, info, 800.0)
        return {"stopped": False}
    priors = []

    def fake_run_tune(problems, store, device, evaluate, **kw):
        priors.append(kw["lt_prior"])
        return TuneResult(problems=list(problems), trials=[], history=[], best={}, curve=[], device_s=0.0)
    monkeypatch.setattr(runner, "run_isolated", fake_isolated)
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)
    r = CliRunner().invoke(main, ["tune", "--shapes", p.shape, "--db", str(db), "--no-report", "--seed-from-lt"])
    assert r.exit_code == 0, r.output
    assert "--seed-from-lt: 2 kernels after cuBLASLt autotuned's choices on 1 of 1 shapes" in r.output
    assert [s.name for _f, s in priors[0][p]] == ["sm90_coop_128x160x64_c2x1_persist_s0_rh_sw1_tn_f16_f32_xab",
                                                  "sm90_pp_128x160x64_c2x1_persist_s0_rh_sw1_tn_f16_f32_xab"]
    r = CliRunner().invoke(main, ["tune", "--shapes", p.shape, "--db", str(db), "--no-report"])
    assert r.exit_code == 0 and priors[1] is None and "--seed-from-lt" not in r.output


def test_tune_transfer_from_names_an_input_type_for_a_bf16_run(tmp_path, monkeypatch):
    """tune --dtype bf16 --transfer-from GPU:fp16/fp32: the source is this GPU's fp16-input tuning
    (allowed: another input type), handed to run_tune with its input type; the same GPU with the
    run's own types is refused, and a malformed IN/ACC is a usage error."""
    import gemmrl.search.run as srun
    from gemmrl.search.run import TUNED
    from gemmrl.search.tune import TuneResult

    _fake_gpu_for_tune(monkeypatch)
    from gemmrl.bench import runner

    monkeypatch.setattr(runner, "run_isolated", lambda *a, **kw: {"stopped": False})
    db = tmp_path / "t.sqlite"
    store = Store(db)
    store.put_tuning("Fake GPU", Problem(64, 64, 64), TUNED, b'{"family": "raw", "spec": {}}', "fp16 winner", 3.0)
    store.close()
    seen = []

    def fake_run_tune(problems, store, device, evaluate, **kw):
        seen.append((list(problems), kw["transfer_from"]))
        return TuneResult(problems=list(problems), trials=[], history=[], best={}, curve=[], device_s=0.0)
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--dtype", "bf16", "--db", str(db), "--no-report",
                                  "--transfer-from", "Fake GPU:fp16/fp32"])
    assert r.exit_code == 0, r.output
    assert seen[-1][0][0].dtype == "bf16" and seen[-1][1] == [("Fake GPU", "fp32", "fp16")]
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--dtype", "bf16", "--db", str(db), "--no-report",
                                  "--transfer-from", "Fake GPU:bf16/fp32"])
    assert r.exit_code == 2 and "is this GPU" in r.output, r.output
    r = CliRunner().invoke(main, ["tune", "--shapes", "64x64x64", "--dtype", "bf16", "--db", str(db), "--no-report",
                                  "--transfer-from", "Fake GPU:fp16/bf16"])
    assert r.exit_code == 2 and "names an input type" in r.output, r.output


def test_cuda_l2_imports_a_carried_prebuilt_module(tmp_path):
    """A CUDA-L2 module built on another machine of the same image and carried as the .so alone
    (scripts/cuda-l2-prebuild.py) is imported as it is, not compiled again; a build directory
    that torch's JIT made itself (build.ninja beside it) is left to the JIT. The module here is a
    real CPython extension compiled with the C compiler, standing in for the torch extension."""
    import shutil
    import subprocess
    import sysconfig
    from pathlib import Path

    import pytest

    from gemmrl.baselines import cuda_l2

    if shutil.which("cc") is None or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no C compiler or no Python headers")
    src = tmp_path / "64_64_64.cu"
    src.write_text("void cuda_l2_h100_fp32(torch::Tensor a, torch::Tensor b, torch::Tensor b_col_major, "
                   "torch::Tensor c) {}\n")
    name = cuda_l2.module_name(src)
    assert name.startswith("cudal2_64_64_64_") and name == cuda_l2.module_name(src)
    src2 = tmp_path / "other" / "64_64_64.cu"
    src2.parent.mkdir()
    src2.write_text(src.read_text() + "// changed\n")
    assert cuda_l2.module_name(src2) != name  # the digest follows the text
    bdir = tmp_path / "root" / name
    bdir.mkdir(parents=True)
    c = tmp_path / "m.c"
    c.write_text('#include <Python.h>\n'
                 'static PyObject* run(PyObject* s, PyObject* a) { return PyLong_FromLong(42); }\n'
                 'static PyMethodDef M[] = {{"run", run, METH_VARARGS, ""}, {0}};\n'
                 f'static struct PyModuleDef D = {{PyModuleDef_HEAD_INIT, "{name}", 0, -1, M}};\n'
                 f'PyMODINIT_FUNC PyInit_{name}(void) {{ return PyModule_Create(&D); }}\n')
    subprocess.run(["cc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(c), "-o",
                    str(bdir / f"{name}.so")], check=True)
    mod = cuda_l2.build(src, tmp_path / "root")
    assert mod.run() == 42 and mod.__name__ == name


def test_bench_times_host_modes_to_the_precision_target_unless_quick():
    from gemmrl.bench.timing import HostSettings
    from gemmrl.cli import HOST_CI, HOST_MAX_S, host_precision

    off = HostSettings(mode="offline", **host_precision("offline", False, None, None))
    srv = HostSettings(mode="server", **host_precision("server", False, None, None), gaps="round", stat="paired")
    assert (off.target_ci, off.max_s, srv.target_ci, srv.max_s) == (HOST_CI, 5.0, HOST_CI, 12.0) == \
        (0.005, HOST_MAX_S["offline"], 0.005, HOST_MAX_S["server"])
    assert off.protocol() == "offline:v3:ci=0.005"
    assert srv.protocol() == "server:v5:ci=0.005:qps=1000:gaps=round"
    assert srv.max_rounds == 2400 and off.max_rounds == 20000  # the time cap binds, not the round cap
    longer = host_precision("server", False, 0.01, 30.0)
    assert longer == {"target_ci": 0.01, "max_rounds": 6000, "max_s": 30.0}
    quick = HostSettings(mode="server", **host_precision("server", True, None, None), gaps="round")
    assert quick.target_ci is None and quick.max_rounds == 100 and quick.protocol() == "server:v2:qps=1000:gaps=round"
    assert HostSettings(mode="offline", **host_precision("offline", True, None, None)) == HostSettings(mode="offline")


def test_bench_times_kernel_mode_to_the_precision_target_unless_quick():
    from gemmrl.bench.timing import KernelSettings
    from gemmrl.cli import KERNEL_CI, KERNEL_MAX_S, kernel_precision

    k = KernelSettings(**kernel_precision(False, None, None))
    assert (k.target_ci, k.max_s, k.min_rounds) == (KERNEL_CI, KERNEL_MAX_S, 10) == (0.005, 3.0, 10)
    assert k.protocol() == "kernel:v3:ci=0.005" and k.max_rounds == 400 and k.stat == "paired"
    assert KernelSettings(**kernel_precision(False, 0.01, 8.0)).protocol() == "kernel:v3:ci=0.01"
    assert KernelSettings(**kernel_precision(False, None, None, "median")).protocol() == "kernel:v2:ci=0.005"
    assert KernelSettings(**kernel_precision(False, 0.01, 8.0)).max_s == 8.0
    quick = KernelSettings(**kernel_precision(True, None, None, "paired"))
    assert quick == KernelSettings() and quick.protocol() == "kernel:v1"  # a tune's baselines before its search


def test_noise_tables_a_runs_repeat_timings(tmp_path):
    db = tmp_path / "s.sqlite"
    _fill(Store(db))
    out = tmp_path / "noise.json"
    r = CliRunner().invoke(main, ["noise", "--db", str(db), "--run", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    line = next(x for x in r.output.splitlines() if x.startswith("1 ") and " median " in x)
    assert "kernel" in line and "torch.matmul" in line and "2/2" in line and "1.00%" in line
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    assert run["run"] == 1 and run["provenance"]["commit"] == "c0ffee"
    assert run["agreement"]["kernel"]["torch.matmul"]["stats"]["median"]["max"] == pytest.approx(0.01)
    r = CliRunner().invoke(main, ["noise", "--db", str(db), "--run", "7"])
    assert r.exit_code == 1 and "no run 7" in r.output


def test_a_bench_run_ends_with_its_own_noise_per_mode():
    from gemmrl.cli import run_noise_lines

    def m(M, impl, mode, t, **details):
        return {"M": M, "N": 64, "K": 64, "dtype": "fp16", "acc": "fp32", "impl": impl, "mode": mode,
                "median_us": t, "mean_us": t, "status": "ok", "details": details}

    recs = [m(64, "torch.matmul", "offline", 10.0, ci_reached=True),
            m(64, "torch.matmul@repeat", "offline", 10.1, ci_reached=True),
            m(128, "torch.matmul", "offline", 10.0, ci_reached=False),
            m(128, "torch.matmul@repeat", "offline", 10.5, ci_reached=False),
            m(64, "torch.matmul", "server", 50.0, paired={"torch.matmul@repeat": 1.005}),
            m(64, "torch.matmul@repeat", "server", 60.0, paired={"torch.matmul": 1 / 1.005}),
            {**m(256, "torch.matmul", "kernel", 3.0), "median_us": None, "status": "error"}]  # left out
    off, srv = run_noise_lines(recs)
    assert off.startswith("noise, offline: torch.matmul timed twice agreed within 2% on 1 of 2 shapes (median 3.00%")
    assert "worst 5.00% at 128_64_64" in off and "1 of 2 stopped at the time cap" in off
    # server mode: the paired ratio the reports compare (0.5%), not the 20% apart times
    assert "on 1 of 1 shapes (median 0.50%" in srv and "time cap" not in srv
    assert run_noise_lines([m(64, "torch.matmul", "kernel", 3.0)]) == []  # no repeat: nothing to say


def test_store_summary_counts_bf16_problems_apart_from_fp16(tmp_path):
    """`gemmrl store` counts (shape, input type, accumulator) problems: one shape measured and tuned
    in fp16 and in bf16 is two problems, and the tuned line names the input type (the first bf16
    tunes, 2026-12-01, read as 13 more fp16 shapes)."""
    db = tmp_path / "s.sqlite"
    st = Store(db)
    run = st.start_run("gemmrl tune", "NVIDIA H200", {}, {})
    for dtype in ("fp16", "bf16"):
        p = Problem(64, 64, 64, dtype, "fp32")
        st.record_session(run, "s" + dtype, "NVIDIA H200", p, "kernel", "kernel:v1", {
            "torch.matmul": {"median_us": 3.0, "n": 20, "status": "ok", "details": {}}})
        st.put_tuning("NVIDIA H200", p, "gemmrl-tuned", b"{}", "", 2.0)
    st.put_tuning("NVIDIA H200", Problem(128, 64, 64, "fp16", "fp16"), "gemmrl-tuned", b"{}", "", 2.0)
    st.finish_run(run)
    st.close()
    r = CliRunner().invoke(main, ["store", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "2 measurements of 2 (shape, input, accumulator) problems" in r.output, r.output
    assert ("tuned: 1 shapes (fp16 in, acc fp16), 1 shapes (fp16 in, acc fp32), 1 shapes (bf16 in, acc fp32)"
            in r.output), r.output


def test_store_releases_a_quarantine_and_says_what_it_was(tmp_path):
    db = tmp_path / "s.sqlite"
    s = Store(db)
    for shape in ((8192, 512, 8192), (4096, 8192, 12288)):
        s.quarantine("NVIDIA H200", Problem(*shape, "fp16", "fp16"), "cuda-l2", f"crashed on {shape}")
    s.quarantine("NVIDIA H200", Problem(64, 64, 64), "sm90_kernel_x", "hung")
    s.close()
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--release-quarantine", "cuda-l2", "--shapes", "8192x512x8192"])
    assert r.exit_code == 0, r.output
    assert "released NVIDIA H200 8192x512x8192 (fp16, fp16): crashed on (8192, 512, 8192)" in r.output
    assert "released 1 quarantine entry of cuda-l2" in r.output
    s = Store(db, readonly=True)
    assert s.quarantined("NVIDIA H200", Problem(8192, 512, 8192, "fp16", "fp16")) == {}
    assert "cuda-l2" in s.quarantined("NVIDIA H200", Problem(4096, 8192, 12288, "fp16", "fp16"))
    assert "sm90_kernel_x" in s.quarantined("NVIDIA H200", Problem(64, 64, 64))
    s.close()
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--release-quarantine", "cuda-l2"])
    assert r.exit_code == 0 and "released 1 quarantine entry" in r.output and "4096x8192x12288" in r.output
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--release-quarantine", "cuda-l2"])
    assert r.exit_code == 1 and "no quarantine entry for 'cuda-l2'" in r.output
    r = CliRunner().invoke(main, ["store", "--db", str(db), "--shapes", "64x64x64"])
    assert r.exit_code == 2 and "--shapes goes with --release-quarantine" in r.output


@pytest.mark.parametrize("argv", [["tune", "--shapes", "64x64x64", "--no-report"],
                                  ["bench", "--shapes", "64x64x64", "--impl", "torch.matmul", "--no-report"]])
def test_a_runs_provenance_records_the_torch_settings_it_times_with(monkeypatch, tmp_path, argv):
    """torch's default allows reduced-precision fp16 reduction; gemmrl's workers time without it.
    The run's provenance is taken after the command sets the harness's flags, so it says False:
    before the fix, the 145 H100 and H200 tune runs up to run 599 recorded True."""
    import torch

    from gemmrl.bench import env, runner

    class Recorded(Exception):
        pass

    seen = {}

    def provenance(cublas_version=""):
        seen.update(fp16=torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
                    bf16=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
        raise Recorded

    monkeypatch.setattr(runner, "require_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(env, "provenance", provenance)
    for flag in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        monkeypatch.setattr(torch.backends.cuda.matmul, flag, True)
    r = CliRunner().invoke(main, argv + ["--db", str(tmp_path / "s.sqlite")])
    assert isinstance(r.exception, Recorded), r.output
    assert seen == {"fp16": False, "bf16": False}


def test_gpu_identity_names_the_physical_gpu_and_its_limits(monkeypatch):
    """A run's provenance names the GPU it timed on (UUID, PCI bus, power limit, clocks, VBIOS),
    asked of nvidia-smi by UUID; what cannot be read is left out, and nothing raises."""
    import subprocess
    from types import SimpleNamespace

    from gemmrl.bench import env

    row = "00000000:19:00.0, 700.00, 1980, 3201, 1755, 96.00.A5.00.01\n"
    assert env.parse_gpu_query("GPU-abc", row) == {
        "uuid": "GPU-abc", "pci_bus_id": "00000000:19:00.0", "power_limit_w": 700.0, "max_sm_mhz": 1980.0,
        "max_mem_mhz": 3201.0, "app_sm_mhz": 1755.0, "vbios": "96.00.A5.00.01"}
    got = env.parse_gpu_query("GPU-abc", "00000000:19:00.0, [N/A], 1980, 3201, [Not Supported], 96.00\n")
    assert "power_limit_w" not in got and "app_sm_mhz" not in got and got["max_sm_mhz"] == 1980.0
    assert env.parse_gpu_query("GPU-abc", "") == {"uuid": "GPU-abc"}
    assert env.parse_gpu_query("GPU-abc", "a, b\n") == {"uuid": "GPU-abc"}  # not the fields asked
    calls = []

    def run(argv, **kw):
        calls.append(argv)
        return SimpleNamespace(returncode=0, stdout=row)

    monkeypatch.setattr(subprocess, "run", run)
    got = env.gpu_identity(SimpleNamespace(uuid="6b4e-1234"))
    assert got["uuid"] == "GPU-6b4e-1234" and got["power_limit_w"] == 700.0
    assert calls[0][1] == "--id=GPU-6b4e-1234" and calls[0][2].startswith("--query-gpu=pci.bus_id,")
    assert env.gpu_identity(SimpleNamespace(uuid="")) == {}

    def broken(argv, **kw):
        raise OSError("no nvidia-smi")

    monkeypatch.setattr(subprocess, "run", broken)
    assert env.gpu_identity(SimpleNamespace(uuid="GPU-x")) == {"uuid": "GPU-x"}


class _FakeNvml:
    """pynvml's calls gpu_state makes, for one GPU; `fail` names the calls that raise."""

    NVML_FI_DEV_MEMORY_TEMP = 82

    def __init__(self, uuid="GPU-abc", fail=(), mem_temp_type=1):
        self.uuid, self.fail, self.mem_temp_type, self.inits = uuid, set(fail), mem_temp_type, 0

    def _check(self, name):
        if name in self.fail:
            raise RuntimeError(f"NVML: {name} not supported")

    def nvmlInit(self):
        self._check("init")
        self.inits += 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid != self.uuid:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "handle"

    def nvmlDeviceGetTemperature(self, h, sensor):
        self._check("temp")
        assert h == "handle" and sensor == 0
        return 61

    def nvmlDeviceGetFieldValues(self, h, ids):
        from types import SimpleNamespace

        self._check("fields")
        assert ids == [82]
        value = SimpleNamespace(uiVal=74, siVal=-1, dVal=-1.0)
        return [SimpleNamespace(nvmlReturn=0, valueType=self.mem_temp_type, value=value)]

    def nvmlDeviceGetClockInfo(self, h, clock):
        self._check("clocks")
        return {1: 1755, 2: 3201}[clock]

    def nvmlDeviceGetPowerUsage(self, h):
        return 412345  # milliwatts

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        self._check("events")
        return 0x4 | 0x20


def test_gpu_state_reads_temperatures_clocks_power_and_throttling_and_never_raises(monkeypatch):
    """env.gpu_state: the GPU's state for a session's record, through NVML; a reading NVML
    refuses is left out, NVML missing or refusing the GPU gives {}, GEMMRL_GPU_STATE=0 turns it
    off, and NVML is initialized once per process."""
    from gemmrl.bench import env

    monkeypatch.delenv(env.STATE_ENV, raising=False)
    nvml = _FakeNvml()
    want = {"temp_c": 61, "mem_temp_c": 74, "sm_mhz": 1755, "mem_mhz": 3201, "power_w": 412.3,
            "clock_events": ["sw_power_cap", "sw_thermal"]}
    assert env.gpu_state("abc", nvml=nvml) == want  # torch's UUID has no GPU- prefix
    assert env.gpu_state("GPU-abc", nvml=nvml) == want and nvml.inits == 1
    part = _FakeNvml(fail={"fields", "events"})
    assert env.gpu_state("GPU-abc", nvml=part) == {"temp_c": 61, "sm_mhz": 1755, "mem_mhz": 3201, "power_w": 412.3}
    assert env.gpu_state("GPU-other", nvml=_FakeNvml()) == {}
    broken = _FakeNvml(fail={"init"})
    assert env.gpu_state("GPU-abc", nvml=broken) == {}
    broken.fail.clear()
    assert env.gpu_state("GPU-abc", nvml=broken) == {} and broken.inits == 0  # not tried again
    assert env.gpu_state("GPU-abc", nvml=_FakeNvml(mem_temp_type=5))["mem_temp_c"] == -1  # by its type
    monkeypatch.setenv(env.STATE_ENV, "0")
    assert env.gpu_state("GPU-abc", nvml=_FakeNvml()) == {}
    assert env.clock_event_names(0) == [] and env.clock_event_names(0x1 | 0x400) == ["gpu_idle", "0x400"]


def test_use_harness_settings_turns_reduced_precision_reduction_off(monkeypatch):
    import torch

    from gemmrl.bench import env

    for flag in ("allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"):
        monkeypatch.setattr(torch.backends.cuda.matmul, flag, True)
    assert env.use_harness_settings() == {"allow_fp16_reduced_precision_reduction": False,
                                          "allow_bf16_reduced_precision_reduction": False}
    assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction is False
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is False


def test_a_reports_provenance_is_its_newest_measuring_run_not_the_devices_newest(tmp_path):
    """A later run of another accumulator (here fp16, commit 'later') must not describe the fp32
    report; the run list still names every run of the device."""
    db = tmp_path / "s.sqlite"
    st = Store(db)
    _fill(st)
    run = st.start_run("gemmrl bench --acc fp16", "NVIDIA H100 80GB HBM3", {"commit": "later", "date": "2026-11-28"},
                       {})
    st.record_session(run, "u", "NVIDIA H100 80GB HBM3", Problem(64, 64, 64, acc="fp16"), "kernel", "kernel:v1", {
        "torch.matmul": {"median_us": 3.0, "n": 20, "status": "ok", "details": {}}})
    st.finish_run(run)
    st.close()
    out = tmp_path / "res"
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out)])
    assert r.exit_code == 0, r.output
    prov = json.loads((out / "h100" / "torch_matmul_h100_F32F16F16F32_summary.json").read_text())["provenance"]
    assert prov["commit"] == "c0ffee" and prov["date"] == "2026-11-21"
    assert [x["command"] for x in prov["runs"]] == ["gemmrl bench", "gemmrl bench --acc fp16"]
    r = CliRunner().invoke(main, ["report", "--db", str(db), "--out", str(out), "--acc", "fp16"])
    assert r.exit_code == 0, r.output
    prov = json.loads((out / "h100" / "torch_matmul_h100_F16F16F16F16_summary.json").read_text())["provenance"]
    assert prov["commit"] == "later"


def test_tune_says_which_shapes_the_policy_failed_on(tmp_path, monkeypatch):
    from gemmrl.bench import runner
    from gemmrl.search import run as srun
    from gemmrl.search.tune import TuneResult

    _fake_gpu_for_tune(monkeypatch)
    p, q = Problem(2048, 1024, 16384), Problem(512, 512, 512)

    def fake_run_tune(problems, store, device, evaluate, **kw):
        return TuneResult(problems=list(problems), trials=[], history=[], best={}, curve=[], device_s=0.0,
                          failed={p: "ValueError: K=16384 is not a multiple of 3 splits x 8"})
    monkeypatch.setattr(runner, "run_isolated", lambda *a, **kw: {"stopped": False})
    monkeypatch.setattr(srun, "run_tune", fake_run_tune)
    r = CliRunner().invoke(main, ["tune", "--shapes", f"{p.shape},{q.shape}", "--db", str(tmp_path / "s.sqlite"),
                                  "--no-report"])
    assert r.exit_code == 0, r.output
    assert ("the policy failed on 1 shape(s), left unsearched (their earlier winners stand); "
            "first: 2048x1024x16384: ValueError: K=16384 is not a multiple of 3 splits x 8") in r.output


def _bench_without_gpu(monkeypatch, impls, run_isolated):
    """`gemmrl bench` on this GPU-less machine: the GPU, its provenance and peaks, the
    implementations and the timing loop stood in for; what the command does around them is real."""
    import torch

    from gemmrl import cli
    from gemmrl.bench import env, runner

    monkeypatch.setattr(runner, "require_gpu", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    monkeypatch.setattr(env, "provenance", lambda cublas_version="": {"driver": "580", "cuda": "13.0",
                                                                      "torch": "2.11"})
    monkeypatch.setattr(env, "measure_peaks", lambda: {"matrix_tflops": 700.0, "bandwidth_gbs": 4000.0,
                                                       "copy_gbs": 4000.0, "read_gbs": 4000.0})
    monkeypatch.setattr(cli, "_cublas_version", lambda: "test")
    monkeypatch.setattr(cli, "build_impls", lambda specs, store=None, device="", include_dirs=(): impls)
    monkeypatch.setattr(runner, "run_isolated", run_isolated)


class _Compiles:
    """An implementation whose shapes each need kernels compiled (build_jobs), none built yet."""
    name = "compiles"

    def __init__(self, kernels_per_shape: int, on_prebuild=None):
        self.k, self.built, self.on_prebuild = kernels_per_shape, [], on_prebuild

    def build_jobs(self, problems):
        return [[(f"{p.shape}-{i}", f"// {p.shape} {i}", {"arch": "sm_90a"}) for i in range(self.k)] for p in problems]

    def prebuild(self, problems, jobs=None, log=print, plan=None):
        assert plan == self.build_jobs(problems)  # bench's plan of this slice, not another's
        if self.on_prebuild:
            self.on_prebuild(len(self.built))
        self.built.append([p.shape for p in problems])


def test_bench_compiles_and_times_a_slice_of_the_shapes_at_a_time(monkeypatch, tmp_path):
    """A bench whose kernels are not built compiles one wave of them (as many as nvcc processes
    run at once), times those shapes, and goes on: a step cut early keeps what it timed (the
    forty-fifth session's offline retime compiled 119 kernels for 150 s and then timed nothing)."""
    from gemmrl.build import nvcc, pool

    monkeypatch.setattr(nvcc, "is_built", lambda src, **kw: False)
    monkeypatch.setattr(pool, "default_jobs", lambda: 4)
    impl = _Compiles(2)
    timed = []

    def run_isolated(problems, specs, store, cfg, **kw):
        timed.append([p.shape for p in problems])
        return {"sessions": len(problems), "skipped": 0, "rejected": 0, "stopped": len(timed) == 3}

    _bench_without_gpu(monkeypatch, [impl], run_isolated)
    shapes = tmp_path / "s.txt"
    shapes.write_text("\n".join(f"64x64x{64 * (i + 1)}" for i in range(7)) + "\n")
    r = CliRunner().invoke(main, ["bench", "--shapes", str(shapes), "--no-report", "--db", str(tmp_path / "s.sqlite")])
    assert r.exit_code == 0, r.output
    # 2 kernels a shape, at most 4 a slice: slices of 2 shapes, each compiled, then timed
    assert impl.built == timed == [["64x64x64", "64x64x128"], ["64x64x192", "64x64x256"],
                                   ["64x64x320", "64x64x384"]]  # the third slice's timing stopped
    assert "in 4 slices of the 7 shapes" in r.output and "measured 6 (shape, mode) sessions" in r.output
    from gemmrl.store.db import Store

    store = Store(tmp_path / "s.sqlite")
    assert store.runs()[-1]["status"] == "partial"
    store.close()


def test_a_stopped_bench_counts_the_sessions_the_store_holds(monkeypatch, tmp_path):
    """A SIGTERM that lands after a worker stored a shape's session and before the parent counted
    it left the summary one short (H200, run 719: "measured 26", 27 whole sessions stored): a
    stopped bench counts its run's sessions in the store."""
    from gemmrl.store.db import Store

    def run_isolated(problems, specs, store, cfg, run_id=None, **kw):
        for p in problems[:2]:  # two stored, one of them counted
            store.record_session(run_id, f"s{p.K}", "NVIDIA H200", p, "kernel", "kernel:v3",
                                 {"torch.matmul": {"median_us": 5.0, "n": 50}})
        return {"sessions": 1, "skipped": 0, "rejected": 0, "stopped": True}

    _bench_without_gpu(monkeypatch, [], run_isolated)
    db = tmp_path / "s.sqlite"
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64,64x64x128,64x64x192", "--no-report", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert "measured 2 (shape, mode) sessions" in r.output, r.output
    store = Store(db)
    assert store.run_session_count(store.runs()[-1]["id"]) == 2 and store.runs()[-1]["status"] == "partial"
    assert store.run_session_count(store.runs()[-1]["id"] + 1) == 0  # a run with none
    store.close()


def test_bench_retime_after_resumes_a_cut_retime_and_checks_its_run(monkeypatch, tmp_path):
    """`--retime-after RUN` is --retime less what later runs measured: the same step, repeated in
    the next call of a session, takes up where a cut one stopped (a product retime of 453 shapes
    in three modes is more than one call). A run number past the store's last is an argument
    error, before the GPU."""
    from gemmrl.store.db import Store

    db = tmp_path / "s.sqlite"
    store = Store(db)
    for _ in range(3):
        store.start_run("gemmrl bench", "NVIDIA H200", {}, {})
    store.close()
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--retime-after", "4", "--db", str(db)])
    assert r.exit_code == 2 and "has no run 4 (its last is 3)" in r.output, r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--retime-after", "1",
                                  "--db", str(tmp_path / "none.sqlite")])
    assert r.exit_code == 2 and "no store at" in r.output, r.output
    assert not (tmp_path / "none.sqlite").exists()  # the check made no empty store
    seen = []

    def run_isolated(problems, specs, store, cfg, **kw):
        seen.append((cfg.retime, cfg.retime_after))
        return {"sessions": 0, "skipped": len(problems), "rejected": 0, "stopped": False}

    _bench_without_gpu(monkeypatch, [], run_isolated)
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--retime-after", "3", "--no-report",
                                  "--db", str(db)])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64", "--retime", "--no-report", "--db", str(db)])
    assert r.exit_code == 0, r.output
    assert seen == [(True, 3), (True, None)]


def test_a_sigterm_while_bench_compiles_ends_the_run_as_partial(monkeypatch, tmp_path):
    import os
    import signal

    from gemmrl.build import nvcc, pool

    monkeypatch.setattr(nvcc, "is_built", lambda src, **kw: False)
    monkeypatch.setattr(pool, "default_jobs", lambda: 2)
    impl = _Compiles(1, on_prebuild=lambda n: os.kill(os.getpid(), signal.SIGTERM) if n == 1 else None)
    timed = []

    def run_isolated(problems, specs, store, cfg, **kw):
        timed.append([p.shape for p in problems])
        return {"sessions": len(problems), "skipped": 0, "rejected": 0, "stopped": False}

    _bench_without_gpu(monkeypatch, [impl], run_isolated)
    prev = signal.getsignal(signal.SIGTERM)
    try:
        r = CliRunner().invoke(main, ["bench", "--shapes", "64x64x64,64x64x128,64x64x192,64x64x256", "--no-report",
                                      "--db", str(tmp_path / "s.sqlite")])
    finally:
        signal.signal(signal.SIGTERM, prev)
    assert r.exit_code == 0, r.output
    assert timed == [["64x64x64", "64x64x128"]]  # the second slice was being compiled
    assert "stopped while compiling" in r.output and "measured 2 (shape, mode) sessions" in r.output
    from gemmrl.store.db import Store

    store = Store(tmp_path / "s.sqlite")
    assert store.runs()[-1]["status"] == "partial"
    store.close()
