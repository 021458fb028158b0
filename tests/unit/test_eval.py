"""Evaluation (titanlike/eval, scripts/evaluate.py, [eval] in the loop): the lm-evaluation-harness adapter against
log-likelihoods computed by hand from the model's logits, a checkpoint's perplexity against the trainer's validation
loss, and the bad-input lines (the in-loop evaluation on 2 gloo processes against 1:
tests/multiproc/test_dist_eval.py). Local tasks only: nothing is
downloaded (HF_DATASETS_OFFLINE=1)."""
import dataclasses
import importlib.util
import json
import logging
import math
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("lm_eval")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a local task must never reach for the network
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lm_eval.api.instance import Instance  # noqa: E402

import models  # noqa: E402
from tests.launch import REPO_ROOT  # noqa: E402
from titanlike.config import ConfigError, config_from_dict, load_config  # noqa: E402
from titanlike.config.sections import Data  # noqa: E402
from titanlike.data.tokenizers import build_tokenizer  # noqa: E402
from titanlike.eval.harness import TitanlikeLM  # noqa: E402
from titanlike.eval.tasks import flat_metrics, run_tasks  # noqa: E402
from titanlike.train.trainer import Trainer  # noqa: E402

TASKS = REPO_ROOT / "tests" / "unit" / "data" / "eval_tasks"


def _script():
    spec = importlib.util.spec_from_file_location("evaluate_script", REPO_ROOT / "scripts" / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def include_path(tmp_path_factory):
    """The repository's task YAMLs with their data files made absolute (they are relative to the repo root)."""
    folder = tmp_path_factory.mktemp("tasks")
    for y in TASKS.glob("*.yaml"):
        (folder / y.name).write_text(y.read_text().replace("tests/unit/data/eval_tasks/", f"{TASKS}/"))
    return str(folder)


@pytest.fixture(scope="module")
def tiny():
    tok = build_tokenizer(Data())
    spec = models.get_spec(models.DEFAULT_MODEL)
    args = dataclasses.replace(spec.flavor_args("debugmodel"), n_layers=2, dim=64, n_heads=4, n_kv_heads=2,
                               vocab_size=tok.vocab_size, max_seq_len=64)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    return model.eval(), tok


def _logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[:i+1]) for every i, from one plain forward."""
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]])).float()[0], dim=-1)
    return logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)


def _hand_ll(model, tok, context: str, continuation: str) -> float:
    """lm_eval's rule for a pair: trailing spaces of the context move to the continuation, the pair is encoded whole
    and split after the context's own tokens."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    ctx = tok.encode(context)
    whole = tok.encode(context + continuation)
    return _logprobs(model, whole)[len(ctx) - 1:].sum().item()


def test_loglikelihood_multiple_choice_matches_hand_computed(tiny, include_path):
    model, tok = tiny
    lm = TitanlikeLM(model=model, tokenizer=tok, max_length=64, batch_size=4, device="cpu", progress=False)
    results = run_tasks(lm, ["titanlike_tiny_choice"], include_path, log_samples=True)
    samples = sorted(results["samples"]["titanlike_tiny_choice"], key=lambda s: s["doc_id"])
    assert len(samples) == 6
    hits = []
    for s in samples:
        doc = s["doc"]
        hand = [_hand_ll(model, tok, doc["question"], " " + c) for c in doc["choices"]]  # " ": target_delimiter
        got = [float(r[0][0]) for r in s["resps"]]
        assert got == pytest.approx(hand, abs=1e-4)
        hits.append(float(max(range(len(hand)), key=hand.__getitem__) == doc["answer"]))
    assert flat_metrics(results)["titanlike_tiny_choice/acc"] == pytest.approx(sum(hits) / len(hits))


def test_loglikelihood_rolling_is_the_windowed_token_sum(tiny):
    """Texts longer than the context (8) are scored in disjoint windows: tokens [s, e) predicted from the 8 tokens
    before position e of BOS + text (the first window starts at BOS)."""
    model, tok = tiny
    lm = TitanlikeLM(model=model, tokenizer=tok, max_length=8, batch_size=3, device="cpu", progress=False)
    texts = [json.loads(line)["text"] for line in (TASKS / "tiny_text.jsonl").read_text().splitlines()]
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)])
    for text, value in zip(texts, got):
        ids = tok.encode(text)
        full = [lm.prefix_token_id] + ids
        assert len(ids) > 16  # at least three windows
        total = 0.0
        for s in range(0, len(ids), 8):
            e = min(s + 8, len(ids))
            window = full[max(0, e - 8):e + 1]  # input full[e-8:e], targets up to full[e]
            total += _logprobs(model, window)[-(e - s):].sum().item()
        assert value == pytest.approx(total, abs=1e-3)


