"""Per-step metrics: one console line per log step, TensorBoard scalars (and Weights & Biases with
metrics.enable_wandb, titanlike/observe/wandb_writer.py), tokens/s, MFU and memory.

TensorBoard: each training process writes its own time-stamped folder `<run>/<save_tb_folder>/<YYYYmmdd-HHMMSS>`,
so runs that share a run name (the default) stay separate plots; a resumed run gets a new folder too, which
TensorBoard overlays on the earlier one by step."""
from __future__ import annotations

import logging
import os
import resource
import time

import torch

logger = logging.getLogger("titanlike")

# Dense (non-sparse) bf16 tensor-core peak, FLOP/s, from the vendors' datasheets. Matched by substring of
# torch.cuda.get_device_name(), most specific first.
BF16_PEAK_FLOPS = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("GH200", 989e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362e12),
]


def device_peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this device, or None (CPU, unknown GPU: MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in BF16_PEAK_FLOPS:
        if key in name:
            return peak
    logger.warning("no bf16 peak known for %r: MFU will not be reported", name)
    return None


def memory_stats(device: torch.device) -> dict[str, float]:
    """Peak memory since the last call, in GiB (reset each call so each log line shows its own window)."""
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        reserved = torch.cuda.max_memory_reserved(device) / 2**30
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.reset_peak_memory_stats(device)
        return {"memory/peak_active_gib": peak, "memory/peak_reserved_gib": reserved,
                "memory/peak_reserved_pct": 100 * reserved / total}
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux
    return {"memory/max_rss_gib": rss_gib}


def stamped_folder(parent: str) -> str:
    """A new folder `parent/<YYYYmmdd-HHMMSS>` (with -2, -3 ... when one of that second exists), created."""
    base = os.path.join(parent, time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"


def megatron_format(step: int, m: dict[str, float], ms_per_step: float, total_steps: int, global_batch: int) -> str:
    """Megatron-LM's training log line (its `training_log`), field for field, so parsers written for it keep
    working: consumed samples count whole global batches; bf16/fp32 runs print loss scale 1.0, as Megatron does."""
    return (f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] iteration {step:8d}/{total_steps:8d} | consumed samples: "
            f"{step * global_batch:12d} | elapsed time per iteration (ms): {ms_per_step:.1f} | learning rate: "
            f"{m.get('lr', 0.0):.6E} | global batch size: {global_batch:5d} | lm loss: {m['loss']:.6E} | loss scale: "
            f"{m.get('loss_scale', 1.0):.1f} | grad norm: {m.get('grad_norm', 0.0):.3f} | number of skipped "
            f"iterations: {int(m.get('skipped_iters', 0)):3d} | number of nan iterations: "
            f"{int(m.get('nan_iters', 0)):3d} |")


class MetricsLogger:
    """Collects what the trainer reports at log steps; rank 0 prints and writes TensorBoard and W&B.

    `job_config` (the JobConfig) and `run_dir`: for W&B, which logs the whole config; without them (or with
    metrics.enable_wandb false) only TensorBoard. megatron_line = (total steps, global batch size): print
    Megatron-LM's iteration line instead of titanlike's (metrics.log_format = "megatron")."""

    def __init__(self, *, log_dir: str | None, device: torch.device, flops_per_token: float,
                 is_rank0: bool, enable_tensorboard: bool, job_config=None, run_dir: str | None = None,
                 megatron_line: tuple[int, int] | None = None):
        self.device = device
        self.flops_per_token = flops_per_token
        self.peak = device_peak_flops(device)
        self.is_rank0 = is_rank0
        self.writer = self.wandb = None
        self.tb_dir = None
        if is_rank0 and enable_tensorboard and log_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = stamped_folder(log_dir)
            self.writer = SummaryWriter(self.tb_dir)
            logger.info(f"TensorBoard: {self.tb_dir}  (tensorboard --logdir {log_dir})")
        if job_config is not None and job_config.metrics.enable_wandb:
            from titanlike.observe.wandb_writer import WandbWriter, import_wandb

            import_wandb(job_config.metrics)  # on every rank: a missing package is a ConfigError everywhere, not a hang
            if is_rank0:
                from titanlike.config.load import config_to_dict

                run_dir = run_dir or os.getcwd()
                self.wandb = WandbWriter(job_config.metrics, run_dir, config_to_dict(job_config),
                                         run_name=os.path.basename(os.path.normpath(run_dir)),
                                         notes=job_config.job.description)
        self._t0 = time.perf_counter()
        self._tokens = 0  # tokens processed by this rank since the last log line
        self._steps = 0  # steps since the last log line
        self._data_wait = 0.0  # seconds the training loop waited for the loader since the last log line
        self.megatron_line = megatron_line

    def add_tokens(self, n: int) -> None:
        """Once per step: this rank's tokens of the step."""
        self._tokens += n
        self._steps += 1

    def add_data_wait(self, seconds: float) -> None:
        """Seconds the loop waited in the loader's next() (Trainer.next_batches): the log line's data share."""
        self._data_wait += seconds

    def log(self, step: int, scalars: dict[str, float]) -> dict[str, float]:
        """`scalars` hold already-synced Python numbers (loss, grad_norm, lr); adds throughput and memory."""
        elapsed = time.perf_counter() - self._t0
        tps = self._tokens / max(elapsed, 1e-9)
        out = dict(scalars)
        if "dpo/pairs" in out:  # DPO: the global pairs trained since the last line -> pairs per second, per step
            pairs = out.pop("dpo/pairs")
            out["throughput/pairs_per_sec"] = pairs / max(elapsed, 1e-9)
            out["dpo/pairs_per_step"] = pairs / max(self._steps, 1)
        out["throughput/tokens_per_sec_per_device"] = tps
        out["throughput/tflops_per_device"] = tps * self.flops_per_token / 1e12
        if self.peak:
            out["throughput/mfu_pct"] = 100 * tps * self.flops_per_token / self.peak
        # the loader's share of the wall time since the last line (0 when its workers keep ahead of the steps)
        out["data/wait_pct"] = 100 * self._data_wait / max(elapsed, 1e-9)
        out.update(memory_stats(self.device))
        ms_per_step = 1000 * elapsed / max(self._steps, 1)
        self._t0, self._tokens, self._steps, self._data_wait = time.perf_counter(), 0, 0, 0.0
        if self.is_rank0:
            if self.megatron_line is not None:
                logger.info(megatron_format(step, out, ms_per_step, *self.megatron_line))
            else:
                logger.info(self.format_line(step, out))
            self._write_scalars(step, out)
        return out

    def _write_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """To TensorBoard and W&B, where enabled (rank 0's callers only)."""
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        if self.wandb is not None:
            self.wandb.scalars(step, scalars)

    @staticmethod
    def format_line(step: int, m: dict[str, float]) -> str:
        parts = [f"step {step:>6}", f"loss {m['loss']:8.4f}"]
        if "grad_norm" in m:
            parts.append(f"grad_norm {m['grad_norm']:7.3f}")
        if "lr" in m:
            parts.append(f"lr {m['lr']:.2e}")
        if "loss_scale" in m:  # fp16: the scale, and the steps skipped for overflow since the last line
            parts.append(f"loss_scale {m['loss_scale']:.0f}" + (f" (skipped {m['skipped_iters']})"
                                                                 if m.get("skipped_iters") else ""))
        if "dpo/reward_accuracy" in m:  # DPO: pairs whose chosen reward beats the rejected one, the mean margin
            parts.append(f"acc {m['dpo/reward_accuracy']:.3f} margin {m['dpo/reward_margin']:.4f}")
        if "throughput/pairs_per_sec" in m:  # DPO: preference pairs per second, the whole run's (every rank's)
            parts.append(f"pairs/s {m['throughput/pairs_per_sec']:,.2f}")
        parts.append(f"tok/s {m['throughput/tokens_per_sec_per_device']:>9,.0f}")
        if "throughput/mfu_pct" in m:
            parts.append(f"mfu {m['throughput/mfu_pct']:5.1f}%")
        if "moe/aux_loss" in m:  # mixture-of-experts models: auxiliary loss, worst layer's busiest expert / mean
            parts.append(f"aux {m['moe/aux_loss']:.4f} load {m['moe/load_max_over_mean']:.2f}")
            if m.get("moe/dropped_pct"):
                parts.append(f"dropped {m['moe/dropped_pct']:.1f}%")
        if "mtp/total_loss" in m:  # multi-token prediction: each depth's loss (loss above is the main LM loss)
            depths = sorted((k for k in m if k.startswith("mtp/loss_")), key=lambda k: int(k.rsplit("_", 1)[1]))
            parts.append("mtp " + "/".join(f"{m[k]:.4f}" for k in depths) + f" total {m['mtp/total_loss']:.4f}")
        if "memory/peak_reserved_gib" in m:
            parts.append(f"mem {m['memory/peak_reserved_gib']:.1f}GiB ({m['memory/peak_reserved_pct']:.0f}%)")
        elif "memory/max_rss_gib" in m:
            parts.append(f"rss {m['memory/max_rss_gib']:.2f}GiB")
        if "data/wait_pct" in m:  # last, so parsers of the fields before it keep working
            parts.append(f"data {m['data/wait_pct']:.1f}%")
        return "  ".join(parts)

    def log_validation(self, step: int, loss: float, metrics: dict[str, float] | None = None) -> None:
        """The validation loss and perplexity, and `metrics`: the objective's own (e.g. "mlm_accuracy"), each
        logged as validation/<name>."""
        if self.is_rank0:
            import math

            ppl = math.exp(min(loss, 50))
            extra = "".join(f"  {k} {v:.4f}" for k, v in (metrics or {}).items())
            logger.info(f"validate step {step:>6}  loss {loss:8.4f}  ppl {ppl:10.3f}{extra}")
            self._write_scalars(step, {"validation/loss": loss, "validation/perplexity": ppl,
                                       **{f"validation/{k}": v for k, v in (metrics or {}).items()}})

    def log_eval(self, step: int, results: dict[str, float], seconds: float, share_pct: float,
                 recent_pct: float) -> None:
        """[eval] results (titanlike/train/evaluate.py): "<task>/<metric>" and "ppl/<set>/loss" (its perplexity
        added), with the time this evaluation took, as a share of the training steps' time since the previous one
        (recent_pct), and all evaluations' time as a share of all training steps' time (share_pct)."""
        self._t0 += seconds  # the next log line's tok/s and MFU count the training steps only (every rank)
        if not self.is_rank0:
            return
        import math

        out = dict(results)
        for key, value in results.items():
            if key.startswith("ppl/") and key.endswith("/loss"):
                out[key[:-len("loss")] + "perplexity"] = math.exp(min(value, 50))
        shown = "  ".join(f"{k} {v:.4f}" for k, v in out.items())
        logger.info(f"eval step {step:>6}  {shown}  ({seconds:.1f} s = {recent_pct:.1f}% of the training time since "
                    f"the last evaluation; all evaluations {share_pct:.1f}% of training time)")
        out = {f"eval/{k}": v for k, v in out.items()}
        out.update({"eval/seconds": seconds, "eval/share_of_training_pct": share_pct,
                    "eval/share_recent_pct": recent_pct})
        self._write_scalars(step, out)

    def log_text(self, tag: str, text: str) -> None:
        """A text entry in TensorBoard (e.g. job.description, shown under the TEXT tab) and the W&B summary;
        "" writes nothing."""
        if self.writer is not None and text:
            self.writer.add_text(tag, text)
        if self.wandb is not None and text:
            self.wandb.text(tag, text)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.close()
            self.wandb = None
