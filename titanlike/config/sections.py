"""Typed config sections. One dataclass per TOML table; each builder receives only its own section.

Field types are the contract with the TOML loader: the loader checks every value against these annotations,
so a new field needs nothing but a line here (and a check in validate.py if it has cross-field rules).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Job:
    dump_folder: str = "./outputs"  # run folders live under here
    run_name: str = ""  # "" = the config file's stem
    description: str = ""


@dataclass
class Model:
    name: str = "llama3"  # key into models.MODELS
    flavor: str = "debugmodel"  # key into the model's flavors
    plan: str = "default"  # a registered plan name, or "package.module:function"
    vocab_size: int = -1  # -1 = take it from the tokenizer
    attn_backend: str = "sdpa"  # sdpa (torch picks per device) | flash | cudnn | efficient | math (reference)


@dataclass
class Training:
    steps: int = 100
    seq_len: int = 256
    local_batch_size: int = 8  # sequences per micro-batch per data-parallel rank
    global_batch_size: int = -1  # sequences per optimizer step over all DP ranks; -1 = local * dp (no accumulation)
    max_norm: float = 1.0  # gradient clipping; <= 0 disables
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"  # auto | cpu | cuda
    mixed_precision_param: str = "bfloat16"  # FSDP param dtype on CUDA (CPU always float32)
    mixed_precision_reduce: str = "float32"
    gc_freq: int = 50  # python gc.collect() every N steps (automatic gc is disabled); 0 = leave gc automatic


@dataclass
class Optimizer:
    name: str = "AdamW"
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = False  # Megatron/GPT convention: 1-D params get no weight decay
    decay_embeddings: bool = False
    fused: str = "auto"  # auto (fused on CUDA) | true | false


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    decay_type: str = "cosine"  # cosine | linear | wsd (warmup-stable-decay) | constant
    decay_ratio: float = 0.2  # wsd only: fraction of steps spent in the final decay
    min_lr_factor: float = 0.1  # min LR = lr * min_lr_factor


@dataclass
class Parallelism:
    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = -1  # FSDP shard degree; -1 = whatever the world size leaves
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    fsdp_reshard_after_forward: str = "default"  # default | always | never


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective
    selective_option: str = "op"  # "op" = save matmul/attention outputs; "N" = checkpoint every N-th block


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss"])


@dataclass
class Float8:
    enable: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])
    enable_fsdp_float8_all_gather: bool = False
    precompute_float8_dynamic_scale_for_fsdp: bool = False


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"  # relative to the run folder
    interval: int = 500
    keep_latest_k: int = 0  # 0 = keep all
    load_step: int = -1  # -1 = newest complete step
    async_mode: str = "disabled"  # disabled | async | async_with_pinned_mem


@dataclass
class Data:
    dataset: str = "stdlib"  # stdlib (the Python standard library's own source) | mock
    tokenizer: str = "builtin"  # builtin (byte-level BPE trained and cached locally) | path to tokenizer.json
    builtin_vocab_size: int = 2048
    cache_dir: str = ""  # "" = ~/.cache/titanlike
    num_workers: int = 0
    pin_memory: bool = True


@dataclass
class Metrics:
    log_freq: int = 10
    enable_tensorboard: bool = True
    save_tb_folder: str = "tb"


@dataclass
class Validation:
    enable: bool = False
    interval: int = 100
    steps: int = 10


@dataclass
class FaultTolerance:
    enable: bool = False
    replica_id: int = 0
    group_size: int = 0
    min_replica_size: int = 1


@dataclass
class Profiling:
    enable_profiling: bool = False
    profile_freq: int = 100
    save_traces_folder: str = "profile_traces"
    enable_memory_snapshot: bool = False


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    profiling: Profiling = field(default_factory=Profiling)
