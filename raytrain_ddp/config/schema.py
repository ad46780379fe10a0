"""The run configuration's schema: every setting of the service, its default, its unit and its limits.

This module is the only place where the service's defaults live (a recipe's own defaults live in its
function signatures: see `recipe.py`). How a config is put together from the job's YAML, a config
file and `key=value` overrides, and validated as a whole, is `layering.py`'s.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator


class ConfigError(ValueError):
    """The configuration cannot be used; `problems` lists every reason, one line each."""

    def __init__(self, job: str, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid configuration for job '{job}' ({len(self.problems)} problem(s)):\n{lines}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EarlyStoppingSettings(_Section):
    """When a run ends before train.epochs: its checkpoint score (checkpoint.score_attribute) no
    longer improving (see early_stopping.py)."""

    patience: int | None = Field(
        None,
        ge=1,
        description="end the run (finished: its best checkpoint registers) after this many evaluations in a row "
        "without improvement of checkpoint.score_attribute; an evaluation is each report (epoch ends, and every "
        "checkpoint.every_n_steps); null = off",
    )
    min_delta: float = Field(
        0.0, ge=0, description="an improvement smaller than this (in the score's units) does not count as one"
    )


class TrainSettings(_Section):
    """How each worker optimizes."""

    epochs: int = Field(10, ge=1, description="passes over the training set")
    batch_size: int = Field(
        64,
        ge=1,
        description="rows per micro-batch per worker (global batch = batch_size x num_workers (an elastic range's max) "
        "x grad_accum_steps)",
    )
    grad_accum_steps: int = Field(
        1, ge=1, description="micro-batches per optimizer step; DDP syncs gradients only on the last (no_sync); 1 = off"
    )
    drop_last: bool = Field(False, description="drop each worker's last incomplete batch of an epoch")
    shuffle: bool = Field(True, description="reshuffle the training rows every epoch, seeded by (seed, epoch)")
    local_shuffle_buffer_size: int = Field(
        10_000,
        ge=1,
        description="Ray Datasets, streams: rows of a worker's share shuffled together (torch Datasets: fully)",
    )
    group_by_length: str | None = Field(
        None,
        description="Ray Datasets (materialized), streams: the column of each row's length (chat_sft: length); a "
        "worker's batches are then formed of rows of similar length within each shuffle window "
        "(local_shuffle_buffer_size rows), in a seeded order: less padding; null = off",
    )
    num_loader_workers: int = Field(
        0, ge=0, description="torch Dataset path: DataLoader worker processes per training worker; 0 = load in the loop"
    )
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="torch.optim.AdamW or SGD (with momentum)")
    lr: float = Field(1e-3, gt=0, description="peak learning rate")
    weight_decay: float = Field(
        0.0,
        ge=0,
        description="decoupled (AdamW) or L2 (SGD) decay of weight matrices and kernels (not biases or norms); 0 = off",
    )
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum (ignored by AdamW)")
    lr_schedule: Literal["constant", "cosine", "step"] = Field(
        "constant",
        description="per optimizer step, after warmup: constant; cosine decay to 0 at the last step; "
        "or step (x lr_step_gamma every lr_step_epochs)",
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup to lr; 0 = off")
    lr_step_epochs: int = Field(30, ge=1, description="lr_schedule=step: epochs between decays")
    lr_step_gamma: float = Field(0.1, gt=0, le=1, description="lr_schedule=step: factor applied at each decay")
    grad_clip_norm: float | None = Field(
        None, gt=0, description="clip gradients to this global L2 norm before each step; null = off"
    )
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="torch.autocast dtype of forward passes; fp16 (GPU only) adds a checkpointed GradScaler"
    )
    eval_batch_size: int = Field(256, ge=1, description="rows per validation batch")
    compile: bool = Field(
        False,
        description="torch.compile the model for training (a graph per batch shape, compiled on first use: "
        "seconds to minutes before the first step for a faster step); evaluation stays eager",
    )
    early_stopping: EarlyStoppingSettings = Field(default_factory=EarlyStoppingSettings)


class DataSettings(_Section):
    """Streamed datasets (raytrain_ddp.data.stream): how each worker's reading pipeline may use the cluster,
    and what it does with a file it cannot read; and what the labels mean."""

    class_names: list[str] | None = Field(
        None,
        min_length=2,
        description="what each of a classifier's outputs means, in order: registered with the model and named "
        "in its predictions; jobs that read them from the data (image_folder: the class folders) set it; "
        "null = unnamed",
    )

    max_bad_files: int = Field(
        0,
        ge=0,
        description="unreadable files (a damaged image or Parquet file, a missing column) a run may skip, "
        "counted in every report; 0 = the first one stops the run, naming it",
    )
    object_store_mb: float | None = Field(
        None,
        gt=0,
        description="object store memory each worker's reading pipeline may fill before Ray Data holds back "
        "reading; null = half the cluster's object store, shared by the workers",
    )
    cpus: float | None = Field(
        None, gt=0, description="CPUs each worker's reading pipeline may use at once; null = any free in the cluster"
    )
    task_rows: int = Field(
        256, ge=1, description="rows each reading task reads, decodes and transforms (images: files)"
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict,
        description="node labels the reading tasks need, e.g. {role: data} for nodes started with "
        "--labels role=data; {} = any node",
    )

    @field_validator("class_names")
    @classmethod
    def _named_once(cls, names: list[str] | None) -> list[str] | None:
        if names is not None and (twice := sorted({n for n in names if names.count(n) > 1})):
            raise ValueError(f"each class once: {', '.join(map(repr, twice))} named twice")
        if names is not None and "class" in names:  # registry/named_outputs.py's column of the likeliest class
            raise ValueError("'class' names the column of each row's most likely class in predictions: rename it")
        return names


class ScalingSettings(_Section):
    """Ray Train's ScalingConfig."""

    num_workers: int | tuple[int, int] = Field(
        2,
        description="DDP workers (Ray Train worker actors); [min, max] = elastic: the run starts on as many as fit, "
        "at least min, goes on with fewer after a node is lost and grows back when nodes return, keeping its "
        "global batch (each count in the range must divide max x train.grad_accum_steps)",
    )
    resize_check_s: float = Field(
        60.0,
        gt=0,
        description="elastic num_workers: how often Ray Train looks for room for more workers; a grow restarts the "
        "workers from the newest checkpoint they can resume (an epoch's end, or mid-epoch on as many workers)",
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every worker holds the whole model, its gradients and optimizer state (settings: ddp.*); "
        "fsdp: PyTorch's FSDP2, each worker holds 1/N of them, its repeated blocks gathered one at a time, and "
        "checkpoints are written in shards by every worker (settings: fsdp.*); see docs/scaling.md",
    )
    use_gpu: bool = Field(False, description="one GPU per worker, NCCL backend; false = CPU, gloo")
    resources_per_worker: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 1.0},
        description="Ray resources reserved per worker, e.g. {CPU: 0.5} on a 2-core laptop to leave Ray Data a core",
    )
    label_selector: dict[str, str] = Field(
        default_factory=dict,
        description="node labels the workers need, e.g. {role: train} for nodes started with --labels role=train "
        "(and data.label_selector to read on other nodes); {} = any node",
    )

    @field_validator("num_workers", mode="before")
    @classmethod
    def _workers_or_a_range(cls, value: Any) -> int | tuple[int, int]:
        pair = value if isinstance(value, (list, tuple)) else (value, value)
        if len(pair) != 2 or not all(_whole(n) for n in pair):
            raise ValueError("must be a number of workers (e.g. 2) or an elastic range [min, max] (e.g. [1, 2])")
        least, most = (int(n) for n in pair)
        if least < 1 or least > most:
            raise ValueError("must be >= 1, or a range [min, max] with 1 <= min <= max")
        return least if least == most else (least, most)

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if self.elastic else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if self.elastic else self.num_workers

    @property
    def workers_text(self) -> str:
        """'2 workers', '1 worker', or an elastic range: '1–2 workers (elastic)'."""
        if self.elastic:
            return f"{self.min_workers}–{self.max_workers} workers (elastic)"
        return f"{self.num_workers} worker{'s' * (self.num_workers != 1)}"

    @model_validator(mode="after")
    def _resources_are_possible(self) -> ScalingSettings:
        bad = {k: v for k, v in self.resources_per_worker.items() if v < 0}
        if bad:
            raise ValueError(f"resources_per_worker amounts must be >= 0, got {bad}")
        if not self.use_gpu and self.resources_per_worker.get("GPU", 0) > 0:
            raise ValueError("resources_per_worker asks for GPUs but use_gpu is false; set scaling.use_gpu=true")
        return self


