"""Typed config sections. One dataclass per TOML table; each builder receives only the sections it reads: its own
section (`CheckpointManager(cfg.checkpoint, ...)`), or a small frozen dataclass of the few it reads, built once by
the caller from the JobConfig (`parallelize.PlanSections.of(cfg)` for plans, `BuildSections` for build_model,
`UpdateSections` for the Updater). The whole JobConfig goes only where it is the input: validation, load/TOML, the
Trainer (the run) and the planner (which estimates a whole run).

Field types are the contract with the TOML loader: the loader checks every value against these annotations,
so a new field needs nothing but a line here (and a check in validate.py if it has cross-field rules).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from models import DEFAULT_MODEL
from titanlike.config.section_data import Data


@dataclass
class Job:
    dump_folder: str = "./outputs"  # run folders live under here
    run_name: str = ""  # "" = the config file's stem
    description: str = ""  # free text: logged at start-up with the run name, and TensorBoard text job/description


@dataclass
class Model:
    name: str = DEFAULT_MODEL  # key into models.MODELS
    flavor: str = "debugmodel"  # key into the model's flavors
    plan: str = "default"  # a registered plan name, or "package.module:function"
    vocab_size: int = -1  # -1 = take it from the tokenizer
    # vocab_size=-1: round the tokenizer's vocabulary up to a multiple of this (Megatron pads to
    # --make-vocab-size-divisible-by x TP: 50257 -> 50304); the extra rows are never a target
    vocab_pad_multiple: int = 1
    n_layers: int = -1  # -1 = the flavor's; else that many blocks of the flavor's shape (Megatron's --num-layers)
    # Fields of the flavor changed for this run, {field = value} of the family's ModelArgs (models/<name>/args.py):
    # a shape no named flavor has, e.g. args = {dim = 1280, n_heads = 16} (scripts/from_megatron.py writes these)
    args: dict = field(default_factory=dict)
    # auto (FlashAttention-4 where installed on Hopper+, else cuDNN first, then flash; else torch's choice) | sdpa
    # (torch's choice: flash first on CUDA) | flash | cudnn | efficient | math (reference) | fa4 (flash-attn-4 or error;
    # also the encoders' bidirectional attention, which "auto" keeps on SDPA)
    attn_backend: str = "auto"
    # Masked attention (data.document_masking, parallelism.cp > 1): auto (FlexAttention on a GPU, else SDPA) | sdpa
    # (SDPA with a dense boolean mask: CPU and short sequences) | flex (GPU only)
    mask_kernel: str = "auto"
    # The recurrent mixers' scans (Mamba-2, Gated DeltaNet): auto (flash-linear-attention's Triton kernels on a CUDA GPU
    # where fla-core is installed, else PyTorch) | torch (the chunked PyTorch scans: CPU, reference) | fla (or error)
    mixer_kernel: str = "auto"


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
    # One device only (FSDP casts sharded weights itself): auto (master_weights when compile.components has
    # "optimizer", else autocast) | autocast (fp32 weights, bf16 matmuls) | master_weights (bf16 weights, fp32
    # master weights and moments in the optimizer, as Megatron's --bf16; titanlike/optim/master_weights.py, and
    # master_muon.py for optimizer.name="Muon")
    mixed_precision_impl: str = "auto"
    gc_freq: int = 50  # python gc.collect() every N steps (automatic gc is disabled); 0 = leave gc automatic
    skip_nonfinite_steps: bool = True  # a NaN/Inf gradient norm skips that update (counted, logged)
    max_consecutive_bad_steps: int = 5  # this many skipped updates in a row stop the run; 0 = never stop
    # >0: instead of stopping, reload the newest complete checkpoint (weights, optimizer, LR) and go on with the data
    # after the bad steps, at most this many times per run (needs checkpoint.enable)
    max_rollbacks: int = 0
    signal_check_freq: int = 10  # multi-process runs agree on a SIGTERM/SIGUSR1 every N steps (one all-reduce)
    loss_spike_zscore: float = 6.0  # warn when a logged loss is this many std above the recent ones; 0 = off
    # >0: output projection + cross-entropy in chunks of this many tokens, so the [tokens, vocab] logits are never
    # materialised in full (titanlike/train/loss.py); 0 = plain logits then cross-entropy
    loss_chunk_tokens: int = 0


@dataclass
class LossScaling:
    """fp16 loss scaling (training.mixed_precision_param="float16"; Megatron's --fp16 flags,
    titanlike/optim/loss_scale.py). The loss is multiplied by the scale before backward; a step whose gradients overflow
    is skipped."""
    static_scale: float = 0.0  # > 0: this fixed scale (--loss-scale); 0 = dynamic
    initial_scale: float = 4294967296.0  # dynamic: the first scale, 2**32 (--initial-loss-scale)
    min_scale: float = 1.0  # dynamic: never below this (--min-loss-scale)
    window: int = 1000  # dynamic: this many steps without overflow double the scale (--loss-scale-window)
    hysteresis: int = 2  # dynamic: overflowing steps (since the last growth) before the scale halves (--hysteresis)


@dataclass
class Optimizer:
    name: str = "AdamW"  # AdamW | Muon (the blocks' matrices; AdamW for the rest: docs/optimizer.md)
    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = False  # Megatron/GPT convention: 1-D params get no weight decay
    decay_embeddings: bool = False
    fused: str = "auto"  # auto (fused on CUDA) | true | false
    # training.mixed_precision_impl=master_weights on CUDA: each block's update runs on a side stream while the next
    # forward computes the blocks before it (the forward waits per block, never for the whole step). AdamW only:
    # Muon's Newton-Schulz matmuls would compete with the forward's
    overlap_with_forward: bool = True
    # name="Muon" (titanlike/optim/muon.py): momentum, Nesterov, Newton-Schulz steps and the dtype they run in
    # (bfloat16 as the reference; float32 for exact comparisons), and how lr scales per matrix: match_rms_adamw
    # (0.2*sqrt(max(A, B)): AdamW's lr carries over) | original (sqrt(max(1, A/B))) | none
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5
    muon_ns_dtype: str = "bfloat16"
    muon_lr_scale: str = "match_rms_adamw"


@dataclass
class LRScheduler:
    warmup_steps: int = 10
    decay_type: str = "cosine"  # cosine | linear | wsd (warmup-stable-decay) | constant
    decay_ratio: float = 0.2  # wsd only: fraction of steps spent in the final decay
    min_lr_factor: float = 0.1  # min LR = lr * min_lr_factor
    # Resuming with another training.steps than the checkpoint's run (a warning says so either way): "stretch" the
    # schedule over the new total (the LR jumps to where the new schedule is at that step), or "keep" the saved
    # schedule's shape (steps past its end stay at its final LR)
    on_steps_change: str = "stretch"


@dataclass
class Parallelism:
    dp_replicate: int = 1  # HSDP replicas
    dp_shard: int = -1  # FSDP shard degree; -1 = whatever the world size leaves
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    fsdp_reshard_after_forward: str = "default"  # default | always | never
    # Context parallel (cp > 1; parallelize/cp.py), how attention sees the whole sequence: allgather (K/V gathered,
    # local queries) | alltoall (a head shard over the whole sequence; cp must divide a TP rank's query and KV heads)
    # | ring (K/V passed around the ranks, partials merged by log-sum-exp). The same result; Megatron's --cp-comm-type
    cp_method: str = "allgather"
    # Tensor parallel (tp > 1; parallelize/tp.py, the model's plan in parallelize/<model.name>.py)
    enable_sequence_parallel: bool = True  # norms on sequence shards: all-gather/reduce-scatter instead of all-reduce
    enable_loss_parallel: bool = True  # cross-entropy on vocabulary-sharded logits (never gathers [tokens, vocab])
    enable_async_tp: bool = False  # CUDA + compile: matmuls micro-pipelined with the TP collectives (symmetric memory)
    # Pipeline parallel (pp > 1; parallelize/pp.py). Schedule: GPipe | 1F1B | Interleaved1F1B | LoopedBFS |
    # InterleavedZeroBubble | ZBVZeroBubble | DualPipeV (the last three or four need several stages per rank).
    pp_schedule: str = "1F1B"
    pp_microbatches: int = -1  # micro-batches per local batch (must divide it); -1 = local_batch_size (1 sequence each)
    pp_stages_per_rank: int = -1  # virtual stages per PP rank; -1 = 1 for GPipe/1F1B, 2 for the multi-stage schedules
    pp_layers_per_stage: int = -1  # > 0: instead of pp_stages_per_rank, stages = ceil(n_layers / this)
    # e.g. ["layers.8", "layers.16"]: the first layer of stages 1..
    pp_split_points: list[str] = field(default_factory=list)
    # Cost of the modules before / after the blocks (the embeddings / final norm + output projection) in block
    # equivalents for the even split; -1 = the model's own FLOP estimate (ModelSpec.pp_costs at this seq_len)
    pp_embedding_weight: float = -1.0
    pp_output_weight: float = -1.0


@dataclass
class ActivationCheckpoint:
    mode: str = "none"  # none | full | selective | memory_budget
    # "op" = save matmul/attention outputs; "attention" = save attention outputs only (long context); "N" = checkpoint
    # every N-th block
    selective_option: str = "op"
    # mode="memory_budget" (needs compile): each compiled block keeps this fraction of the activation memory it would
    # keep without AC; torch's min-cut partitioner picks the cheapest ops to recompute (0 = all, 1 = none).
    memory_budget: float = 0.5


@dataclass
class Compile:
    enable: bool = False
    components: list[str] = field(default_factory=lambda: ["model", "loss", "optimizer"])
    # torch.compile's backend for the blocks and the loss. "aot_eager" traces the same graphs (dynamo, AOTAutograd)
    # without Inductor's code generation: quick to compile, for tests and debugging, not for speed. Async TP and
    # memory_budget AC are Inductor passes; the optimizer's fused update always uses Inductor.
    backend: str = "inductor"
    # torch.compile's caches (FX graph, AOTAutograd, Triton, portable artifacts) kept here so a requeued job warm-starts
    # on any node: "" = torch's defaults (the node's /tmp), "auto" = <run folder>/compile_cache, or a folder (shared)
    cache_dir: str = ""


@dataclass
class Float8:
    enable: bool = False
    recipe: str = "tensorwise"  # tensorwise | rowwise | rowwise_with_gw_hp
    filter_fqns: list[str] = field(default_factory=lambda: ["output"])  # Linear FQNs (dotted runs) kept high-precision
    # also keep the family's own output heads (its ModelSpec.float8_keep: BERT's pooler and sentence-order head,
    # ViT's classifier) in high precision, as "output" above keeps the LM head
    keep_model_heads: bool = True
    filter_small: bool = False  # also keep layers too small to gain (torchao's H100 size thresholds per recipe)
    enable_fsdp_float8_all_gather: bool = False  # tensorwise + FSDP: all-gather float8 weights (half the bytes)
    precompute_float8_dynamic_scale_for_fsdp: bool = False  # one all-reduce for all scales after optimizer.step()
    # with both of the above: each weight's cast to float8 before its all-gather as one compiled kernel instead of
    # torchao's three eager ones (same bytes; float8/fsdp_cast.py). It compiles even with compile.enable=false: set
    # it false too for a fully eager run.
    compile_fsdp_cast: bool = True
    # also the MoE's routed experts: their three grouped GEMMs through torchao's float8 rowwise grouped GEMM (dynamic
    # per-row scales, forward and backward; token groups padded to 16 rows), whatever the recipe above; the router
    # stays high precision, shared experts follow the Linear rules. Needs enable, routed experts with widths that are
    # multiples of 16, and CUDA capability >= 9.0 (float8/experts.py). Slower than bf16 at few tokens an expert
    # (docs/benchmarks.md, MoE): measure before turning it on
    moe_experts: bool = False


@dataclass
class Lora:
    """LoRA fine-tuning (docs/post_training.md#lora; models/common/lora.py): the base model frozen, low-rank adapters
    trained beside the chosen Linear layers (and routed experts), PEFT's init and scaling."""
    enable: bool = False
    rank: int = 16  # the adapters' inner dimension r (PEFT's r); at most min(in, out) of every adapted layer
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input (PEFT's lora_dropout); 0 for exact layout parity
    # Module names matched against Linear FQN suffixes as PEFT's target_modules ("wq" matches layers.3.attention.wq;
    # "layers.0.attention.wq" that one alone); each entry must match at least one Linear of the model, or a routed
    # experts module ("experts": adapters on every expert's w1, w2, w3, needs include_experts)
    target_modules: list[str] = field(default_factory=lambda: ["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    # also what lies inside MoE layers: the shared experts' Linears, the routed experts when a target names them;
    # router gates never
    include_experts: bool = False
    # checkpoints hold only the trainable parameters (adapters) and their optimizer state; a resume takes the base
    # from checkpoint.initial_load_path again (false: the whole model, base included)
    save_adapter_only: bool = True


@dataclass
class Checkpoint:
    enable: bool = False
    folder: str = "checkpoint"  # relative to the run folder
    interval: int = 500
    keep_latest_k: int = 0  # 0 = keep all
    load_step: int = -1  # -1 = newest complete step
    # On load, check every file against the CRC32s in its step's MANIFEST.json (reads the step once more, split
    # over all ranks); false = file sizes only
    verify_checksums: bool = True
    # auto (async on a GPU, disabled on a CPU) | disabled (the loop waits for the write) | async (the loop waits only
    # for the copy to host memory) | async_with_pinned_mem; a save in flight at the end is committed before exit
    async_mode: str = "auto"
    io_threads: int = 1  # writer threads per rank (DCP FileSystemWriter thread_count; one file per thread)
    # async_with_pinned_mem: allocate and pin the staging buffers in the background as training starts, not inside
    # the first save (which then stalled a step for ~30 s on an 8B model); costs that host memory from step 1
    prestage: bool = True
    model_only_export: bool = False  # at the last step also write export-step-N: model weights only, export_dtype
    last_save_model_only: bool = False  # at the last step write only export-step-N (no full state: not resumable)
    export_dtype: str = "float32"  # float32 | bfloat16 | float16
    create_seed_checkpoint: bool = False  # one process: initialise the model, save it as step-0, exit (no training)
    initial_load_path: str = ""  # a checkpoint folder or step folder to start from while this run has none
    initial_load_model_only: bool = True  # take only the weights from initial_load_path (HF import, fine-tuning)


@dataclass
class Metrics:
    log_freq: int = 10
    # titanlike | megatron (also print Megatron-LM's iteration line: "iteration N/ M | consumed samples: ... | lm loss:
    # ... | loss scale: ... | grad norm: ... | number of skipped iterations: ..." for log parsers written for it)
    log_format: str = "titanlike"
    enable_tensorboard: bool = True
    save_tb_folder: str = "tb"  # each process writes <run>/<save_tb_folder>/<YYYYmmdd-HHMMSS>/
    enable_wandb: bool = False  # also log to Weights & Biases, rank 0 (pip install 'titanlike[wandb]')
    wandb_project: str = "titanlike"
    wandb_entity: str = ""  # "" = your W&B default entity
    wandb_mode: str = ""  # "" = WANDB_MODE, else online | offline (no network; `wandb sync` later) | disabled


@dataclass
class Validation:
    enable: bool = False
    interval: int = 100
    steps: int = 10
    split: str = "valid"  # which split of the data to score: valid | test (indexed: data.split's shares)
    dataset: str = ""  # "" = data.dataset
    paths: list[str] = field(default_factory=list)  # [] = data.paths; else its own prefixes/files (whole, no split)


@dataclass
class Eval:
    """In-loop evaluation every `interval` steps (titanlike/train/evaluate.py, docs/evaluation.md):
    lm-evaluation-harness tasks (pip install 'titanlike[eval]') scored on a DP-sharded share of their requests per rank,
    and extra perplexity sets scored like [validation]. Leaves the model's training state, the RNGs and the data
    position untouched."""
    enable: bool = False
    interval: int = 1000
    # lm_eval task names (`lm-eval ls tasks`); local tasks: YAMLs in include_path
    tasks: list[str] = field(default_factory=list)
    include_path: str = ""  # folder of local task YAML files ("" = lm_eval's own tasks only)
    limit: int = 0  # the first N documents of each task; 0 = all
    num_fewshot: int = -1  # -1 = the task's default
    batch_size: int = 8  # sequences per scoring forward (padded to a power-of-two length: few shapes to compile)
    # Extra held-out sets, scored like [validation] (validation.steps batches each): "DATASET" or "DATASET:PATH [PATH]"
    # (paths space-separated as in data.paths), e.g. ["text:/data/wiki_val.jsonl",
    # "indexed:/data/pile_val_text_document"]
    perplexity_sets: list[str] = field(default_factory=list)


@dataclass
class DPO:
    """Preference tuning, read when data.dataset = "preference" (JSONL pairs of prompt, chosen, rejected): the
    objective is then DPO against a reference model, the initial weights (titanlike/train/dpo.py;
    docs/post_training.md)."""
    beta: float = 0.1  # > 0: the rewards are beta * log(policy / reference) of a response; larger = closer to it
    # sigmoid (DPO, summed log-probs) | ipo (IPO, per-token mean log-probs, as TRL) | length_normalized (DPO on
    # per-token mean log-probs: TRL's sigmoid_norm, Tulu 3's dpo_norm)
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0  # in [0, 0.5): sigmoid losses assume this share of flipped labels (cDPO); not ipo
    # precompute (one pass over the data with the initial weights before step 1, kept in checkpoints) | frozen_copy
    # (a second model with the initial weights and the same plan, run without gradients every step)
    reference: str = "precompute"


@dataclass
class Comm:
    """Collective timeouts, the flight recorder and the per-rank heartbeat (titanlike/resilience/comm_watch.py,
    docs/faults.md)."""
    init_timeout_seconds: int = 300  # process-group creation, checkpoint load and the first step
    train_timeout_seconds: int = 100  # every collective after the first step: a hung peer raises after this long
    trace_buf_size: int = 20000  # flight recorder: last N collectives per rank (TORCH_FR_BUFFER_SIZE); 0 = off
    save_traces_folder: str = "comm_traces"  # under the run folder: flight-recorder dumps (rank_<R>[.json])
    heartbeat_interval_seconds: float = 30.0  # each rank rewrites <run>/heartbeat/rank<R>.txt this often; 0 = off
    heartbeat_stall_seconds: float = 60.0  # warn after this long without finishing a step (below the timeout)


@dataclass
class FaultTolerance:
    """torchft replica groups (titanlike/resilience/ft.py): each group is its own job running the data-parallel
    replicate dimension; a failed group drops out of the quorum and rejoins by copying a live group's state."""
    enable: bool = False
    replica_id: int = 0  # this group's index in [0, group_size)
    group_size: int = 0  # number of replica groups
    min_replica_size: int = 1  # steps commit only while at least this many groups take part
    lighthouse: str = ""  # http://HOST:PORT of scripts/lighthouse.py; "" = $TORCHFT_LIGHTHOUSE
    process_group: str = "auto"  # cross-group collectives: auto (nccl on CUDA, else gloo) | gloo | nccl
    max_failed_commits: int = 10  # this many steps in a row that torchft could not commit stop the run


@dataclass
class Profiling:
    enable_profiling: bool = False
    profile_freq: int = 100
    save_traces_folder: str = "profile_traces"  # under the run folder: iteration_<step>/rank<r>_trace.json
    profile_active: int = 1  # steps recorded per trace (ending at a multiple of profile_freq)
    profile_warmup: int = 3  # steps before those, profiled but not recorded (stabilises the timings)
    enable_memory_snapshot: bool = False  # CUDA only: allocator history -> memory_snapshot/iteration_<step>/*.pickle
    save_memory_snapshot_folder: str = "memory_snapshot"


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    loss_scaling: LossScaling = field(default_factory=LossScaling)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    lora: Lora = field(default_factory=Lora)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    data: Data = field(default_factory=Data)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    dpo: DPO = field(default_factory=DPO)
    comm: Comm = field(default_factory=Comm)
    fault_tolerance: FaultTolerance = field(default_factory=FaultTolerance)
    profiling: Profiling = field(default_factory=Profiling)
