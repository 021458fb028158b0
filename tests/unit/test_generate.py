"""Generation with the KV cache (titanlike/infer, models/common/kv_cache.py; a family's own cache:
test_generate_cache.py), for every family: greedy tokens equal transformers' generate on the same weights (fp32,
CPU), cached decode logits equal a full forward, a left-padded batch equals each prompt alone, seeded sampling, stop
sequences, loading a real training run's DCP checkpoint, and the one-line errors of scripts/generate.py."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import models
from tests.launch import REPO_ROOT
from titanlike.infer import generate, load_for_inference
from titanlike.infer.generate import step_at
from titanlike.infer.load import build_model

transformers = pytest.importorskip("transformers")

SCRIPT = str(REPO_ROOT / "scripts/generate.py")
# (family, flavor to shrink): every family of the registry, the MoE variants where a family has both.
FAMILIES = [("llama3", "debugmodel"), ("gpt", "debugmodel_untied"), ("qwen3", "debugmodel_moe"),
            ("mixtral", "debugmodel"), ("deepseek_v3", "debugmodel"), ("nemotron_h", "debugmodel"),
            ("mamba2", "debugmodel")]
FAMILIES += [("qwen3_next", "debugmodel")]  # 4 layers: three Gated DeltaNet (their own cache state), one attention
FAMILIES += [("nemotron_h", "debugmodel_moe")]  # "ME*E": MoE layers carry no state between forwards
# Cached decode vs full forward, fp32: the same math in another order (masked SDPA over the cache, MLA's absorbed
# wkv_b), so equal to float rounding.
LOGITS_ATOL = 1e-4


# Families titanlike.infer does not generate with, and why; a new family must land in one list or the other.
NOT_HERE = {"bert": "an encoder: nothing to generate", "vit": "an image classifier",
            "llava": "images in the prompt: tests/unit/test_llava_generate.py (pixels at the prefill, HF's generate)",
            "t5": "an encoder-decoder: models/t5/generate.py, held to transformers' generate in test_t5.py"}


def test_every_family_is_covered():
    assert sorted({f for f, _ in FAMILIES} | set(NOT_HERE)) == sorted(models.MODELS)


def tiny(family: str, flavor: str, seed: int = 0) -> torch.nn.Module:
    spec = models.get_spec(family)
    kw = dict(dim=64, n_layers=2, vocab_size=128, max_seq_len=64)
    if family == "qwen3":
        kw["head_dim"] = 16
    if family in ("nemotron_h", "qwen3_next"):  # its pattern's depth ("M*M-"); qwen3_next: layer 4 attends
        kw["n_layers"] = 4
    args = dataclasses.replace(spec.flavors[flavor], **kw)
    torch.manual_seed(seed)
    model = build_model(spec, args, torch.device("cpu"), torch.float32)
    if family == "gpt":  # GPT's 0.02-std embedding makes a random model repeat one token: widen it
        with torch.no_grad():
            model.tok_embeddings.weight.normal_(std=1.0)
            model.pos_embeddings.weight.normal_(std=1.0)
    return model


def to_hf_folder(model, path) -> str:
    """Save `model` as the HF folder its family's adapter describes (what scripts/convert_hf.py export writes)."""
    spec = models.get_spec(next(n for n, s in models.MODELS.items() if isinstance(model, s.model_cls)))
    cfg = spec.hf.hf_config(model.args, torch.float32)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    hf = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    hf.load_state_dict(spec.hf.to_hf(model.state_dict(), model.args), strict=False)
    hf.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("family,flavor", FAMILIES)
def test_greedy_matches_transformers_generate(family, flavor, tmp_path):
    folder = to_hf_folder(tiny(family, flavor), tmp_path / "hf")
    ours = load_for_inference(folder)  # the HF folder path of the loader, too
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    prompts = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    want = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=12, do_sample=False,
                       eos_token_id=None, pad_token_id=0)[:, 7:].tolist()
    got = generate(ours.model, prompts.tolist(), max_new_tokens=12)
    assert got == want
    # a model stuck on one token would prove little (a tiny random model may fall into a short loop on one prompt:
    # torch 2.11's initial weights loop mixtral's first prompt on two tokens, the second prompt varies)
    assert max(len(set(row)) for row in got) > 3, got


