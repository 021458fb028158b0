"""Evaluation of a model: lm-evaluation-harness tasks (harness.py, tasks.py), token scoring (scoring.py) and the
perplexity of a checkpoint on any dataset titanlike reads (perplexity.py). See docs/evaluation.md.

lm_eval is optional (`pip install 'titanlike[eval]'`): only harness.py and tasks.py import it, when used."""
