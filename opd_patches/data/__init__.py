"""Training-data preparation: source rows -> VERL parquet, de-duplicated and decontaminated.

- `text`: problem-text normalisation and the word n-grams both de-duplication and decontamination use;
- `decontaminate`: an index of the evaluation problems and the overlap rule (threshold documented there);
- `prepare`: reading DAPO-Math-17k-style or plain {problem, answer} rows, the pipeline and its report;
  `python -m opd_patches.data SRC --out DIR` (what `make data SRC=...` runs).

These modules need only pandas and pyarrow themselves (no torch, no model); the `opd_patches` package
around them imports no VERL either (registration is `opd_patches.register()`).
"""