@pytest.mark.parametrize("family,flavor", FAMILIES)
def test_cached_decode_logits_equal_full_forward(family, flavor):
    model = tiny(family, flavor)
    seq = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(2))
    prompt, total = 8, seq.shape[1]
    with torch.no_grad():
        want = model(seq)
        for static in (False, True):  # eager (attend over the slots in use) and compiled-style (all slots, masked)
            cache = models.get_spec(family).cache(model, 2, total)  # the family's declared cache: K/V
            valid = torch.ones(2, total, dtype=torch.bool)
            pos = torch.arange(total).expand(2, total)
            got = []
            with cache.attached(model):
                cache.set_step(step_at(valid, 0, prompt, prompt))
                got.append(model(seq[:, :prompt], positions=pos[:, :prompt]))
                for i in range(prompt, total):
                    n = None if static else i + 1
                    cache.set_step(step_at(valid, i, 1, n))
                    got.append(model(seq[:, i:i + 1], positions=pos[:, i:i + 1]))
            err = (torch.cat(got, dim=1) - want).abs().max().item()
            assert err <= LOGITS_ATOL, (static, err)
    assert not any(getattr(m, "kv_cache", None) for m in model.modules())  # detached again


@pytest.mark.parametrize("family,flavor", FAMILIES)
def test_left_padded_batch_equals_each_prompt_alone(family, flavor):
    model = tiny(family, flavor)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (9, 3, 6)]
    batch = generate(model, prompts, max_new_tokens=10)
    assert batch == [generate(model, [p], max_new_tokens=10)[0] for p in prompts]


def test_sampling_seeded_top_k_1_and_top_p():
    model = tiny("llama3", "debugmodel")
    prompts = [[5, 6, 7], [9, 10]]
    sample = dict(max_new_tokens=16, temperature=1.0)
    a = generate(model, prompts, seed=0, **sample)
    assert a == generate(model, prompts, seed=0, **sample)
    assert a != generate(model, prompts, seed=1, **sample)
    greedy = generate(model, prompts, max_new_tokens=16)
    assert a != greedy
    assert generate(model, prompts, seed=4, top_k=1, **sample) == greedy
    assert generate(model, prompts, seed=4, top_p=1e-6, **sample) == greedy  # the nucleus keeps the best token
    assert generate(model, prompts, seed=0, top_k=5, top_p=0.9, **sample) != greedy


def test_eos_stop_sequences_and_streaming():
    model = tiny("llama3", "debugmodel")
    prompts = [[5, 6, 7], [9, 10]]
    full = generate(model, prompts, max_new_tokens=12)
    eos = full[0][4]
    stop = [full[1][3:5]]
    streamed: list[list[int]] = [[], []]
    got = generate(model, prompts, max_new_tokens=12, eos_id=[eos], stop=stop,
                   on_token=lambda row, t: streamed[row].append(t))
    cut0 = full[0].index(eos)
    assert got[0] == full[0][:cut0]
    assert got[1] == full[1][:3] or (eos in full[1] and got[1] == full[1][:full[1].index(eos)])
    assert streamed == got
    with pytest.raises(ValueError, match="context of 64 tokens"):
        generate(model, [[1] * 60], max_new_tokens=5)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, prompts, max_new_tokens=2, top_p=0)