class DDPSettings(_Section):
    """Keyword arguments of torch DistributedDataParallel, passed through ray.train.torch.prepare_model,
    and whether to convert BatchNorm layers to SyncBatchNorm first."""

    find_unused_parameters: bool = Field(False, description="tolerate parameters that get no gradient in a step")
    broadcast_buffers: bool = Field(True, description="sync buffers (BatchNorm stats) from rank 0 every forward")
    static_graph: bool = Field(False, description="the graph is the same every step (enables DDP optimizations)")
    gradient_as_bucket_view: bool = Field(False, description="gradients alias the all-reduce buckets (saves memory)")
    bucket_cap_mb: float = Field(25.0, gt=0, description="all-reduce bucket size in MiB")
    sync_batchnorm: bool = Field(
        False, description="BatchNorm statistics over the global batch (SyncBatchNorm; torch supports it on GPUs only)"
    )


class FSDPSettings(_Section):
    """FSDP2 (torch.distributed.fsdp.fully_shard), for scaling.strategy=fsdp: each of the model's blocks
    (the recipe's shard_blocks, else a Hugging Face model's decoder layers) is sharded, then the root."""

    reshard_after_forward: bool = Field(
        True,
        description="free each block's gathered parameters after its forward and gather them again for the "
        "backward (least memory); false keeps them until the backward (one all-gather less a step, more memory)",
    )
    reduce_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="train.precision=bf16: the dtype gradients are reduced in (fp32: exact sums of bf16 "
        "gradients; bf16: half the traffic)",
    )
    cpu_offload: bool = Field(
        False,
        description="keep the sharded parameters, gradients and optimizer state in CPU memory, copied to the GPU "
        "for each block's forward and backward (the optimizer steps on CPU): larger models, slower steps; GPUs only",
    )


