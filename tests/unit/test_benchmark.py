"""scripts/bench/benchmark.py: matrix expansion (command line and TOML), the titanlike and peer command lines, log
parsing, summary statistics and the table — and one tiny real run on CPU (2 cases, with a stand-in peer script)."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from titanlike.observe.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))  # benchmark.py imports bench_matrix beside it
_spec = importlib.util.spec_from_file_location("benchmark", ROOT / "scripts" / "bench" / "benchmark.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

OPTS = Namespace(vocab=128256, data="mock", steps=10, log_freq=1, dump_folder="/tmp/x", extra=[], peer="peer.sh",
                 peer_extra=[])


def test_matrix_from_command_line_and_toml():
    cases = bench.expand_matrix({"flavor": "1B", "float8": "none,tensorwise", "seq": "2048,4096", "compile": "on"})
    assert [(c["seq"], c["float8"]) for c in cases] == [(2048, "none"), (2048, "tensorwise"), (4096, "none"),
                                                         (4096, "tensorwise")]
    assert all(c["compile"] is True and c["batch"] == 2 and c["ac"] == "none" for c in cases)
    toml = """
[defaults]
flavor = "8B"
seq = 8192
batch = 1
[[case]]
float8 = ["none", "tensorwise"]
[[case]]
ac = "selective"
ac_option = ["op", "2"]
layout = "tp=2"
"""
    cases = bench.expand_matrix({"nproc": "2", "seq": "1024"}, toml)  # the command line beats [defaults]
    assert len(cases) == 4 and all(c["nproc"] == 2 and c["seq"] == 1024 and c["flavor"] == "8B" for c in cases)
    assert [c["ac_option"] for c in cases[2:]] == ["op", "2"] and cases[3]["layout"] == "tp=2"
    with pytest.raises(ValueError, match="float8"):
        bench.expand_matrix({"float8": "fp4"})
    with pytest.raises(ValueError, match="unknown benchmark axes"):
        bench.expand_matrix({}, "[[case]]\nwarp = 9\n")
    with pytest.raises(ValueError, match="KEY=N"):
        bench.expand_matrix({"layout": "tp2"})


def test_command_lines_for_both_frameworks():
    (case,) = bench.expand_matrix({"flavor": "8B", "nproc": "2", "float8": "tensorwise", "compile": "on",
                                   "ac": "selective", "ac_option": "2", "seq": "8192", "batch": "1"})
    ours = bench.titanlike_cmd(case, OPTS)
    assert "--nproc_per_node=2" in ours and "configs/llama3_8b.toml" in ours
    assert {"--float8.enable=true", "--float8.recipe=tensorwise", "--float8.enable_fsdp_float8_all_gather=true",
            "--float8.precompute_float8_dynamic_scale_for_fsdp=true", "--compile.enable=true"} <= set(ours)
    peer = " ".join(bench.peer_cmd(case, OPTS))
    assert ("--model.converters quantize.linear.float8 --quantize.linear.float8.filter_fqns output "
            "--quantize.linear.float8.enable_fsdp_float8_all_gather "
            "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp") in peer
    assert "recipe_name" not in peer  # torchtitan 0.2.2 refuses recipe_name together with the float8 all-gather
    assert "--compile.enable" in peer and "--activation_checkpoint.selective_ac_option 2" in peer

    (one_gpu,) = bench.expand_matrix({"flavor": "1B", "float8": "tensorwise"})  # no FSDP: no float8 all-gather
    assert not any("all_gather" in a for a in bench.titanlike_cmd(one_gpu, OPTS) + bench.peer_cmd(one_gpu, OPTS))
    (rowwise,) = bench.expand_matrix({"nproc": "4", "float8": "rowwise", "layout": "tp=2"})
    assert "--parallelism.tp=2" in bench.titanlike_cmd(rowwise, OPTS)
    peer = " ".join(bench.peer_cmd(rowwise, OPTS))
    assert "--quantize.linear.float8.recipe_name rowwise" in peer and "--parallelism.tensor_parallel_degree 2" in peer
    # "+experts": float8.moe_experts on top of the recipe (the MoE's routed experts); no peer flags for it
    (experts,) = bench.expand_matrix({"model": "qwen3", "flavor": "30B-A3B_4L", "float8": "tensorwise+experts"})
    assert {"--float8.enable=true", "--float8.recipe=tensorwise",
            "--float8.moe_experts=true"} <= set(bench.titanlike_cmd(experts, OPTS))
    assert bench.peer_cmd(experts, OPTS) is None
    (chunked,) = bench.expand_matrix({"loss_chunk": "4096"})  # titanlike's own lever: the peer runs the plain shape
    assert bench.peer_cmd(chunked, OPTS) == bench.peer_cmd(bench.expand_matrix({})[0], OPTS)
    (long,) = bench.expand_matrix({"seq": "32768", "ac": "selective", "ac_option": "op", "peer_ac": "full"})
    assert "--activation_checkpoint.selective_option=op" in bench.titanlike_cmd(long, OPTS)
    peer = " ".join(bench.peer_cmd(long, OPTS))
    assert "--activation_checkpoint.mode full" in peer and "peer-ac-full" in bench.label(long)


def test_post_training_cases_against_trl():
    """--peer trl-dpo sets the post axis; titanlike gets the chat/preference flags and the shared tokenizer folder, the
    TRL peer its mode; pretraining cases have no TRL peer and post-training cases no torchtitan peer."""
    opts = Namespace(**{**vars(OPTS), "peer": bench.PEER_TRL, "post_data": "/d"})
    sft, lora, dpo = bench.expand_matrix({}, '[[case]]\npost = "sft"\n[[case]]\npost = "lora"\nflavor = "8B"\n'
                                             '[[case]]\npost = "dpo"\nseq = 2048\nbatch = 4\n')
    ours = bench.titanlike_cmd(sft, opts)
    assert {"--data.dataset=chat", "--data.paths=/d/chat.jsonl", "--data.tokenizer=/d/tokenizer",
            "--data.document_masking=true", "--data.sft_layout=pack"} <= set(ours) and "--data.dataset=mock" not in ours
    assert "--lora.enable=true" in bench.titanlike_cmd(lora, opts) and "--lora.enable=true" not in ours
    assert {"--data.dataset=preference", "--data.paths=/d/pairs.jsonl", "--data.preference_layout=pack",
            "--data.document_masking=true", "--data.reset_position_ids=true"} <= set(bench.titanlike_cmd(dpo, opts))
    peer = bench.peer_cmd(lora, opts)
    assert peer[1:4] == [bench.PEER_TRL, "lora", "--vocab"] and "8B" in peer and "--data" in peer
    # DPO: titanlike's batch is packed rows of seq tokens, TRL's pairs of two padded sequences
    assert bench.tokens_per_step(dpo) == 4 * 2048 and bench.tokens_per_step(dpo, peer=True) == 2 * 4 * 2048
    assert bench.tokens_per_step(sft) == bench.tokens_per_step(sft, peer=True) == 2 * 4096
    assert bench.label(dpo).startswith("dpo 1B s2048 b4")
    assert bench.peer_cmd(bench.expand_matrix({})[0], opts) is None  # pretraining: not TRL's
    assert bench.peer_cmd(sft, OPTS) is None  # post-training: not torchtitan's
    with pytest.raises(ValueError, match="post="):
        bench.expand_matrix({"post": "ppo"})
    log = "12:00:00 INFO chat data (train): 171 conversations, 152,741 tokens in 163 rows of 1025 (pack: 91% filled)"
    assert bench.pack_fill(log) == pytest.approx(152741 / (163 * 1025)) and bench.pack_fill("step 1") is None


def test_bert_and_t5_cases_against_the_hf_peer():
    """--model bert / t5 --peer hf: titanlike on base_gpu.toml at the flavor's vocabulary, BERT's mask id a spare row
    (the builtin tokenizer has no [MASK]), T5's decoder exactly dec_seq long on both sides, one FLOPs count for both;
    the torchtitan peer runs neither."""
    opts = Namespace(**{**vars(OPTS), "vocab": 0, "peer": bench.PEER_HF})
    bert, t5 = bench.expand_matrix({"seq": "512", "batch": "8", "compile": "on"},
                                   '[[case]]\nmodel = "bert"\nflavor = "bert-large"\n'
                                   '[[case]]\nmodel = "t5"\nflavor = "t5-v1_1-large"\ndec_seq = 128\n')
    ours = bench.titanlike_cmd(bert, opts)
    assert {"configs/base_gpu.toml", "--model.name=bert", "--model.vocab_size=30522",
            "--model.args={mask_token_id = -1}", "--data.dataset=mock"} <= set(ours)
    ours = bench.titanlike_cmd(t5, opts)
    assert {"--model.vocab_size=32128", "--model.args={decoder_multiple = 128}",
            "--data.decoder_seq_length=128"} <= set(ours)
    peer = bench.peer_cmd(t5, opts)
    assert peer[1:6] == [bench.PEER_HF, "--vocab", "32128", "--model", "t5"] and "--decoder-len 128" in " ".join(peer)
    assert bench.peer_cmd(bert, opts)[4:6] == ["--model", "bert"] and "--decoder-len" not in bench.peer_cmd(bert, opts)
    assert bench.peer_cmd(bert, OPTS) is None  # torchtitan's launcher: no BERT
    assert bench.label(t5) == "t5 t5-v1_1-large s512 d128 b8 n1 compile bf16"
    assert bench.tokens_per_step(t5) == bench.tokens_per_step(t5, peer=True) == 8 * 512  # encoder tokens
    import models
    from models.t5.counts import decoder_len
    from peer_hf import encoder_args

    args = encoder_args("t5", "t5-v1_1-large", 32128, 512, 128)
    assert decoder_len(args, 512) == 128 and decoder_len(encoder_args("t5", "t5-v1_1-large", 0, 512), 512) == 104
    assert bench.flops_per_token("t5", "t5-v1_1-large", 512, 32128, 128) == models.get_spec("t5").flops_per_token(
        args, 512) > bench.flops_per_token("t5", "t5-v1_1-large", 512, 32128)
    with pytest.raises(ValueError, match="shorter than the span objective"):
        encoder_args("t5", "t5-v1_1-large", 0, 512, 64)
    with pytest.raises(ValueError, match="dec_seq"):
        bench.expand_matrix({"model": "bert", "dec_seq": "128"})
    assert bench.default_config("t5", "debugmodel") == "configs/t5_debug.toml"


def test_hf_peer_trains_bert_and_t5_on_cpu(capsys):
    """peer_hf.py's BERT (MLM + NSP labels) and T5 steps at the debug shapes, on CPU, print lines benchmark.py parses,
    credited with batch x seq tokens."""
    pytest.importorskip("transformers")
    import torch

    import models
    from peer_hf import encoder_args, encoder_step, timed_loop

    for name, dec in (("bert", 0), ("t5", 16)):
        a = Namespace(seq=32, batch=2, steps=2, log_freq=1, ac="none", compile=False)
        args = encoder_args(name, "debugmodel", 2148, 32, dec)
        model, step_fn = encoder_step(name, args, a, "cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        timed_loop(step_fn, model, opt, a, 64, models.get_spec(name).flops_per_token(args, 32), "cpu")
        rows = bench.parse_peer(capsys.readouterr().out)
        assert [r["step"] for r in rows] == [1, 2] and all(r["tps"] > 0 and r["loss"] > 0 for r in rows)


def test_dpo_is_compared_in_pairs_per_second():
    """titanlike's pairs/s comes from its DPO step lines; the TRL peer's is its batch of pairs over its step time (from
    its tok/s over 2·batch·seq tokens); the DPO ratio is theirs, the SFT ratio stays tok/s scaled by the pack fill."""
    (dpo,) = bench.expand_matrix({"post": "dpo", "seq": "2048", "batch": "2"})
    lines = []
    for step, (pairs, tps) in enumerate([(1.0, 100.0), (30.0, 9000.0), (32.0, 9500.0), (31.0, 9400.0)], start=1):
        m = {"loss": 0.69, "grad_norm": 1.0, "lr": 1e-6, "dpo/reward_accuracy": 0.5, "dpo/reward_margin": 0.01,
             "throughput/pairs_per_sec": pairs, "throughput/tokens_per_sec_per_device": tps,
             "throughput/mfu_pct": 40.0, "memory/peak_reserved_gib": 30.0, "memory/peak_reserved_pct": 40}
        lines.append("12:00:00 INFO " + MetricsLogger.format_line(step, m))
    rows = bench.parse_ours("\n".join(lines))
    assert [r["pairs_s"] for r in rows] == [1.0, 30.0, 32.0, 31.0] and rows[1]["tps"] == 9000.0
    ours = bench.summarize(rows, 1, bench.tokens_per_step(dpo), None)
    assert ours["pairs_s"] == 31.0 and ours["step_ms"] == pytest.approx(1000 * 2 * 2048 / 9400)
    assert "pairs_s" not in bench.summarize(bench.parse_ours(lines[0].replace("pairs/s", "x")), 0, 1, None)

    peer_lines = "\n".join(f"step: {s} loss: 0.69 memory: 40.00GiB tps: {tps:,} tflops: 1.0 mfu: 10.00%"
                           for s, tps in [(1, 1000), (2, 40960), (3, 40960)])  # 2·2·2048 tokens in 0.2 s
    peer_tokens = bench.tokens_per_step(dpo, peer=True)
    theirs = bench.summarize(bench.parse_peer(peer_lines), 1, peer_tokens, None, pairs_per_step=2)
    assert theirs["step_ms"] == pytest.approx(200.0) and theirs["pairs_s"] == pytest.approx(10.0)
    assert bench.post_training_ratio(dpo, ours, theirs) == {"ratio": pytest.approx(3.1)}
    (sft,) = bench.expand_matrix({"post": "sft"})
    assert bench.post_training_ratio(sft, {"tps": 900.0, "pack_fill": 0.9}, {"tps": 810.0}) == {"ratio": 1.0}
    assert bench.post_training_ratio(dpo, {"tps": 1.0}, theirs) == {}  # (no pairs/s: no DPO ratio)
    table = bench.format_table([{"label": bench.label(dpo), "titanlike": ours, "peer": theirs, "ratio": 3.1}])
    assert "pairs/s" in table.splitlines()[0] and "31.00" in table and "10.00" in table


def test_post_training_data_is_deterministic_and_loads_in_transformers(tmp_path):
    """The benchmark inputs: the same files from two writes; the tokenizer folder loads in AutoTokenizer with its
    {% generation %} template, and transformers' assistant masks equal titanlike's on every conversation."""
    transformers = pytest.importorskip("transformers")
    import post_training_data as ptd
    from titanlike.data.chat import load_chat_template, render_with_masks
    from titanlike.data.tokenizers.hf import HFTokenizer

    a, b = (ptd.ensure(str(tmp_path / n), conversations_n=12, pairs_n=6) for n in "ab")
    for name in ("chat.jsonl", "pairs.jsonl", "tokenizer/tokenizer.json", "tokenizer/chat_template.jinja"):
        assert (Path(a) / name).read_bytes() == (Path(b) / name).read_bytes(), name
    hf = transformers.AutoTokenizer.from_pretrained(f"{a}/tokenizer")
    assert "{% generation %}" in hf.chat_template and len(hf.encode("<|im_end|>", add_special_tokens=False)) == 1
    tok = HFTokenizer(f"{a}/tokenizer/tokenizer.json")
    template = load_chat_template(Namespace(chat_template=""), tok)
    rows = [json.loads(line) for line in open(f"{a}/chat.jsonl")]
    assert len(rows) == 12 and all(r["messages"][1]["role"] == "assistant" for r in rows)
    for r in rows:
        out = hf.apply_chat_template(r["messages"], return_dict=True, return_assistant_tokens_mask=True)
        assert (out["input_ids"], out["assistant_masks"]) == tuple(render_with_masks(template, r["messages"], tok))
    pairs = [json.loads(line) for line in open(f"{a}/pairs.jsonl")]
    assert len(pairs) == 6 and all(p["chosen"] != p["rejected"] for p in pairs)
    assert ptd.ensure(a) == a  # present: kept as it is


def test_trl_peer_packing_is_document_masked_under_sdpa():
    """The TRL peer's padding-free packing (no attention mask, position ids restarting per conversation) gives each
    conversation the logits it has alone under SDPA, as titanlike's document masking: the two sides compute the same."""
    pytest.importorskip("transformers")
    import torch

    import models
    from peer_trl import build_model

    spec = models.get_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], vocab_size=300)
    model = build_model(spec, args, 64, "cpu").float()
    a, b = torch.randint(0, 300, (1, 20)), torch.randint(0, 300, (1, 30))
    pos = torch.cat([torch.arange(20), torch.arange(30)])[None]
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=pos).logits
        alone = torch.cat([model(input_ids=a).logits, model(input_ids=b).logits], 1)
    assert (packed - alone).abs().max() < 1e-4