def test_generate_until_stops_at_until(tiny):
    model, tok = tiny
    lm = TitanlikeLM(model=model, tokenizer=tok, max_length=64, batch_size=2, device="cpu", progress=False)
    prompts = ["def add(a, b):\n    return", "import os\nimport"]
    requests, expected = [], []
    for i, prompt in enumerate(prompts):
        ids = tok.encode(prompt)
        new = []
        for _ in range(8):  # the greedy continuation by hand: full forwards, argmax
            with torch.no_grad():
                nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
            if nxt == lm.eot_token_id:
                break
            new.append(nxt)
        text = tok.decode(new)
        until = text[len(text) // 2:len(text) // 2 + 2]  # a string the greedy text does contain
        assert until and until in text
        expected.append(text.split(until)[0])
        requests.append(Instance("generate_until", {}, (prompt, {"until": [until], "max_gen_toks": 8}), i))
    got = lm.generate_until(requests)
    assert got == expected
    assert all(r["until"][0] not in g for g, r in zip(got, (q.args[1] for q in requests)))


def _tiny_run(tmp_path, **sections):
    base = {"job": {"dump_folder": str(tmp_path), "run_name": "run"},
            "model": {"flavor": "debugmodel", "n_layers": 2},
            "training": {"steps": 2, "seq_len": 32, "local_batch_size": 4, "device": "cpu"},
            "data": {"dataset": "stdlib"}, "lr_scheduler": {"warmup_steps": 1},
            "metrics": {"log_freq": 1, "enable_tensorboard": False}}
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return config_from_dict(base)


def test_checkpoint_perplexity_equals_the_trainers_validation_loss(tmp_path, include_path):
    cfg = _tiny_run(tmp_path, checkpoint={"enable": True, "interval": 2},
                    validation={"enable": True, "interval": 2, "steps": 2})
    trainer = Trainer(cfg)
    seen = []
    log_validation = trainer.metrics.log_validation
    trainer.metrics.log_validation = lambda step, loss: (seen.append(loss), log_validation(step, loss))
    try:
        trainer.train()
    finally:
        trainer.close()
    script, out = _script(), tmp_path / "ppl.json"
    assert script.main(["--perplexity", "--checkpoint", str(tmp_path / "run"), "--data.dataset=stdlib",
                        "--training.seq_len=32", "--training.local_batch_size=4", "--validation.steps=2",
                        "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["perplexity"] == pytest.approx(math.exp(seen[-1]), rel=1e-5)
    assert result["tokens"] == 2 * 4 * 32 and result["step"] == 2
    # The harness on the same checkpoint, built from --model_args-style arguments (checkpoint=..., device=...)
    out = tmp_path / "tasks.json"
    assert script.main(["--tasks", "titanlike_tiny_choice", "--checkpoint", str(tmp_path / "run"),
                        "--include-path", include_path, "--limit", "3", "--output", str(out)]) == 0
    metrics = json.loads(out.read_text())["metrics"]
    assert 0.0 <= metrics["titanlike_tiny_choice/acc"] <= 1.0


@pytest.fixture(autouse=True)
def _titanlike_logger_restored():
    """scripts/evaluate.py's main() sets up the "titanlike" logger as a script does (its own stderr handler, no
    propagation); put it back, or later tests' caplog sees nothing and the handler writes to a closed stream."""
    log = logging.getLogger("titanlike")
    saved = (list(log.handlers), log.propagate, log.level)
    yield
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])


def test_bad_input_is_one_line_exit_2(tmp_path, include_path, capsys):
    script = _script()
    cases = [
        (["--tasks", "titanlike_tiny_choice", "--checkpoint", str(tmp_path / "nope")], "no such file or folder"),
        (["--tasks", "titanlike_tiny_choice", "--checkpoint", str(tmp_path), "--include-path",
          str(tmp_path / "missing")], "--include-path"),
        (["--tasks", "titanlike_tiny_choise", "--checkpoint", str(tmp_path), "--include-path", include_path],
         "did you mean 'titanlike_tiny_choice'"),
    ]
    for argv, expect in cases:
        assert script.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expect in err, err
        assert "lm-eval ls tasks" in err or "unknown" not in err
    base = ["--eval.enable", "--eval.tasks=titanlike_tiny_choice", f"--job.dump_folder={tmp_path}"]
    with pytest.raises(ConfigError, match=r"^eval.include_path='.*missing' is not a folder"):
        load_config([*base, f"--eval.include_path={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match=r"^eval.tasks under parallelism.pp=2"):
        load_config([*base, f"--eval.include_path={include_path}", "--parallelism.pp=2"])
    cfg = load_config([*base, f"--eval.include_path={include_path}"])  # a good local task passes
    assert cfg.eval.tasks == ["titanlike_tiny_choice"]
