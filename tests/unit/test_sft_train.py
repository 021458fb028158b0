"""Supervised fine-tuning end to end on the CPU: configs/sft_debug.toml (the debug Llama, the builtin tokenizer, the
built-in ChatML template, tests/unit/data/chat_tiny.jsonl packed with document masking) trains and its loss falls;
the first step's loss is the mean over the batch's assistant tokens; the HF export carries the template, so
transformers' apply_chat_template and generate on it equal titanlike's rendering and generation; generate.py --chat
prints the assistant's reply alone. (The data itself: tests/unit/test_sft_data.py.)"""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from models.batch import IGNORE_INDEX
from tests.launch import REPO_ROOT
from titanlike.config.load import load_config
from titanlike.train.trainer import Trainer

transformers = pytest.importorskip("transformers")
SCRIPT = REPO_ROOT / "scripts" / "generate.py"
CHAT = [{"role": "user", "content": "What is 3 + 4?"}]


def _script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """configs/sft_debug.toml for 30 steps with a checkpoint at the end; (run folder, history, first-step check)."""
    root = tmp_path_factory.mktemp("sft")
    cfg = load_config(["--config", str(REPO_ROOT / "configs/sft_debug.toml"), f"--job.dump_folder={root}",
                       "--training.device=cpu", "--training.steps=30", "--metrics.log_freq=1",
                       "--metrics.enable_tensorboard=false", "--checkpoint.enable", "--checkpoint.interval=30",
                       "--validation.enable", "--validation.interval=30"])
    trainer = Trainer(cfg)
    first = {}
    read = trainer.next_batches

    def next_batches(data_iter):
        batches = read(data_iter)
        if trainer.step == 1:  # before the first update: the weights its logged loss is taken with
            with torch.no_grad():
                first["sum"] = sum(float(trainer.forward_loss(b)) for b in batches)
            first["targets"] = sum(int((b.labels != IGNORE_INDEX).sum()) for b in batches)
            first["tokens"] = sum(b.labels.numel() for b in batches)
        return batches

    trainer.next_batches = next_batches
    try:
        history = trainer.train()
    finally:
        trainer.close()
    return root / "sft_debug", history, first


def test_sft_debug_learns_on_assistant_tokens(run):
    folder, history, first = run
    losses = [h["loss"] for h in history if "loss" in h]
    assert history[0]["step"] == 1 and history[-1]["step"] == 30
    assert losses[-1] < losses[0] - 3.0, losses  # ~7.8 -> ~1.3: the replies' format and much of the arithmetic
    # the logged loss is the summed cross-entropy over the assistant tokens divided by their count (a fraction of
    # the batch's tokens: prompts, headers and padding carry no label)
    assert 0 < first["targets"] < first["tokens"] / 2
    assert history[0]["loss"] == pytest.approx(first["sum"] / first["targets"], rel=1e-5)
    assert (folder / "checkpoint" / "step-30").is_dir()


def test_export_carries_the_template_and_generates_as_titanlike(run, tmp_path, capsys):
    from titanlike.checkpoint.hf import export_hf
    from titanlike.data.chat import load_chat_template, render_with_masks
    from titanlike.infer import generate, load_for_inference

    folder = run[0]
    out = export_hf(str(folder), str(tmp_path / "hf"), dtype="float32", progress=False)
    assert (tmp_path / "hf" / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(out)
    loaded = load_for_inference(str(folder))
    template = load_chat_template(loaded.data, loaded.tokenizer)
    convo = CHAT + [{"role": "assistant", "content": "3 + 4 = 7."}, {"role": "user", "content": "And 東京?"}]
    assert tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True) == \
        template.render(convo, add_generation_prompt=True)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == render_with_masks(template, CHAT, loaded.tokenizer, add_generation_prompt=True)[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert generate(loaded.model, [ids], max_new_tokens=12) == [want]
    # generate.py --chat on the run and on the export: the reply alone, cut at the template's end of turn
    script = _script()
    reply = script._reply(loaded.tokenizer.decode(want), "<|im_end|>")
    for source in (str(folder), out):
        assert script.main([source, "--chat", "--prompt", CHAT[0]["content"], "--max-new-tokens", "12"]) == 0
        printed = capsys.readouterr().out
        assert printed == reply + "\n", (printed, reply)
        assert "<|im_start|>" not in printed and "What is" not in printed
    assert script.main([str(folder), "--chat", "--prompt", "a", "--prompt", CHAT[0]["content"],
                        "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.endswith(f"=== prompt 2\n{reply}\n")
    # starting from an HF folder: the import keeps the template beside the tokenizer, where data.chat_template=""
    # finds it (training from it is checkpoint.initial_load_path=<import>, docs/post_training.md)
    from titanlike.checkpoint.hf import import_hf
    from titanlike.config.sections import Data
    from titanlike.data.tokenizers import build_tokenizer

    imported = import_hf(out, str(tmp_path / "imported"), progress=False)
    data = Data(dataset="chat", tokenizer=imported["tokenizer"])
    again = load_chat_template(data, build_tokenizer(data))
    assert again.text == template.text and again.render(convo) == template.render(convo)
    assert script.main([str(folder), "--chat", "--tokens", "1,2", "--prompt", "x"]) == 2
    assert script.main([str(folder), "--system", "be brief", "--prompt", "x"]) == 2
    assert "add --chat" in capsys.readouterr().err


def test_chat_stream_holds_back_the_end_of_turn(capsys):
    class Pieces:
        def __init__(self, pieces):
            self.pieces = pieces

        def decode(self, ids):
            return "".join(self.pieces[i] for i in ids)

    script = _script()
    stream = script._ChatStream(Pieces(["7", ".<", "|im", "_end", "|>", "\n", "more"]), "<|im_end|>")
    shown = []
    for t in range(7):
        stream(0, t)
        shown.append(capsys.readouterr().out)
    assert shown == ["7", ".", "", "", "", "", ""]  # "<" waited: it began the end of turn
    assert script._reply("7.<|im_end|>\nmore", "<|im_end|>") == "7." and script._reply("7.", "<|im_end|>") == "7."
