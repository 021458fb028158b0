"""Pipeline parallelism without processes: the split, stage placement, stage modules' FQNs, config errors and
the optimizer container. Multi-process parity lives in tests/multiproc/test_dist_pp.py."""
import dataclasses

import pytest
import torch

import models
from parallelize.pp import is_multi_stage, model_layout, schedule_class, stage_module
from parallelize.pp_split import split_at, split_layers, stage_ids, stage_owners
from titanlike.config import ConfigError, JobConfig, validate, validate_model
from titanlike.config.validate_pp import PP_SCHEDULES, pp_stage_count
from titanlike.optim.lr import build_lr_scheduler
from titanlike.optim.container import OptimizersContainer

NAMES = [str(i) for i in range(8)]


def llama(n_layers=4, **kw):
    spec = models.get_spec("llama3")
    args = spec.args_cls(dim=64, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=128, multiple_of=32,
                         rope_theta=10000.0, max_seq_len=16, **kw)
    with torch.device("meta"):
        return spec.model_cls(args)


def cfg_with(**par) -> JobConfig:
    cfg = JobConfig()
    cfg.training.local_batch_size = 8
    for k, v in par.items():
        setattr(cfg.parallelism, k, v)
    return cfg


@pytest.mark.parametrize("n,stages,emb,out,sizes", [
    (8, 2, 0, 0, [4, 4]),
    (8, 2, 1, 1, [4, 4]),
    (5, 2, 0, 0, [3, 2]),  # uneven: the extra layer goes first
    (4, 2, 0, 2.1, [3, 1]),  # a heavy output projection (8B_4L-like) moves a block to the first stage
    (8, 4, 0, 0, [2, 2, 2, 2]),
    (8, 4, 1, 1, [2, 2, 3, 1]),  # stage costs 3, 2, 3, 2
    (32, 4, 0, 2.4, [9, 8, 9, 6]),
    (4, 4, 0, 10.0, [1, 1, 1, 1]),  # never an empty stage, however heavy the ends
    (3, 1, 1, 1, [3]),
])
def test_split_layers_balances_cost(n, stages, emb, out, sizes):
    groups = split_layers([str(i) for i in range(n)], stages, emb, out)
    assert [len(g) for g in groups] == sizes
    assert sum(groups, []) == [str(i) for i in range(n)]  # contiguous, in order, all of them


def test_split_errors():
    with pytest.raises(ValueError, match="5 pipeline stages for 4 layers"):
        split_layers(NAMES[:4], 5)
    assert split_at(NAMES, ["layers.2", "5"]) == [NAMES[:2], NAMES[2:5], NAMES[5:]]
    with pytest.raises(ValueError, match="not a layer"):
        split_at(NAMES, ["layers.9"])
    with pytest.raises(ValueError, match="strictly increasing"):
        split_at(NAMES, ["layers.4", "layers.2"])
    with pytest.raises(ValueError, match="strictly increasing"):
        split_at(NAMES, ["layers.0"])


def test_split_balances_ranks_with_several_stages_each():
    names = [str(i) for i in range(32)]
    # Llama 3 8B at seq 8192: the output projection costs ~1.84 blocks. Per-stage rounding alone gives
    # [9, 8, 9, 6] (rank loads 18 / 15.84 with loop placement); moving boundaries evens the ranks out.
    sizes = [len(g) for g in split_layers(names, 4, 0.0, 1.84, owners=stage_owners(2, 4, v_shape=False))]
    assert sizes == [9, 8, 8, 7]  # rank 0: 9 + 8 = 17, rank 1: 8 + 7 + 1.84 = 16.84
    sizes = [len(g) for g in split_layers(names, 4, 0.0, 1.84, owners=stage_owners(2, 4, v_shape=True))]
    assert sizes[0] + sizes[3] + 1.84 <= 17 and sizes[1] + sizes[2] <= 17


def test_stage_placement_loop_and_v():
    assert stage_owners(2, 4, v_shape=False) == [0, 1, 0, 1]
    assert stage_owners(2, 4, v_shape=True) == [0, 1, 1, 0]
    assert stage_ids(1, 4, 8, v_shape=True) == [1, 6]
    assert stage_ids(1, 4, 8, v_shape=False) == [1, 5]
    with pytest.raises(ValueError, match="exactly 2 stages per rank"):
        stage_owners(2, 6, v_shape=True)


