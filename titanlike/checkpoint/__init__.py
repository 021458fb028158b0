"""Checkpoints that never lose a run: DCP full state, async save, commit markers, resharding, HF interop.

    manager.py  CheckpointManager (save / async save / seed / export / preflight), used by the Trainer
    committing.py  its commit half: per-rank checksums (async: in the background), commit, keep-last-k, failures
    loading.py  its load half (every rank verifies a share of the chosen step); load_model_weights (one process)
    layout.py   folder layout, commit marker, keep-last-k, step states, checking and choosing the step to load
    integrity.py  MANIFEST.json: a CRC32 per 64 MiB chunk of every file, computed and verified in parallel
    preflight.py  before step 1: the checkpoint folder is writable and its disk holds the steps kept
    states.py   non-tensor states (RNG, LR, data, trainer), model-shape checks, offline full-model reads
    hf.py       Hugging Face folders <-> titanlike checkpoints, through each family's HF adapter (convert_hf.py)
"""
from titanlike.checkpoint.layout import CheckpointError, StepInfo, complete_steps, scan, step_path
from titanlike.checkpoint.loading import load_model_weights
from titanlike.checkpoint.manager import CheckpointManager
from titanlike.checkpoint.states import full_model_state, model_from_meta, read_meta_json, read_metadata

__all__ = ["CheckpointError", "CheckpointManager", "StepInfo", "complete_steps", "full_model_state",
           "load_model_weights", "model_from_meta", "read_meta_json", "read_metadata", "scan", "step_path"]
