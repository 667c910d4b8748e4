"""Embedded default assets: a tiny tokenizer, student/teacher models and toy math data.

They let the recipes run end to end with no downloads; see ``build.py``.
"""
