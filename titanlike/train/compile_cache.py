"""compile.cache_dir: torch.compile's caches in a folder that outlives the node, for warm restarts
(docs/multinode.md, "Warm restart").

A requeued job on another node would compile cold again: torch keeps its FX-graph (Inductor), AOTAutograd and
Triton caches under the node's /tmp. With compile.cache_dir set, before anything compiles (the Trainer's start):
  - TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR point into the folder (torch reads them at each compile, so setting
    them before the first step is enough), the FX-graph and AOTAutograd caches are switched on, and so is the disk
    cache of Triton's @autotune choices (TRITON_CACHE_AUTOTUNING, for hand-written Triton kernels such as fla's);
  - torch's portable cache artifacts ("mega-cache", torch.compiler.save/load_cache_artifacts) of this rank are loaded
    when present: they refill the local caches even where only the one file survived (a node-local cache folder
    copied away, a cleaned /tmp);
  - after the first step each rank saves its artifacts (temporary file, then os.replace: a reader never sees half a
    file). Per rank, not rank 0 alone: pipeline stages compile different graphs, and the graphs' cache keys may name
    the rank's device, so rank 0's file could miss elsewhere. The key names torch's version and the world layout; a
    changed model or config only misses (the caches key on the graphs), it never loads a wrong kernel.
Misses say why, in one line: beside each artifact file a small record (`<key>.json`) keeps the versions and the
config fields that shape the compiled graphs (the Trainer's `fingerprint`). A start that finds no file for its key
names the keys the folder has (another torch or layout); a warm first step that still misses names the fields or
versions that changed since the save, or says none did (then the code itself changed).
Only the Trainer calls this: the memory estimate (titanlike/planner) builds through construct.py and writes no cache.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch

logger = logging.getLogger("titanlike")


def resolve_cache_dir(cache_dir: str, run_dir: str) -> str | None:
    """compile.cache_dir -> the folder, or None for torch's defaults ("")."""
    if not cache_dir:
        return None
    return os.path.abspath(os.path.join(run_dir, "compile_cache") if cache_dir == "auto" else cache_dir)


def _counters() -> dict[str, int]:
    """The cache hit/miss/bypass counts Dynamo keeps for this process (torch._dynamo.utils.counters)."""
    from torch._dynamo.utils import counters

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"fx_hit": ind["fxgraph_cache_hit"], "fx_miss": ind["fxgraph_cache_miss"],
            "fx_bypass": ind["fxgraph_cache_bypass"], "aot_hit": aot["autograd_cache_hit"],
            "aot_miss": aot["autograd_cache_miss"], "aot_bypass": aot["autograd_cache_bypass"]}


# Where a first step's compile time goes: torch._dynamo.utils.compilation_time_metrics' phases (seconds summed over
# the graphs). The backend phases nest inside the forward and backward ones, so the parts overlap by design.
_PHASES = {"dynamo": "bytecode_tracing", "forward": "OutputGraph.call_user_compiler",
           "backward": "compile_fx.<locals>.bw_compiler", "codegen": "GraphLowering.compile_to_module",
           "kernel_wait": "async_compile.wait", "cache_load": "AOTAutogradCache.inductor_load",
           "graphs": "_compile.compile_inner"}


def _is_autotune(name: str) -> bool:
    """Inductor's autotuning records: GEMM templates at compile time (one name per template: "mm_template_autotuning",
    ...), and Triton kernels' config benchmarks on their first launch (in the first step, outside the compile)."""
    return name.endswith(("_template_autotuning", "_template_precompiling")) or \
        name == "CachingAutotuner.benchmark_all_configs"


