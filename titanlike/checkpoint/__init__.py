"""Checkpoints that never lose a run: DCP full state, async save, commit markers, resharding, HF interop.

    manager.py  CheckpointManager (save / async save / seed / export), used by the Trainer
    loading.py  its load half; load_model_weights (one process, e.g. evaluation)
    layout.py   folder layout, commit marker, keep-last-k, integrity checks
    states.py   non-tensor states (RNG, LR, data, trainer), model-shape checks, offline full-model reads
    hf.py       Hugging Face folders <-> titanlike checkpoints, through each family's HF adapter (convert_hf.py)
"""
from titanlike.checkpoint.layout import CheckpointError, StepInfo, complete_steps, scan, step_path
from titanlike.checkpoint.loading import load_model_weights
from titanlike.checkpoint.manager import CheckpointManager
from titanlike.checkpoint.states import full_model_state, model_from_meta, read_meta_json, read_metadata

__all__ = ["CheckpointError", "CheckpointManager", "StepInfo", "complete_steps", "full_model_state",
           "load_model_weights", "model_from_meta", "read_meta_json", "read_metadata", "scan", "step_path"]