def test_parse_and_summarize_logs():
    lines = []
    for step, tps in enumerate([100.0, 900.0, 1000.0, 1100.0, 1000.0], start=1):
        m = {"loss": 10.0 - step, "grad_norm": 1.0, "lr": 1e-4, "throughput/tokens_per_sec_per_device": tps,
             "throughput/mfu_pct": tps / 20, "memory/peak_reserved_gib": 30.0 + step, "memory/peak_reserved_pct": 40}
        lines.append("12:00:00 INFO " + MetricsLogger.format_line(step, m))
    rows = bench.parse_ours("\n".join(lines))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[0]["mfu"] == 5.0 and rows[4]["mem"] == 35.0
    s = bench.summarize(rows, warmup=1, tokens_per_step=1000, flops_per_token=2e9)
    assert s["tps"] == 1000.0 and s["mfu"] == 50.0 and s["steps_measured"] == 4
    assert s["tflops"] == pytest.approx(2.0) and s["first_step_s"] == pytest.approx(10.0)
    assert s["step_ms"] == pytest.approx(1000.0) and 0 < s["spread_pct"] < 25
    assert (s["loss_first"], s["loss_last"]) == (9.0, 5.0)

    peer_line = ("\x1b[31mstep:  7  \x1b[32mloss: 9.14030  \x1b[38;2;180;60;0mgrad_norm:  1.2345  \x1b[36mmemory: "
                 "35.01GiB(44.27%)  \x1b[34mtps: 49,602  \x1b[36mtflops: 448.05  \x1b[35mmfu: 45.30%\x1b[39m")
    (row,) = bench.parse_peer(peer_line)
    assert row == {"step": 7, "loss": 9.1403, "mem": 35.01, "tps": 49602.0, "tflops": 448.05, "mfu": 45.3}
    table = bench.format_table([{"label": "1B s4096", "titanlike": s, "peer": bench.summarize([row], 0, 1000, None),
                                 "ratio": 1000 / 49602}])
    assert "tok/s/dev" in table and "49,602" in table and "0.020" in table


