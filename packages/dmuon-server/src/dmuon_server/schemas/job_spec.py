"""A job spec as submitted (``POST /v1/jobs``): the recipe's or a script, with the
launcher's options; and a resume request."""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Any, Literal

import dmuon_recipe_contract as contract
from pydantic import (
    Field,
    model_validator,
)

from dmuon_server.schemas.common import (
    NAME_PATTERN,
    StrictModel,
)
from dmuon_server.schemas.train_spec import (
    TrainSpec,
)
from dmuon_server.storage.records import JobRecord

#: An argument of a script: any text but NUL (it becomes one argv entry, never shell text).
ScriptArg = Annotated[str, Field(max_length=1024, pattern=r"^[^\x00]*$")]


class ScriptSpec(StrictModel):
    """Your own training script, run by torchrun like the recipe."""

    path: str = Field(
        min_length=1,
        max_length=4096,
        pattern=r"^[^\x00]+$",
        description="The Python file (`.py`) to run, inside one of the server's code roots "
        "(`--code-root`) after symlinks and `..` are resolved; a relative path is looked up "
        "in each root in turn.",
    )
    args: list[ScriptArg] = Field(
        default_factory=list,
        max_length=256,
        description="Its command-line arguments, each passed as one argv entry (no shell).",
    )
    steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Steps the script runs, if it says: shown as progress and ETA, given to "
        "it as `DMUON_STEPS`, and what `POST /v1/jobs/{id}/resume` compares a checkpoint to.",
    )
    micro_batch_size: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        description="Given to the script as `DMUON_MICRO_BATCH_SIZE`, if set.",
    )
    accum_steps: int | None = Field(
        default=None,
        ge=1,
        le=1024,
        description="Micro-batches per optimizer step, given to the script as "
        "`DMUON_ACCUM_STEPS`, if set.",
    )


class InitFrom(StrictModel):
    """A checkpoint of another job to take the initial weights from."""

    job: str = Field(
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_-]+$",
        description="Id of the job that saved it.",
    )
    step: Annotated[int, Field(ge=0, le=99_999_999)] | Literal["latest"] = Field(
        description="Step of the checkpoint, or `latest` for that job's newest one "
        "(resolved when this job is submitted)."
    )


#: Slurm partition and account names as the job spec accepts them.
SLURM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
#: Slurm's time-limit formats: minutes, minutes:seconds, hours:minutes:seconds,
#: days-hours, days-hours:minutes, days-hours:minutes:seconds.
SLURM_TIME_PATTERN = r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}){0,2})$"
#: The spec fields only the Slurm launcher uses.
SLURM_ONLY_FIELDS = ("partition", "time_limit", "account")


