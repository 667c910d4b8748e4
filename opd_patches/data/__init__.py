"""Training-data preparation: source rows -> VERL parquet, de-duplicated and decontaminated.

- `text`: problem-text normalisation and the word n-grams both de-duplication and decontamination use;
- `decontaminate`: an index of the evaluation problems and the overlap rule (threshold documented there);
- `prepare`: reading DAPO-Math-17k-style or plain {problem, answer} rows, the pipeline and its report;
  `python -m opd_patches.data SRC --out DIR` (what `make data SRC=...` runs);
- `eval_sets`: public or local tables of evaluation problems -> the evaluation data folder that both
  decontamination and `opd_patches.eval` read (what `make data-eval EVAL_SETS=...` runs, first).

These modules need only pandas and pyarrow themselves (`eval_sets` also `datasets`, for hub sources; no
torch, no model); the `opd_patches` package around them imports no VERL either (registration is
`opd_patches.register()`).
"""