@pytest.mark.slow
def test_tiny_cpu_run_with_stand_in_peer(tmp_path):
    """Two real titanlike runs (bf16 vs float8 tensorwise) of the debug model on CPU, a fake peer printing
    torchtitan-style lines, the JSON and the ratio."""
    peer = tmp_path / "peer.sh"
    peer.write_text("#!/bin/bash\nfor s in 1 2 3 4; do echo \"step: $s  loss: 5.0  grad_norm: 1.0  "
                    "memory: 1.00GiB(1.00%)  tps: 500  tflops: 0.01  mfu: 0.10%\"; done\n")
    out = tmp_path / "bench.json"
    res = bench.main(["--config", "configs/debug_model.toml", "--flavor", "debugmodel", "--vocab", "256",
                      "--data", "mock", "--seq", "8", "--batch", "1", "--steps", "4", "--warmup", "1",
                      "--float8", "none,tensorwise", "--peer", str(peer), "--dump-folder", str(tmp_path / "runs"),
                      "--out", str(out), "--", "--training.device=cpu"])
    saved = json.loads(out.read_text())
    assert saved["results"] == json.loads(json.dumps(res["results"]))
    assert [r["case"]["float8"] for r in saved["results"]] == ["none", "tensorwise"]
    for r in saved["results"]:
        ours = r["titanlike"]
        assert ours["rc"] == 0 and ours["tps"] > 0 and ours["steps_measured"] == 3 and ours["tflops"] > 0
        assert ours["first_step_s"] > 0 and "spread_pct" in ours and ours["mem"] > 0
        assert r["peer"]["tps"] == 500 and r["ratio"] == pytest.approx(ours["tps"] / 500)
        assert [step for step, _ in ours["loss_curve"]] == [1, 2, 3, 4]
    # float8 vs its bf16 twin: same data and seed, so the curves agree closely even on this tiny model
    assert saved["results"][1]["loss_vs_bf16"]["max_rel"] < 0.01 and "loss_vs_bf16" not in saved["results"][0]