class CheckpointSettings(_Section):
    """Ray Train's CheckpointConfig: a checkpoint at the end of each epoch (and every N steps, if asked),
    each evaluated and ranked by a reported metric."""

    every_n_steps: int | None = Field(
        None,
        ge=1,
        description="also checkpoint (and evaluate) every N optimizer steps, mid-epoch; a failure then "
        "costs at most N steps; null = at epoch ends only",
    )
    num_to_keep: int | None = Field(
        2, ge=1, description="checkpoints kept on storage (best by score, plus the latest); null = all"
    )
    score_attribute: str = Field("val_loss", min_length=1, description="reported metric that ranks checkpoints")
    score_order: Literal["max", "min"] = Field("min", description="whether a larger or smaller score is better")
    upload: Literal["sync", "async"] = Field(
        "sync",
        description="sync: training waits until each checkpoint is whole on storage (a restart resumes from it "
        "even if Ray had not recorded it yet); async: rank 0 writes it locally and training goes on while it "
        "uploads (a failure meanwhile resumes from the one before)",
    )
    upload_retry_s: float = Field(
        60,
        ge=0,
        description="how long a checkpoint's upload retries transient storage errors (S3 throttling or "
        "unavailable) in a row, with backoff, before the run stops naming the error (upload: async fails the "
        "attempt instead); a full disk or no permission stops it at once; 0 = no retries",
    )
    preemption_check_steps: int = Field(
        10,
        ge=0,
        description="every N optimizer steps the ranks ask Ray Train whether a node of theirs is being preempted "
        "(drained, as a spot instance reclaimed): the first time it is, a checkpoint is taken at once; a barrier "
        "of the ranks, where Ray Train watches for preemptions (a cluster of several nodes or an autoscaler); "
        "0 = never",
    )