class JobCreate(StrictModel):
    """Body of ``POST /v1/jobs`` and ``POST /v1/jobs:validate``."""

    name: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        pattern=NAME_PATTERN,
        description="A label for people; need not be unique. No control, format or "
        "line-separator characters (no right-to-left override, zero-width space, ...).",
    )
    nproc_per_node: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Processes torchrun starts per node; at most the server's limit. "
        "Omitted: `gpus_per_node` when that asks for GPUs, else 1.",
    )
    nnodes: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Nodes the job runs on, one torchrun agent each (world size: nnodes x "
        "nproc_per_node). More than 1 needs the Slurm launcher (`--launcher slurm`).",
    )
    partition: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=SLURM_NAME_PATTERN,
        description="Slurm partition (`sbatch --partition`); the cluster's default when "
        "omitted. Slurm launcher only.",
    )
    time_limit: str | None = Field(
        default=None,
        min_length=1,
        max_length=32,
        pattern=SLURM_TIME_PATTERN,
        description="Slurm time limit (`sbatch --time`): `MM`, `MM:SS`, `HH:MM:SS`, `D-HH`, "
        "`D-HH:MM` or `D-HH:MM:SS`; the partition's default when omitted. Slurm launcher only.",
    )
    account: str | None = Field(
        default=None,
        min_length=1,
        max_length=64,
        pattern=SLURM_NAME_PATTERN,
        description="Slurm account to charge (`sbatch --account`). Slurm launcher only.",
    )
    train: TrainSpec | None = Field(
        default=None,
        description="The reference recipe's settings (`python -m dmuon.train`); give this "
        "or `script`.",
    )
    script: ScriptSpec | None = Field(
        default=None,
        description="Your own training script instead of the recipe (`--code-root`); give "
        "this or `train`.",
    )
    priority: int = Field(
        default=0,
        ge=-1000,
        le=1000,
        description="Queue priority: a higher one starts first; first come, first served "
        "within a priority.",
    )
    gpus_per_node: int | None = Field(
        default=None,
        ge=0,
        le=1024,
        description="GPUs per node, one per process: `nproc_per_node` (the default on a "
        "server with GPUs) or 0 (none: the processes see no GPU). Under Slurm it becomes "
        "`--gpus-per-node`; omitted, no GPU is asked for.",
    )
    max_restarts: int = Field(
        default=0,
        ge=0,
        le=100,
        description=(
            "Relaunch the job up to this many times when a rank dies (killed, out of memory, "
            "crashed); each relaunch resumes from the job's latest checkpoint. Usage errors "
            "and divergence are never retried."
        ),
    )
    init_from: InitFrom | None = Field(
        default=None,
        description="Start from the weights of another job's checkpoint (`--init-from`); "
        "the optimizer starts fresh at step 1. Recipe jobs only.",
    )

    @model_validator(mode="before")
    @classmethod
    def _processes_follow_the_gpus(cls, data: Any) -> Any:
        if isinstance(data, dict) and "nproc_per_node" not in data:
            gpus = data.get("gpus_per_node")
            if isinstance(gpus, int) and not isinstance(gpus, bool) and gpus > 0:
                return {**data, "nproc_per_node": gpus}
        return data

    @model_validator(mode="after")
    def _one_program(self) -> JobCreate:
        if (self.train is None) == (self.script is None):
            raise ValueError(
                "give either train (the recipe's settings) or script (your own training "
                "script), not both and not neither"
            )
        if self.script is not None and self.init_from is not None:
            raise ValueError(
                "init_from is the recipe's (--init-from); a script loads the weights it "
                "wants itself"
            )
        t = self.train
        if t is not None and t.optimizer == "adamw":
            muon_only = [
                name
                for name in contract.MUON_ONLY_FLAGS
                if getattr(t, name, None) not in (None, contract.flag(name).default)
            ]
            if muon_only:
                raise ValueError(
                    f"{', '.join(muon_only)}: only for the dmuon optimizer (they change how "
                    'its Muon matrices are updated); drop them or set "optimizer": "dmuon"'
                )
        return self

    @property
    def steps(self) -> int | None:
        """The steps the job runs (the script's, when it said)."""
        return self.train.steps if self.train is not None else self.script.steps  # type: ignore[union-attr]

    def with_steps(self, steps: int) -> JobCreate:
        """This spec with another number of steps (``train.steps`` or ``script.steps``)."""
        if self.train is not None:
            return self.model_copy(update={"train": self.train.model_copy(update={"steps": steps})})
        assert self.script is not None
        return self.model_copy(update={"script": self.script.model_copy(update={"steps": steps})})


class ResumeRequest(StrictModel):
    """Body of ``POST /v1/jobs/{id}/resume`` (may be omitted)."""

    steps: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="New total number of optimizer steps (more than the latest "
        "checkpoint's step); the job's own `train.steps` (or `script.steps`) when omitted.",
    )


@lru_cache(maxsize=4096)
def _parse_spec(text: str) -> JobCreate:
    return JobCreate.model_validate_json(text)


def spec_of(job: JobRecord) -> JobCreate:
    """A stored job's spec, parsed once per text: every view and round of the scheduler
    reads the specs of many jobs, which change only when a job is resumed. Treat the
    result as read-only (``model_copy`` makes a changed one)."""
    return _parse_spec(job.spec)