def _compile_times() -> dict[str, float]:
    """Seconds per phase so far in this process ("graphs": how many frames Dynamo compiled, recompiles included;
    "autotune": Inductor's autotuning); {} where this torch keeps no such record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        return {}
    out = {k: (len(metrics.get(name, ())) if k == "graphs" else sum(metrics.get(name, ())))
           for k, name in _PHASES.items()}
    out["autotune"] = sum(sum(v) for name, v in list(metrics.items()) if _is_autotune(name))
    return out


def split_line(t: dict[str, float]) -> str:
    """The compile split of a first step, in one line."""
    return (f"compile split: {int(t['graphs'])} graphs; Dynamo tracing {t['dynamo']:.1f} s, forward AOTAutograd + "
            f"Inductor {t['forward']:.1f} s, backward {t['backward']:.1f} s (of which Inductor code generation "
            f"{t['codegen']:.1f} s, waiting for kernel builds {t['kernel_wait']:.1f} s, cache loads "
            f"{t['cache_load']:.1f} s); autotuning {t.get('autotune', 0.0):.1f} s")


class CompileCache:
    """The run's compile cache (module docstring): `start()` before anything compiles, `first_step_done()` after the
    first step. With folder None (compile.cache_dir = "") it only reports the first step's compile time and hits."""

    def __init__(self, folder: str | None, rank: int, layout: str, fingerprint: dict | None = None):
        self.folder = folder
        self.rank = rank
        # what shapes the compiled graphs ({section: {field: value}}) and the versions that build them: saved beside
        # the artifacts, compared on a warm start that misses
        self.fingerprint = {"versions": _versions(), **(fingerprint or {})}
        self.saved_fingerprint: dict | None = None
        # torch's version and the world layout: another torch or another layout never loads these artifacts
        self.key = f"torch{torch.__version__.replace('+', '_')}-{layout}-rank{rank}"
        self.loaded = 0  # artifact entries loaded at start (the warm-restart test reads it)
        self.saved = 0
        self.first_step: dict = {}  # seconds, counters of the first step (for the tests and the log)
        self._t0 = None  # the first step's start (perf_counter) and Dynamo's cache counters then
        self._c0: dict[str, int] = {}
        self._times0: dict[str, float] = {}

    @property
    def artifacts_path(self) -> str:
        return os.path.join(self.folder, "artifacts", f"{self.key}.bin")

    @property
    def record_path(self) -> str:
        return os.path.join(self.folder, "artifacts", f"{self.key}.json")

    def _read_record(self) -> None:
        try:
            with open(self.record_path) as f:
                self.saved_fingerprint = json.load(f)
        except (OSError, ValueError):  # none yet (or written by an older titanlike): no reason can be named
            self.saved_fingerprint = None

    def _other_keys(self) -> str:
        """Artifact files in the folder for other keys (another torch version, layout or rank), for the cold-start
        line."""
        names = sorted(f[:-4] for f in os.listdir(os.path.dirname(self.artifacts_path)) if f.endswith(".bin"))
        return "" if not names else f" (the folder has {', '.join(names[:3])}{', ...' if len(names) > 3 else ''}: " \
            f"another torch version or layout compiles its own)"

    def miss_reason(self) -> str:
        """Why a warm start still missed: the recorded fields that differ from this run's, in one line."""
        if self.saved_fingerprint is None:
            return "no record of the run that saved the artifacts"
        diffs = _diff(self.saved_fingerprint, self.fingerprint)
        if not diffs:
            return ("nothing recorded changed (versions and graph-shaping config are the same): the model or "
                    "titanlike code changed, or TORCH_LOGS=+inductor says why")
        return "changed since the save: " + "; ".join(diffs[:4]) + (f"; and {len(diffs) - 4} more" if len(diffs) > 4
                                                                     else "")

    def start(self) -> None:
        if self.folder is None:
            return
        os.makedirs(os.path.join(self.folder, "artifacts"), exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(self.folder, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(self.folder, "triton")
        # Triton's own autotuner (@triton.autotune: flash-linear-attention's kernels, torchao's) keeps its choices in
        # memory only unless this is on; then they land in TRITON_CACHE_DIR too and a restart skips the benchmarking
        # (which dominated the hybrids' cold first step). Read when an autotuned kernel is defined, i.e. when its
        # module is imported: the model build, after this. A value the user set wins.
        os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")
        import torch._functorch.config as aot_config
        import torch._inductor.config as inductor_config

        # Both default on; TORCHINDUCTOR_FX_GRAPH_CACHE=0 / TORCHINDUCTOR_AUTOGRAD_CACHE=0 would turn them off.
        # (hasattr: a torch config module refuses unknown names; both exist in torch 2.11 and 2.13.)
        for module, name in ((inductor_config, "fx_graph_cache"), (aot_config, "enable_autograd_cache")):
            if hasattr(module, name):
                setattr(module, name, True)
        how = "no artifacts yet (cold start)" + self._other_keys()
        self._read_record()
        if not hasattr(torch.compiler, "load_cache_artifacts"):  # (guarded: the on-disk caches alone then)
            how = "this torch has no portable cache artifacts"
        elif os.path.exists(self.artifacts_path):
            try:  # an unreadable file costs a cold compile, never the run
                with open(self.artifacts_path, "rb") as f:
                    info = torch.compiler.load_cache_artifacts(f.read())
                self.loaded = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
                how = f"loaded {self.loaded} artifacts from {os.path.basename(self.artifacts_path)}"
            except Exception as e:  # noqa: BLE001 - torch's deserialisation raises various types
                how = f"could not load {self.artifacts_path} ({type(e).__name__}: {str(e)[:120]}): compiling cold"
        if self.rank == 0:
            logger.info(f"compile cache: {self.folder} (compile.cache_dir); {how}")

    def first_step_begins(self) -> None:
        self._t0 = time.perf_counter()
        self._c0 = _counters()
        self._times0 = _compile_times()

    def first_step_done(self) -> None:
        """The first step's time and cache hits in one line; its artifacts saved (with a folder)."""
        if self._t0 is None:
            return
        seconds = time.perf_counter() - self._t0
        c = {k: v - self._c0[k] for k, v in _counters().items()}
        times = {k: v - self._times0.get(k, 0) for k, v in _compile_times().items()}
        self.first_step = {"seconds": seconds, **c, "split": times}
        if self.folder is not None:
            self._save()
        if self.rank == 0 and (c["fx_hit"] + c["fx_miss"] + c["aot_hit"] + c["aot_miss"] + c["fx_bypass"] > 0):
            bypass = (f"; bypassed {c['fx_bypass']} Inductor, {c['aot_bypass']} AOTAutograd (uncacheable graphs, "
                      f"TORCH_LOGS=+inductor says why)" if c["fx_bypass"] + c["aot_bypass"] else "")
            saved = f"; saved {self.saved} artifacts" if self.saved else ""
            logger.info(f"compile: first step {seconds:.1f} s; FX-graph cache {c['fx_hit']} hits / {c['fx_miss']} "
                        f"misses, AOTAutograd cache {c['aot_hit']} hits / {c['aot_miss']} misses{bypass}{saved}")
            if self.loaded and c["fx_miss"] + c["aot_miss"]:
                logger.info(f"compile cache: {c['fx_miss'] + c['aot_miss']} misses after loading {self.loaded} "
                            f"artifacts; {self.miss_reason()}")
            if times.get("graphs"):
                logger.info(split_line(times))

    def _save(self) -> None:
        """This rank's artifacts since start-up (a warm start records its hits too), written atomically."""
        if not hasattr(torch.compiler, "save_cache_artifacts"):
            return
        got = torch.compiler.save_cache_artifacts()
        if got is None:  # nothing compiled: keep what is there
            return
        data, info = got
        tmp = f"{self.artifacts_path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, self.artifacts_path)
        self.saved = sum(len(v) for v in info.artifacts.values())
        tmp = f"{self.record_path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.fingerprint, f, indent=1, sort_keys=True, default=str)
        os.replace(tmp, self.record_path)


def _versions() -> dict:
    """What builds the kernels besides the graphs: torch, Triton and the device."""
    out = {"torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        out["device"] = torch.cuda.get_device_name()
    return out


def _diff(old: dict, new: dict, prefix: str = "") -> list[str]:
    """The dotted fields whose values differ between two records ("model.n_layers 2 -> 4")."""
    out = []
    for k in sorted(set(old) | set(new)):
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _diff(a, b, f"{prefix}{k}.")
        elif json.dumps(a, sort_keys=True, default=str) != json.dumps(b, sort_keys=True, default=str):
            out.append(f"{prefix}{k} {a!r} -> {b!r}")
    return out


# The training fields that change a compiled graph (shapes, dtypes, what the loss and update compute); the rest of
# [training] (steps, seeds, fault handling) never does, so a change there is not named as a miss's reason.
_TRAINING_GRAPH_FIELDS = ("seq_len", "local_batch_size", "mixed_precision_param", "mixed_precision_reduce",
                          "mixed_precision_impl", "max_norm", "loss_chunk_tokens", "skip_nonfinite_steps")


def graph_fingerprint(cfg) -> dict:
    """The config fields that shape the compiled graphs, as plain values, for the record beside the artifacts."""
    import dataclasses

    sections = {name: dataclasses.asdict(getattr(cfg, name)) for name in
                ("model", "parallelism", "activation_checkpoint", "float8", "lora", "compile")}
    sections["compile"].pop("cache_dir", None)  # where the cache lives is not what it holds
    sections["training"] = {k: getattr(cfg.training, k) for k in _TRAINING_GRAPH_FIELDS if hasattr(cfg.training, k)}
    sections["optimizer"] = {"name": cfg.optimizer.name}
    return sections


def world_layout(dims, device_type: str) -> str:
    """The artifact key's layout part: device type, world size and every parallel degree."""
    degrees = "".join(f"{n}{getattr(dims, a)}" for n, a in (("r", "dp_replicate"), ("s", "dp_shard"), ("c", "cp"),
                                                           ("t", "tp"), ("p", "pp"), ("e", "ep")))
    return f"{device_type}-w{dims.world_size}-{degrees}"


__all__ = ["CompileCache", "graph_fingerprint", "resolve_cache_dir", "world_layout"]