class RunSettings(_Section):
    """Ray Train's RunConfig: where a run lives and how often it may fail."""

    name: str | None = Field(
        None, description="run name; the same name + storage_path resumes; null = '<job>-<time>-<random>'"
    )
    storage_path: str = Field("./runs", min_length=1, description="checkpoints go to <storage_path>/<name>/")
    max_failures: int = Field(
        0,
        ge=-1,
        description="restarts of the workers, from the latest checkpoint, after a worker fails; -1 = unlimited",
    )
    controller_poll_s: float = Field(
        0.5,
        gt=0,
        description="how often Ray Train's controller polls the workers: the delay of progress lines, "
        "failure detection and each checkpoint's record (the workers do not wait for it) (Ray's default: 2)",
    )
    prestart_workers: bool = Field(
        True,
        description="the driver asks Ray for Ray Train's processes ahead: CPU workers', as it joins, where Ray has no "
        "choice of their nodes (one node has room, or the nodes' rooms add up to exactly the workers; they "
        "load torch while it builds the datasets and checks the recipe: ~1-2 s of a 2-core start, ~2 s on a "
        "2-node loopback cluster); "
        "the controller's, once the datasets are built; false = they start when Ray Train asks for them",
    )
    resources_wait_s: float = Field(
        600,
        ge=0,
        description="how long the workers may wait for their resources (at the start, or after a node is lost) "
        "before the run fails with its resume command; 0 = refused at once unless they are free now",
    )
    progress_s: float = Field(
        2.0,
        ge=0,
        description="live progress between reports (step, loss, samples/s, ETA): rank 0 sends it at most this "
        "often, from a thread of its own; a terminal redraws it in place; 0 = off (a line per report only)",
    )
    progress_log_s: float = Field(
        60.0,
        gt=0,
        description="where the console is no terminal (a log, `ray job logs`, a notebook): a progress line at "
        "most this often between reports, instead of the live display",
    )

    @property
    def path(self) -> str:
        """The run's directory, <storage_path>/<name>: absolute, or a URI, once the config is resolved."""
        return f"{self.storage_path}/{self.name}"

    @model_validator(mode="after")
    def _name_is_a_directory_name(self) -> RunSettings:
        if self.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name):
            raise ValueError(f"name must be letters, digits, '.', '_' or '-' (a directory name), got {self.name!r}")
        _refuse_credentials(
            "storage_path", self.storage_path, "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or an instance role"
        )
        return self


class SweepSettings(_Section):
    """`raytrain-ddp sweep`: trials of the run, each with values drawn from `search`, the trailing ones
    stopped early (ASHA on checkpoint.score_attribute), the best trial's model registered. A `train`
    of the job ignores this section."""

    search: dict[str, Any] = Field(
        default_factory=dict,
        description="config key: space, e.g. train.lr: loguniform(1e-4, 1e-1); spaces: choice(a, b, ...), "
        "grid(a, b, ...), uniform(lo, hi), loguniform(lo, hi), randint(lo, hi) (hi excluded)",
    )
    trials: int | None = Field(
        None, ge=1, description="how many trials; null = the grid's combinations (where every space is a grid)"
    )
    concurrent: int = Field(1, ge=1, description="trials trained at once, each with the run's own scaling")
    grace_epochs: int = Field(
        1, ge=1, description="epochs every trial trains before the scheduler may stop it for trailing the others"
    )
    reduction_factor: float = Field(
        2, gt=1, description="ASHA's rungs: at each, all but the best 1/reduction_factor of the trials stop"
    )


# `register` shadows the `register` classmethod every pydantic model inherits from ABCMeta (for
# virtual subclasses, never used on a config); pydantic warns about it at import, to no purpose.
warnings.filterwarnings("ignore", message='Field name "register" in "MLflowSettings" shadows', category=UserWarning)


