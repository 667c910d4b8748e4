"""Evaluation: sample a model on a suite of math questions, grade, summarise with clustered errors, plot.

    python -m opd_patches.eval --model DIR --suite NAME [--out DIR] [--limit N] [--samples K]
        [--max-new-tokens T] [--backend auto|hf|vllm] [--verifier JUDGE_MODEL] ...
    make eval MODEL=... SUITE=math500|aime|embedded [OUT=...] [EVAL_ARGS="..."]

Modules: `suites` (protocol files in protocols/, question files or generated questions, the data
folder), `backends` (hf) and `vllm_backend`, both returning `completion.Completion`, `harness` (the
resumable run), `verifier` (the optional judge fallback), `summary`
(records -> summary JSON), `plot` (`python -m opd_patches.eval.plot`: scores per checkpoint, training
curves), `compare` (`python -m opd_patches.eval.compare A B`: paired comparison of two runs).
Outputs in `--out`: generations.jsonl (every sample with its grade and who decided), summary.json,
scores.png, eval_config.json.
"""
