"""GRPO with the harness as the reward, on the CPU: the reward builds the generated source with a
real sandboxed nvcc build; one real GRPO step with a tiny random model; trajectories as a
dataset. Skipped when the optional `rl` extra (trl, transformers, datasets) is missing."""

import shutil
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("transformers")
pytest.importorskip("datasets")

from gemmrl.core.problem import Problem  # noqa: E402
from gemmrl.llm import grpo  # noqa: E402
from gemmrl.llm.loop import export_trajectories  # noqa: E402
from gemmrl.llm.prompt import build_messages  # noqa: E402
from gemmrl.store.db import Store  # noqa: E402

KERNELS = Path(__file__).resolve().parent / "kernels"
P = Problem(64, 64, 64)
KEY = "64x64x64:fp16:fp32"


def inlined(name: str) -> str:
    return (KERNELS / name).read_text().replace('#include "common.cuh"', (KERNELS / "common.cuh").read_text())


def reply(src: str) -> str:
    return f"Here is the kernel.\n```cuda\n{src.rstrip()}\n```\n"


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def test_problem_key_round_trip():
    assert grpo.problem_key(P) == KEY and grpo.parse_problem_key(KEY) == P


@needs_nvcc
def test_harness_reward_builds_for_real(tmp_path):
    calls = []
    build = grpo.build_only_evaluator(cache_dir=tmp_path / "builds")

    def evaluate(problem, source):
        calls.append(problem)
        return build(problem, source)

    fn = grpo.make_reward_fn(evaluate_source=evaluate)
    assert fn.__name__ == "harness_reward"
    honest = [{"role": "assistant", "content": reply(inlined("honest_nn.cu"))}]  # conversational
    broken = reply(inlined("honest_nn.cu") + "\nthis is not valid CUDA;\n")  # passes the static check
    garbage = "I think you should use tensor cores."
    cheat = reply(inlined("cheats/calls_cublas.cu"))
    r = fn([honest, broken, garbage, cheat], problem=[KEY] * 4)
    assert r == [grpo.BUILD_CREDIT, 0.0, 0.0, 0.0]
    assert len(calls) == 2  # the honest and the broken kernel were built; garbage/cheat never


def test_refused_cheat_is_not_built():
    called = []
    fn = grpo.make_reward_fn(evaluate_source=lambda p, s: called.append(s) or {"status": "ok", "reward": 5.0})
    cheats = [reply(inlined("cheats/calls_cublas.cu")), reply(inlined("cheats/background_thread.cu"))]
    assert fn(cheats, problem=KEY) == [0.0, 0.0]
    assert called == []
    assert fn(["no code at all", ""], problem=KEY) == [0.0, 0.0]
    assert called == []
    # the evaluator's reward counts only for status ok; an evaluator failure is 0.0
    assert fn([reply(inlined("honest_nn.cu"))], problem=KEY) == [5.0]
    bad = grpo.make_reward_fn(evaluate_source=lambda p, s: {"status": "rejected", "reward": 3.0})
    assert bad([reply(inlined("honest_nn.cu"))], problem=KEY) == [0.0]

    def boom(p, s):
        raise RuntimeError("worker died")
    assert grpo.make_reward_fn(evaluate_source=boom)([reply(inlined("honest_nn.cu"))], problem=KEY) == [0.0]


def test_dataset_from_trajectories(tmp_path):
    store = Store(tmp_path / "s.db")
    msgs = build_messages(P, "NN")
    src = inlined("honest_nn.cu")
    store.record_trajectory(None, "cpu", P, 0, 0, msgs, reply(src), src, "abc", "ok", "", 12.5, 1.2, {})
    store.record_trajectory(None, "cpu", Problem(128, 64, 32), 0, 0, build_messages(Problem(128, 64, 32)),
                            "garbage", None, None, "parse_error", "no block", None, 0.0, {})
    out = tmp_path / "t.jsonl"
    assert export_trajectories(store, out) == 2
    ds = grpo.dataset_from_trajectories(out)
    assert len(ds) == 2
    assert ds[0]["prompt"] == msgs and ds[0]["problem"] == KEY
    assert ds[1]["problem"] == "128x64x32:fp16:fp32" and ds[1]["status"] == "parse_error"
    assert ds[0]["reward"] == 1.2
    assert len(grpo.dataset_from_trajectories(out, statuses={"ok"})) == 1


@needs_nvcc
def test_one_grpo_step_on_cpu_with_the_harness_reward(tmp_path):
    model, tokenizer = grpo.tiny_model_and_tokenizer(seed=0)
    dataset = grpo.prompt_dataset([P, Problem(128, 64, 32)], "NN")
    assert {"prompt", "problem"} <= set(dataset.column_names)
    inner = grpo.make_reward_fn(evaluate_source=grpo.build_only_evaluator(cache_dir=tmp_path / "builds"))
    seen = []

    def harness_reward(completions, problem=None, **kwargs):
        seen.append((list(problem), [grpo._completion_text(c) for c in completions], kwargs.get("prompts")))
        return inner(completions, problem, **kwargs)

    trainer = grpo.train_grpo(model, tokenizer, dataset, harness_reward, tmp_path / "out", steps=1,
                              num_generations=2, prompts_per_step=2, max_completion_length=16,
                              learning_rate=1e-4, seed=0)
    assert trainer.state.global_step == 1
    assert len(seen) == 1
    keys, texts, prompts = seen[0]
    assert len(texts) == 4 and all(isinstance(t, str) for t in texts)
    assert sorted(keys) == sorted(["64x64x64:fp16:fp32"] * 2 + ["128x64x32:fp16:fp32"] * 2)
    for k in set(keys):
        assert keys.count(k) == 2  # num_generations completions per prompt
    logged = [h for h in trainer.state.log_history if any("reward" in k for k in h)]
    assert logged, trainer.state.log_history