class MLflowSettings(_Section):
    """Where metrics and the final model go, and whether the model is registered."""

    tracking_uri: str | None = Field(
        None, description="null = $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory"
    )
    experiment: str | None = Field(None, description="experiment name; null = the job name")
    model_name: str | None = Field(None, description="registered model name; null = the job name")
    # if_better by default: a registry is where a user looks for the model to use, and a version per
    # run (a worse one included) buries it; the first run of a model still registers.
    register: Literal["always", "if_better", "never"] = Field(
        "if_better",
        description="when a finished run registers its best checkpoint's model as a new version: always; "
        "if_better (the default) = only if its checkpoint.score_attribute beats the latest version's (or that "
        "version has no comparable score); never = nothing in the registry. "
        "`raytrain-ddp register RUN_DIR` registers anyway",
    )

    @model_validator(mode="after")
    def _no_credentials(self) -> MLflowSettings:
        if self.tracking_uri is not None:
            _refuse_credentials(
                "tracking_uri",
                self.tracking_uri,
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN",
            )
        return self


def _refuse_credentials(key: str, uri: str, instead: str) -> None:
    """A config is saved in every checkpoint and logged to MLflow: it must never hold a secret."""
    if "@" in urlsplit(uri).netloc:
        raise ValueError(f"{key} must not contain credentials (user:password@); set {instead} in the environment")


