"""RL fine-tuning with GRPO (TRL) whose reward function is the harness.

Datasets: `prompt_dataset(problems, layout)` (one turn-0 prompt per problem, as built by
gemmrl.llm.prompt.build_messages) and `dataset_from_trajectories(jsonl)` (the prompts recorded by
refine() and written by gemmrl.llm.loop.export_trajectories). Both are `datasets.Dataset`s in
TRL's conversational format: {"prompt": [chat messages], "problem": "MxNxK:dtype:acc"}; TRL
passes the "problem" column to the reward function as a keyword argument.

The reward (`make_reward_fn` / `harness_reward`) scores each completion the way refine() does:
extract_kernel (0.0 on a parse error), check_source (0.0 when refused, nothing is built), then
`evaluate_source(problem, source) -> {status, reward, ...}`; only status 'ok' earns its reward.
  - with a GPU and a store: gemmrl.llm.evaluate.gpu_source_evaluator against the fastest baseline
    in the store, i.e. the measured speedup minus penalties (gemmrl.search.reward);
  - without a GPU: `build_only_evaluator`, the sandboxed nvcc build only: 0.0 when it does not
    compile, BUILD_CREDIT (0.1, "it compiles") when it does. Nothing is run or timed, so this is
    a shaping signal for CPU smoke runs, not a speed reward.

`train_grpo` runs GRPOTrainer with settings that also work on a CPU; `tiny_model_and_tokenizer`
makes a randomly initialised tiny causal LM with a tokenizer trained offline (no downloads), for
tests. trl, transformers, datasets and accelerate are the optional `rl` extra: import this module
only where they are installed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable, Iterable

from gemmrl.core.problem import Problem
from gemmrl.llm.parse import ParseError, extract_kernel
from gemmrl.llm.prompt import build_messages
from gemmrl.llm.static_check import check_source

log = logging.getLogger("gemmrl.llm.grpo")

# Reward for a completion whose kernel passes the static check and builds with nvcc, when there
# is no GPU to verify and time it: "it compiles". Well under any real speedup reward (a correct
# kernel at 10% of the baseline's speed already earns 0.1).
BUILD_CREDIT = 0.1


# ---------------------------------------------------------------------------------------------
# Problems as dataset strings

def problem_key(problem: Problem) -> str:
    """'MxNxK:dtype:acc', e.g. '64x128x256:fp16:fp32'."""
    return f"{problem.M}x{problem.N}x{problem.K}:{problem.dtype}:{problem.acc}"


def parse_problem_key(key: str) -> Problem:
    shape, dtype, acc = str(key).split(":")
    m, n, k = (int(x) for x in shape.lower().split("x"))
    return Problem(m, n, k, dtype, acc)


# ---------------------------------------------------------------------------------------------
# Evaluators and the reward function

def build_only_evaluator(*, cache_dir: str | Path | None = None, arch: str = "sm_90a",
                         timeout_s: float = 600.0) -> Callable[[Problem, str], dict]:
    """evaluate_source for a machine without a GPU: the sandboxed nvcc build only.
    ok + BUILD_CREDIT when it compiles, compile_error (reward 0) when it does not."""
    from gemmrl.llm.sandbox import sandboxed_build

    def evaluate_source(problem: Problem, source: str) -> dict:
        b = sandboxed_build(source, name=f"grpo_{problem.M}x{problem.N}x{problem.K}", arch=arch,
                            cache_dir=cache_dir, timeout_s=timeout_s)
        out = {"build_log": str(b.get("log", ""))[-4000:], "resources": b.get("resources", [])}
        if not b.get("ok"):
            return {**out, "status": "compile_error", "reason": "nvcc failed", "reward": 0.0}
        return {**out, "status": "ok", "reason": "it compiles (no GPU: not verified or timed)",
                "time_us": None, "reward": BUILD_CREDIT}

    return evaluate_source


def _completion_text(completion) -> str:
    """A completion as TRL passes it: a string (standard format) or a list of messages
    (conversational format): the assistant contents joined."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        return str(completion.get("content", ""))
    if isinstance(completion, (list, tuple)):
        return "\n".join(_completion_text(m) for m in completion
                         if not isinstance(m, dict) or m.get("role", "assistant") == "assistant")
    return str(completion)