def test_stage_modules_keep_full_model_fqns():
    model = llama(4)
    cfg = cfg_with(pp=2, pp_schedule="Interleaved1F1B", pp_embedding_weight=0.0, pp_output_weight=0.0)
    spec = models.get_spec("llama3")
    layout = model_layout(model, spec, model.args, cfg.parallelism, seq_len=16)
    assert layout == [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"], ["layers.3", "norm", "output"]]
    full = {n for n, _ in model.named_parameters()}
    seen = []
    for names in layout:
        part = stage_module(model, names, (*spec.input_modules, *spec.output_modules))
        fqns = [n for n, _ in part.named_parameters()]
        assert set(fqns) <= full
        seen += fqns
        assert (part.tok_embeddings is None) == ("tok_embeddings" not in names)
        assert (part.output is None) == ("output" not in names)
    assert sorted(seen) == sorted(full)  # each parameter in exactly one stage
    assert len(list(model.layers)) == 4  # the meta model itself is untouched


def test_pipeline_costs_and_stage_counts():
    model = llama(4)
    costs = models.get_spec("llama3").pp_costs(model.args, 16)
    block = sum(p.numel() for p in model.layers["0"].parameters())
    assert costs.layers == {str(i): 6.0 * block + 12.0 * 64 * 16 for i in range(4)}  # FLOPs per token
    assert costs.embedding == 0.0 and 0 < costs.output / costs.layers["0"] < 1  # vocab 128 x dim 64: small
    # Per-layer costs move the boundaries: a layer twice as costly gets a stage to itself.
    assert split_layers(NAMES[:4], 2, layer_costs=[2.0, 1.0, 0.5, 0.5]) == [["0"], ["1", "2", "3"]]
    par = cfg_with(pp=4).parallelism
    assert pp_stage_count(par, 32) == 4
    par.pp_schedule = "ZBVZeroBubble"
    assert pp_stage_count(par, 32) == 8
    par.pp_layers_per_stage = 2
    assert pp_stage_count(par, 32) == 16


def test_schedules_resolve():
    for name in PP_SCHEDULES:
        assert schedule_class(name).__name__ == f"Schedule{name}"
    assert not is_multi_stage("1F1B") and is_multi_stage("ZBVZeroBubble")
    with pytest.raises(ValueError, match="not one of"):
        schedule_class("1f1b")


@pytest.mark.parametrize("par,match", [
    ({"pp": 2, "pp_microbatches": 3}, "pp_microbatches=3 must divide training.local_batch_size=8"),
    ({"pp": 2, "pp_schedule": "OneFOneB"}, "parallelism.pp_schedule='OneFOneB' is not one of"),
    ({"pp": 2, "pp_schedule": "1F1B", "pp_stages_per_rank": 2}, "runs one stage per rank"),
    ({"pp": 2, "pp_schedule": "ZBVZeroBubble", "pp_stages_per_rank": 3}, "exactly 2 stages per rank"),
    ({"pp": 2, "pp_split_points": ["layers.2", "layers.4"]}, "not a multiple of parallelism.pp=2"),
    ({"pp": 2, "pp_split_points": ["layers.2"], "pp_stages_per_rank": 1}, "set at most one of"),
    ({"pp": 2, "pp_microbatches": 0}, "pp_microbatches=0 must be >= 1"),
    ({"pp": 2, "pp_output_weight": -2.0}, "pp_output_weight=-2.0 must be >= 0"),
])
def test_config_errors(par, match):
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace("[", r"\[")):
        validate(cfg_with(**par), world_size=2)


def test_compile_with_split_backward_schedule_is_refused():
    cfg = cfg_with(pp=2, pp_schedule="ZBVZeroBubble")
    cfg.compile.enable = True
    with pytest.raises(ConfigError, match="compile.enable=false"):
        validate(cfg, world_size=2)
    cfg.parallelism.pp_schedule = "Interleaved1F1B"
    validate(cfg, world_size=2)


def test_per_op_sac_with_split_backward_schedule_is_refused():
    cfg = cfg_with(pp=2, pp_schedule="DualPipeV")
    cfg.activation_checkpoint.mode = "selective"
    with pytest.raises(ConfigError, match="per-op selective activation checkpointing forbids"):
        validate(cfg, world_size=2)
    cfg.activation_checkpoint.selective_option = "2"
    validate(cfg, world_size=2)


def check_model(spec, args, cfg):
    validate_model(spec, args, cfg.parallelism, cfg.model.flavor)  # the two sections it reads


def test_more_stages_than_layers():
    args = dataclasses.replace(models.get_spec("llama3").flavors["debugmodel"], n_layers=3)
    with pytest.raises(ConfigError, match="parallelism.pp=4 exceeds"):
        check_model(models.get_spec("llama3"), args, cfg_with(pp=4))
    with pytest.raises(ConfigError, match="parallelism.pp=2 with 4 stages in all .Interleaved1F1B. exceeds"):
        check_model(models.get_spec("llama3"), args, cfg_with(pp=2, pp_schedule="Interleaved1F1B"))
    with pytest.raises(ConfigError, match="runs one stage per rank but parallelism.pp_layers_per_stage=1 gives 2"):
        check_model(models.get_spec("llama3"), dataclasses.replace(args, n_layers=4),
                       cfg_with(pp=2, pp_layers_per_stage=1))
    check_model(models.get_spec("llama3"), args, cfg_with(pp=2, pp_schedule="1F1B"))