class Config(_Section):
    """A whole run: the job, the recipe's keyword arguments and the service's settings."""

    job: str = Field(description="recipe name in jobs/ or a path to a job's .py/.yaml file")
    seed: int = Field(0, ge=0, description="drives model init, data split, per-epoch shuffle and dropout")
    model: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the recipe's build_model")
    dataset: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the recipe's build_datasets"
    )
    train: TrainSettings = Field(default_factory=TrainSettings)
    scaling: ScalingSettings = Field(default_factory=ScalingSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    ddp: DDPSettings = Field(default_factory=DDPSettings)
    fsdp: FSDPSettings = Field(default_factory=FSDPSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    run: RunSettings = Field(default_factory=RunSettings)
    mlflow: MLflowSettings = Field(default_factory=MLflowSettings)
    sweep: SweepSettings = Field(default_factory=SweepSettings)

    @model_validator(mode="after")
    def _compiles_under_ddp(self) -> Config:
        # Under DDP, dynamo splits the compiled graph at DDP's buckets (DDPOptimizer), and asserts that
        # DDP's first bucket, of 1 MiB, is no larger than the others (torch/_dynamo/backends/distributed.py).
        if self.train.compile and self.scaling.max_workers > 1 and self.ddp.bucket_cap_mb < 1:
            raise ValueError(
                f"train.compile=true needs ddp.bucket_cap_mb >= 1 (got {self.ddp.bucket_cap_mb:g}): torch splits the "
                "compiled graph at DDP's buckets and refuses buckets smaller than DDP's first, of 1 MiB"
            )
        return self

    @model_validator(mode="after")
    def _runs_on_the_chosen_device(self) -> Config:
        if self.scaling.use_gpu:
            return self
        if self.train.precision == "fp16":
            raise ValueError(
                "train.precision=fp16 needs a GPU (CUDA autocast with a GradScaler); on CPU use bf16 or fp32, "
                "or set scaling.use_gpu=true"
            )
        if self.ddp.sync_batchnorm and self.scaling.max_workers > 1:
            raise ValueError(
                "ddp.sync_batchnorm=true needs GPUs (torch's SyncBatchNorm rejects CPU tensors); "
                "set scaling.use_gpu=true or ddp.sync_batchnorm=false"
            )
        return self

    @model_validator(mode="after")
    def _settings_of_the_strategy(self) -> Config:
        """The settings of the strategy not chosen mean nothing: one set differently is refused, as are
        what FSDP2 here does not take."""
        fsdp = self.scaling.strategy == "fsdp"
        unused, section = (self.ddp, "ddp") if fsdp else (self.fsdp, "fsdp")
        changed = [f"{section}.{k}" for k, v in unused.model_dump().items() if v != type(unused)().model_dump()[k]]
        if changed:
            raise ValueError(
                f"{', '.join(changed)} set, but scaling.strategy={self.scaling.strategy} does not use {section}.* "
                f"settings: remove them, or set scaling.strategy={'ddp' if fsdp else 'fsdp'}"
            )
        if not fsdp:
            return self
        if self.train.precision == "fp16":
            raise ValueError(
                "train.precision=fp16 is not offered with scaling.strategy=fsdp (its loss scaler would need every "
                "shard's overflow check): use train.precision=bf16"
            )
        if self.checkpoint.upload == "async":
            raise ValueError(
                "checkpoint.upload=async is not offered with scaling.strategy=fsdp (every worker writes its own "
                "shards, then the manifest is written): use checkpoint.upload=sync"
            )
        if self.fsdp.cpu_offload and not self.scaling.use_gpu:
            raise ValueError("fsdp.cpu_offload=true needs GPUs (it moves GPU memory to CPU): set scaling.use_gpu=true")
        return self

    @model_validator(mode="after")
    def _every_count_shares_a_step(self) -> Config:
        """An elastic run keeps its global batch: each count of workers in the range accumulates an equal
        share of a step's micro-batches (`accumulation_on`)."""
        s, per_step = self.scaling, self.micro_batches_per_step
        uneven = [w for w in worker_counts(s.num_workers) if per_step % w]
        if uneven:
            least = math.lcm(*worker_counts(s.num_workers)) // s.max_workers
            raise ValueError(
                f"scaling.num_workers={list(s.num_workers)}: an optimizer step is {per_step} micro-batches "
                f"({s.max_workers} workers × train.grad_accum_steps {self.train.grad_accum_steps}), which "
                f"{', '.join(map(str, uneven))} worker(s) cannot share evenly; set train.grad_accum_steps to a "
                f"multiple of {least} (on {s.max_workers} workers; more on fewer), or choose a range whose counts "
                f"all divide {per_step}"
            )
        return self

    @property
    def micro_batches_per_step(self) -> int:
        """The micro-batches of train.batch_size rows that make one optimizer step over all workers: the
        global batch, counted in micro-batches, fixed for the run whatever its number of workers."""
        return self.scaling.max_workers * self.train.grad_accum_steps

    def accumulation_on(self, world_size: int) -> int:
        """The micro-batches each of `world_size` workers accumulates a step: train.grad_accum_steps on
        the most workers, more on fewer."""
        return self.micro_batches_per_step // world_size

    # How this config was made: the recipe it was validated against and its layers (see layering.py).
    # Not part of its data, so never saved, logged or compared; it lets one command import its job once.
    _origin: Any = PrivateAttr(default=None)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Config) and self.to_dict() == other.to_dict()

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Config:
        return cls.model_validate(data)

    def flat(self) -> dict[str, Any]:
        """`{"train.lr": 0.001, ...}`: the config as MLflow params."""
        return {".".join(path): value for path, value in flatten(self.to_dict()).items()}


def _whole(n: Any) -> bool:
    """A whole number, as pydantic's lax int takes it: 2, 2.0 or "2" (not True)."""
    if isinstance(n, str):
        return n.strip().isdigit()
    return isinstance(n, (int, float)) and not isinstance(n, bool) and float(n).is_integer()


def worker_counts(num_workers: int | Sequence[int]) -> list[int]:
    """The numbers of workers a run may have: one, or each of an elastic range [min, max] (as a config
    or a saved one has it)."""
    return [num_workers] if isinstance(num_workers, int) else list(range(num_workers[0], num_workers[1] + 1))


def flatten(data: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """A nested mapping as `{("key", "path"): value}`; an empty mapping is a value of its own."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, Mapping) and value:
            flat |= {(key, *path): inner for path, inner in flatten(value).items()}
        else:
            flat[(key,)] = value
    return flat