def score_completion(problem: Problem, text: str, evaluate_source) -> tuple[float, dict]:
    """(reward, info) for one completion: 0.0 on a parse error or a static-check refusal (no
    build), else the evaluator's reward when its status is 'ok', else 0.0."""
    try:
        source = extract_kernel(text)
    except ParseError as e:
        return 0.0, {"status": "parse_error", "reason": str(e)}
    refusals = check_source(source)
    if refusals:
        return 0.0, {"status": "refused", "reason": "static check: " + "; ".join(refusals)}
    try:
        res = dict(evaluate_source(problem, source))
    except Exception as e:  # an evaluator failure is this completion's failure, not training's
        log.exception("evaluate_source failed")
        return 0.0, {"status": "crashed", "reason": f"evaluator error: {type(e).__name__}: {e}"}
    status = res.get("status", "crashed")
    r = float(res.get("reward") or 0.0) if status == "ok" else 0.0
    return max(0.0, r), {"status": status, "reason": str(res.get("reason", ""))}


def harness_reward(completions, problem=None, *, problem_key=None, evaluate_source=None,
                   log_extra=None, **kwargs) -> list[float]:
    """A TRL reward function: one float per completion. `problem` is the dataset column of
    'MxNxK:dtype:acc' strings (one per completion, as TRL repeats columns per generation);
    `problem_key` is an alias; `evaluate_source` defaults to the build-only evaluator. Other
    keywords TRL passes (prompts, completion_ids, trainer_state, log_metric, ...) are ignored."""
    keys = problem if problem is not None else problem_key
    if keys is None:
        raise ValueError("harness_reward needs the 'problem' column (MxNxK:dtype:acc per completion)")
    if isinstance(keys, str):
        keys = [keys] * len(completions)
    if len(keys) != len(completions):
        raise ValueError(f"{len(completions)} completions but {len(keys)} problem keys")
    if evaluate_source is None:
        evaluate_source = build_only_evaluator()
    rewards, statuses = [], []
    for comp, key in zip(completions, keys):
        r, info = score_completion(parse_problem_key(key), _completion_text(comp), evaluate_source)
        rewards.append(r)
        statuses.append(info["status"])
    if callable(log_extra):
        try:
            log_extra("harness_status", statuses)
        except Exception:  # logging is best effort
            pass
    return rewards


def make_reward_fn(evaluate_source: Callable[[Problem, str], dict] | None = None, store=None,
                   device: str | None = None, *, mode: str = "kernel", timeout_s: float = 600.0):
    """The harness as a TRL reward function (a callable with __name__ 'harness_reward' and a
    close() that stops any worker). evaluate_source wins when given; else, with a CUDA GPU and
    a store, the GPU evaluator (build, verify, time, reward = speedup vs the store's fastest
    baseline for `device`, default the current GPU's name); else the build-only evaluator."""
    close: Callable[[], None] = lambda: None
    evaluator = evaluate_source
    if evaluator is None:
        try:
            import torch
            has_gpu = torch.cuda.is_available()
        except Exception:
            has_gpu = False
        if has_gpu and store is not None:
            from gemmrl.llm.evaluate import gpu_source_evaluator
            from gemmrl.search.tune import best_baseline_from_store

            import torch
            dev = device or torch.cuda.get_device_name()
            evaluator, close = gpu_source_evaluator(best_baseline_from_store(store, dev, mode),
                                                    timeout_s=timeout_s)
        else:
            if has_gpu:
                log.warning("a GPU but no store for baselines: using the build-only reward")
            evaluator = build_only_evaluator(timeout_s=timeout_s)

    def reward_fn(completions, problem=None, **kwargs) -> list[float]:
        kwargs.pop("evaluate_source", None)
        return harness_reward(completions, problem, evaluate_source=evaluator, **kwargs)

    reward_fn.__name__ = "harness_reward"
    reward_fn.__qualname__ = "harness_reward"
    reward_fn.evaluate_source = evaluator
    reward_fn.close = close
    return reward_fn


# ---------------------------------------------------------------------------------------------
# Datasets

def prompt_dataset(problems: Iterable[Problem], layout: str = "NN", **build_kwargs):
    """One turn-0 conversational prompt per problem (build_messages(problem, layout, ...))."""
    from datasets import Dataset

    rows = [{"prompt": build_messages(p, layout, **build_kwargs), "problem": problem_key(p)}
            for p in problems]
    return Dataset.from_list(rows)