# ------------------------------------------------------------------------------------- a real run and the script
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """Two steps of the embedded default (Llama-shaped debug model, builtin tokenizer) with checkpoints on."""
    root = tmp_path_factory.mktemp("run")
    p = subprocess.run([sys.executable, str(REPO_ROOT / "scripts/train.py"), "--training.steps=2",
                        "--training.seq_len=32", "--training.local_batch_size=2", "--training.device=cpu",
                        "--checkpoint.enable", "--checkpoint.interval=2", "--metrics.enable_tensorboard=false",
                        f"--job.dump_folder={root}", "--job.run_name=tiny"], cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return root / "tiny"


def test_training_checkpoint_loads_and_generates(trained_run):
    loaded = load_for_inference(str(trained_run))  # the run folder: its checkpoint/ folder, newest step
    assert loaded.step == 2 and loaded.tokenizer is not None and loaded.max_seq_len == 32
    assert not loaded.model.training and loaded.stop_ids == [loaded.tokenizer.eos_id]
    prompt = loaded.tokenizer.encode("def f(x):", bos=True)
    out = generate(loaded.model, [prompt], max_new_tokens=8)[0]
    assert len(out) <= 8 and all(0 <= t < loaded.args.vocab_size for t in out)
    again = load_for_inference(str(trained_run / "checkpoint" / "step-2"), dtype=torch.bfloat16)
    assert next(again.model.parameters()).dtype == torch.bfloat16


def _load_script():
    spec = importlib.util.spec_from_file_location("generate_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_script_equals_transformers_on_the_export(trained_run, tmp_path, capsys):
    """The run trained without BOS (data.add_bos=false): generate.py encodes a prompt as transformers' tokenizer does on
    the HF export of the same step, so its greedy tokens equal transformers' generate; it says which step it loaded."""
    from titanlike.checkpoint.hf import export_hf

    out = export_hf(str(trained_run), str(tmp_path / "hf"), dtype="float32", progress=False)  # a run folder
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    prompt = "def main():"
    ids = tok(prompt)["input_ids"]
    loaded = load_for_inference(str(trained_run))
    assert not loaded.add_bos and loaded.encode(prompt) == ids
    want = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                       max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    assert generate(loaded.model, [ids], max_new_tokens=8) == [want]
    assert _load_script().main([str(trained_run), "--prompt", prompt, "--max-new-tokens", "8"]) == 0
    printed = capsys.readouterr()
    new = generate(loaded.model, [ids], max_new_tokens=8, eos_id=loaded.stop_ids)[0]
    assert printed.out == prompt + loaded.tokenizer.decode(new) + "\n"
    assert printed.err.strip().splitlines()[-1] == f"loaded step 2 from {trained_run / 'checkpoint' / 'step-2'}"


def _script(*args, timeout=120):
    return subprocess.run([sys.executable, SCRIPT, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_script_streams_text(trained_run):
    p = _script(str(trained_run), "--prompt", "import os", "--max-new-tokens", "6", "--temperature", "0.7",
                "--seed", "1")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("import os"), p.stdout


def test_script_bad_input_is_one_line(trained_run, tmp_path, capsys):
    step = trained_run / "checkpoint" / "step-2"
    other = tmp_path / "other" / "step-2"
    other.parent.mkdir()
    subprocess.run(["cp", "-r", str(step), str(other)], check=True)
    meta = (other / "meta.json").read_text()  # same size: the step still passes its size check
    (other / "meta.json").write_text(meta.replace(json.dumps(models.DEFAULT_MODEL), '"nope00"'))
    corrupt = tmp_path / "corrupt" / "step-2"
    corrupt.parent.mkdir()
    subprocess.run(["cp", "-r", str(step), str(corrupt)], check=True)
    shard = next(f for f in os.listdir(corrupt) if f.endswith(".distcp"))
    with open(corrupt / shard, "r+b") as f:
        f.truncate(10)
    cases = [
        ([str(tmp_path / "missing"), "--prompt", "x"], "does not exist"),
        ([str(other.parent), "--prompt", "x"], "unknown model.name='nope00'"),
        ([str(corrupt.parent), "--prompt", "x"], "damaged"),
        ([str(trained_run), "--prompt", "x " * 40], "context of 32 tokens"),
        ([str(trained_run), "--prompt", "x", "--temperature", "-1"], "--temperature"),
        ([str(trained_run), "--tokens", "1,2,x"], "--tokens"),
    ]
    # main() in this process for each case (a process per case would cost seconds of imports each), the script as a
    # process once: its exit status and that nothing else reaches stderr
    script = _load_script()
    for argv, expect in cases:
        try:
            code = script.main([*argv, "--max-new-tokens", "4"])
        except SystemExit as e:  # argument errors exit from the parser, as in the real script
            code = e.code
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expect in lines[0], (argv, lines)
        assert lines[0].startswith("error: ")
    p = _script(str(corrupt.parent), "--prompt", "x", "--max-new-tokens", "4")
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "damaged" in lines[0] and "Traceback" not in p.stderr, p.stderr


@pytest.mark.slow
def test_compiled_decode_equals_eager():
    model = tiny("deepseek_v3", "debugmodel")
    prompts = [[5, 6, 7, 8], [9, 10]]
    want = generate(model, prompts, max_new_tokens=6)
    assert generate(model, prompts, max_new_tokens=6, compile=True) == want
    assert generate(model, prompts, max_new_tokens=6, compile=True) == want  # the compiled step is reused