def _load_peer_launcher():
    spec = importlib.util.spec_from_file_location("peer_torchtitan", ROOT / "scripts" / "bench" / "peer_torchtitan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_peer_launcher_prepares_offline_inputs(tmp_path):
    """The launcher's tokenizer and corpus, written without torchtitan (absent here, as on any CPU machine)."""
    tokenizers = pytest.importorskip("tokenizers")
    before = {m for m in sys.modules if m.split(".")[0] == "torchtitan"}
    peer = _load_peer_launcher()
    peer.main(["--work", str(tmp_path), "--docs", "3", "--words-per-doc", "20", "--prepare-only"])
    assert {m for m in sys.modules if m.split(".")[0] == "torchtitan"} == before  # torchtitan only when it runs

    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert tok.token_to_id(config["bos_token"]) == 0 and tok.token_to_id(config["eos_token"]) == 1
    docs = [json.loads(line) for line in (tmp_path / "data" / "train.json").read_text().splitlines()]
    assert len(docs) == 3 and all(len(d["text"].split()) == 20 for d in docs)
    ids = tok.encode(docs[0]["text"]).ids
    assert len(ids) == 20 and all(3 <= i < 3 + peer.N_WORDS for i in ids)  # every word known: no <unk> (id 2)

    # Same parameters: the finished inputs are kept (each benchmark case and rank would otherwise redo them).
    stamp = tmp_path / "prepared.json"
    mtime = stamp.stat().st_mtime_ns
    peer.prepare_inputs(str(tmp_path), docs=3, words_per_doc=20)
    assert stamp.stat().st_mtime_ns == mtime
    assert peer.split_argv(["--work", "w", "--", "--model.flavor", "1B", "--", "x"]) == (
        ["--work", "w"], ["--model.flavor", "1B", "--", "x"])
    flags = peer.input_flags({"tokenizer": "T", "data": "D"})
    assert flags == ["--model.hf_assets_path", "T", "--training.dataset", "c4_test", "--training.dataset_path", "D"]


def test_peer_auto_is_the_in_repo_launcher(monkeypatch):
    launcher = ROOT / "scripts" / "bench" / "peer_torchtitan.sh"
    assert bench.resolve_peer("auto") == str(launcher) and launcher.is_file()
    assert bench.resolve_peer("") == "" and bench.resolve_peer("other/peer.sh") == "other/peer.sh"
    (case,) = bench.expand_matrix({"flavor": "1B", "compile": "on"})
    opts = Namespace(**{**vars(OPTS), "peer": bench.resolve_peer("auto")})
    assert bench.peer_cmd(case, opts) == [
        "bash", str(launcher), "1B", "--training.seq_len", "4096", "--training.local_batch_size", "2",
        "--training.steps", "10", "--metrics.log_freq", "1", "--activation_checkpoint.mode", "none",
        "--activation_checkpoint.selective_ac_option", str(case["ac_option"]), "--compile.enable"]

    # main() hands the resolved path on: capture the commands instead of running them (FLOP counts are not the point)
    ran = []
    monkeypatch.setattr(bench, "flops_per_token", lambda model, flavor, seq, vocab, dec_seq=0: None)
    monkeypatch.setattr(bench, "run", lambda cmd, env, log, timeout: ran.append((cmd, env.get("NPROC"))) or ("", 0, 0))
    bench.main(["--flavor", "debugmodel", "--vocab", "256", "--steps", "3", "--peer", "auto"])
    (ours, _), (peer_run, nproc) = ran
    assert "scripts/train.py" in ours and peer_run[:3] == ["bash", str(launcher), "debugmodel"] and nproc == "1"


def test_peer_shell_entry_with_stand_in_torchrun(tmp_path):
    """The shell entry's torchrun command line (defaults first, caller's flags last) and its output filter."""
    fake = tmp_path / "torchrun"
    fake.write_text('#!/bin/bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\necho "[titan] INFO building the model"\n'
                    'for s in 1 2; do echo "step:  $s  loss: 9.0  memory: 1.00GiB(1%)  tps: 1,000  mfu: 1.00%"; done\n'
                    'for i in $(seq 60); do echo "RuntimeError: rank failed $i" >&2; done\nexit 3\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "NPROC": "2", "MODEL": "qwen3"}
    p = subprocess.run(["bash", str(ROOT / "scripts" / "bench" / "peer_torchtitan.sh"), "30B-A3B_4L",
                        "--training.seq_len", "2048"], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 3  # torchrun's status, not the filter's
    args = (tmp_path / "args").read_text().split()
    assert args[:3] == ["--standalone", "--nproc_per_node", "2"]
    assert args[3] == str(ROOT / "scripts" / "bench" / "peer_torchtitan.py")
    assert args[4:7] == ["--work", os.path.join(os.environ.get("TMPDIR", "/tmp"), "ttwork"), "--"]  # $TMPDIR/ttwork
    tt = " ".join(args[7:])
    out_dir = os.path.join(os.environ.get("TMPDIR", "/tmp"), "ttout")
    assert tt.startswith("--model.name qwen3 --model.flavor 30B-A3B_4L --training.local_batch_size 2 "
                         "--training.seq_len 4096 --training.steps 15 --lr_scheduler.warmup_steps 2 "
                         f"--metrics.log_freq 1 --job.dump_folder {out_dir}") and tt.endswith("--training.seq_len 2048")
    lines = p.stdout.splitlines()
    assert [r["step"] for r in bench.parse_peer(p.stdout)] == [1, 2] and "building" not in p.stdout
    assert len(lines) == 2 + 40 and lines[-1] == "RuntimeError: rank failed 40"


def test_fetch_wheels_script_documents_itself_and_refuses_unknown_arguments():
    script = Path(__file__).resolve().parents[2] / "scripts/bench/fetch_wheels.sh"
    ok = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "--peer" in ok.stdout and "/tmp/site" in ok.stdout
    bad = subprocess.run(["bash", str(script), "--pear"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "fetch_wheels.sh: unknown argument '--pear' (use --peer and/or --extra NAME==VERSION ...)"]


def test_vit_and_llava_cases_count_images_and_decoder_tokens(tmp_path):
    """--model vit / llava: titanlike's row length, config, data flags; the unit per step (images, decoder tokens),
    the FLOPs per unit, its tok/s scaled to that unit; the peers' commands (timm, transformers)."""
    import dataclasses

    import models
    from models.vit import flops_per_image

    opts = Namespace(**{**vars(OPTS), "data": "stdlib", "vocab": 0, "peer": bench.PEER_TIMM})
    (vit,) = bench.expand_matrix({"model": "vit", "flavor": "L/16", "batch": "256", "compile": "on"})
    ours = bench.titanlike_cmd(vit, opts)
    assert {"configs/vit_l16.toml", "--training.seq_len=150528", "--data.dataset=mock",
            "--model.vocab_size=256"} <= set(ours)
    assert bench.tokens_per_step(vit) == 256 and bench.label(vit) == "vit L/16 b256 n1 compile bf16"
    assert bench.flops_per_unit(vit, 256) == flops_per_image(models.get_spec("vit").flavors["L/16"])
    assert bench.peer_cmd(vit, opts)[1:3] == [bench.PEER_TIMM, "L/16"]
    m = {"loss": 6.9, "throughput/tokens_per_sec_per_device": 301056, "throughput/mfu_pct": 40.0,
         "memory/peak_reserved_gib": 60.0, "memory/peak_reserved_pct": 75, "data/wait_pct": 2.5}
    rows = bench.parse_ours(MetricsLogger.format_line(3, m))  # the loader's share of the wall time: last
    assert rows[0]["data_pct"] == 2.5 and bench.vision.scale_ours(rows, vit)[0]["tps"] == 2.0  # images/s

    hf = Namespace(**{**vars(opts), "peer": bench.PEER_HF})
    (llava,) = bench.expand_matrix({"model": "llava", "flavor": "1B-siglip", "seq": "4096", "images": "4"})
    ours = bench.titanlike_cmd(llava, hf)
    assert {"configs/llava_1b.toml", "--training.seq_len=1773568", "--data.dataset=mock_image_text",
            "--data.images_per_row=4", "--data.image_size=384", "--data.image_tokens=729",
            "--model.args={images_per_row = 4}", "--model.vocab_size=128256"} <= set(ours)
    assert bench.tokens_per_step(llava) == 2 * 4096 and "i4" in bench.label(llava)
    spec = models.get_spec("llava")
    args = dataclasses.replace(spec.flavors["1B-siglip"], images_per_row=4, vocab_size=128256)
    text = models.get_spec("llama3").flops_per_token(args.text_args, 4096)
    from models.llava import flops_per_image as llava_image

    assert bench.flops_per_unit(llava, 128256) == pytest.approx(text + 4 * llava_image(args) / 4096)
    assert bench.peer_cmd(llava, hf)[2:9] == ["--vocab", "128256", "--model", "llava", "--images", "4", "1B-siglip"]
    assert bench.peer_cmd(llava, opts) is None and bench.peer_cmd(vit, hf) is None  # each family its own peer
    # --data jpeg with --images K: K-image JPEG shards (KEY.0.jpg, ...), K slots a row
    (small,) = bench.expand_matrix({"model": "llava", "flavor": "debug-siglip", "seq": "48", "images": "2"})
    jpeg = Namespace(**{**vars(hf), "data": "jpeg", "image_data": str(tmp_path / "img")})
    ours = bench.titanlike_cmd(small, jpeg)
    side = spec.flavors["debug-siglip"].vision.image_size
    paths = sorted((tmp_path / "img" / f"jpeg{side}x2").glob("*.tar"))
    assert {"--data.dataset=webdataset", f"--data.paths={paths[0].parent}/shapes{side}-train-*.tar",
            "--data.images_per_row=2", "--data.wds_target=txt", "--model.args={images_per_row = 2}"} <= set(ours)
    import tarfile

    with tarfile.open(paths[0]) as tar:
        assert tar.getnames()[:4] == ["000000.0.jpg", "000000.1.jpg", "000000.cls", "000000.txt"]
    with pytest.raises(ValueError, match="llava's images per row"):
        bench.expand_matrix({"model": "vit", "images": "2"})


def _vision_run(tmp_path, model: str, flavor: str, peer: str, *extra: str) -> dict:
    res = bench.main(["--model", model, "--flavor", flavor, "--batch", "2", "--steps", "3", "--warmup", "1",
                      "--peer", peer, "--dump-folder", str(tmp_path / "runs"), "--image-data", str(tmp_path / "img"),
                      *extra, "--", "--training.device=cpu"])
    (r,) = res["results"]
    for who in ("titanlike", "peer"):
        assert r[who]["rc"] == 0 and r[who]["tps"] > 0 and r[who]["steps_measured"] == 2, (who, r[who])
    assert r["titanlike"]["data_pct"] >= 0 and r["ratio"] > 0
    return r


@pytest.mark.slow
def test_vit_against_timm_end_to_end_on_cpu(tmp_path):
    """benchmark.py --model vit --peer timm at the debug shape: both sides' lines parse, images/s on both; titanlike
    decodes JPEG shards (--data jpeg, written on the fly)."""
    pytest.importorskip("timm", reason="timm is not installed here (the GPU machine has it)")
    r = _vision_run(tmp_path, "vit", "debugmodel", "timm", "--data", "jpeg")
    assert r["titanlike"]["tps"] < 1e4  # images, not pixel values


@pytest.mark.slow
def test_llava_against_transformers_end_to_end_on_cpu(tmp_path):
    """benchmark.py --model llava --peer hf at the debug SigLIP shape with 2 images per row (mock rows): both sides'
    lines parse, decoder tokens/s on both."""
    pytest.importorskip("transformers")
    r = _vision_run(tmp_path, "llava", "debug-siglip", "hf", "--seq", "48", "--images", "2", "--vocab", "64")
    assert r["flops_per_token"] > 0 and r["titanlike"]["tflops"] > 0


def test_a_run_killed_from_outside_names_itself_and_keeps_its_log(tmp_path):
    """An outer `timeout` stopping the benchmark mid-run: the command was printed when the run started, the run's
    output so far is printed and kept in its --log file (written as the run goes), and the run's process is gone."""
    import signal
    import time

    log, pid_file = tmp_path / "case.0.titanlike.log", tmp_path / "child.pid"
    child = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
             "print('step 1 loss 9.0', flush=True); time.sleep(120)")
    driver = (f"import signal, sys; sys.path.insert(0, {str(ROOT / 'scripts' / 'bench')!r}); import bench_proc; "
              "[signal.signal(s, bench_proc.stop_runs) for s in (signal.SIGTERM, signal.SIGINT)]; "
              f"bench_proc.run([sys.executable, '-c', {child!r}], {{}}, {str(log)!r}, None)")
    p = subprocess.Popen([sys.executable, "-c", driver], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 60
    while not (log.exists() and "step 1" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert out.startswith("$ ") and "stopped by signal 15 during the run above" in out and "step 1 loss 9.0" in out
    assert "step 1 loss 9.0" in log.read_text()
    child_pid = int(pid_file.read_text())
    time.sleep(0.2)
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_only_one_side_runs_with_the_shared_flags(tmp_path, capsys):
    """--only peer: the peer alone, with the command line both sides would get (its vocabulary included), no ratio;
    --only peer without --peer is refused in one line."""
    peer = tmp_path / "peer.sh"
    peer.write_text("#!/bin/bash\necho \"$@\" > \"$(dirname \"$0\")/args.txt\"\nfor s in 1 2 3; do echo \"step: $s  "
                    "loss: 5.0  grad_norm: 1.0  memory: 1.00GiB(1.00%)  tps: 500  tflops: 0.01  mfu: 0.10%\"; done\n")
    res = bench.main(["--flavor", "debugmodel", "--vocab", "256", "--data", "mock", "--seq", "8", "--batch", "1",
                      "--steps", "3", "--warmup", "1", "--peer", str(peer), "--only", "peer",
                      "--dump-folder", str(tmp_path / "runs")])
    (r,) = res["results"]
    assert "titanlike" not in r and "ratio" not in r and r["peer"]["tps"] == 500 and r["peer"]["rc"] == 0
    assert "debugmodel" in (tmp_path / "args.txt").read_text()
    table = capsys.readouterr().out
    assert any(line.startswith(r["label"]) and "peer" in line for line in table.splitlines())
    with pytest.raises(SystemExit):
        bench.main(["--flavor", "debugmodel", "--only", "peer"])
    assert "--only peer needs --peer" in capsys.readouterr().err


def test_each_side_compiles_cold_in_its_own_caches_and_warm_reruns_on_them(tmp_path, monkeypatch):
    """--compile-cache fresh (the default): a run's Inductor/Triton caches are its own folder under the dump folder,
    emptied before the cold run (a second benchmark starts cold again) and kept for the --warm rerun; shared: torch's
    own caches (the benchmark sets none)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    peer = tmp_path / "peer.sh"
    peer.write_text("#!/bin/bash\nd=\"$TORCHINDUCTOR_CACHE_DIR\"; here=\"$(dirname \"$0\")\"\n"
                    "echo \"dir=$d seen=$( [ -n \"$d\" ] && ls \"$d\" 2>/dev/null | tr '\\n' ,)\" \\\n"
                    "  >> \"$here/runs.txt\"\n"
                    "case $d in */compile_caches/*) mkdir -p \"$d\" && touch \"$d/compiled\";; esac\n"
                    "for s in 1 2 3; do echo \"step: $s  loss: 5.0  grad_norm: 1.0  memory: 1.00GiB(1.00%)  tps: 500  "
                    "tflops: 0.01  mfu: 0.10%\"; done\n")
    common = ["--flavor", "debugmodel", "--vocab", "256", "--data", "mock", "--seq", "8", "--batch", "1", "--steps",
              "3", "--warmup", "1", "--peer", str(peer), "--only", "peer", "--dump-folder", str(tmp_path / "runs")]
    bench.main(common + ["--warm"])
    bench.main(common)
    bench.main(common + ["--compile-cache", "shared"])
    runs = (tmp_path / "runs.txt").read_text().splitlines()
    cold, warm, again, shared = runs
    folder = str(tmp_path / "runs" / "compile_caches")
    assert cold.startswith(f"dir={folder}/") and cold.endswith("/peer/inductor seen="), cold
    assert warm == cold.replace("seen=", "seen=compiled,"), (cold, warm)  # the rerun found what the cold run left
    assert again == cold, again  # emptied again for the next cold run
    assert folder not in shared, shared  # whatever this process has (torch's default)