def test_optimizers_container_drives_all_parts_with_one_scheduler():
    parts = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    opts = [torch.optim.AdamW(p.parameters(), lr=1.0) for p in parts]
    container = OptimizersContainer(opts)
    sched = build_lr_scheduler(container, JobConfig().lr_scheduler, total_steps=100)  # warmup 10: lr 0.1 at step 0
    assert all(g["lr"] == pytest.approx(0.1) for o in opts for g in o.param_groups)
    for p in parts:
        p.weight.grad = torch.ones_like(p.weight)
    before = [p.weight.detach().clone() for p in parts]
    container.step()
    sched.step()
    container.zero_grad()
    assert all(not torch.equal(b, p.weight) for b, p in zip(before, parts))
    assert all(p.weight.grad is None for p in parts)
    assert all(g["lr"] == pytest.approx(0.2) for o in opts for g in o.param_groups)
    assert len(container.state) == 2  # the two weights (the biases got no gradient)


def test_bubble_tool_on_a_synthetic_trace():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "scripts" / "bench" / "pp_bubble.py"
    spec = importlib.util.spec_from_file_location("pp_bubble", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    events = [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#3", "ts": 0, "dur": 100},
        {"ph": "X", "cat": "kernel", "name": "gemm_a", "ts": 10, "dur": 30},
        {"ph": "X", "cat": "kernel", "name": "gemm_b", "ts": 30, "dur": 30},  # overlaps gemm_a: busy 10..60
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv", "ts": 60, "dur": 20},  # waiting: not busy
        {"ph": "X", "cat": "kernel", "name": "late", "ts": 90, "dur": 50},  # clipped to the window: 90..100
    ]
    r = tool.trace_bubble(events)
    assert r["busy_ms"] * 1e3 == pytest.approx(60) and r["nccl_only_ms"] * 1e3 == pytest.approx(20)
    assert r["bubble"] == pytest.approx(0.4)
    assert tool.theoretical_bubble("1F1B", 2, 8) == pytest.approx(1 / 9)
    assert tool.theoretical_bubble("Interleaved1F1B", 2, 8) == pytest.approx(1 / 17)


def test_packed_targets_cut_labels_and_extras_alike():
    """The schedule's target with a Batch's extras packed beside the labels (titanlike/train/pipeline_targets.py): cut
    into micro-batches along the rows as torch's schedule cuts it, each part unpacks to that micro-batch's labels and
    extras, the float values bit for bit (negative, tiny, infinite, NaN, bf16 alike)."""
    from models.batch import IGNORE_INDEX, Batch
    from titanlike.train.pipeline_targets import pack_targets, unpack_targets

    labels = torch.arange(24).view(6, 4)
    labels[::2, 0] = IGNORE_INDEX
    logps = torch.tensor([-3.25, -1e-30, float("-inf"), float("nan"), -12345.678, 0.0])
    extras = {"reference_logps": logps, "weights": torch.tensor([[1.5, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12]],
                                                                 dtype=torch.bfloat16)}
    batch = Batch(inputs={"tokens": labels.clone()}, labels=labels, extras=extras)
    target, layout = pack_targets(labels, extras)
    assert target.dtype == torch.int64 and target.shape == (6, 4 + 1 + 2)
    for part, mb in zip(target.tensor_split(3), batch.split(3)):
        y, got = unpack_targets(part, layout)
        assert torch.equal(y, mb.labels) and got.keys() == mb.extras.keys()
        for k, v in mb.extras.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            assert torch.equal(got[k].view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32),
                               v.view(torch.int16 if v.dtype == torch.bfloat16 else torch.int32))
    per_row, layout = pack_targets(torch.tensor([3, 1]), {"w": torch.tensor([0.5, -2.0])})  # per-sequence labels
    y, got = unpack_targets(per_row, layout)
    assert y.tolist() == [3, 1] and got["w"].tolist() == [0.5, -2.0]


def test_targets_without_extras_are_the_labels():
    from titanlike.train.pipeline_targets import pack_targets, unpack_targets

    labels = torch.ones(2, 3, dtype=torch.long)
    target, layout = pack_targets(labels, {})
    assert target is labels and layout is None and unpack_targets(target, None) == (labels, {})
    with pytest.raises(ValueError, match=r"extras\['n'\] must be a floating tensor with one entry per row \(2\)"):
        pack_targets(labels, {"n": torch.ones(2, dtype=torch.long)})
