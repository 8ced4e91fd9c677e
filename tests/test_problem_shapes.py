import pytest

from gemmrl.core.problem import Problem, ProblemError, bucket_label, size_bucket
from gemmrl.core import shapes


def test_grid_is_cuda_l2s_1000_shapes_in_m_major_order():
    g = shapes.grid()
    assert len(g) == 1000 == len(set(g))
    assert g[0].mnk == "64_64_64" and g[1].mnk == "64_64_128" and g[-1].mnk == "16384_16384_16384"
    assert {p.M for p in g} == set(shapes.GRID_SIZES)


def test_subset_is_stratified_deterministic_and_spans_sizes():
    s = shapes.subset()
    assert len(s) == 100 == len(set(s))
    assert s == shapes.subset()  # same everywhere
    flops = sorted(p.flops for p in s)
    grid_flops = sorted(p.flops for p in shapes.grid())
    # one shape per tenth of the FLOPs-ordered grid: both ends are covered
    assert flops[0] <= grid_flops[9] and flops[-1] >= grid_flops[-10]
    buckets = {size_bucket(f) for f in flops}
    assert len(buckets) >= 8
    assert set(s) <= set(shapes.grid())
    assert shapes.subset(10, seed=1) != shapes.subset(10, seed=2)


@pytest.mark.parametrize("text", ["4096x1024x512", "4096_1024_512", "4096,1024,512", " 4096 X 1024 x 512 "])
def test_parse_shape_forms(text):
    p = shapes.parse_shape(text)
    assert (p.M, p.N, p.K) == (4096, 1024, 512)


@pytest.mark.parametrize("text,words", [
    ("0x64x64", "M must be positive"),
    ("64x-1x64", "N must be positive"),
    ("64x64", "expected MxNxK"),
    ("axbxc", "expected MxNxK"),
    ("64x64x99999999999", "32-bit"),
])
def test_parse_shape_errors_name_the_problem(text, words):
    with pytest.raises(ProblemError, match=words):
        shapes.parse_shape(text)


def test_problem_rejects_unknown_types_and_bool_sizes():
    with pytest.raises(ProblemError, match="unknown dtype 'fp8'"):
        Problem(64, 64, 64, "fp8")
    with pytest.raises(ProblemError, match="unknown accumulator"):
        Problem(64, 64, 64, "fp16", "fp64")
    with pytest.raises(ProblemError, match="bf16 inputs with an fp16"):
        Problem(64, 64, 64, "bf16", "fp16")
    with pytest.raises(ProblemError, match="integer"):
        Problem(True, 64, 64)


def test_problem_counts():
    p = Problem(128, 256, 512)
    assert p.flops == 2 * 128 * 256 * 512
    assert p.min_bytes == 2 * (128 * 512 + 512 * 256 + 128 * 256)
    assert p.precision == "F32F16F16F32" and Problem(64, 64, 64, acc="fp16").precision == "F16F16F16F16"


def test_size_buckets_are_powers_of_eight():
    assert size_bucket(1) == 0 and size_bucket(7) == 0 and size_bucket(8) == 1
    assert size_bucket(8**12) == 12 and size_bucket(8**12 - 1) == 11
    assert bucket_label(12) == "2^36-2^39"
    with pytest.raises(ProblemError):
        size_bucket(0)


def test_shape_file_with_comments_and_cuda_l2_csv(tmp_path):
    f = tmp_path / "shapes.txt"
    f.write_text("# llama\n4096x4096x1024\n\n  128_256_512  # decode\n4096x4096x1024\n")
    assert [p.shape for p in shapes.resolve(str(f))] == ["4096x4096x1024", "128x256x512"]
    csv = tmp_path / "r.csv"
    csv.write_text("mnk,torch.matmul,cuBLAS-tn\n64_64_64,1.8,1.9\n64_64_128,1.6,1.7\n")
    assert [p.mnk for p in shapes.parse_shape_file(csv)] == ["64_64_64", "64_64_128"]


def test_shape_file_errors_give_file_and_line(tmp_path):
    f = tmp_path / "bad.txt"
    f.write_text("64x64x64\n64x64\n")
    with pytest.raises(ProblemError, match=r"bad.txt:2: cannot parse"):
        shapes.parse_shape_file(f)
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n")
    with pytest.raises(ProblemError, match="holds no shapes"):
        shapes.parse_shape_file(empty)
    with pytest.raises(ProblemError, match="cannot read"):
        shapes.parse_shape_file(tmp_path / "missing.txt")


def test_resolve_specs():
    assert len(shapes.resolve("grid")) == 1000
    assert len(shapes.resolve("subset")) == 100
    assert len(shapes.resolve("subset:7")) == 7
    assert [p.shape for p in shapes.resolve("64x64x64,128x64x64 64x64x64")] == ["64x64x64", "128x64x64"]
    with pytest.raises(ProblemError, match="subset:N"):
        shapes.resolve("subset:abc")
    with pytest.raises(ProblemError, match="not 'grid'"):
        shapes.resolve("nonexistent/file.txt")