def dataset_from_trajectories(jsonl_path: str | Path, *, statuses: Iterable[str] | None = None,
                              dedupe: bool = True):
    """The prompts of an export_trajectories JSONL as a conversational prompt dataset. Each
    row's recorded reply, status and reward are kept as extra columns (the trainer generates its
    own completions; the reward function ignores them). `statuses` keeps only those rows;
    `dedupe` keeps one row per distinct (prompt, problem) (the samples of one turn share it)."""
    from datasets import Dataset

    keep = set(statuses) if statuses is not None else None
    rows, seen = [], set()
    with open(jsonl_path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            if keep is not None and r.get("status") not in keep:
                continue
            prompt = r["prompt"]
            if isinstance(prompt, str):
                prompt = json.loads(prompt)
            p = r["problem"]
            key = problem_key(Problem(int(p["M"]), int(p["N"]), int(p["K"]), p["dtype"], p["acc"]))
            ident = (json.dumps(prompt, sort_keys=True), key)
            if dedupe and ident in seen:
                continue
            seen.add(ident)
            rows.append({"prompt": [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt],
                         "problem": key, "reply": r.get("reply") or "",
                         "status": r.get("status") or "", "reward": float(r.get("reward") or 0.0)})
    return Dataset.from_list(rows)


# ---------------------------------------------------------------------------------------------
# Training

def train_grpo(model, tokenizer, dataset, reward_fn, output_dir: str | Path, *, steps: int = 1,
               num_generations: int = 2, prompts_per_step: int = 1, max_completion_length: int = 256,
               learning_rate: float = 1e-6, seed: int = 0, use_cpu: bool | None = None,
               temperature: float = 1.0, beta: float = 0.0, **config_kwargs):
    """GRPO for `steps` optimizer steps; returns the trainer after trainer.train(). Each step
    samples `num_generations` completions for each of `prompts_per_step` prompts (one batch:
    per_device_train_batch_size = num_generations * prompts_per_step). use_cpu defaults to
    'no CUDA GPU'; on a CPU everything runs in fp32. Extra keywords go to GRPOConfig."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    if use_cpu is None:
        use_cpu = not torch.cuda.is_available()
    bf16 = (not use_cpu) and torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    cfg = dict(
        output_dir=str(output_dir), max_steps=int(steps), num_generations=int(num_generations),
        per_device_train_batch_size=int(num_generations) * int(prompts_per_step),
        gradient_accumulation_steps=1, max_completion_length=int(max_completion_length),
        learning_rate=float(learning_rate), seed=int(seed), data_seed=int(seed),
        use_cpu=bool(use_cpu), bf16=bf16, fp16=False, gradient_checkpointing=False,
        report_to="none", logging_steps=1, save_strategy="no", temperature=float(temperature),
        beta=float(beta), dataloader_num_workers=0, dataloader_pin_memory=not use_cpu,
        disable_tqdm=True,
    )
    import dataclasses
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(GRPOConfig)}:
        cfg["activation_checkpointing"] = cfg.pop("gradient_checkpointing")  # transformers >= 5 name
    cfg.update(config_kwargs)
    args = GRPOConfig(**cfg)
    trainer = GRPOTrainer(model=model, reward_funcs=[reward_fn], args=args, train_dataset=dataset,
                          processing_class=tokenizer)
    trainer.train()
    return trainer


# ---------------------------------------------------------------------------------------------
# A tiny random model for tests (no downloads)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|endoftext|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]


def _tokenizer_corpus() -> list[str]:
    from gemmrl.llm.prompt import system_message

    text = [system_message()["content"],
            build_messages(Problem(128, 256, 512))[1]["content"]]
    kernel = Path(__file__).resolve().parents[2] / "tests" / "kernels" / "honest_nn.cu"
    if kernel.is_file():
        text.append("```cuda\n" + kernel.read_text() + "```")
    return text


def tiny_model_and_tokenizer(seed: int = 0, *, vocab_size: int = 384, n_embd: int = 32,
                             n_layer: int = 1, n_head: int = 2, n_positions: int = 8192):
    """A randomly initialised 1-layer GPT-2 and a byte-level BPE tokenizer trained offline on
    the prompt template and a kernel source (any text tokenizes: the 256 bytes are in the
    alphabet), wrapped in PreTrainedTokenizerFast with pad/eos tokens and a chat template."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(_tokenizer_corpus(), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", pad_token="<|pad|>",
                                        unk_token=None, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[2:]})
    tokenizer.chat_template = CHAT_TEMPLATE

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=n_embd,
                        n_layer=n_layer, n_head=n_head, bos_token_id=tokenizer.bos_token_id,
                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    model = GPT2LMHeadModel(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer
